"""Record a peer router's launch options, as its own argparse parser defines them, for
tests/test_cli_compat.py. Run with the peer's Python:

    /work/main/bench/venvs/sglang-router/bin/python tests/data/record_peer_options.py \\
        sglang_router > tests/data/sglang_router_0.3.2_options.json
    /work/main/bench/venvs/smg/bin/python tests/data/record_peer_options.py \\
        smg > tests/data/smg_1.13_options.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys


def record(package: str) -> list[dict[str, object]]:
    router_args = importlib.import_module(f"{package}.router_args")
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return [
        {
            "options": action.option_strings,
            "action": type(action).__name__,
            "nargs": action.nargs,
            "type": getattr(action.type, "__name__", None),
            "choices": list(action.choices) if action.choices else None,
        }
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
    ]


if __name__ == "__main__":
    json.dump(record(sys.argv[1]), sys.stdout, indent=1)
    sys.stdout.write("\n")

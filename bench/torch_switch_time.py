"""Time in-process role switches of one idle torch worker, straight through its
``POST /pd_role_switch`` (no router), and check that its tensors stay the same.

    .venv/bin/python bench/torch_switch_time.py [--kv-transfer mooncake|tcp] [--switches 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_worker.cluster import WorkerCluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-transfer", choices=("mooncake", "tcp"), default="mooncake")
    parser.add_argument("--switches", type=int, default=10)
    args = parser.parse_args()
    with WorkerCluster(prefill=1, decode=0, engine="torch", kv_transfer=args.kv_transfer) as c:
        url = c.workers[0].url
        secs = []
        with httpx.Client(timeout=60.0) as http:
            before = http.get(url + "/torch_state").json()
            role = "prefill"
            for _ in range(args.switches):
                role = "decode" if role == "prefill" else "prefill"
                body = {"new_role": role, "decode_cuda_graph_memory_gb": 0.1}
                started = time.perf_counter()
                reply = http.post(url + "/pd_role_switch", json=body).json()
                secs.append(time.perf_counter() - started)
                if not reply["success"]:
                    print(f"switch to {role} failed: {reply['message']}")
                    return 1
            after = http.get(url + "/torch_state").json()
    same = {k: before[k] for k in ("weights_data_ptr", "kv_pool_data_ptr")} == {
        k: after[k] for k in ("weights_data_ptr", "kv_pool_data_ptr")
    }
    print(
        f"{args.kv_transfer}: {args.switches} switches, median {statistics.median(secs):.3f} s, "
        f"max {max(secs):.3f} s; same weight and pool data_ptr: {same}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

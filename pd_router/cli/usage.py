"""Usage errors an operator can read: the usage line and one line of error (not the whole
usage), with the nearest option or command for a near miss, exit status 2; ``--version`` from
the package metadata."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NoReturn

USAGE_ERROR = 2
INTERRUPTED = 130
DISTRIBUTION = "pd-router"


def package_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed)"


def nearest(word: str, choices: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.7)
    return matches[0] if matches else None


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage on errors (``short_usage``), a suggestion for a mistyped
    option, and with ``version`` a ``--version``."""

    def __init__(self, *args: Any, short_usage: str, version: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.short_usage = short_usage
        if version:
            self.add_argument(
                "--version", action="version", version=f"%(prog)s {package_version()}",
                help="print the version and exit",
            )  # fmt: skip

    def error(self, message: str) -> NoReturn:
        self.exit(
            USAGE_ERROR,
            f"usage: {self.short_usage}  ({self.prog} --help)\n{self.prog}: error: {message}\n",
        )

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized(extras))
        return parsed

    def unrecognized(self, extras: list[str]) -> str:
        word = extras[0]
        if not word.startswith("-"):
            return f"unexpected argument {word!r}"
        name = word.split("=", 1)[0]
        guess = nearest(name, self._option_string_actions)
        hint = f" (did you mean {guess}?)" if guess else ""
        return f"unrecognized option {name}{hint}"

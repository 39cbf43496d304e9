"""Every repository path the documentation names exists: a path in backticks or a link target
in README.md and docs/*.md that starts at one of the repository's top-level folders (or, for a
link, a file beside the document). A file moved without its mentions fails here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
CODE = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def top_level() -> frozenset[str]:
    """The repository's tracked top-level folders."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return frozenset(name.split("/", 1)[0] for name in files if "/" in name)


FOLDERS = top_level()


def named_paths(text: str) -> set[str]:
    """Repository paths in backticks: a top-level folder, then at least one more part."""
    paths = set()
    for token in CODE.findall(text):
        path = re.split(r"[:#]", token, maxsplit=1)[0].removeprefix("./").rstrip("/.,")
        if "/" in path and path.split("/", 1)[0] in FOLDERS and not re.search(r"[*<>{}$]", path):
            paths.add(path)
    return paths


def linked_paths(doc: Path, text: str) -> set[Path]:
    """Local link targets, resolved from the document's folder."""
    targets = set()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        targets.add((doc.parent / target.split("#", 1)[0]).resolve())
    return targets


def built(path: str) -> bool:
    """Whether ``path`` is one git ignores: made by a build (``make``), not in the clone."""
    return any(
        subprocess.run(["git", "check-ignore", "-q", name], cwd=REPO).returncode == 0
        for name in (path, path + "/")
    )


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_path_a_document_names_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = [p for p in sorted(named_paths(text)) if not (REPO / p).exists() and not built(p)]
    missing += [str(p) for p in sorted(linked_paths(doc, text)) if not p.exists()]
    assert missing == [], f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"

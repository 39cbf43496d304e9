"""Kubernetes label selectors as the discovery flags give them, matched here as the API server
matches them.

``--selector app=sglang tier=inference`` (the peers' form: one requirement per argument) and
``--selector "app=sglang,role in (prefill, decode)"`` (kubectl's) both parse. Requirements:
``key=value`` (also ``==``), ``key!=value``, ``key in (a, b)``, ``key notin (a, b)``, ``key``
(the label is present) and ``!key`` (absent). A pod is watched with the requirements that the
selectors in use share (one watch, so a pod whose role label is patched moves from the prefill
to the decode selector without leaving in between) and matched against each selector here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pd_router.control.workers import Role

KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
VALUE = r"[-A-Za-z0-9_.]*"
EQUALITY = re.compile(rf"^({KEY})\s*(==|=|!=)\s*({VALUE})$")
SET = re.compile(rf"^({KEY})\s+(in|notin)\s*\(([^)]*)\)$")
EXISTS = re.compile(rf"^(!?)\s*({KEY})$")


class SelectorError(ValueError):
    """A selector that does not parse."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.op == "exists":
            return value is not None
        if self.op == "!":
            return value is None
        if self.op in ("=", "in"):
            return value in self.values
        return value not in self.values

    def __str__(self) -> str:
        if self.op == "exists":
            return self.key
        if self.op == "!":
            return f"!{self.key}"
        if self.op in ("=", "!="):
            return f"{self.key}{self.op}{self.values[0]}"
        return f"{self.key} {self.op} ({','.join(self.values)})"


@dataclass(frozen=True)
class Selector:
    requirements: tuple[Requirement, ...] = ()

    @classmethod
    def parse(cls, parts: Iterable[str]) -> Selector:
        requirements: list[Requirement] = []
        for part in parts:
            for text in split_top_level(part):
                requirements.append(parse_requirement(text))
        return cls(tuple(dict.fromkeys(requirements)))

    def __bool__(self) -> bool:
        return bool(self.requirements)

    def __str__(self) -> str:
        return ",".join(str(r) for r in self.requirements)

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)

    def equalities(self) -> dict[str, str]:
        return {r.key: r.values[0] for r in self.requirements if r.op == "="}


def split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses, each part stripped."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_requirement(text: str) -> Requirement:
    if m := EQUALITY.match(text):
        key, op, value = m.groups()
        return Requirement(key, "!=" if op == "!=" else "=", (value,))
    if m := SET.match(text):
        key, op, values = m.groups()
        items = tuple(sorted({v.strip() for v in values.split(",") if v.strip()}))
        if not items:
            raise SelectorError(f"{text!r}: an empty set")
        return Requirement(key, op, items)
    if m := EXISTS.match(text):
        negated, key = m.groups()
        return Requirement(key, "!" if negated else "exists")
    raise SelectorError(f"{text!r} is not a label selector requirement")


def shared(selectors: Iterable[Selector]) -> Selector:
    """The requirements every one of ``selectors`` has (what a single watch can ask the API
    server for); none when any selector is empty."""
    selectors = list(selectors)
    if not selectors or not all(selectors):
        return Selector()
    common = set(selectors[0].requirements)
    for selector in selectors[1:]:
        common &= set(selector.requirements)
    return Selector(tuple(r for r in selectors[0].requirements if r in common))


@dataclass(frozen=True)
class RoleLabel:
    """The pod label that names a worker's role, and its value for each role."""

    key: str
    values: Mapping[Role, str]

    def role_of(self, labels: Mapping[str, str]) -> Role | None:
        value = labels.get(self.key)
        return next((role for role, v in self.values.items() if v == value), None)


def role_label(prefill: Selector, decode: Selector, key: str | None) -> RoleLabel | None:
    """The role label kept true after conversions: ``key`` with the values the prefill and
    decode selectors give it (``prefill``/``decode`` where they give none); without ``key``,
    the one label whose value the two selectors set differently; None when there is none."""
    p, d = prefill.equalities(), decode.equalities()
    if key is None:
        differing = [k for k in p.keys() & d.keys() if p[k] != d[k]]
        if len(differing) != 1:
            return None
        key = differing[0]
    return RoleLabel(key, {Role.PREFILL: p.get(key, "prefill"), Role.DECODE: d.get(key, "decode")})

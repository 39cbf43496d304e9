"""The approximate radix tree of cache-aware routing: which prompt prefixes each worker served.

The router cannot see a worker's KV cache, so it keeps an approximation, as smg does: every
prompt it routes is inserted under the worker that got it, and a new prompt goes where the
longest prefix of it was sent before. One tree holds every worker of a pool ("tenants"): edges
are labelled with text, each node records the tenants whose prompts pass through it with the
time they last did, so a tenant present at a node is present at all its ancestors. The size is
the characters held per tenant (shared text counts once per tenant, as a worker caches its own
copy); :meth:`ApproxRadixTree.evict` trims least recently used leaves of any tenant until the
total is within a bound.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Container


class _Node:
    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        # tenant -> when a prompt of that tenant last passed through this node
        self.tenants: dict[str, float] = {}


class ApproxRadixTree:
    """Prefixes of the prompts routed to each tenant (worker URL), with LRU eviction."""

    def __init__(self) -> None:
        self._root = _Node("", None)
        self._sizes: dict[str, int] = {}

    @property
    def size(self) -> int:
        """Characters held, summed over tenants."""
        return sum(self._sizes.values())

    def tenant_size(self, tenant: str) -> int:
        """Characters held for ``tenant`` (0 for an unknown one)."""
        return self._sizes.get(tenant, 0)

    def insert(self, text: str, tenant: str, now: float) -> None:
        """Record that ``tenant`` served a prompt ``text`` at time ``now``."""
        node = self._root
        pos = 0
        added = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = _Node(text[pos:], node)
                node.children[text[pos]] = child
            else:
                common = _common_length(child.text, text, pos)
                if common < len(child.text):
                    child = self._split(child, common)
            if tenant not in child.tenants:
                added += len(child.text)
            child.tenants[tenant] = now
            pos += len(child.text)
            node = child
        if added:
            self._sizes[tenant] = self._sizes.get(tenant, 0) + added

    def match(self, text: str, tenants: Container[str]) -> tuple[str | None, int]:
        """The tenant among ``tenants`` that served the longest prefix of ``text``, and that
        prefix's length in characters; (None, 0) when none shares even one character. Of
        tenants with equally long prefixes, the one that used it last wins."""
        node = self._root
        pos = 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None or not any(t in tenants for t in child.tenants):
                break
            common = _common_length(child.text, text, pos)
            node = child
            pos += common
            if common < len(child.text):
                break
        if node is self._root:
            return None, 0
        present = [(when, t) for t, when in node.tenants.items() if t in tenants]
        return max(present)[1], pos

    def remove_tenant(self, tenant: str) -> None:
        """Forget every prefix ``tenant`` served (a worker that left the pool)."""
        for node in reversed(self._nodes()):  # children before their parents
            held = node.tenants.pop(tenant, None) is not None
            if held and not node.tenants and node.parent is not None:
                del node.parent.children[node.text[0]]
        self._sizes.pop(tenant, None)

    def evict(self, max_size: int) -> None:
        """Drop least recently used tenant leaves until :attr:`size` is at most ``max_size``."""
        total = self.size
        if total <= max_size:
            return
        order = itertools.count()
        heap = [
            (when, next(order), node, tenant)
            for node in self._nodes()
            for tenant, when in node.tenants.items()
            if _is_leaf(node, tenant)
        ]
        heapq.heapify(heap)
        while heap and total > max_size:
            _, _, node, tenant = heapq.heappop(heap)
            total -= self._drop(node, tenant)
            parent = node.parent
            if parent is not None and parent is not self._root and _is_leaf(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], next(order), parent, tenant))

    def _drop(self, node: _Node, tenant: str) -> int:
        """Remove ``tenant`` from a node where it is a leaf; the characters freed."""
        del node.tenants[tenant]
        freed = len(node.text)
        left = self._sizes[tenant] - freed
        if left > 0:
            self._sizes[tenant] = left
        else:
            del self._sizes[tenant]
        if not node.tenants and node.parent is not None:
            del node.parent.children[node.text[0]]
        return freed

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` characters; the new upper node is returned."""
        parent = child.parent
        if parent is None:
            raise ValueError("the root has no edge to split")
        upper = _Node(child.text[:at], parent)
        upper.tenants = dict(child.tenants)
        parent.children[upper.text[0]] = upper
        child.text = child.text[at:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    def _nodes(self) -> list[_Node]:
        """Every node but the root."""
        found: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found


def _is_leaf(node: _Node, tenant: str) -> bool:
    """``tenant`` holds ``node`` but none of its children: its deepest text here."""
    return tenant in node.tenants and not any(
        tenant in child.tenants for child in node.children.values()
    )


def _common_length(edge: str, text: str, pos: int) -> int:
    """How many leading characters of ``edge`` equal ``text`` from ``pos`` on."""
    if text.startswith(edge, pos):
        return len(edge)
    limit = min(len(edge), len(text) - pos)
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(edge[:mid], pos):
            low = mid
        else:
            high = mid - 1
    return low

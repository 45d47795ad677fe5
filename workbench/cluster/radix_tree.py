"""The approximate radix tree of SGLang's cache-aware router: which replica saw which prefix.

One tree for all replicas ("tenants"), keyed by token ids (SGLang keys by characters of the
text), edges compressed. Every node a tenant's inserted prompt passed through records the
tenant and when (its LRU time). It approximates each replica's prefix cache from the routing
history alone: what was sent to a replica is assumed to be cached there until the tree
evicts it (a tenant over ``max_tree_size`` tokens loses its least recently used leaves).

Invariant: ``size[t]`` is the number of tokens on the nodes that hold tenant ``t``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key, self.parent = key, parent
        self.children: dict[int, _Node] = {}
        self.tenants: dict[int, float] = {}  # tenant -> last access time


def _common(a: tuple[int, ...], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b) - start)
    k = 0
    while k < n and a[k] == b[start + k]:
        k += 1
    return k


class RadixTree:
    """``insert(tokens, tenant, now)``; ``match(tokens)`` -> each tenant's matched prefix length;
    ``evict(max_size)`` drops least recently used leaves of tenants above ``max_size`` tokens."""

    def __init__(self) -> None:
        self.root = _Node((), None)
        self.size: dict[int, int] = {}

    def insert(self, tokens: Sequence[int], tenant: int, now: float) -> None:
        node, i = self.root, 0
        node.tenants[tenant] = now
        self.size.setdefault(tenant, 0)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tuple(tokens[i:]), node)
                leaf.tenants[tenant] = now
                node.children[tokens[i]] = leaf
                self.size[tenant] += len(leaf.key)
                return
            k = _common(child.key, tokens, i)
            if k < len(child.key):  # split the edge at k
                mid = _Node(child.key[:k], node)
                mid.tenants = dict(child.tenants)
                child.key, child.parent = child.key[k:], mid
                mid.children[child.key[0]] = child
                node.children[tokens[i]] = mid
                child = mid
            if tenant not in child.tenants:
                self.size[tenant] += len(child.key)
            child.tenants[tenant] = now
            node, i = child, i + k

    def match(self, tokens: Sequence[int]) -> dict[int, int]:
        """Per tenant, how many leading tokens of ``tokens`` it holds (tenants holding none left out)."""
        matched: dict[int, int] = {}
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common(child.key, tokens, i)
            i += k
            for tenant in child.tenants:
                matched[tenant] = i
            if k < len(child.key):
                break
            node = child
        return matched

    def evict(self, max_size: int) -> None:
        """Tenants holding more than ``max_size`` tokens lose their least recently used leaves
        (a node's tenant entry whose children do not hold that tenant) until they fit."""
        for tenant, size in list(self.size.items()):
            if size <= max_size:
                continue
            heap = [(n.tenants[tenant], id(n), n) for n in self._nodes() if tenant in n.tenants and n is not self.root
                    and not any(tenant in c.tenants for c in n.children.values())]
            heapq.heapify(heap)
            while self.size[tenant] > max_size and heap:
                _, _, node = heapq.heappop(heap)
                del node.tenants[tenant]
                self.size[tenant] -= len(node.key)
                parent = node.parent
                if not node.tenants and not node.children:
                    del parent.children[node.key[0]]
                if parent is not self.root and tenant in parent.tenants and not any(
                        tenant in c.tenants for c in parent.children.values()):
                    heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

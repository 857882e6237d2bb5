"""Agent trees: which session is whose parent, as the control plane sees them.

A session may name its parent (``x-parent-session-id``, or a harness's sub-agent headers, see
``docs/clients.md``). The plane links a new session to its parent when its first request
arrives and uses the link three ways: a child of an admitted parent waits in the children's
lane, ahead of new sessions (``aimd/lanes.py``); a parent dormant while it has live children
waits on them, so its KV hold ends at once (its forecast and its retained prefix stop counting)
instead of holding room against the very children it waits for; and a child's calls run at
least at its parent's level (``sched/core.py``).

Links live as long as the child: a parent that ends first leaves its children orphans (plain
sessions). Pure code: no I/O.
"""

from __future__ import annotations

import heapq

__all__ = ["Trees"]


class Trees:
    def __init__(self) -> None:
        self._parent: dict[str, str] = {}
        self._children: dict[str, set[str]] = {}
        self.linked_total = 0
        """Children linked since start."""

    def link(self, child: str, parent: str) -> bool:
        """``child`` names ``parent``; False when that would be no tree (itself, a cycle, or
        ``child`` has a parent already)."""
        if child == parent or child in self._parent or self.root_of(parent) == child:
            return False
        self._parent[child] = parent
        self._children.setdefault(parent, set()).add(child)
        self.linked_total += 1
        return True

    def parent_of(self, key: str) -> str | None:
        return self._parent.get(key)

    def children_of(self, key: str) -> list[str]:
        """Live children of ``key``, sorted."""
        return sorted(self._children.get(key, ()))

    def has_children(self, key: str) -> bool:
        return bool(self._children.get(key))

    def root_of(self, key: str) -> str:
        seen = {key}
        while (p := self._parent.get(key)) is not None and p not in seen:
            seen.add(p)
            key = p
        return key

    def ended(self, key: str) -> None:
        """``key`` ended: it leaves its parent's children; its own children become roots."""
        parent = self._parent.pop(key, None)
        if parent is not None:
            kids = self._children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[parent]
        for child in self._children.pop(key, ()):
            self._parent.pop(child, None)

    def forest(self, limit: int | None = None) -> dict[str, list[str]]:
        """Parent → live children, for the state document: the first ``limit`` parents by id,
        each with its first ``limit`` children (None: all), without sorting what is not shown."""
        if limit is None:
            return {p: sorted(c) for p, c in sorted(self._children.items()) if c}
        parents = heapq.nsmallest(limit, (p for p, c in self._children.items() if c))
        return {p: heapq.nsmallest(limit, self._children[p]) for p in parents}

    def __len__(self) -> int:
        return len(self._parent)

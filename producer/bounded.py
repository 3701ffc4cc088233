"""Bounded memory for caches and "remember recent keys" maps. Imports nothing of rlrec, so any
layer may use it (it sits in the lowest one).

* `ByteBoundedLRU`: a cache that holds at most `max_bytes` (sizes its caller states), the least
  recently used entry first out; an entry larger than the whole bound is not stored.
* `OldestHalfDict`: a dict of at most `max_items` keys; the insert that goes past it forgets the
  older half at once (insertion order), so the bound costs O(1) per insert, amortised.

Neither is thread-safe: a caller shared by threads holds its own lock around each call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from itertools import islice
from typing import Any, Generic, TypeVar

__all__ = ["ByteBoundedLRU", "OldestHalfDict"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_MISSING: Any = object()


class ByteBoundedLRU(Generic[K, V]):
    """Values by key, at most `max_bytes` in all (the `nbytes` given to `put`), least recently used
    first out. `get` counts as a use, `peek` does not."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.nbytes = 0  # sum of the stored entries' sizes, always <= max_bytes
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of `key` (now the most recently used), or `default`."""
        item = self._items.get(key)
        if item is None:
            return default
        self._items.move_to_end(key)
        return item[0]

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value of `key` without marking it used, or `default`."""
        item = self._items.get(key)
        return default if item is None else item[0]

    def put(self, key: K, value: V, nbytes: int) -> bool:
        """Store `value` under `key` (replacing an earlier value; most recently used) and drop the
        least recently used entries until the total is within `max_bytes`. A value of more than
        `max_bytes` is not stored (an earlier value of `key` is dropped): returns False."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.pop(key)
        if nbytes > self.max_bytes:
            return False
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self.nbytes -= size
        return True

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove `key`; its value, or `default`."""
        item = self._items.pop(key, None)
        if item is None:
            return default
        self.nbytes -= item[1]
        return item[0]

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._items)

    def __repr__(self) -> str:
        return f"ByteBoundedLRU({len(self)} entries, {self.nbytes}/{self.max_bytes} bytes)"


class OldestHalfDict(dict[K, V]):
    """A dict that keeps at most `max_items` keys: setting a new key past that forgets the
    `max_items // 2` oldest keys (insertion order; setting an existing key keeps its place, as in
    a dict). Reads, `in`, `pop` and `del` are a plain dict's. For "remember recently seen ids"
    maps, where forgetting an old id is harmless but the map must not grow without end."""

    max_items: int = 1 << 62  # set by __init__ (a class default: unpickling sets items first)

    def __init__(self, max_items: int) -> None:
        super().__init__()
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.max_items = int(max_items)

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        if len(self) > self.max_items:
            for k in list(islice(iter(self), max(1, self.max_items // 2))):
                super().__delitem__(k)

    def set_many(self, pairs: list[tuple[K, V]]) -> None:
        """``self[k] = v`` for each pair in order, with one size check when there are at most
        ``max_items // 2`` pairs (the same keys are kept: one forgetting at most, of older keys)."""
        if len(pairs) > self.max_items // 2:
            for k, v in pairs:
                self[k] = v
            return
        dict.update(self, pairs)
        if len(self) > self.max_items:
            for k in list(islice(iter(self), max(1, self.max_items // 2))):
                super().__delitem__(k)

    def setdefault(self, key: K, default: V = None) -> V:  # type: ignore[assignment]
        if key not in self:
            self[key] = default  # the newest key is never among those forgotten
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def __ior__(self, other: Any) -> OldestHalfDict[K, V]:  # type: ignore[override]
        self.update(other)
        return self

    def __repr__(self) -> str:
        return f"OldestHalfDict(max_items={self.max_items}, {dict.__repr__(self)})"

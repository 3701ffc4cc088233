"""Cursors: points of a store's manifest, as text, checked against the store they name.

A point of the manifest is a *cursor*: for every partition log, how many of its entries are
seen (entries ``0 .. n-1``; a log the cursor does not name is at 0), and how many removal
records existed when it was taken (`rlrec.store.point_removals`). `rlrec.store.snapshot` opens
one; `cursor_covering` and `cursor_at` compute one from shard entries or positions.

Cursor text: ``r1~TAG~TOPIC:PARTITION=N,PARTITION=N+TOPIC:...[~rm=R]``; ``TAG`` (12 hex
digits) is a hash of the first entry of each log the cursor names, so a cursor of another store
is refused; ``R`` (omitted when 0): the removal records written before the point was taken.

Example:
    >>> c = Cursor.parse("r1~0123456789ab~rl:0=12,1=3")
    >>> c.positions[("rl", 1)], str(c)
    (3, 'r1~0123456789ab~rl:0=12,1=3')
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlrec.store.live_set import first_entry_key
from rlrec.store.manifest import PartitionLog, ShardEntry
from rlrec.store.retention import RemovalRecord
from rlrec.store.storage import Storage

__all__ = ["Cursor", "CursorError", "ExpiredPointError", "cursor_at", "cursor_covering"]

_CURSOR_VERSION = "r1"
_CURSOR_RE = re.compile(r"^r1~([0-9a-f]{12})~(.*)$")
_GROUP_RE = re.compile(r"^([a-zA-Z0-9._-]+):(\d+=\d+(?:,\d+=\d+)*)$")


class CursorError(ValueError):
    """A point of the manifest that this store does not have: a malformed cursor, a cursor of
    another store, a position past a log's end, a time in the future or before any commit.
    Its message is one line."""

    #: a usage error for the command line (rlrec.errors)
    exit_code = 2


class ExpiredPointError(CursorError):
    """A point of the manifest whose data retention removed (`rlrec.store.retention`): some of
    its shards' files are deleted. The newest point, and every point taken after the removal,
    read what is left. Its message is one line: which point, removed when."""


@dataclass(frozen=True)
class Cursor:
    """A point of a store's manifest: ``{(topic, partition): entries seen}`` and the store's tag.

    Args:
        positions: entries seen per partition log (a log not named: none of it).
        tag: 12 hex digits naming the store (a hash of each named log's first entry).
        removals: the removal records that existed when the point was taken (numbered below
            it); of those, the ones planned at or below its positions in every log are in
            effect (`counted_records`): their shards are not part of it. The others' shards
            are (read within their grace, then expired).

    Example:
        >>> c = Cursor({("rl", 0): 12, ("rl", 1): 3}, "0123456789ab")
        >>> str(c)
        'r1~0123456789ab~rl:0=12,1=3'
        >>> Cursor.parse(str(c)) == c
        True
        >>> str(Cursor({("rl", 0): 12}, "0123456789ab", removals=2))
        'r1~0123456789ab~rl:0=12~rm=2'
    """

    positions: Mapping[tuple[str, int], int]
    tag: str
    removals: int = 0

    def __str__(self) -> str:
        groups: dict[str, list[str]] = {}
        for (topic, part), n in sorted(self.positions.items()):
            groups.setdefault(topic, []).append(f"{part}={n}")
        body = "+".join(f"{t}:{','.join(ps)}" for t, ps in groups.items())
        rm = f"~rm={self.removals}" if self.removals else ""
        return f"{_CURSOR_VERSION}~{self.tag}~{body}{rm}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cursor) and (dict(self.positions), self.tag, self.removals) == (
            dict(other.positions),
            other.tag,
            other.removals,
        )

    def __hash__(self) -> int:
        return hash(str(self))

    @classmethod
    def parse(cls, text: str) -> Cursor:
        """A cursor from its text (`str(cursor)`); `CursorError` if it is not one."""
        if not isinstance(text, str):
            raise CursorError(f"a cursor is a string like 'r1~TAG~rl:0=12', got {type(text).__name__}")
        m = _CURSOR_RE.match(text.strip())
        if not m:
            raise CursorError(f"not an rlrec cursor: {_short(text)!r} (expected 'r1~TAG~TOPIC:PARTITION=N,...')")
        positions: dict[tuple[str, int], int] = {}
        body, removals = m.group(2), 0
        if "~" in body:
            body, _, rm = body.partition("~")
            if not re.fullmatch(r"rm=\d{1,9}", rm):
                raise CursorError(f"not an rlrec cursor: {_short(text)!r} (bad part {_short(rm)!r})")
            removals = int(rm[3:])
        for group in body.split("+") if body else []:
            g = _GROUP_RE.match(group)
            if not g:
                raise CursorError(f"not an rlrec cursor: {_short(text)!r} (bad part {_short(group)!r})")
            for item in g.group(2).split(","):
                part, n = (int(x) for x in item.split("="))
                if (g.group(1), part) in positions:
                    raise CursorError(f"not an rlrec cursor: {_short(text)!r} ({g.group(1)}/{part} named twice)")
                positions[(g.group(1), part)] = n
        return cls(positions, m.group(1), removals)


def _short(text: Any, n: int = 60) -> str:
    s = str(text)
    return s if len(s) <= n else s[: n - 3] + "..."


_first_entry_key = first_entry_key


def _tag(firsts: Mapping[tuple[str, int], str]) -> str:
    h = hashlib.sha256()
    for (topic, part), key in sorted(firsts.items()):
        h.update(f"{topic}/{part}={key}\n".encode())
    return h.hexdigest()[:12]


def _as_cursor(value: str | Cursor) -> Cursor:
    return value if isinstance(value, Cursor) else Cursor.parse(value)


def _check_store(c: Cursor, firsts: Mapping[tuple[str, int], str], storage: Storage) -> None:
    missing = sorted(k for k in c.positions if k not in firsts)
    if missing:
        t, p = missing[0]
        raise CursorError(
            f"the cursor names partition log {t}/{p}, which {storage.uri('')} does not have (a cursor of another store?)"
        )
    if _tag({k: firsts[k] for k in c.positions}) != c.tag:
        raise CursorError(f"the cursor is from another store (its logs do not begin like those of {storage.uri('')})")


def _iso(ts: float) -> str:
    """A UNIX time as ISO 8601 UTC with milliseconds, and the UNIX time itself.

    Example:
        >>> _iso(0.0)
        '1970-01-01T00:00:00.000Z (UNIX 0.000)'
    """
    from datetime import datetime, timezone

    text = datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return f"{text} (UNIX {ts:.3f})"


def _expired(what: str, recs: Iterable[RemovalRecord], count: int) -> ExpiredPointError:
    rec = min(recs, key=lambda r: r.n)
    return ExpiredPointError(
        f"{what} is expired: retention removed {count} of its shard(s) at {_iso(rec.time)} (removal record "
        f"{rec.n}, files deleted after {_iso(rec.deletable_at)}); open the newest point or a later one"
    )


def cursor_covering(
    storage: Storage | str, entries: Iterable[ShardEntry], firsts: dict[tuple[str, int], str] | None = None
) -> Cursor:
    """The smallest point of the manifest that holds every one of `entries` (shard entries of
    the store): per partition log, the entries up to the last of them. `open_snapshot` at it,
    then `Snapshot.subset` with their paths, gives exactly those entries back.

    Args:
        storage: the store (a `Storage` or its URI).
        entries: shard entries of its manifest (e.g. the ones a trainer has trained on).
        firsts: a cache of the logs' first-entry keys, filled here (the first entry of a log
            never changes): reuse it across calls to read each log's first entry once.

    Example:
        >>> import tempfile
        >>> from rlrec.store.commit import ShardCommitter
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
        >>> root = tempfile.mkdtemp()
        >>> c = ShardCommitter(root)
        >>> _ = c.commit(expert_cartpole_episodes(1)); _ = c.commit(expert_cartpole_episodes(1, seed=1))
        >>> from rlrec.store.snapshot import open_snapshot
        >>> snap = open_snapshot(root)
        >>> point = cursor_covering(root, snap.entries[:1])
        >>> [e.path for e in open_snapshot(root, as_of=point).entries] == [snap.entries[0].path]
        True
    """
    positions: dict[tuple[str, int], int] = {}
    for e in entries:
        key = (e.topic, e.partition)
        positions[key] = max(positions.get(key, 0), int(e.seq) + 1)  # type: ignore[arg-type]
    return cursor_at(storage, positions, firsts)


def cursor_at(
    storage: Storage | str, positions: Mapping[tuple[str, int], int], firsts: dict[tuple[str, int], str] | None = None
) -> Cursor:
    """The point of the manifest at `positions` (per partition log ``(topic, partition)``: the
    number of its entries the point holds), tagged with the logs' first entries as
    `open_snapshot` tags its cursors. `cursor_covering` computes the positions from entries; a
    reader that kept them (the trainer, in its checkpoint) needs no entry but each log's first.

    Args:
        storage: the store (a `Storage` or its URI).
        positions: (topic, partition) -> entries held (> 0).
        firsts: a cache of the logs' first-entry keys, filled here.

    Raises:
        CursorError: a log of `positions` has no entries in `storage`.

    Example:
        >>> import tempfile
        >>> from rlrec.store.commit import ShardCommitter
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
        >>> root = tempfile.mkdtemp()
        >>> _ = ShardCommitter(root).commit(expert_cartpole_episodes(1))
        >>> from rlrec.store.snapshot import open_snapshot
        >>> str(cursor_at(root, {("rl", 0): 2})) == open_snapshot(root).cursor  # a claim, then the shard
        True
    """
    st = Storage.from_uri(storage) if isinstance(storage, str) else storage
    cache = firsts if firsts is not None else {}
    for key in positions:
        if key not in cache:
            plog = PartitionLog(st, *key)
            first = plog.read_entry(0)
            if first is None:  # folded into a snapshot entry: the whole log says what it was
                entries0 = plog.load(strict=True)
                first = entries0[0] if entries0 else None
            if first is None:
                raise CursorError(f"{key[0]}/{key[1]} has no manifest entries under {st.uri('')}")
            cache[key] = _first_entry_key(first)
    return Cursor(positions, _tag({k: cache[k] for k in positions}))

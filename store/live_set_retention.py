"""Retention's facts of a partition log at a point (`Retention`): what `rlrec retain` needs of
its live shards besides their entries -- a live set's retention columns (docs/FORMAT.md,
"Retention columns"), carried forward by the writer column-wise (`rlrec.store.live_set.HeadShards`
replays what it folded on them), or made from the history (`history_facts`).

Example:
    >>> history_facts([]).tables()["held_seq"].to_pylist()
    []
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from rlrec.store.live_set_file import LiveRows
from rlrec.store.manifest import Entry, ReplaceEntry, ShardEntry

__all__ = ["Retention", "facts_of_rows", "history_facts"]


@dataclass
class Retention:
    """What retention (`rlrec.store.retention`) needs of one log's live shards at a point besides
    their entries -- a live set's retention columns (docs/FORMAT.md, "Retention columns"), or the
    same made from the history (`history_facts`):

    * ``newest_of(seq)``: per live shard, the newest first-commit time of its episodes (its own
      commit time for a shard entry; for a merged shard the newest of those of the shards it
      replaced that hold episodes, else its own): when it expires;
    * ``holds_of(seq)`` (all: `holds`): per live shard, the seqs of the shard entries whose
      episodes it holds (a shard entry holds itself): what a pin by identity resolves to;
    * `replaced`: per shard file replaced below the point and not named by a folded removal
      record, the entry that committed it: (the replace entry that replaced it, its policy id,
      its file name): what retention records as ``replaced``.

    A live set's columns are the base (``base``: arrays, never copied); what a fold changes since
    is kept beside them (the ``_``-fields), so that carrying a live set forward costs its changes,
    and `tables` its columns less the rows dropped plus those added (as `HeadShards.rows`).
    """

    base: dict[str, Any] = field(default_factory=dict)
    base_seqs: Sequence[int] = ()
    _newest: dict[int, float] = field(default_factory=dict)
    _holds: dict[int, tuple[int, ...]] = field(default_factory=dict)  # merged shards added since
    _gone: set[int] = field(default_factory=set)  # base holders no longer live
    _replaced: dict[int, tuple[int, str, str]] = field(default_factory=dict)  # added since
    _recorded: set[int] = field(default_factory=set)  # base replaced files a folded record names

    def copy(self) -> Retention:
        return Retention(
            self.base,
            self.base_seqs,
            dict(self._newest),
            dict(self._holds),
            set(self._gone),
            dict(self._replaced),
            set(self._recorded),
        )

    def newest_of(self, seq: int) -> float:
        """The newest first-commit time of the episodes of the live shard committed at `seq`."""
        if seq in self._newest:
            return self._newest[seq]
        i = bisect.bisect_left(self.base_seqs, seq)
        if i == len(self.base_seqs) or self.base_seqs[i] != seq:
            raise KeyError(seq)
        return float(self.base["newest"][i])

    def expiring(self, cutoff: float) -> list[int]:
        """The seqs, ascending, whose newest first-commit time is at or below `cutoff` (of the
        shards this was built with or added since; the caller checks which are live)."""
        out = {q for q, t in self._newest.items() if t <= cutoff}
        if len(self.base_seqs):
            old = np.asarray(self.base_seqs)[np.asarray(self.base["newest"]) <= cutoff].tolist()
            out |= {q for q in old if q not in self._newest}
        return sorted(out)

    def _base_holds_map(self) -> dict[int, tuple[int, ...]]:
        cache = self.base.setdefault("_maps", {})  # type: ignore[attr-defined]
        if "holds" not in cache:
            held: dict[int, list[int]] = {}
            if "held_seq" in self.base:
                for h, by in zip(self.base["held_seq"].tolist(), self.base["held_by"].tolist()):
                    held.setdefault(by, []).append(h)
            cache["holds"] = {k: tuple(v) for k, v in held.items()}
        return cache["holds"]

    def _base_replaced_map(self) -> dict[int, tuple[int, str, str]]:
        cache = self.base.setdefault("_maps", {})  # type: ignore[attr-defined]
        if "replaced" not in cache:
            b = self.base
            cache["replaced"] = (
                dict(
                    zip(
                        b["replaced_seq"].tolist(),
                        zip(
                            b["replaced_by"].to_pylist(),
                            b["replaced_policy_id"].to_pylist(),
                            b["replaced_name"].to_pylist(),
                        ),
                    )
                )
                if "replaced_seq" in b
                else {}
            )
        return cache["replaced"]

    def seqs(self) -> set[int]:
        """The seqs of the live shards it knows a newest first-commit time of."""
        return {q for q in self.base_seqs if q not in self._gone} | set(self._newest)

    def holds_of(self, seq: int) -> tuple[int, ...]:
        """The shard entries whose episodes the live shard committed at `seq` holds."""
        if seq in self._holds:
            return self._holds[seq]
        if seq not in self._gone:
            return self._base_holds_map().get(seq, (seq,))
        return (seq,)

    @property
    def holds(self) -> dict[int, tuple[int, ...]]:
        """Every live merged shard's held shard entries (a new dict)."""
        out = {k: v for k, v in self._base_holds_map().items() if k not in self._gone}
        return out | self._holds

    @property
    def replaced(self) -> dict[int, tuple[int, str, str]]:
        """The replaced files (module docstring), as a new dict."""
        out = {k: v for k, v in self._base_replaced_map().items() if k not in self._recorded}
        return out | self._replaced

    def replaced_file(self, seq: int) -> tuple[str, str] | None:
        """(path, staging path) of the replaced shard committed at `seq`, None if not listed."""
        v = self._replaced.get(seq)
        if v is None and seq not in self._recorded:
            v = self._base_replaced_map().get(seq)
        if v is None:
            return None
        _, policy, name = v
        return f"{policy}/{name}", f"{policy}/_staging/{name}"

    def add_shard(self, e: ShardEntry) -> None:
        """A shard entry committed: its episodes first committed with it."""
        self._newest[e.seq] = float(e.commit_time)  # type: ignore[index]

    def replace(self, e: ReplaceEntry, old: Sequence[ShardEntry]) -> None:
        """Replace entry `e` merged the live shards `old` (those at ``e.replaces``)."""
        with_episodes = [self.newest_of(o.seq) for o in old if o.episodes > 0]  # type: ignore[arg-type]
        held = []
        for o in old:
            held += self.holds_of(o.seq)  # type: ignore[arg-type]
            self._drop(o.seq)  # type: ignore[arg-type]
            self._replaced[o.seq] = (e.seq, o.policy_id, o.path.rsplit("/", 1)[-1])  # type: ignore[index,assignment]
        self._newest[e.seq] = max(with_episodes) if with_episodes else float(e.shard.commit_time)  # type: ignore[index]
        self._holds[e.seq] = tuple(sorted(held))  # type: ignore[index]

    def _drop(self, seq: int) -> None:
        self._holds.pop(seq, None)
        self._newest.pop(seq, None)
        self._gone.add(seq)

    def record(self, f: Any, dropped: bool) -> None:
        """A removal record's file `f` (`RemovedFile`) folded: it `dropped` the live shard at its
        seq, else it may name a replaced file."""
        if dropped:
            self._drop(f.seq)
            return
        named = self.replaced_file(f.seq) == (f.path, f.staging_path)
        if named and self._replaced.pop(f.seq, None) is None:
            self._recorded.add(f.seq)  # a base row

    def tables(self) -> dict[str, pa.Array]:
        """The held and replaced tables (`rlrec.store.live_set_file.HELD_COLUMNS`,
        ``REPLACED_COLUMNS``): the base's less what was dropped, plus what was added, in seq
        order (column-wise: no object per kept row)."""
        i64, st = pa.int64(), pa.string()
        b = self.base
        hs = np.asarray(b["held_seq"]) if "held_seq" in b else np.zeros(0, np.int64)
        hb = np.asarray(b["held_by"]) if "held_by" in b else np.zeros(0, np.int64)
        if self._gone and len(hb):
            keep = ~np.isin(hb, np.fromiter(self._gone, np.int64))
            hs, hb = hs[keep], hb[keep]
        add = [(h, by) for by, held in self._holds.items() for h in held]
        if add:
            hs = np.concatenate([hs, np.array([h for h, _ in add], np.int64)])
            hb = np.concatenate([hb, np.array([by for _, by in add], np.int64)])
        order = np.argsort(hs, kind="stable")
        rs = np.asarray(b["replaced_seq"]) if "replaced_seq" in b else np.zeros(0, np.int64)
        rep = {
            "replaced_seq": pa.array(rs, i64),
            "replaced_by": b.get("replaced_by", pa.array([], i64)),
            "replaced_policy_id": b.get("replaced_policy_id", pa.array([], st)),
            "replaced_name": b.get("replaced_name", pa.array([], st)),
        }
        if self._recorded and len(rs):
            mask = pa.array(~np.isin(rs, np.fromiter(self._recorded, np.int64)))
            rep = {k: v.filter(mask) for k, v in rep.items()}
        if self._replaced:
            new = sorted(self._replaced.items())
            more = {
                "replaced_seq": pa.array([q for q, _ in new], i64),
                "replaced_by": pa.array([v[0] for _, v in new], i64),
                "replaced_policy_id": pa.array([v[1] for _, v in new], st),
                "replaced_name": pa.array([v[2] for _, v in new], st),
            }
            rep = {k: pa.concat_arrays([rep[k], more[k]]) for k in rep}
            rep = {
                k: v.take(pa.array(np.argsort(np.asarray(rep["replaced_seq"]), kind="stable"))) for k, v in rep.items()
            }
        return {"held_seq": pa.array(hs[order], i64), "held_by": pa.array(hb[order], i64), **rep}


def facts_of_rows(rows: LiveRows) -> Callable[[], Retention] | None:
    """Retention's facts of a live set's rows (its retention columns, used as they are), or
    None where it has none."""
    t = rows.tables
    if t is None:
        return None
    newest = rows.columns["newest_commit"]

    def ints(a: pa.Array) -> np.ndarray:
        return a.to_numpy() if len(a) else np.zeros(0, np.int64)

    base = {
        "newest": newest.to_numpy() if len(newest) else np.zeros(0),
        "held_seq": ints(t["held_seq"]),
        "held_by": ints(t["held_by"]),
        "replaced_seq": ints(t["replaced_seq"]),
        "replaced_by": t["replaced_by"],
        "replaced_policy_id": t["replaced_policy_id"],
        "replaced_name": t["replaced_name"],
    }
    return lambda: Retention(base, rows.seqs)  # the base's maps, built when first needed, are shared


def history_facts(entries: Iterable[Entry]) -> Retention:
    """`Retention` of one log from its entries (every entry up to a point, in seq order), before
    any removal record is folded: every shard file replaced counts as replaced."""
    r = Retention()
    shards: dict[int, ShardEntry] = {}
    for e in entries:
        if isinstance(e, ShardEntry):
            shards[e.seq] = e  # type: ignore[index]
            r.add_shard(e)
        elif isinstance(e, ReplaceEntry):
            r.replace(e, [shards.pop(q) for q in e.replaces if q in shards])
            shards[e.seq] = e.shard  # type: ignore[index]
    return r

"""Which data trained which policy version, reopened exactly (docs/TRAINER.md, "Lineage").

Every version `rlrec train` publishes carries a ``lineage.json`` whose sha256 its signed
``policy.json`` pins. Besides ``new_shards`` (the shards first trained on since the previous
version) it records what was trained and where that data is:

* ``trained``: every shard trained on (with at least one row in a gradient step) by the time
  the version was exported, as manifest seq ranges per partition log (`add_seq`, `ranges_doc`;
  a lineage written before ranges lists their paths as ``shards``), and ``shards_trained``;
* ``input``: the store the trainer read (its URI);
* ``cursor``: the smallest point of that store's manifest holding every trained shard
  (`rlrec.store.cursor.cursor_at`; a trainer follows the manifest and trains shards
  as they land, so this is the point up to which it had trained when it exported the version);
* ``holdout_fraction``: F of the held-out split (`rlrec.trainer.holdout`): the episodes of
  those shards with ``is_held_out(id, F)`` were held out, never trained on.

So the data a version was trained on is: the episodes first committed by the entries
``trained`` names, less the held-out episodes; the data it held out: the same shards'
held-out episodes. `open_lineage` builds exactly these, read from the shards that hold them now
(`rlrec.store.snapshot.open_entries`: a compaction that merged them changes the files, not the
episodes), and `files_needed` names those shards (what retention must keep). Its
weights saw rows of every listed shard; a shard's remaining rows may still have been in the
replay window when it was exported (the lineage is per shard, not per row), and episodes the
trainer refused as unusable (counted in ``episodes_skipped``) are in the reopened data.

The lineage is read with the checks `load_policy` applies (`rlrec.trainer.policy.read_lineage`):
policy.json's signature verified with the trainer's public key, lineage.json matching the
sha256 it pins. A lineage written before cursors were recorded lists shards only: reopening it
is a `LineageError`.
"""

from __future__ import annotations

import bisect
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

from rlrec.store.snapshot import merge_ranges, open_entries, open_snapshot
from rlrec.store.snapshot_reader import Snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.holdout import holdout_key, is_held_out

__all__ = [
    "REPIN_MARGIN_S",
    "HoldoutSplit",
    "Lineage",
    "LineageError",
    "LineageInputWarning",
    "files_needed",
    "list_lineages",
    "open_lineage",
    "ranges_minus",
    "read_version_lineage",
    "removed_data",
]

#: a version may pin data a removal record names only while the record's grace has at least
#: this long to run (the publishing and the retaining hosts' clocks may differ this much)
REPIN_MARGIN_S = 60.0


class LineageInputWarning(UserWarning):
    """A version's data is read through another URI than the one its trainer read."""


class LineageError(ValueError):
    """A version's data cannot be reopened: unknown version, an unsigned or tampered lineage, a
    lineage without a cursor, contradicting arguments. Its message is one line."""

    #: a usage error for the command line (rlrec.errors)
    exit_code = 2


@dataclass(frozen=True)
class HoldoutSplit:
    """One side of the held-out split as an episode filter (`Snapshot.subset`): keeps the
    episodes with ``is_held_out(holdout_key(id, multi_agent_id), fraction) == held_out`` (the
    snapshot hands it the multi-agent episode id of an agent row: ``by_multi_agent_episode``).
    Picklable (DataLoader workers), and its ``repr`` names it in the subset's `Snapshot.selection`
    the same way in every process.

    Example:
        >>> HoldoutSplit(0.0, held_out=False)("episode-1"), HoldoutSplit(0.0, held_out=True)("episode-1")
        (True, False)
    """

    fraction: float
    held_out: bool
    #: `rlrec.store.snapshot_reader.Snapshot` passes an agent row's multi-agent episode id as 2nd argument
    by_multi_agent_episode = True

    def __call__(self, episode_id: str | None, multi_agent_episode_id: str | None = None) -> bool:
        # a null id (a tabular shard's eps_id) is split as the trainer splits it: by its text "None"
        return is_held_out(holdout_key(episode_id, multi_agent_episode_id), self.fraction) == self.held_out


def add_seq(ranges: list[list[int]], seq: int) -> None:
    """Add manifest seq `seq` to `ranges` (sorted, disjoint half-open ``[start, end)`` ranges),
    merging the ranges it touches: a log's trained shards in a few ranges, not one per shard.

    Example:
        >>> r = []
        >>> for s in (1, 2, 4, 3, 9): add_seq(r, s)
        >>> r
        [[1, 5], [9, 10]]
    """
    i = bisect.bisect_left(ranges, [seq + 1])  # the first range starting after seq
    if i and ranges[i - 1][1] > seq:  # inside the range before
        return
    if i and ranges[i - 1][1] == seq:  # extends the range before
        ranges[i - 1][1] = seq + 1
        if i < len(ranges) and ranges[i][0] == seq + 1:  # and joins it to the next
            ranges[i - 1][1] = ranges.pop(i)[1]
        return
    if i < len(ranges) and ranges[i][0] == seq + 1:  # extends the next range down
        ranges[i][0] = seq
        return
    ranges.insert(i, [seq, seq + 1])


def ranges_minus(ranges: Any, minus: Any) -> list[tuple[int, int]]:
    """The seqs of `ranges` not in `minus` (both half-open ``[start, end)`` ranges, any order), as
    sorted disjoint ranges.

    Example:
        >>> ranges_minus([(0, 10), (12, 14)], [(2, 4), (9, 13)])
        [(0, 2), (4, 9), (13, 14)]
    """
    out: list[tuple[int, int]] = []
    cut = merge_ranges(minus)
    for a, b in merge_ranges(ranges):
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def ranges_doc(ranges: dict[tuple[str, int], list[list[int]]]) -> list:
    """`ranges` (per (topic, partition)) as JSON: ``[[topic, partition, [[start, end], ...]], ...]``."""
    return [[t, p, [list(r) for r in rs]] for (t, p), rs in sorted(ranges.items())]


def _ranges_from_doc(doc: Any, where: str) -> dict[tuple[str, int], tuple[tuple[int, int], ...]]:
    """The ``trained`` ranges of a lineage.json: integers only, each log once, merged into sorted
    disjoint ranges (`merge_ranges`)."""
    out: dict[tuple[str, int], tuple[tuple[int, int], ...]] = {}

    def whole(x: Any) -> bool:
        return type(x) is int and x >= 0

    try:
        for topic, part, rs in doc:
            if not isinstance(topic, str) or not whole(part) or (topic, part) in out:
                raise TypeError
            pairs = [(a, b) for a, b in rs]
            if not all(whole(a) and whole(b) and a < b for a, b in pairs):
                raise ValueError
            out[(topic, part)] = tuple(merge_ranges(pairs))
    except (TypeError, ValueError):
        raise LineageError(
            f"{where}: trained is not a list of [topic, partition, [[start, end], ...]] (integers, each log once)"
        ) from None
    return out


@dataclass(frozen=True)
class Lineage:
    """One published version's verified lineage.

    Attributes:
        policy_version: the version.
        cursor: the manifest point holding its shards (None: written before cursors were recorded).
        trained: per partition log ``(topic, partition)``, the manifest seq ranges ``(start,
            end)`` of the shards it was trained on (None: a lineage that lists `shards`).
        shards: the manifest paths of the shards it was trained on, as a lineage that lists
            them records them (None: it records `trained` ranges).
        holdout_fraction: F of the held-out split (0: nothing held out).
        input: the URI of the store the trainer read (None: not recorded).
        signed: policy.json's signature verified with the configured public key.
        doc: the whole lineage.json.
    """

    policy_version: int
    cursor: str | None
    trained: dict[tuple[str, int], tuple[tuple[int, int], ...]] | None
    shards: tuple[str, ...] | None
    holdout_fraction: float
    input: str | None
    signed: bool
    doc: dict

    @property
    def num_shards(self) -> int | None:
        """How many shards it was trained on (None: not recorded)."""
        if self.shards is not None:
            return len(self.shards)
        n = self.doc.get("shards_trained")
        return n if isinstance(n, int) and not isinstance(n, bool) else None

    def shard_paths(self, entries: Any) -> list[str]:
        """The paths of the shards it was trained on among `entries` (the shard entries of the
        snapshot at its cursor)."""
        if self.shards is not None:
            return list(self.shards)
        ranges = self.trained or {}
        return [
            e.path
            for e in entries
            if any(a <= e.seq < b for a, b in ranges.get((e.topic, e.partition), ()))  # type: ignore[operator]
        ]

    @classmethod
    def from_doc(cls, version: int, doc: dict, signed: bool) -> Lineage:
        """A `Lineage` from a verified lineage.json (`LineageError` if its fields are malformed)."""
        where = f"the lineage of policy version {version}"
        cursor, f = doc.get("cursor"), doc.get("holdout_fraction", 0.0)
        if cursor is not None:
            from rlrec.store.cursor import Cursor, CursorError

            try:
                Cursor.parse(cursor if isinstance(cursor, str) else repr(cursor)[:80])
            except CursorError as e:
                raise LineageError(f"{where}: {e}") from None
        trained, shards = None, None
        if "trained" in doc:
            trained = _ranges_from_doc(doc["trained"], where)
        else:
            shards = doc.get("shards", [])
            if not isinstance(shards, list) or not all(isinstance(k, str) for k in shards):
                raise LineageError(f"{where}: shards is not a list of paths")
            shards = tuple(shards)
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0.0 <= f < 1.0:
            raise LineageError(f"{where}: holdout_fraction {f!r:.40} is not in [0, 1)")
        inp = doc.get("input")
        return cls(version, cursor, trained, shards, float(f), inp if isinstance(inp, str) else None, signed, doc)


def read_version_lineage(
    policies: str,
    version: int,
    *,
    public_key: Any = None,
    allow_unsigned: bool = False,
    run_id: str | None = None,
    channel: str | None = None,
) -> Lineage:
    """The verified lineage of published `version` (`rlrec.trainer.policy.read_lineage`).

    Args:
        policies: the publish root (``{checkpoint_dir}/policies`` by default).
        version: the policy version.
        public_key: the trainer's Ed25519 public key (PEM bytes or a path; default
            ``$RLREC_POLICY_PUBLIC_KEY``).
        allow_unsigned: accept a version whose policy.json carries no verified signature.
        run_id: only a version signed for this run (``rlrec train`` logs its run id).
        channel: only a version signed for this channel.

    Raises:
        LineageError: unknown version, unsigned, tampered, another run or channel than
            pinned (one-line message).

    Example:
        >>> read_version_lineage("/ckpt/policies", 3).cursor  # doctest: +SKIP
        'r1~4be0c6a2f1d9~rl:0=14'
    """
    from rlrec.trainer.policy import PolicyLoadError, read_lineage

    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= 999_999:
        raise LineageError(f"policy_version must be an integer in 1..999999, got {version!r:.40}")
    try:
        doc, signed = read_lineage(
            policies, version, public_key=public_key, allow_unsigned=allow_unsigned, run_id=run_id, channel=channel
        )
    except FileNotFoundError as e:
        raise LineageError(str(e).strip("'\"")) from None
    except PolicyLoadError as e:
        raise LineageError(f"policy version {version}: {e}") from None
    return Lineage.from_doc(version, doc, signed)


def open_lineage(
    storage: Storage | str,
    policies: str,
    version: int,
    *,
    held_out: bool = False,
    public_key: Any = None,
    allow_unsigned: bool = False,
    run_id: str | None = None,
    channel: str | None = None,
) -> Snapshot:
    """The data published `version` was trained on (or, with `held_out`, the data it held out),
    as a snapshot of `storage` (module docstring): the episodes of the shard entries it trained
    on, read from the shards that hold them now. Its `Snapshot.selection` (the entries and the
    side of the split) names the data; its cursor is the smallest point where those shards are
    live (the version's lineage cursor until a compaction merges them), and its ``lineage``
    attribute is the verified `Lineage` it was opened from.

    Args:
        storage: the store the trainer read (a `Storage` or its URI).
        policies: the publish root.
        version: the policy version.
        held_out: the held-out episodes of the version's shards instead of the trained ones.
        public_key: the trainer's public key (default ``$RLREC_POLICY_PUBLIC_KEY``).
        allow_unsigned: accept an unsigned version.
        run_id: only a version signed for this run.
        channel: only a version signed for this channel.

    Raises:
        LineageError: unknown version, unsigned or tampered lineage, another run or channel
            than pinned, a lineage without a cursor, `held_out` of a version that held nothing out.
        CursorError: the cursor is not a point of `storage` (another store, a shard missing).

    Warns:
        LineageInputWarning: `storage` is named by another URI than the lineage's ``input``
            (the cursor's tag still proves it is the same store: a mirror, another scheme).

    Example:
        >>> snap = open_lineage("/data/shards", "/ckpt/policies", 3)  # doctest: +SKIP
        >>> held = open_lineage("/data/shards", "/ckpt/policies", 3, held_out=True)  # doctest: +SKIP
        >>> set(snap.steps()["episode_id"].to_pylist()) & set(held.steps()["episode_id"].to_pylist())  # doctest: +SKIP
        set()
    """
    lin = read_version_lineage(
        policies, version, public_key=public_key, allow_unsigned=allow_unsigned, run_id=run_id, channel=channel
    )
    if lin.cursor is None:
        raise LineageError(
            f"the lineage of policy version {version} records no manifest cursor (published before rlrec "
            "recorded one): its data cannot be reopened exactly; lineage.json lists its shards"
        )
    if held_out and not lin.holdout_fraction:
        raise LineageError(f"policy version {version} held nothing out (its holdout_fraction is 0)")
    keep = HoldoutSplit(lin.holdout_fraction, bool(held_out))
    snap = _trained_data(storage, lin)
    here = snap.storage.uri("")
    if lin.input is not None and lin.input.rstrip("/") != here.rstrip("/"):
        warnings.warn(
            f"policy version {version} was trained on {lin.input}, this reads {here} (the cursor's tag matches: "
            "the same store by another name)",
            LineageInputWarning,
            stacklevel=2,
        )
    data = snap.subset(keep_episode=keep)
    data.lineage = lin  # type: ignore[attr-defined]
    return data


def _trained_data(storage: Storage | str | Snapshot, lin: Lineage) -> Snapshot:
    """The episodes of the shards `lin` was trained on, in the shards that hold them now
    (`open_entries`; `storage` may be the store's newest snapshot, reused), after checking that
    its cursor is a point of the store."""
    assert lin.cursor is not None
    if lin.trained is None:  # a lineage that lists paths: the shards live at its cursor
        st = storage.storage if isinstance(storage, Snapshot) else storage
        snap = open_snapshot(st, as_of=lin.cursor)
        return snap.subset(lin.shard_paths(snap.entries))
    st = Storage.from_uri(storage) if isinstance(storage, str) else storage
    return open_entries(st, lin.trained, within=lin.cursor)


def files_needed(storage: Storage | str | Snapshot, lineage: Lineage) -> set[str]:
    """The manifest paths of the shards that reopening `lineage`'s data reads (trained and held
    out): what retention must keep while the version may be deployed or rolled back to.

    Args:
        storage: the store the version's trainer read, or a snapshot of its newest point
            (`open_snapshot(storage)`): the manifest read once for many versions.
        lineage: its verified lineage (`read_version_lineage`).

    Raises:
        LineageError: a lineage without a cursor.
        CursorError: its cursor is not a point of `storage`.

    Example:
        >>> files_needed("/data/shards", read_version_lineage("/ckpt/policies", 3))  # doctest: +SKIP
        {'expert/rl-00000-000000000000-000000000041.parquet'}
    """
    if lineage.cursor is None:
        raise LineageError(f"the lineage of policy version {lineage.policy_version} records no manifest cursor")
    return {e.path for e in _trained_data(storage, lineage).entries}


def list_lineages(policies: str, *, public_key: Any = None) -> list[dict]:
    """One row per version directory under `policies`, for display (`rlrec report`, `inspect
    --policies`): ``policy_version``, ``cursor`` (None: not recorded), ``shards`` (count),
    ``holdout_fraction`` (None: not recorded), ``signed``, ``error`` (why its lineage is not
    usable, else None). Unsigned versions are listed (``signed`` False); one bad or unreadable
    version is a row with its ``error``, never an exception.

    Args:
        policies: the publish root.
        public_key: the trainer's public key (default ``$RLREC_POLICY_PUBLIC_KEY``).

    Raises:
        LineageError: the publish root does not exist (a local path) or cannot be listed.

    Example:
        >>> [r["policy_version"] for r in list_lineages("/ckpt/policies")]  # doctest: +SKIP
        [1, 2, 3]
    """
    from rlrec.trainer.policy import PolicyLoadError, _Files

    try:
        names = _Files(policies).version_dirs()
    except FileNotFoundError:
        raise LineageError(
            f"no publish root at {policies}: nothing is published there (rlrec train publishes to "
            "--publish-dir, default {checkpoint-dir}/policies)"
        ) from None
    except (OSError, PolicyLoadError) as e:
        raise LineageError(f"cannot list the publish root {policies}: {type(e).__name__}: {e}") from None
    rows = []
    for name in names:
        version = int(name[1:])
        row: dict[str, Any] = {"policy_version": version, "cursor": None, "shards": None, "holdout_fraction": None}
        row.update(signed=None, error=None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # listed as unsigned instead
                lin = read_version_lineage(policies, version, public_key=public_key, allow_unsigned=True)
        except LineageError as e:
            row["error"] = str(e)
        except Exception as e:  # an unreadable version is one row, the listing goes on
            row["error"] = f"policy version {version}: {type(e).__name__}: {e}".splitlines()[0]
        else:
            recorded = "holdout_fraction" in lin.doc
            row.update(
                cursor=lin.cursor,
                shards=lin.num_shards,
                holdout_fraction=lin.holdout_fraction if recorded else None,
                signed=lin.signed,
            )
        rows.append(row)
    return rows


def removed_data(
    storage: Storage | str, trained: dict[tuple[str, int], Any], *, now: float | None = None
) -> tuple[list[str], list[str]]:
    """Whether retention recorded as removed the data of the shard entries `trained` (a
    version's lineage ``trained``: per log, seq ranges), checked by a publisher once its version
    directory is written (so that from then on ``rlrec retain --policies`` pins it): ``(re-pinned,
    lost)`` -- the manifest paths of the live shards holding those entries' episodes that a
    removal record names, split into those whose files are there and whose record's grace runs
    at least `REPIN_MARGIN_S` more (retain asks for the pins again right before it deletes, so
    the new version keeps them) and the others (deleted, or about to be: lost to the version).

    Reads the removal log, and only when a record names one of the `trained` logs, those logs.

    Example:
        >>> import tempfile
        >>> removed_data(tempfile.mkdtemp(), {("rl", 0): [(2, 3)]})
        ([], [])
    """
    from rlrec.store.manifest import PartitionLog
    from rlrec.store.retention import pinned_live_shards, read_removals, resolve_removals

    st = Storage.from_uri(storage) if isinstance(storage, str) else storage
    now = time.time() if now is None else now
    records = read_removals(st)
    named = {(f.topic, f.partition) for r in records for f in r.files} & set(trained)
    if not named:
        return [], []
    logs = {k: PartitionLog(st, *k).load(strict=True) for k in sorted(named)}
    resolved = resolve_removals(records, logs)
    repinned, lost = [], []
    for key, shard in sorted(pinned_live_shards(logs, {k: trained[k] for k in named}).items()):
        hit = resolved.get(key)
        if hit is None:
            continue
        there = st.exists(shard.path) or st.exists(shard.staging_path)
        (repinned if there and now < hit[0].deletable_at - REPIN_MARGIN_S else lost).append(shard.path)
    return repinned, lost

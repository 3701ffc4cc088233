"""Maintenance of an output root: garbage collection, inspection, verification.

* :func:`gc` -- delete shard files no manifest entry names (crashed or fenced
  writers' staging files, interrupted temp files), once they are older than a
  grace period.  A file a committed entry names, as ``path`` or as
  ``staging_path``, is never deleted, whatever its age.  Never touches
  ``_manifest/``.
* :func:`inspect` -- the manifest as a JSON-able document (``rlrec inspect``).
* :func:`verify` -- check committed shards against the files: missing, size,
  sha256, duplicate episode ids, log anomalies (gaps, unfenced zombies,
  snapshots that disagree with the entries they fold), optional decode check.
* :func:`episode_summary` -- episode length/return statistics from the
  ``length`` / ``episode_return`` columns of the shards, when they have them.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from rlrec.store.deletion import STAGING_DIR, delete_files
from rlrec.store.log_shards import live_shards, shard_files
from rlrec.store.manifest import (
    ClaimEntry,
    Entry,
    ManifestError,
    PartitionLog,
    ShardEntry,
    SnapshotEntry,
    manifest_totals,
    read_manifest,
    read_partition_logs,
)
from rlrec.store.storage import FileInfo, Storage

__all__ = ["STAGING_DIR", "DecodeCheck", "episode_summary", "gc", "inspect", "propensity_counts", "verify"]

log = logging.getLogger("rlrec.maintenance")


#: ``decode_check(data, entry) -> (episodes, steps)``: decode a shard's bytes; may
#: return None for "cannot check this one" (e.g. a format it does not know).
DecodeCheck = Callable[[bytes, ShardEntry], "tuple[int, int] | None"]


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _is_temp(name: str) -> bool:
    return name.startswith(".") and ".tmp-" in name


def _candidate_files(storage: Storage) -> tuple[dict[str, list[FileInfo]], set[str]]:
    """Files directly in each top-level dir (not ``_*``/``.*``) and in its ``_staging/``.

    Returns ({policy_dir: [files]}, {dirs that have a _staging subdir}).
    """
    files: dict[str, list[FileInfo]] = {}
    with_staging: set[str] = set()
    for top in storage.list(""):
        if not top.is_dir or top.name.startswith(("_", ".")):
            continue
        entries = storage.list(top.path)
        files[top.path] = [f for f in entries if not f.is_dir]
        if any(f.is_dir and f.name == STAGING_DIR for f in entries):
            with_staging.add(top.path)
            files[top.path] += [f for f in storage.list(f"{top.path}/{STAGING_DIR}") if not f.is_dir]
    return files, with_staging


def _deletable_shape(f: FileInfo) -> bool:
    """A file gc may delete by its place and name: in ``_staging/``, a ``*.parquet`` or an
    interrupted temp file (``_candidate_files`` lists only policy-dir candidates)."""
    return _parent(f.path).endswith(f"/{STAGING_DIR}") or f.name.endswith(".parquet") or _is_temp(f.name)


#: A published shard file's name: ``{topic}+{partition:05d}+{first:020d}+{last:020d}+e{epoch}.{suffix}.parquet``,
#: the suffix ``c{12 hex}`` for compaction's merged shards (`rlrec.store.commit.ShardCommitter`,
#: `rlrec.store.compaction`): the Kafka offsets its episodes span.
_SHARD_NAME_RE = re.compile(
    r"^(?P<tp>.+\+\d{5})\+(?P<first>\d{20})\+(?P<last>\d{20})\+e\d+\.(?P<suffix>[^/]+)\.parquet$"
)
_MERGED_SUFFIX_RE = re.compile(r"^c[0-9a-f]{12}$")


def _heads_cannot_name(files: dict[str, list[FileInfo]], old: list[FileInfo]) -> bool:
    """True when the listing alone shows an old file the heads (live shards, recent removal
    records) are not expected to name, so that only the history can decide and gc reads it
    alone: a file in ``_staging/`` or an interrupted temp file (a crashed writer's), or a
    published shard file whose offsets lie within a merged shard's of its policy dir and
    partition, or equal another shard file's (a file compaction replaced and retention has not
    deleted, or a fenced writer's attempt). A guess about what to read first, never about what
    to delete: a wrong one costs the heads' reads or the history's, as before live sets."""
    if any(not f.name.endswith(".parquet") or _parent(f.path).endswith(f"/{STAGING_DIR}") for f in old):
        return True
    old_paths = {f.path for f in old}
    for d, infos in files.items():
        shards: dict[str, list[tuple[int, int, bool, str]]] = {}
        for f in infos:
            m = _SHARD_NAME_RE.match(f.name)
            if m and _parent(f.path) == d:
                merged = bool(_MERGED_SUFFIX_RE.match(m["suffix"]))
                shards.setdefault(m["tp"], []).append((int(m["first"]), int(m["last"]), merged, f.path))
        if any(_within_another(group, old_paths) for group in shards.values()):
            return True
    return False


def _within_another(group: list[tuple[int, int, bool, str]], old_paths: set[str]) -> bool:
    """Whether the offsets of an old file of `group` (one policy dir's shard files of one
    partition) equal another file's or lie within a merged one's (n log n)."""
    same = collections.Counter((lo, hi) for lo, hi, _, _ in group)
    merged = sorted((lo, hi, p) for lo, hi, m, p in group if m)
    starts = [lo for lo, _, _ in merged]
    top: list[tuple[tuple[int, str], tuple[int, str]]] = []  # per prefix: the two widest reaches
    best, second = (-1, ""), (-1, "")
    for _, hi, p in merged:
        if hi > best[0]:
            best, second = (hi, p), best
        elif hi > second[0]:
            second = (hi, p)
        top.append((best, second))
    for lo, hi, _, p in group:
        if p not in old_paths:
            continue
        if same[(lo, hi)] > 1:
            return True
        i = bisect.bisect_right(starts, lo)  # the merged files starting at or before lo
        if i:
            b1, b2 = top[i - 1]
            if (b1[0] if b1[1] != p else b2[0]) >= hi:
                return True
    return False


def _unnamed_by_heads(storage: Storage, files: Iterable[FileInfo]) -> list[FileInfo]:
    """`files` that no shard at the head of any partition log names (path or staging path) nor
    any removal record read with them (retention deletes those after their grace): read through
    each log's live set where it has a usable one (`rlrec.store.live_set.read_heads`, the readers'
    one decision about a live set; the whole history where it has none). A live set can only
    make a file named here, never unnamed: gc deletes nothing the history has not decided."""
    from rlrec.store.live_set import read_heads

    try:
        heads, _, records = read_heads(storage, strict=False)
    except ManifestError as e:  # a log or record the head cannot fold: the history decides, as before
        log.warning("gc: the manifest's head cannot be read (%s): reading its history", e)
        return list(files)
    named = {p for h in heads.values() for s in h.shards for p in (s.path, s.staging_path)}
    named |= {p for r in records for f in r.files for p in (f.path, f.staging_path)}
    return [f for f in files if f.path not in named]


def gc(
    storage: Storage,
    older_than_s: float,
    dry_run: bool = False,
    *,
    now: float | None = None,
) -> list[str]:
    """Delete unreferenced shard files older than *older_than_s* seconds.

    Considered: files directly inside a *policy dir* and inside its ``_staging/``
    (a policy dir is a top-level directory that some manifest entry names as
    ``policy_id`` or that has a ``_staging/`` subdirectory; other directories,
    nested directories and ``_manifest/`` are never touched).  Of these, the
    published ``*.parquet`` files, everything in ``_staging/`` and interrupted
    temp files (``.NAME.tmp-*``) are garbage unless a committed entry names
    them -- as its ``path`` or its ``staging_path``, published or not, whatever
    their age: this is the one place that rule is enforced (a staged copy of a
    published shard is removed by the writer's roll-forward, never by gc).

    Files are listed *before* the manifest is read, so a shard committed while
    gc runs is seen as referenced.  The grace period must exceed the longest
    time a writer may take from writing a staging file to appending its entry
    (plus clock skew between this host and the storage, whose mtimes are used);
    a writer whose staged file was deleted anyway publishes the shard from
    memory (``ShardCommitter``).

    Deletes through `rlrec.store.deletion.delete_files`, the one deletion path retention uses
    too (shard-file paths only, never through a symlink).

    Returns the deleted (with *dry_run*: deletable) paths relative to the root.
    """
    if older_than_s < 0:
        raise ValueError("older_than_s must be >= 0")
    files, with_staging = _candidate_files(storage)  # 1. list files
    now = time.time() if now is None else now
    old = [f for infos in files.values() for f in infos if _deletable_shape(f) and f.mtime is not None]
    old = [f for f in old if now - f.mtime >= older_than_s]  # type: ignore[operator]
    # 2. then read the manifest: its head (live sets), which can only name files as referenced,
    # unless the listing shows a file only the history can decide (then the history alone)
    if not old or (not _heads_cannot_name(files, old) and not _unnamed_by_heads(storage, old)):
        return []
    # a file the head does not name: every shard an entry names decides, replaced ones too (retention's)
    entries = [e for log_entries in read_partition_logs(storage).values() for e in shard_files(log_entries)]
    policy_dirs = {e.policy_id for e in entries} | with_staging
    keep = {p for e in entries for p in (e.path, e.staging_path)}  # named by an entry: never garbage
    garbage: list[str] = []
    for d, infos in files.items():
        if d not in policy_dirs:
            continue
        for f in infos:
            in_staging = _parent(f.path) == f"{d}/{STAGING_DIR}"
            if not (in_staging or f.name.endswith(".parquet") or _is_temp(f.name)):
                continue
            if f.path in keep or f.mtime is None:
                continue
            if now - f.mtime < older_than_s:
                continue
            garbage.append(f.path)
    # the one deletion path (shared with retention): listing followed links, never delete through one
    return delete_files(storage, garbage, dry_run=dry_run, who="gc")


def inspect(storage: Storage) -> dict[str, Any]:
    """``{"shards": [...], "totals": {...}}`` for ``rlrec inspect``.

    Each shard: path (a URI/absolute path pyarrow can open), topic, partition,
    first_offset, last_offset, episodes, steps, bytes, policy_id, commit_time.
    """
    entries = read_manifest(storage)
    shards = [
        {
            "path": storage.uri(e.path),
            "topic": e.topic,
            "partition": e.partition,
            "first_offset": e.first_offset,
            "last_offset": e.last_offset,
            "episodes": e.episodes,
            "steps": e.steps,
            "bytes": e.bytes,
            "policy_id": e.policy_id,
            "commit_time": e.commit_time,
        }
        for e in entries
    ]
    return {"shards": shards, "totals": manifest_totals(entries), "steps_without_logp": propensity_counts(entries)}


def propensity_counts(entries: Iterable[ShardEntry]) -> dict[str, Any]:
    """Steps without a behaviour propensity (``action_logp``) per policy and policy version,
    from the shard entries' ``steps_without_logp`` counts; shards whose entry has none (written
    before the count existed) are summed under ``unknown``.

    Args:
        entries: committed shard entries.

    Returns:
        ``{"by_policy": {policy_id: {policy_version: steps}}, "unknown": {"shards": n, "steps": n}}``
        (versions in numeric order where they are numbers).

    Example:
        >>> from types import SimpleNamespace as E
        >>> propensity_counts([E(policy_id="p", steps=9, steps_without_logp={"2": 4}),
        ...                    E(policy_id="p", steps=5, steps_without_logp=None)])
        {'by_policy': {'p': {'2': 4}}, 'unknown': {'shards': 1, 'steps': 5}}
    """
    by: dict[str, dict[str, int]] = {}
    unknown = {"shards": 0, "steps": 0}
    for e in entries:
        counts = e.steps_without_logp
        if counts is None:
            unknown["shards"] += 1
            unknown["steps"] += e.steps
            continue
        per = by.setdefault(e.policy_id, {})
        for v, n in counts.items():
            per[v] = per.get(v, 0) + n

    def order(v: str) -> tuple:
        return (0, int(v), "") if v.lstrip("-").isdigit() else (1, 0, v)

    return {
        "by_policy": {pid: {v: per[v] for v in sorted(per, key=order)} for pid, per in sorted(by.items())},
        "unknown": unknown,
    }


def verify(
    storage: Storage, decode_check: DecodeCheck | None = None, *, totals: dict[str, Any] | None = None
) -> list[str]:
    """Problems found (empty list: all good).

    Checks every committed shard (replaced ones and replacements too): the published file exists (a shard that is
    only staged, awaiting roll-forward, is checked in its staging file), its
    size and sha256 match the entry, no episode id is committed twice, each
    partition log has no gaps and no shard entry follows a newer epoch's claim
    (impossible with conditional writes; a sign of unfenced zombies otherwise).
    With *decode_check* (``(data, entry) -> (episodes, steps) | None``) the
    decoded counts are compared with the entry too (None: not checked).

    Every live set (`rlrec.store.live_set`) is rebuilt from the history it summarizes (the log's
    entries below its seq, the removal records below its ``removals``) and compared row by row,
    every field: a live set that hides a shard, lists a replaced or removed one, or claims more
    removal records or entries than exist is reported (readers at the head trust one they can
    parse). *totals*, if given, is filled with `manifest_totals` of the live shards at the head as
    the history says (what was verified, never what a live set says).
    """
    from rlrec.store.retention import read_removals, resolve_removals

    problems: list[str] = []
    records = read_removals(storage)
    logs = read_partition_logs(storage)
    removed = resolve_removals(records, logs)  # their files may be gone: retention deleted them
    entries: list[ShardEntry] = []  # every shard file committed, replaced ones too
    live: dict[int, ShardEntry] = {}  # id() -> the live shards (each episode in exactly one)
    for (topic, partition), log_entries in sorted(logs.items()):
        seqs = [e.seq for e in log_entries]
        if seqs != list(range(len(seqs))):
            problems.append(f"manifest log {topic}/{partition:05d} has gaps (seqs {seqs[:5]}...)")
        problems += _snapshot_problems(storage, topic, partition, log_entries)
        problems += _live_set_problems(storage, topic, partition, log_entries, records)
        max_claim = 0
        for e in log_entries:
            if isinstance(e, SnapshotEntry):
                continue
            if isinstance(e, ClaimEntry):
                if e.epoch <= max_claim:
                    problems.append(
                        f"{topic}/{partition:05d} seq {e.seq}: claim epoch {e.epoch} "
                        f"not above earlier claim {max_claim}"
                    )
                max_claim = max(max_claim, e.epoch)
            else:
                if e.epoch < max_claim:
                    problems.append(
                        f"{topic}/{partition:05d} seq {e.seq}: {e.type} of epoch {e.epoch} "
                        f"committed after claim of epoch {max_claim} (unfenced zombie)"
                    )
                entries.append(e if isinstance(e, ShardEntry) else e.shard)
        try:
            live.update((id(s), s) for s in live_shards(log_entries).values())
        except ManifestError as err:  # a replace entry that breaks the rule of replacement
            problems.append(f"manifest log {topic}/{partition:05d}: {err}")

    if totals is not None:
        totals.clear()
        totals.update(manifest_totals(s for s in live.values() if (s.topic, s.partition, s.seq) not in removed))
    seen_ids: dict[str, str] = {}
    for e in sorted(entries, key=lambda e: (e.commit_time, e.topic, e.partition, e.seq)):
        where = f"{e.topic}/{e.partition:05d} seq {e.seq} ({e.path})"
        for eid in e.episode_ids if id(e) in live else ():  # a replaced shard's ids live on in its replacement
            first = seen_ids.setdefault(eid, where)
            if first != where:
                problems.append(f"duplicate episode id {eid!r}: in {first} and {where}")

        path = e.path
        info = storage.info(path)
        if info is None:
            info = storage.info(e.staging_path)
            if info is None and (e.topic, e.partition, e.seq) in removed:
                continue
            if info is None:
                problems.append(f"{where}: published file missing (and staging file missing)")
                continue
            path = e.staging_path
            log.info("%s: not published yet; checking staging file", where)
        if info.size is not None and info.size != e.bytes:
            problems.append(f"{where}: size {info.size} != {e.bytes} in manifest")
            continue
        try:
            data = storage.read(path)
        except FileNotFoundError:
            problems.append(f"{where}: file vanished while verifying")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != e.sha256:
            problems.append(f"{where}: sha256 {digest[:16]}... != {e.sha256[:16]}... in manifest")
            continue
        if decode_check is not None:
            try:
                counts = decode_check(data, e)
            except Exception as err:  # a broken shard must not stop the others
                problems.append(f"{where}: cannot decode: {type(err).__name__}: {err}")
                continue
            if counts is None:
                continue
            episodes, steps = counts
            if (episodes, steps) != (e.episodes, e.steps):
                problems.append(
                    f"{where}: decoded {episodes} episodes/{steps} steps, manifest says {e.episodes}/{e.steps}"
                )
    return problems


def _live_set_problems(
    storage: Storage, topic: str, partition: int, entries: list[Entry], records: list[Any]
) -> list[str]:
    """Each live set of the log must be what its history says: rebuilt from the entries below
    its seq and the removal records below its ``removals`` (`rlrec.store.live_set.fold`), row
    for row, every field but the episode ids."""
    import dataclasses

    from rlrec.store.live_set import (
        first_entry_key,
        fold,
        history_facts,
        live_set_path,
        live_set_seqs,
        parse_live_set,
    )
    from rlrec.store.live_set_file import size_cap
    from rlrec.store.localfs import EscapesRoot
    from rlrec.store.manifest import UnsupportedManifestError

    problems: list[str] = []
    count = max((r.n + 1 for r in records), default=0)
    try:
        seqs = live_set_seqs(storage, topic, partition)
    except EscapesRoot as e:
        return [f"{topic}/{partition:05d} live sets: the directory is a symlink, readers ignore it ({e})"]
    for seq in seqs:
        where = f"{topic}/{partition:05d} live set {seq}"
        if seq > len(entries) or [e.seq for e in entries[:seq]] != list(range(seq)):
            problems.append(f"{where}: the log has no entries 0..{seq - 1}")  # not read: readers never read it
            continue
        try:
            ls = parse_live_set(
                storage.read(live_set_path(topic, partition, seq), limit=size_cap(seq)), topic, partition, seq
            )
        except FileNotFoundError:
            continue  # deleted meanwhile by the writer of a newer one
        except EscapesRoot as e:
            problems.append(f"{where}: is a symlink, readers ignore it ({e})")
            continue
        except UnsupportedManifestError as e:
            log.info("%s: of a newer format, not checked (readers of this version ignore it): %s", where, e)
            continue
        except ManifestError as e:
            problems.append(f"{where}: malformed, readers ignore it ({e})")
            continue
        below = entries[:seq]
        if ls.removals > count:
            problems.append(f"{where}: folds {ls.removals} removal records, {count} exist")
            continue
        late = [
            r.n
            for r in records
            if r.n < ls.removals and any((f.topic, f.partition) == (topic, partition) and f.seq >= seq for f in r.files)
        ]
        if late:  # readers skip it, so the shards it removes at or past the seq would stay live at the head
            problems.append(f"{where}: folds removal record {late[0]}, which names entries at or past its seq")
            continue
        if ls.first != first_entry_key(below[0] if below else None):
            problems.append(f"{where}: 'first' is not the key of the log's entry 0")
        try:
            folded = [r for r in records if r.n < ls.removals]
            live = fold(topic, partition, live_shards(below), [], folded, lambda below=below: history_facts(below))
        except ManifestError:
            continue  # the log itself breaks the rule of replacement: reported with the log
        problems += _retention_problems(where, live.retention(), fold(topic, partition, ls.shards, [], []).retention())
        want = {s.seq: dataclasses.replace(s, episode_ids=()) for s in live}
        got = {s.seq: s for s in ls.shards}
        for q in sorted(set(want) | set(got)):
            if q not in got:
                problems.append(f"{where}: hides live shard seq {q} ({want[q].path})")
            elif q not in want:
                problems.append(f"{where}: lists seq {q} ({got[q].path}), not live there (replaced, removed or none)")
            elif got[q] != want[q]:
                problems.append(f"{where}: row seq {q} differs from the shard its entry commits")
    return problems


def _retention_problems(where: str, want: Any, got: Any) -> list[str]:
    """How a live set's retention columns (`got`, None: it has none) differ from the history's
    (`want`, `rlrec.store.live_set_retention.Retention`)."""
    if got is None:
        return []  # none: readers that need them read the history
    out = []
    for q in sorted(want.seqs() | got.seqs()):
        try:
            w, g = want.newest_of(q), got.newest_of(q)
        except KeyError:
            continue  # not a live row of both: reported with the rows
        if w != g:
            out.append(f"{where}: row seq {q}'s newest_commit is {g}, its episodes' newest first commit is {w}")
        if want.holds_of(q) != got.holds_of(q):
            out.append(
                f"{where}: row seq {q} holds shard entries {list(got.holds_of(q))}, not {list(want.holds_of(q))}"
            )
    want_replaced, got_replaced = want.replaced, got.replaced
    for q in sorted(set(want_replaced) | set(got_replaced)):
        if want_replaced.get(q) != got_replaced.get(q):
            w, g = want_replaced.get(q), got_replaced.get(q)
            out.append(f"{where}: replaced files: seq {q} is {g or 'not listed'}, the history says {w or 'none'}")
    return out


def _snapshot_problems(storage: Storage, topic: str, partition: int, entries: list[Entry]) -> list[str]:
    """Each snapshot must agree with the entries below it: its newest claim, its offsets, its
    resume position, and every entry it folds byte for byte equal to the entry on storage."""
    plog = PartitionLog(storage, topic, partition)
    problems: list[str] = []
    top_claim: ClaimEntry | None = None
    max_lo = -1
    max_lo_before: dict[int, int] = {}  # seq -> max last_offset of the shard entries below it
    position: int | None = None  # the largest resume_offset of the entries so far
    for e in entries:
        if e.seq is None:
            continue
        max_lo_before[e.seq] = max_lo
        if isinstance(e, (ClaimEntry, ShardEntry)) and e.resume_offset is not None:
            position = e.resume_offset if position is None else max(position, e.resume_offset)
        if isinstance(e, ClaimEntry):
            if top_claim is None or e.epoch > top_claim.epoch:
                top_claim = e
        elif isinstance(e, ShardEntry):
            max_lo = max(max_lo, e.last_offset)
            continue
        if not isinstance(e, SnapshotEntry):
            continue
        where = f"{topic}/{partition:05d} snapshot seq {e.seq}"
        if top_claim is None or e.last_claim != top_claim:
            problems.append(f"{where}: last_claim {e.last_claim.seq} is not the newest claim below it")
        if e.max_last_offset != max_lo_before[e.seq]:
            problems.append(f"{where}: max_last_offset {e.max_last_offset} != {max_lo_before[e.seq]} of its entries")
        if e.below_max_last_offset != max_lo_before.get(e.folded_from, -1):
            problems.append(f"{where}: below_max_last_offset {e.below_max_last_offset} does not match the log")
        if e.resume_offset != position:  # a forged one would move where consumers resume
            problems.append(
                f"{where}: resume_offset {e.resume_offset} != {position}, the largest of the entries below it"
            )
        seqs = list(range(e.folded_from, e.seq))
        for seq, folded, original in zip(seqs, e.entries, _read_many(plog.read_entry, seqs)):
            if original != folded:
                what = "is missing on storage" if original is None else "differs from the entry on storage"
                problems.append(f"{where}: folded entry {seq} {what}")
    return problems


def _read_many(fn: Callable[[int], Any], items: list[int]) -> list[Any]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=8) as ex:
        return list(ex.map(fn, items))


def episode_summary(storage: Storage, entries: Iterable[ShardEntry] | None = None) -> dict[str, Any] | None:
    """count/mean/min/max of the ``length`` and ``episode_return`` columns over the
    published shards that have them (only those two columns are read).

    Returns None if no shard has either column.
    """
    import pyarrow.compute as pc

    from rlrec.store.schema_gate import open_shard

    if entries is None:
        entries = read_manifest(storage)
    cols = ("length", "episode_return")
    acc: dict[str, dict[str, float]] = {}
    for e in entries:
        try:
            with storage.filesystem.open_input_file(storage.full_path(e.path)) as f:
                shard = open_shard(f, fmt=e.format)  # the schema gate, before any column is read
                present = [c for c in cols if c in shard.names]
                if not present:
                    continue
                table = shard.read(present)
        except Exception as err:  # missing file, not Parquet, refused by the gate: skip, verify reports
            log.debug("episode summary: skipping %s: %s", e.path, err)
            continue
        for c in present:
            arr = table.column(c).drop_null()
            if len(arr) == 0:
                continue
            a = acc.setdefault(c, {"count": 0, "sum": 0.0, "min": float("inf"), "max": float("-inf")})
            mm = pc.min_max(arr)
            a["count"] += len(arr)
            a["sum"] += float(pc.sum(arr).as_py())
            a["min"] = min(a["min"], float(mm["min"].as_py()))
            a["max"] = max(a["max"], float(mm["max"].as_py()))
    if not acc:
        return None
    return {
        c: {"count": int(a["count"]), "mean": a["sum"] / a["count"], "min": a["min"], "max": a["max"]}
        for c, a in acc.items()
    }

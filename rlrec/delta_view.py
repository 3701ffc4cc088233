"""A read-only Delta Lake view of a store: `rlrec export URI URI --to delta` (docs/DELTA.md).

One Delta table per policy id, its log at ``{store}/{policy_id}/_delta_log/``, its files the
store's own published shards (relative paths: no data is copied). The view mirrors the manifest
entry by entry: a shard entry of the policy is one commit (add), a replace entry one commit
(remove + add, ``dataChange=false``), a removal record of retention one commit (remove). Every
commit carries, as Delta app transactions (``txn``), the point of the manifest it mirrors: per
partition log the app id ``rlrec:{topic}/{partition}`` at the number of entries read (seq + 1),
and ``rlrec:_removed`` at the number of removal records applied. So:

* the mapping from a Delta version to an rlrec cursor is read from the table itself
  (`version_cursor`), and survives Delta log cleanup and checkpoints (commit metadata does not);
* a rerun, or a ``--follow`` loop restarted after a crash, starts where the table's txns say:
  every commit is one create-once object, so none is missing or doubled.

The manifest stays the source of truth; the view is derived and may be deleted and exported
again at any time (``rm -r {store}/{policy_id}/_delta_log``).

**Where the view lives, and why.** delta-rs 1.6.6 (what polars and DuckDB read Delta through)
resolves every add path against the table root: an absolute URI (``file:///...``, ``s3://...``)
or a ``../`` path is read as a file *under* the root and fails (measured; docs/DELTA.md). So the
table's root must be the folder holding the shards: the policy directory.

**Protecting the store from the engines.** A table rooted in the policy directory lets a
``VACUUM`` delete what it does not reference: replaced shards rlrec keeps for older points, and
shards not exported yet. The view's protocol therefore names a writer feature no engine
implements (`VIEW_FEATURE`, writer version 7, reader version 1): readers read it (reader version
1 has no reader features), while a writer that honours the protocol -- delta-rs's ``vacuum``,
``optimize``, ``delete``, ``merge``, ``update`` and writes -- refuses to touch it. rlrec writes
the view's log itself (create-once commits through `Storage.create_once`).

Example::

    >>> import tempfile
    >>> from rlrec.store.commit import ShardCommitter
    >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
    >>> root = tempfile.mkdtemp()
    >>> _ = ShardCommitter(root, "rl", 0).commit(expert_cartpole_episodes(2))
    >>> [(v.policy_id, v.version, v.commits) for v in export_views(root)]
    [('expert', 0, 1)]
    >>> [v.commits for v in export_views(root)]  # a rerun adds nothing
    [0]
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rlrec.store.cursor import Cursor, cursor_at
from rlrec.store.log_shards import live_shards, shard_files
from rlrec.store.manifest import PartitionLog, list_partition_logs
from rlrec.store.manifest_entries import ClaimEntry, Entry, ReplaceEntry, ShardEntry, SnapshotEntry
from rlrec.store.point_removals import counted_records
from rlrec.store.retention import RemovalRecord, read_removals, resolve_removals
from rlrec.store.snapshot import open_snapshot
from rlrec.store.storage import Storage

log = logging.getLogger(__name__)

#: the folder of a view's Delta log inside its policy directory
LOG_DIR = "_delta_log"
#: the writer feature no engine implements: writers that honour the protocol refuse the table
VIEW_FEATURE = "rlrecReadOnlyView"
#: the pinned protocol of every view (a table with any other is not exported to)
PROTOCOL = {"minReaderVersion": 1, "minWriterVersion": 7, "writerFeatures": [VIEW_FEATURE]}
#: commits between Delta checkpoints (delta-rs's default interval)
CHECKPOINT_EVERY = 100
#: the app id of the removal log's progress
REMOVALS_APP = "rlrec:_removed"
#: the table properties of a view: checkpoints every 100 commits; removed files kept "forever"
#: by engines that ignore the protocol (rlrec's retention decides when a shard goes)
CONFIGURATION = {
    "delta.checkpointInterval": str(CHECKPOINT_EVERY),
    "delta.deletedFileRetentionDuration": "interval 36500 days",
}


class ViewError(RuntimeError):
    """The view cannot be exported to (not an rlrec view, changed by another writer, a shard of
    another schema): one line for the user."""


def app_id(topic: str, partition: int) -> str:
    """The Delta app id of partition log (topic, partition): ``rlrec:{topic}/{partition}``."""
    return f"rlrec:{topic}/{partition}"


def storage_options(uri: str, storage: Storage | None = None) -> dict[str, str]:
    """deltalake's ``storage_options`` for a view's URI. For S3: the endpoint, region and keys of
    `storage` (its URI parameters such as ``?endpoint_override=HOST:PORT&scheme=http``) where
    given, else of the environment rlrec itself reads (``AWS_ENDPOINT_URL_S3``,
    ``AWS_ENDPOINT_URL``), plain HTTP allowed for an ``http://`` endpoint (a local S3 such as moto
    or MinIO); for Azure (``az://``, ``abfs://``), the account, endpoint and key or SAS token of
    ``AZURE_STORAGE_CONNECTION_STRING`` or ``AZURE_STORAGE_*`` (delta-rs does not read connection
    strings). Otherwise none: delta-rs reads the standard variables itself.

    Example:
        >>> storage_options("/tmp/store")
        {}
    """
    import os

    if uri.startswith("s3://"):
        settings: dict[str, Any] = {}
        if storage is not None:
            try:
                settings = dict(storage.filesystem.__reduce__()[1][0])
            except Exception:  # not an S3FileSystem that can be introspected
                settings = {}
        endpoint = (
            settings.get("endpoint_override")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or ""
        )
        if endpoint and "://" not in endpoint:
            endpoint = f"{settings.get('scheme') or 'https'}://{endpoint}"
        opts: dict[str, str] = {}
        if endpoint:
            opts["AWS_ENDPOINT_URL"] = endpoint
            if endpoint.startswith("http://"):
                opts["AWS_ALLOW_HTTP"] = "true"
        if settings.get("region"):
            opts["AWS_REGION"] = str(settings["region"])
        if settings.get("access_key"):
            opts["AWS_ACCESS_KEY_ID"] = str(settings["access_key"])
            opts["AWS_SECRET_ACCESS_KEY"] = str(settings.get("secret_key") or "")
            if settings.get("session_token"):
                opts["AWS_SESSION_TOKEN"] = str(settings["session_token"])
        return opts
    if uri.startswith(("az://", "abfs://", "abfss://")):
        from rlrec.store.azure import AzureSettings

        try:
            az = AzureSettings.from_env()
        except ValueError:  # no account in the environment: delta-rs's own sign-in
            return {}
        opts = {"account_name": az.account_name, "azure_storage_endpoint": az.blob_endpoint}
        if az.blob_endpoint.startswith("http://"):
            opts["allow_http"] = "true"
        if az.account_key:
            opts["account_key"] = az.account_key
        elif az.sas_token:
            opts["sas_token"] = az.sas_token
        return opts
    return {}


#: a file of a Delta log that holds a version: a commit, a checkpoint (or its pointer)
_LOG_FILE_RE = re.compile(r"^(\d{20}\.(json|checkpoint(\.\d+\.\d+)?\.parquet)|_last_checkpoint)$")


def has_view(storage: Storage, policy_id: str) -> bool:
    """True when `policy_id`'s ``_delta_log/`` holds a version (a commit or a checkpoint). A log
    folder without one (a kill -9 inside the first commit leaves the folder and a temp file) is
    no table: the next export creates version 0 there (create-once: a concurrent creator is
    still refused)."""
    return any(_LOG_FILE_RE.match(f.name) for f in storage.list(f"{policy_id}/{LOG_DIR}"))


def delta_schema(schema: Any, where: str = "") -> Any:
    """The Arrow schema a view declares for shards of Arrow schema `schema`: Delta has no unsigned
    integers, so each is widened to the signed type that holds all its values (uint8 -> int16,
    uint16 -> int32, uint32 -> int64, uint64 -> decimal(20, 0)); readers cast the files' values to
    it exactly. ViewError for a type a Delta table cannot hold (float16, time, duration).

    Example:
        >>> import pyarrow as pa
        >>> delta_schema(pa.schema([("obs", pa.list_(pa.uint8(), 4)), ("n", pa.uint64())]))
        obs: fixed_size_list<item: int16>[4]
          child 0, item: int16
        n: decimal128(20, 0)
    """
    import pyarrow as pa

    widened = {
        pa.uint8(): pa.int16(),
        pa.uint16(): pa.int32(),
        pa.uint32(): pa.int64(),
        pa.uint64(): pa.decimal128(20, 0),
    }

    def conv(t: Any, name: str) -> Any:
        if t in widened:
            return widened[t]
        if pa.types.is_float16(t) or pa.types.is_time(t) or pa.types.is_duration(t):
            raise ViewError(f"shard {where}: column {name} has type {t}, which a Delta table cannot hold")
        if pa.types.is_fixed_size_list(t):
            return pa.list_(t.value_field.with_type(conv(t.value_type, name)), t.list_size)
        if pa.types.is_large_list(t):
            return pa.large_list(t.value_field.with_type(conv(t.value_type, name)))
        if pa.types.is_list(t):
            return pa.list_(t.value_field.with_type(conv(t.value_type, name)))
        if pa.types.is_struct(t):
            return pa.struct([f.with_type(conv(f.type, f"{name}.{f.name}")) for f in t])
        if pa.types.is_map(t):
            return pa.map_(conv(t.key_type, name), t.item_field.with_type(conv(t.item_type, name)))
        return t

    return pa.schema([f.with_type(conv(f.type, f.name)) for f in schema], metadata=schema.metadata)


def _check_point(
    uri: str,
    positions: Mapping[tuple[str, int], int],
    sizes: Mapping[tuple[str, int], int],
    removals: int,
    records: int,
) -> None:
    """ViewError unless the point a view's txns name is one of the store: each log's position
    between 0 and its number of entries, the removal log's between 0 and its number of records
    (a txn out of range was not written by rlrec: no cursor is made of it)."""
    for (topic, part), n in sorted(positions.items()):
        if not 0 <= n <= sizes.get((topic, part), 0):
            raise ViewError(
                f"the Delta view {uri} names position {n} of log {topic}/{part}, which has "
                f"{sizes.get((topic, part), 0)} entries: its txn {app_id(topic, part)} is out of range, "
                f"not written by rlrec; remove its {LOG_DIR}/ and export again"
            )
    if not 0 <= removals <= records:
        raise ViewError(
            f"the Delta view {uri} names {removals} removal records, the store has {records}: its txn "
            f"{REMOVALS_APP} is out of range, not written by rlrec; remove its {LOG_DIR}/ and export again"
        )


def table_uri(storage: Storage, policy_id: str) -> str:
    """The URI of policy `policy_id`'s view (its policy directory), as Delta readers open it:
    without the store URI's query parameters (no Delta reader takes them; `storage_options`
    carries them)."""
    return storage.uri(policy_id).split("?", 1)[0]


#: a delta-rs error reading the storage (not the log's content)
_STORAGE_ERROR_RE = re.compile(r"(?i)generic \w+ error|object ?store|connect|timed? ?out|dns|credential")


def _open_error(uri: str, what: str, err: Exception) -> ViewError:
    """One line for a delta-rs error opening `uri`: a storage error (connection, settings,
    permissions) is told from a log rlrec cannot read (not an rlrec view)."""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if _STORAGE_ERROR_RE.search(first):
        return ViewError(f"cannot read {what} {uri} from its storage (check the endpoint and credentials): {first}")
    return ViewError(f"{uri} holds a Delta log rlrec cannot read ({first})")


# --------------------------------------------------------------------------------- planning


@dataclass
class _Log:
    """One partition log being walked: its entries, how far the walk went, the live shards there."""

    key: tuple[str, int]
    entries: list[Entry]
    pos: int = 0
    live: dict[int, ShardEntry] = field(default_factory=dict)

    def seek(self, pos: int) -> None:
        self.pos = pos
        self.live = live_shards(self.entries, below=pos) if pos else {}

    def changes(self) -> tuple[list[ShardEntry], list[ShardEntry]]:
        """(shards added, shards no longer live) by the next entry, without taking it."""
        e = self.entries[self.pos]
        if isinstance(e, ShardEntry):
            return [e], []
        if isinstance(e, ReplaceEntry):
            return [e.shard], [self.live[r] for r in e.replaces if r in self.live]
        if isinstance(e, (ClaimEntry, SnapshotEntry)):
            return [], []
        after = live_shards(self.entries, below=self.pos + 1)  # any other kind: the log's own rule
        return [x for s, x in after.items() if s not in self.live], [x for s, x in self.live.items() if s not in after]

    def step(self) -> None:
        """Take the next entry: the live shards after it."""
        e = self.entries[self.pos]
        if isinstance(e, ShardEntry):
            self.live[e.seq] = e  # type: ignore[index]
        elif isinstance(e, ReplaceEntry):
            for r in e.replaces:
                self.live.pop(r, None)
            self.live[e.seq] = e.shard  # type: ignore[index]
        elif not isinstance(e, (ClaimEntry, SnapshotEntry)):
            self.live = live_shards(self.entries, below=self.pos + 1)
        self.pos += 1


@dataclass
class ViewResult:
    """What one export did to one view.

    Args:
        policy_id: the policy the view is of.
        uri: the view's table URI.
        version: its newest Delta version (-1: no table).
        cursor: the rlrec point its newest version mirrors.
        commits: the commits this call wrote.
        waiting: committed shard entries not published yet (mirrored once they are).
        skipped: shards of another format than the view's (a Delta table has one schema).
    """

    policy_id: str
    uri: str
    version: int = -1
    cursor: str = ""
    commits: int = 0
    waiting: int = 0
    skipped: int = 0
    #: the view's state after this export (`follow_views` hands it to the next one)
    state: Any = field(default=None, repr=False, compare=False)


class _View:
    """One policy's Delta view: its state as the table says (version, txns, files) and its commits."""

    def __init__(
        self, storage: Storage, policy_id: str, logs: Mapping[tuple[str, int], list[Entry]], records: int = 0
    ) -> None:
        self.storage = storage
        self.policy_id = policy_id
        self.uri = table_uri(storage, policy_id)
        self.version = -1
        self.positions: dict[tuple[str, int], int] = {}
        self.removals = 0
        self.files: dict[str, ShardEntry] = {}  # relative path -> the entry it mirrors
        self.schema_json: str | None = None
        self.fmt: str | None = None
        self.logs = logs
        self._paths_at_load: list[str] = []
        self._load(records)

    # -- the table's state ------------------------------------------------------------------
    def _load(self, records: int) -> None:
        if not has_view(self.storage, self.policy_id):
            return
        from deltalake import DeltaTable

        try:
            dt = DeltaTable(self.uri, storage_options=storage_options(self.uri, self.storage))
        except Exception as e:
            raise _open_error(self.uri, "the Delta view", e) from None
        proto = dt.protocol()
        found = {
            "minReaderVersion": proto.min_reader_version,
            "minWriterVersion": proto.min_writer_version,
            "writerFeatures": list(proto.writer_features or []),
        }
        if found != PROTOCOL:
            raise ViewError(
                f"{self.uri} holds a Delta table that is not an rlrec view (protocol {found}, expected "
                f"{PROTOCOL}): remove its {LOG_DIR}/ to export again"
            )
        self.version = dt.version()
        self.schema_json = dt.schema().to_json()
        self.fmt = dt.metadata().configuration.get("rlrec.format")
        for key in self.logs:
            v = dt.transaction_version(app_id(*key))
            if v:
                self.positions[key] = int(v)
        self.removals = int(dt.transaction_version(REMOVALS_APP) or 0)
        _check_point(self.uri, self.positions, {k: len(es) for k, es in self.logs.items()}, self.removals, records)
        paths = dt.get_add_actions(flatten=True).column("path").to_pylist()
        self._paths_at_load = sorted(paths)

    def check_mirrors(self, expected: Iterable[ShardEntry]) -> None:
        """ViewError unless the table's files are exactly `expected` (the policy's live shards at
        the point its txns name): another writer (an engine that ignored the protocol) changed it."""
        want = {self.rel(e): e for e in expected if e.format == self.fmt}
        got = self._paths_at_load
        if sorted(want) != got:
            extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
            raise ViewError(
                f"the Delta view {self.uri} no longer mirrors the store at its version {self.version} "
                f"({len(extra)} file(s) not rlrec's, e.g. {extra[:1]}; {len(missing)} missing, e.g. {missing[:1]}): "
                f"another writer changed it; remove its {LOG_DIR}/ and export again"
            )
        self.files = want

    def rel(self, e: ShardEntry) -> str:
        """The add path of shard `e` (relative to the policy directory)."""
        return e.path.split("/", 1)[1]

    # -- commits ----------------------------------------------------------------------------
    def shard_schema(self, e: ShardEntry) -> tuple[str, int] | None:
        """(Delta schema JSON, rows) of shard `e` from its footer (through the schema gate), or
        None when its published file is not there."""
        from deltalake import Schema

        from rlrec.store.schema_gate import open_shard

        if not self.storage.exists(e.path):
            return None
        shard = open_shard(self.storage.full_path(e.path), fmt=e.format, filesystem=self.storage.filesystem)
        schema = delta_schema(shard.schema.remove_metadata(), e.path)
        try:
            return Schema.from_arrow(schema).to_json(), shard.num_rows
        except Exception as err:  # a type delta-rs has no Delta type for
            raise ViewError(
                f"shard {e.path}: its schema has no Delta Lake equivalent ({str(err).splitlines()[0]})"
            ) from None

    def commit(
        self,
        adds: list[tuple[ShardEntry, int]],
        removes: list[tuple[ShardEntry, bool]],
        positions: Mapping[tuple[str, int], int],
        removals: int,
        *,
        data_change: bool = True,
        operation: str,
    ) -> bool:
        """Append the next version: `adds` (entry, rows), `removes` (entry, dataChange), and the
        txns of every log whose position moved since the last commit (and of the removal log).
        False (nothing written) before the table exists when there is nothing to add: the table
        is created by its first add, whose txns then name the point."""
        if self.version < 0 and not adds:
            return False
        now = int(time.time() * 1000)
        actions: list[dict[str, Any]] = [
            {
                "commitInfo": {
                    "timestamp": now,
                    "operation": operation,
                    "operationParameters": {},
                    "engineInfo": "rlrec-export",
                    "isBlindAppend": not removes,
                }
            }
        ]
        if self.version < 0:
            actions += self._create_actions(now)
        for e, dc in removes:
            actions.append(
                {
                    "remove": {
                        "path": self.rel(e),
                        "deletionTimestamp": now,
                        "dataChange": dc,
                        "extendedFileMetadata": True,
                        "partitionValues": {},
                        "size": e.bytes,
                    }
                }
            )
        for e, rows in adds:
            actions.append(
                {
                    "add": {
                        "path": self.rel(e),
                        "partitionValues": {},
                        "size": e.bytes,
                        "modificationTime": int(e.commit_time * 1000),
                        "dataChange": data_change,
                        "stats": json.dumps({"numRecords": rows}),
                    }
                }
            )
        moved = {k: n for k, n in positions.items() if n != self.positions.get(k, 0)}
        for (topic, part), n in sorted(moved.items()):
            actions.append({"txn": {"appId": app_id(topic, part), "version": n, "lastUpdated": now}})
        if removals != self.removals:
            actions.append({"txn": {"appId": REMOVALS_APP, "version": removals, "lastUpdated": now}})
        body = "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in actions).encode()
        version = self.version + 1
        if not self.storage.create_once(f"{self.policy_id}/{LOG_DIR}/{version:020d}.json", body):
            raise ViewError(
                f"version {version} of the Delta view {self.uri} exists already: another export writes "
                "to it (run one at a time; a rerun continues where the view is)"
            )
        self.version = version
        self.positions.update(moved)
        self.removals = removals
        for e, _ in removes:
            self.files.pop(self.rel(e), None)
        for e, _ in adds:
            self.files[self.rel(e)] = e
        if version and version % CHECKPOINT_EVERY == 0:
            self._checkpoint()
        return True

    def _create_actions(self, now: int) -> list[dict[str, Any]]:
        return [
            {"protocol": dict(PROTOCOL)},
            {
                "metaData": {
                    "id": str(uuid.uuid4()),
                    "name": self.policy_id,
                    "description": f"rlrec view of policy {self.policy_id} ({self.fmt} shards): read-only",
                    "format": {"provider": "parquet", "options": {}},
                    "schemaString": self.schema_json,
                    "partitionColumns": [],
                    "configuration": {**CONFIGURATION, "rlrec.format": self.fmt},
                    "createdTime": now,
                }
            },
        ]

    def _checkpoint(self) -> None:
        """A Delta checkpoint of the newest version (delta-rs's writer; a failure is logged: the
        log reads without one, only slower)."""
        from deltalake import DeltaTable

        try:
            DeltaTable(self.uri, storage_options=storage_options(self.uri, self.storage)).create_checkpoint()
        except Exception as e:
            log.warning("could not checkpoint the Delta view %s at version %d: %s", self.uri, self.version, e)


# --------------------------------------------------------------------------------- export


@dataclass
class ManifestCache:
    """The store's partition logs and removal records as read before (a follow loop): each poll
    reads only what was appended since (`PartitionLog.refresh`, records from the next number)."""

    logs: dict[tuple[str, int], PartitionLog] = field(default_factory=dict)
    records: list[RemovalRecord] = field(default_factory=list)
    firsts: dict[tuple[str, int], str] = field(default_factory=dict)  # `cursor_at`'s cache

    def read(self, storage: Storage) -> tuple[list[RemovalRecord], dict[tuple[str, int], list[Entry]]]:
        start = self.records[-1].n + 1 if self.records else 0
        self.records += read_removals(storage, start)  # before the logs: every record's positions are in them
        for key in list_partition_logs(storage):
            if key not in self.logs:
                self.logs[key] = PartitionLog(storage, *key)
            self.logs[key].refresh()  # the first time: the whole log, strictly
        return list(self.records), {k: plog.entries for k, plog in self.logs.items()}


@dataclass
class _Walk:
    """The store's manifest read once, and the point an export goes to."""

    storage: Storage
    logs: dict[tuple[str, int], list[Entry]]
    records: list[RemovalRecord]
    removed: dict[tuple[str, int, int], Any]
    target: dict[tuple[str, int], int]
    target_removals: int
    firsts: dict[tuple[str, int], str] = field(default_factory=dict)

    @classmethod
    def read(cls, storage: Storage, as_of: Any = None, cache: ManifestCache | None = None) -> _Walk:
        target_cursor = None
        if as_of is not None:
            target_cursor = Cursor.parse(open_snapshot(storage, as_of=as_of).cursor)
        cache = cache if cache is not None else ManifestCache()
        records, logs = cache.read(storage)
        removed = resolve_removals(records, logs)
        if target_cursor is None:
            target = {k: len(es) and int(es[-1].seq) + 1 for k, es in logs.items()}  # type: ignore[arg-type]
            target_removals = max((r.n for r in records), default=-1) + 1
        else:
            target = {k: target_cursor.positions.get(k, 0) for k in logs}
            target_removals = target_cursor.removals
        return cls(storage, logs, records, removed, target, target_removals, cache.firsts)

    def policies(self) -> list[str]:
        return sorted({e.policy_id for es in self.logs.values() for e in _shards_of(es)})

    def expected(self, policy_id: str, positions: Mapping[tuple[str, int], int], removals: int) -> list[ShardEntry]:
        """The live shards of `policy_id` at a point (what its view must hold there)."""
        dropped = self.dropped(counted_records(self.records, positions, removals))
        return [
            e
            for k, es in self.logs.items()
            for e in live_shards(es, below=positions.get(k, 0)).values()
            if e.policy_id == policy_id and (e.topic, e.partition, e.seq) not in dropped
        ]

    def dropped(self, records: Iterable[RemovalRecord]) -> set[tuple[str, int, int]]:
        out = set()
        for rec in records:
            for f in rec.files:
                hit = self.removed.get(f.key)
                if hit is not None and (hit[1].path, hit[1].staging_path) == (f.path, f.staging_path):
                    out.add(f.key)
        return out

    def cursor(self, positions: Mapping[tuple[str, int], int], removals: int) -> str:
        held = {k: n for k, n in positions.items() if n > 0}
        return str(replace(cursor_at(self.storage, held, self.firsts), removals=removals))


def _shards_of(entries: Iterable[Entry]) -> Iterable[ShardEntry]:
    for e in entries:
        if isinstance(e, ShardEntry):
            yield e
        elif isinstance(e, ReplaceEntry):
            yield e.shard


def _export_view(walk: _Walk, policy_id: str, stop: Callable[[], bool], view: _View | None = None) -> ViewResult:
    """Bring `policy_id`'s view up to `walk.target`; `view`: its state kept from this process's
    previous export (a follow loop), else read from the table and checked against the store."""
    if (
        view is not None
        and view.version >= 0
        and not walk.storage.exists(f"{policy_id}/{LOG_DIR}/{view.version:020d}.json")
    ):
        view = None  # its newest commit is gone (the view was deleted): read the table again
    if view is None:
        view = _View(walk.storage, policy_id, walk.logs, max((r.n for r in walk.records), default=-1) + 1)
        if view.version >= 0:
            view.check_mirrors(walk.expected(policy_id, view.positions, view.removals))
    res = ViewResult(policy_id, view.uri, view.version)
    walkers = {k: _Log(k, es) for k, es in walk.logs.items()}
    for k, w in walkers.items():
        w.seek(view.positions.get(k, 0))
    removals = view.removals
    blocked: set[tuple[str, int]] = set()

    def positions() -> dict[tuple[str, int], int]:
        return {k: w.pos for k, w in walkers.items()}

    def first_schema(fmt: str) -> str | None:
        """The schema of the policy's first shard of format `fmt` whose file is there."""
        for es in walk.logs.values():
            for x in shard_files(es):
                if x.policy_id == policy_id and x.format == fmt and (found := view.shard_schema(x)):
                    return found[0]
        return None

    def advance(key: tuple[str, int], to: int) -> bool:
        """Walk log `key` up to `to`, one commit per entry that changes the view; False when an
        entry waits for its shard's publication (the log stops before it)."""
        w = walkers[key]
        while w.pos < to and not stop():
            e = w.entries[w.pos]
            added, gone = w.changes()
            added = [x for x in added if x.policy_id == policy_id]
            removes = [(x, not isinstance(e, ReplaceEntry)) for x in gone if view.rel(x) in view.files]
            rows: list[tuple[ShardEntry, int]] = []
            for x in added:
                if view.fmt is not None and x.format != view.fmt:
                    res.skipped += 1
                    continue
                found = view.shard_schema(x)
                if found is None:
                    if (x.topic, x.partition, x.seq) in walk.removed:  # deleted by retention: both refuse it
                        if view.schema_json is None:  # the table's first shard: its schema from another
                            view.schema_json, view.fmt = first_schema(x.format), x.format
                        if view.schema_json is not None:  # (none: every shard of the policy is deleted)
                            rows.append((x, x.steps if x.format == "tabular" else x.episodes))
                        continue
                    res.waiting += 1
                    blocked.add(key)
                    return False
                schema, n = found
                if view.schema_json is None:
                    view.schema_json, view.fmt = schema, x.format
                elif schema != view.schema_json:
                    raise ViewError(
                        f"shard {x.path} ({x.topic}/{x.partition} seq {x.seq}) has another schema than the "
                        f"Delta view {view.uri}: one Delta table has one schema (docs/DELTA.md)"
                    )
                rows.append((x, n))
            w.step()
            if (rows or removes) and view.commit(
                rows,
                removes,
                positions(),
                removals,
                data_change=not isinstance(e, ReplaceEntry),
                operation="rlrec replace" if isinstance(e, ReplaceEntry) else "rlrec shard",
            ):
                res.commits += 1
        return w.pos >= to

    for rec in [r for r in walk.records if removals <= r.n < walk.target_removals]:
        if stop():
            break
        if not all(k in walkers and advance(k, max(n, walkers[k].pos)) for k, n in sorted(rec.positions.items())):
            break
        gone = walk.dropped([rec])
        removes = [
            (e, True)
            for e in list(view.files.values())
            if (e.topic, e.partition, e.seq) in gone and e.policy_id == policy_id
        ]
        removals = rec.n + 1  # (before the table exists: its first add carries it)
        if view.commit([], removes, positions(), removals, operation="rlrec retention"):
            res.commits += 1
    for k in sorted(walkers):
        if k not in blocked and not stop():
            advance(k, walk.target.get(k, 0))
    res.version = view.version
    if view.version >= 0:
        res.cursor = walk.cursor(view.positions, view.removals)
    res.state = view
    return res


def export_views(
    storage: Storage | str,
    *,
    as_of: Any = None,
    policy_id: str | None = None,
    stop: Callable[[], bool] = lambda: False,
    known: Mapping[str, Any] | None = None,
    cache: ManifestCache | None = None,
) -> list[ViewResult]:
    """Bring the Delta view of each policy of `storage` up to a point of its manifest (module
    docstring): a rerun writes nothing new; an interrupted run is continued by the next one.

    Args:
        storage: the store (a `Storage` or its URI).
        as_of: the point to mirror up to (a cursor, a time; None: the newest).
        policy_id: only this policy's view (None: every policy's).
        stop: asked between commits; True stops the export there (a clean stop).
        known: ``{policy id: ViewResult.state}`` of this process's previous export: those views
            are not read again (their commits are create-once: another writer is still detected).
        cache: the manifest as this process read it before (only what was appended since is read).

    Raises:
        ViewError: a view that cannot be exported to (one line).
        CursorError: `as_of` is no point of the store.

    Example::

        >>> import tempfile
        >>> from rlrec.store.commit import ShardCommitter
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
        >>> root = tempfile.mkdtemp()
        >>> _ = ShardCommitter(root, "rl", 0).commit(expert_cartpole_episodes(2))
        >>> export_views(root)[0].cursor == open_snapshot(root).cursor
        True
    """
    st = Storage.from_uri(storage) if isinstance(storage, str) else storage
    walk = _Walk.read(st, as_of, cache)
    policies = walk.policies() if policy_id is None else [policy_id]
    known = known or {}
    return [_export_view(walk, p, stop, known.get(p)) for p in policies]


def follow_views(
    storage: Storage | str,
    *,
    interval_s: float = 1.0,
    policy_id: str | None = None,
    stop: Callable[[], bool] = lambda: False,
    on_poll: Callable[[list[ViewResult]], None] | None = None,
) -> None:
    """`export_views` again every `interval_s` until `stop()` (``rlrec export --to delta --follow``).

    Args:
        storage: the store.
        interval_s: seconds between polls of the manifest.
        policy_id: only this policy's view.
        stop: asked between commits and polls.
        on_poll: called with each poll's results.
    """
    st = Storage.from_uri(storage) if isinstance(storage, str) else storage
    known: dict[str, Any] = {}
    cache = ManifestCache()
    while not stop():
        t0 = time.monotonic()
        results = export_views(st, policy_id=policy_id, stop=stop, known=known, cache=cache)
        known = {r.policy_id: r.state for r in results}
        if on_poll is not None:
            on_poll(results)
        while not stop() and time.monotonic() - t0 < interval_s:
            time.sleep(min(0.05, interval_s))


def version_cursor(storage: Storage | str, policy_id: str, version: int | None = None) -> tuple[int, str]:
    """(Delta version, rlrec cursor) of policy `policy_id`'s view at `version` (None: its newest):
    the point its txns name -- ``rlrec.open(uri, as_of=cursor)`` reads the rows of that version
    (its policy's shards).

    Raises:
        ViewError: no view of that policy, or not an rlrec view.
    """
    from deltalake import DeltaTable

    st = Storage.from_uri(storage) if isinstance(storage, str) else storage
    uri = table_uri(st, policy_id)
    if not has_view(st, policy_id):
        raise ViewError(f"no Delta view of policy {policy_id} at {uri} (rlrec export URI URI --to delta)")
    try:
        dt = DeltaTable(uri, version=version, storage_options=storage_options(uri, st))
    except Exception as e:
        what = "the newest version of the Delta view" if version is None else f"version {version} of the Delta view"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if _STORAGE_ERROR_RE.search(first):
            raise _open_error(uri, what, e) from None
        raise ViewError(f"cannot open {what} {uri}: {first}") from None
    positions = {}
    for key in list_partition_logs(st):
        v = dt.transaction_version(app_id(*key))
        if v:
            positions[key] = int(v)
    removals = int(dt.transaction_version(REMOVALS_APP) or 0)
    sizes = {key: len(PartitionLog(st, *key).load()) for key in positions}
    _check_point(uri, positions, sizes, removals, max((r.n for r in read_removals(st)), default=-1) + 1)
    return dt.version(), str(replace(cursor_at(st, positions), removals=removals))


def list_views(storage: Storage) -> list[str]:
    """The policy ids whose directory holds a Delta view."""
    return sorted(
        top.name
        for top in storage.list("")
        if top.is_dir and not top.name.startswith(("_", ".")) and has_view(storage, top.name)
    )

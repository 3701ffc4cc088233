"""What ``rlrec report`` plots, gathered from a demo data dir or a deployment.

Sources (each optional; a missing one leaves its fields empty and adds a note):

* the shards root (local or ``s3://``): committed shards from the manifest
  (`rlrec.store.manifest.read_first_commits`), and per episode the metadata columns of episode shards
  (policy id/version, length, return, started_ms/ended_ms), read column by column, never the
  packed episodes;
* the trainer's checkpoint dir: ``metrics.jsonl`` (one line per iteration: ``time``,
  ``policy_version``, ``eval_return_mean``, ``new_shards`` = manifest ``path`` of every shard
  first trained on in that iteration, optional ``promotion``);
* the demo's ``metrics.jsonl`` (its last ``dead_letters``) and ``demo.json`` (see
  /work/briefs/layout.md: where the shards and the trainer dir are);
* the trainer's publish root (``{checkpoint_dir}/policies`` unless given): each published
  version's lineage (`rlrec.trainer.lineage.list_lineages`: the manifest cursor of the data it
  was trained on, verified with ``$RLREC_POLICY_PUBLIC_KEY`` when set);
* the dead-letter topic, when bootstrap servers are given: counts by the ``rlrec-dlq-reason``
  header the consumer puts on every dead letter.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("rlrec.report")

__all__ = ["ReportData", "collect", "read_dead_letter_topic"]

_EPISODE_COLUMNS = ("policy_id", "policy_version", "length", "episode_return", "started_ms", "ended_ms")


@dataclass
class ReportData:
    """Everything the report shows; lists are empty when their source was absent."""

    demo_dir: str | None = None
    shards_uri: str | None = None
    trainer_uri: str | None = None
    demo: dict = field(default_factory=dict)
    shards: list = field(default_factory=list)  # ShardEntry, by commit_time
    episodes: dict[str, list] = field(default_factory=dict)  # column -> values (one per episode)
    episode_commit_time: list[float] = field(default_factory=list)  # per episode: its shard's commit
    episode_shard: list[str] = field(default_factory=list)  # per episode: its shard's path
    trainer: list[dict] = field(default_factory=list)  # trainer metrics lines
    demo_metrics: list[dict] = field(default_factory=list)  # demo dashboard lines
    dead_letters: dict[str, int] = field(default_factory=dict)
    dead_letters_source: str | None = None
    first_trained: dict[str, float] = field(default_factory=dict)  # shard path -> first trained time
    policies_uri: str | None = None
    lineages: list[dict] = field(default_factory=list)  # per published version (list_lineages rows)
    #: the shards committed now (a compacted shard by its replacement), as `rlrec inspect` counts
    #: them; None: the manifest was not read
    live_shards: list | None = None
    notes: dict[str, list[str]] = field(default_factory=dict)  # section -> notes

    def note(self, section: str, text: str) -> None:
        self.notes.setdefault(section, []).append(text)


def _read_jsonl(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(d, dict):
            out.append(d)
    return out


def _storage(uri: str):
    from rlrec.store.storage import Storage

    return Storage.from_uri(uri)


def _episode_columns(storage: Any, entry: Any) -> dict[str, list] | None:
    from rlrec.store.schema_gate import open_shard

    for path in (entry.path, entry.staging_path):
        try:
            with storage.filesystem.open_input_file(storage.full_path(path)) as f:
                shard = open_shard(f, fmt=entry.format)  # the schema gate (ShardSchemaError)
                present = [c for c in _EPISODE_COLUMNS if c in shard.names]
                if not present:
                    return None
                table = shard.read(present)
                return {c: table.column(c).to_pylist() for c in present}
        except FileNotFoundError:
            continue
    return None


def _load_shards(data: ReportData, uri: str) -> None:
    from rlrec.store.manifest import read_first_commits, read_manifest

    try:
        storage = _storage(uri)
        # as first committed: commit times and the paths the trainer logged (compaction aside)
        data.shards = read_first_commits(storage)
        data.live_shards = read_manifest(storage)
    except Exception as e:
        data.note("shards", f"cannot read the manifest under {uri}: {type(e).__name__}: {e}")
        return
    if not data.shards:
        data.note("shards", f"no committed shards under {uri}")
        return
    with ThreadPoolExecutor(max_workers=8) as ex:
        cols = list(ex.map(lambda e: _safe_columns(storage, e), data.shards))
    missing = tabular = refused = 0
    for entry, c in zip(data.shards, cols):
        if isinstance(c, str):
            refused += 1
            continue
        if c is None:
            if entry.format == "episodes":
                missing += 1
            else:
                tabular += 1
            continue
        n = len(next(iter(c.values())))
        for k in _EPISODE_COLUMNS:
            data.episodes.setdefault(k, []).extend(c.get(k, [None] * n))
        data.episode_commit_time.extend([entry.commit_time] * n)
        data.episode_shard.extend([entry.path] * n)
    if missing:
        data.note("episodes", f"{missing} shard(s) could not be read (missing files?)")
    if refused:
        data.note(
            "episodes", f"{refused} shard(s) refused by the schema gate (not shown; see `rlrec inspect --verify`)"
        )
    if tabular:
        data.note("episodes", f"{tabular} tabular shard(s) have no per-episode columns; not shown")


def _safe_columns(storage: Any, entry: Any) -> dict[str, list] | str | None:
    """The shard's episode columns; None if unreadable; the reason (a str) if the gate refused it."""
    from rlrec.store.schema_gate import ShardSchemaError

    try:
        return _episode_columns(storage, entry)
    except ShardSchemaError as e:
        log.warning("report: shard %s refused by the schema gate: %s", entry.path, e.reason)
        return e.reason
    except Exception as e:
        log.debug("report: cannot read %s: %s", entry.path, e)
        return None


def _load_trainer(data: ReportData, uri: str) -> None:
    try:
        from rlrec.trainer.metrics import read_metrics_text

        text = read_metrics_text(_storage(uri))
    except FileNotFoundError:
        data.note("trainer", f"no trainer metrics ({uri}/metrics.jsonl does not exist yet)")
        return
    except Exception as e:
        data.note("trainer", f"cannot read {uri}/metrics.jsonl: {type(e).__name__}: {e}")
        return
    data.trainer = _read_jsonl(text)
    if not data.trainer:
        data.note("trainer", "the trainer has not finished an iteration yet")
    for line in data.trainer:
        t = line.get("time")
        if not isinstance(t, (int, float)):
            continue
        for key in line.get("new_shards") or []:
            if isinstance(key, str):
                data.first_trained.setdefault(key, float(t))


def _load_lineages(data: ReportData, uri: str, public_key: str | None = None) -> None:
    from rlrec.trainer.lineage import LineageError, list_lineages

    data.policies_uri = uri
    try:
        data.lineages = list_lineages(uri, public_key=public_key)
    except LineageError as e:  # no publish root (yet), or one that cannot be listed
        data.note("lineage", str(e))
        return
    except Exception as e:
        data.note("lineage", f"cannot read the published versions under {uri}: {type(e).__name__}: {e}")
        return
    if not data.lineages:
        data.note("lineage", f"no policy version is published under {uri}")


def read_dead_letter_topic(
    bootstrap_servers: str, topic: str, *, idle_s: float = 2.0, timeout_s: float = 20.0
) -> dict[str, int]:
    """Count the messages of a dead-letter topic by their ``rlrec-dlq-reason`` header.

    Reads every partition from the beginning (assigned, no consumer group commits) until no
    message came for `idle_s` seconds or `timeout_s` passed.
    """
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"rlrec-report-{os.getpid()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    counts: dict[str, int] = {}
    try:
        md = c.list_topics(topic, timeout=10)
        t = md.topics.get(topic)
        if t is None or t.error is not None or not t.partitions:
            raise RuntimeError(f"topic {topic} does not exist")
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in t.partitions])
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - last < idle_s:
            m = c.poll(0.2)
            if m is None or m.error():
                continue
            last = time.monotonic()
            reason = dict(m.headers() or []).get("rlrec-dlq-reason", b"unknown")
            reason = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
            counts[reason] = counts.get(reason, 0) + 1
    finally:
        c.close()
    return counts


def collect(
    data_dir: str | os.PathLike | None = None,
    *,
    input_uri: str | None = None,
    checkpoint_dir: str | None = None,
    bootstrap_servers: str | None = None,
    dlq_topic: str | None = None,
    policies: str | None = None,
    public_key: str | None = None,
) -> ReportData:
    """Gather the report's data. `data_dir`: a demo data dir (layout: demo.json, shards/,
    trainer/, metrics.jsonl) or a shards root; `input_uri`/`checkpoint_dir`/`policies` (the
    publish root; default ``{checkpoint_dir}/policies``) override; `public_key` verifies the
    published versions' lineage (default: ``$RLREC_POLICY_PUBLIC_KEY``)."""
    data = ReportData()
    demo_dir = None
    if data_dir is not None:
        d = os.fspath(data_dir)
        if (
            "://" not in d
            and os.path.isdir(d)
            and (
                os.path.exists(os.path.join(d, "demo.json"))
                or os.path.isdir(os.path.join(d, "shards"))
                or os.path.exists(os.path.join(d, "metrics.jsonl"))
            )
        ):
            demo_dir = d
        elif input_uri is None:
            input_uri = d  # not a demo dir: take it as the shards root
    if demo_dir is not None:
        try:
            with open(os.path.join(demo_dir, "demo.json"), encoding="utf-8") as f:
                data.demo = json.load(f)
        except FileNotFoundError:
            pass
        except ValueError as e:
            data.note("summary", f"demo.json is not valid JSON: {e}")
        endpoint = data.demo.get("s3_endpoint")
        if endpoint and str(data.demo.get("shards_uri", "")).startswith("s3://"):
            # the demo's local S3 server (moto takes any credentials); the caller's env wins
            os.environ.setdefault("AWS_ENDPOINT_URL", endpoint if "://" in endpoint else f"http://{endpoint}")
            for k, v in (
                ("AWS_ACCESS_KEY_ID", "testing"),
                ("AWS_SECRET_ACCESS_KEY", "testing"),
                ("AWS_REGION", "us-east-1"),
                ("AWS_EC2_METADATA_DISABLED", "true"),
            ):
                os.environ.setdefault(k, v)
        input_uri = input_uri or data.demo.get("shards_uri") or os.path.join(demo_dir, "shards")
        checkpoint_dir = checkpoint_dir or data.demo.get("trainer_dir") or os.path.join(demo_dir, "trainer")
        dlq_topic = dlq_topic or data.demo.get("dlq_topic")
        try:
            with open(os.path.join(demo_dir, "metrics.jsonl"), encoding="utf-8") as f:
                data.demo_metrics = _read_jsonl(f.read())
        except FileNotFoundError:
            pass
    data.demo_dir, data.shards_uri, data.trainer_uri = demo_dir, input_uri, checkpoint_dir

    if input_uri:
        _load_shards(data, input_uri)
    else:
        data.note("shards", "no shards root given (--input)")
    if checkpoint_dir:
        _load_trainer(data, checkpoint_dir)
    else:
        data.note("trainer", "no trainer checkpoint dir given (--checkpoint-dir)")
    policies = policies or (f"{checkpoint_dir.rstrip('/')}/policies" if checkpoint_dir else None)
    if policies:
        _load_lineages(data, policies, public_key)
    else:
        data.note("lineage", "no publish root (--policies or --checkpoint-dir)")

    if bootstrap_servers and dlq_topic:
        try:
            data.dead_letters = read_dead_letter_topic(bootstrap_servers, dlq_topic)
            data.dead_letters_source = f"topic {dlq_topic}"
        except Exception as e:
            data.note("dead-letters", f"cannot read the dead-letter topic {dlq_topic}: {e}")
    elif bootstrap_servers:
        data.note("dead-letters", "no dead-letter topic name (--dlq-topic) to read")
    if data.dead_letters_source is None:
        last = next(
            (m["dead_letters"] for m in reversed(data.demo_metrics) if isinstance(m.get("dead_letters"), dict)), None
        )
        if last is not None:
            data.dead_letters = {str(k): int(v) for k, v in last.items() if isinstance(v, (int, float))}
            data.dead_letters_source = "demo metrics.jsonl (last line)"
        else:
            data.note(
                "dead-letters",
                "no dead-letter counts (no demo metrics.jsonl; give --bootstrap-servers "
                "and --dlq-topic to read the dead-letter topic)",
            )
    return data

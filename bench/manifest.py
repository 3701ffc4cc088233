"""Manifest benchmark: what one partition claim costs at a long history.

    python bench/manifest.py [--entries 20000] [--rounds 5] [--quick] [--json PATH]

One partition log of N shard entries (one tiny shard file each, published; a new owner's claim
every 1,000 entries, as rebalances leave them) is built twice, with the same entries:

  legacy     as written before snapshots existed (claims and shard entries only);
  snapshots  as the current code writes it (a snapshot entry every 100 entries, and the hint).

Each is put on a local directory and on the local S3 server (moto, in this process, seeded
directly in its backend so the setup takes seconds; every timed request goes through HTTP).
Then, per backend, the two claims alternate for --rounds rounds (the order flips every round),
each in a fresh child process (so neither shares moto's interpreter lock with the client, and
each peak RSS is its own; imports and the storage client are made before the clock starts), as a
consumer does on partition assignment:

  baseline   the claim of `store/manifest.py` + `store/commit.py` at commit 51d84f6 (no
             snapshots), loaded from git: list the log, read every entry, append a claim,
             list the policy and staging directories its entries name, map every committed id;
  ours       `ShardCommitter.claim(replay_from=C)`, C = the first offset of the last 30 shards
             (the partition's committed Kafka offset).

Per claim: wall seconds, storage calls (a Storage subclass that counts), the size of the returned
skip set and the child's peak RSS. Reported: median and spread (min..max) per side, and the raw
per-round values. HTTP requests of one more claim of each side are counted at tests/faults.py's
proxy (untimed; the baseline's only with --count-http, it takes minutes at 20k entries). Without
git (or that commit) the baseline is left out (null).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from rlrec.store.storage import Storage  # noqa: E402

LEGACY_COMMIT = "51d84f6"
TOPIC = "rl.transitions"
REBALANCE_EVERY = 1_000
REPLAYABLE = 30  # shards after the committed offset
#: ours must stay within this many storage calls plus the entries since the last snapshot
CLAIM_BUDGET = 10


class CountingStorage(Storage):
    """A Storage that counts its calls (and does nothing else differently)."""

    calls: int = 0

    def _count(self) -> None:
        self.calls += 1

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        self._count()
        return super().read(path, limit=limit)

    def create_once(self, path: str, data: bytes) -> bool:
        self._count()
        return super().create_once(path, data)

    def write(self, path: str, data: bytes) -> None:
        self._count()
        super().write(path, data)

    def list(self, prefix: str = "", recursive: bool = False):
        self._count()
        return super().list(prefix, recursive)

    def exists(self, path: str) -> bool:
        self._count()
        return super().exists(path)

    def info(self, path: str):
        self._count()
        return super().info(path)

    def move(self, src: str, dst: str) -> None:
        self._count()
        super().move(src, dst)

    def delete(self, path: str, *, missing_ok: bool = True) -> bool:
        self._count()
        return super().delete(path, missing_ok=missing_ok)


# ---------------------------------------------------------------------------------------------
# the history


def build_history(root: str, entries: int, snapshots: bool) -> None:
    """A local directory with one partition log of `entries` shard entries (and their files)."""
    from rlrec.store.manifest import PartitionLog, ShardEntry

    st = Storage.from_uri(root, fsync=False)
    every = 100 if snapshots else 0
    log = PartitionLog(st, TOPIC, 0, snapshot_every=every)
    log.claim("w0")
    for i in range(entries):
        if i and i % REBALANCE_EVERY == 0:
            log = PartitionLog(st, TOPIC, 0, snapshot_every=every)
            log.claim(f"w{i}", replay_from=10 * i)
            log.recover()
        data = f"shard {i}".encode()
        name = f"{TOPIC}+00000+{10 * i:020d}+{10 * i + 9:020d}+e{log.epoch}.{i}.parquet"
        e = ShardEntry(
            path=f"pol/{name}",
            staging_path=f"pol/_staging/{name}",
            topic=TOPIC,
            partition=0,
            policy_id="pol",
            first_offset=10 * i,
            last_offset=10 * i + 9,
            episode_ids=[f"ep-{i}-{j}" for j in range(4)],
            episodes=4,
            steps=400,
            bytes=len(data),
            sha256=__import__("hashlib").sha256(data).hexdigest(),
            format="episodes",
            format_version=1,
            event_schema_versions={"EpisodeStart": 1, "StepBatch": 1},
            min_policy_version=1,
            max_policy_version=1,
        )
        st.write(e.staging_path, data)
        log.publish(log.append_shard(e))


def seed_moto(local_dir: str, bucket: str, prefix: str) -> int:
    """Copy a local tree into the in-process moto server's bucket, bypassing HTTP."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    n = 0
    for d, _dirs, files in os.walk(local_dir):
        for f in files:
            full = os.path.join(d, f)
            rel = os.path.relpath(full, local_dir).replace(os.sep, "/")
            with open(full, "rb") as fh:
                backend.put_object(bucket, f"{prefix}/{rel}", fh.read())
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# the two claims


def load_legacy() -> types.ModuleType | None:
    """`store/manifest.py` as of LEGACY_COMMIT, as a module (None without git)."""
    try:
        src = subprocess.run(
            ["git", "-C", ROOT, "show", f"{LEGACY_COMMIT}:store/manifest.py"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    mod = types.ModuleType("rlrec_legacy_manifest")
    mod.__file__ = f"{LEGACY_COMMIT}:store/manifest.py"
    sys.modules[mod.__name__] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def legacy_claim(mod: types.ModuleType, st: Storage, partition: int) -> dict[str, int]:
    """`ShardCommitter.claim` as of LEGACY_COMMIT (store/commit.py), on its own PartitionLog."""
    log = mod.PartitionLog(st, TOPIC, partition)
    log.claim(mod.default_writer_id())
    log.recover()
    committed: dict[str, int] = {}
    for e in log.shard_entries():
        for eid in e.episode_ids:
            committed[eid] = e.last_offset
    return committed


def our_claim(st: Storage, partition: int, replay_from: int) -> dict[str, int]:
    from rlrec.store.commit import ShardCommitter

    committer = ShardCommitter(st, TOPIC, partition)
    committer.claim(replay_from=replay_from)
    return committer.log.committed_last_offsets()


def tail_after_snapshot(st: Storage) -> int:
    from rlrec.store.manifest import PartitionLog, SnapshotEntry

    entries = PartitionLog(st, TOPIC, 0).load()
    last = max((e.seq for e in entries if isinstance(e, SnapshotEntry)), default=-1)
    return len(entries) - 1 - last


# ---------------------------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def worker(spec: dict) -> dict:
    """One timed claim (in a child process): `spec` = {side, uri, replay_from, env}."""
    import resource

    os.environ.update(spec.get("env") or {})
    legacy = load_legacy() if spec["side"] == "baseline" else None
    from rlrec.store.commit import ShardCommitter  # noqa: F401  (imports before the clock)

    st = CountingStorage.from_uri(spec["uri"])
    st.exists("_manifest/.warm-up")  # the filesystem's (and S3's HTTP) connection
    if st.kind == "s3":
        st.s3_client()  # the boto3 client conditional writes use
    st.calls = 0
    t0 = time.perf_counter()
    skip = our_claim(st, 0, spec["replay_from"]) if legacy is None else legacy_claim(legacy, st, 0)
    dt = time.perf_counter() - t0
    return {
        "seconds": dt,
        "storage_calls": st.calls,
        "skip_set": len(skip),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def spawn(spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"claim worker failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(uris: dict[str, str], env: dict, legacy: bool, entries: int, rounds: int) -> dict:
    replay_from = 10 * (entries - REPLAYABLE)
    sides = {"ours": "snapshots"} | ({"baseline": "legacy"} if legacy else {})
    raw: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(rounds):
        for side in list(sides) if r % 2 == 0 else list(reversed(sides)):
            res = spawn({"side": side, "uri": uris[sides[side]], "replay_from": replay_from, "env": env})
            raw[side].append(res)
            print(
                f"  round {r + 1}/{rounds} {side:8s}: {res['seconds'] * 1000:9.1f} ms, "
                f"{res['storage_calls']} storage calls, skip set {res['skip_set']}, {res['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    out: dict[str, Any] = {"raw": raw}
    for side, rows in raw.items():
        out[side] = {k: summary([float(x[k]) for x in rows]) for k in rows[0]}
    return out


def count_http(proxy: Any, uri: str, side: str, legacy: types.ModuleType | None, replay_from: int) -> int:
    st = Storage.from_uri(uri)
    before = proxy.requests
    our_claim(st, 0, replay_from) if side == "ours" else legacy_claim(legacy, st, 0)
    return proxy.requests - before


def run(entries: int, rounds: int, count_baseline_http: bool) -> dict:
    from rlrec.local import LocalS3
    from tests.faults import FaultProxy

    legacy = load_legacy()
    result: dict[str, Any] = {
        "entries": entries,
        "rounds": rounds,
        "legacy_commit": LEGACY_COMMIT if legacy is not None else None,
        "replayable_shards": REPLAYABLE,
        "claim_budget": CLAIM_BUDGET,
    }
    with tempfile.TemporaryDirectory(prefix="rlrec-bench-manifest-") as tmp:
        roots = {k: os.path.join(tmp, k) for k in ("legacy", "snapshots")}
        for kind, root in roots.items():
            t0 = time.monotonic()
            build_history(root, entries, snapshots=kind == "snapshots")
            print(f"built the {kind} history of {entries} entries in {time.monotonic() - t0:.1f}s", flush=True)
        result["tail_after_snapshot"] = tail_after_snapshot(Storage.from_uri(roots["snapshots"]))

        print("local directory:", flush=True)
        result["local"] = measure(roots, {}, legacy is not None, entries, rounds)

        with LocalS3() as s3:
            bucket = s3.create_bucket(f"bench-{uuid.uuid4().hex[:8]}")
            for kind, root in roots.items():
                seed_moto(root, bucket, kind)
            uris = {k: f"s3://{bucket}/{k}" for k in roots}
            print("S3 (moto):", flush=True)
            result["s3"] = measure(uris, s3.env(), legacy is not None, entries, rounds)
            proxy = FaultProxy(s3.port)
            try:
                os.environ.update({**s3.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"})
                replay_from = 10 * (entries - REPLAYABLE)
                http = {"ours": count_http(proxy, uris["snapshots"], "ours", legacy, replay_from)}
                if legacy is not None and count_baseline_http:
                    http["baseline"] = count_http(proxy, uris["legacy"], "baseline", legacy, replay_from)
                result["s3"]["http_requests_per_claim"] = http
                print(f"  HTTP requests per claim: {http}", flush=True)
            finally:
                proxy.close()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=20_000, help="shard entries in the partition's log")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds (>= 3 for a judged run)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2,000 entries, 1 round")
    ap.add_argument("--json", dest="json_path", help="write the result here")
    ap.add_argument("--count-http", action="store_true", help="also count the baseline's HTTP requests (slow)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    entries, rounds = (2_000, 1) if args.quick else (args.entries, args.rounds)
    r = run(entries, rounds, args.count_http or args.quick)
    for where in ("local", "s3"):
        for side in ("ours", "baseline"):
            if side in r[where]:
                s = r[where][side]["seconds"]
                print(
                    f"{where:5s} {side:8s}: claim {s['median'] * 1000:9.1f} ms (min {s['min'] * 1000:.1f}, "
                    f"max {s['max'] * 1000:.1f}); {r[where][side]['storage_calls']['median']:.0f} storage calls"
                )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(r, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

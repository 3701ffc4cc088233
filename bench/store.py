"""Store benchmark: files, reads and compaction of a store of many small shards (issue 31).

    python bench/store.py [--steps 1000000] [--steps-per-shard 1800] [--partitions 4] [--rounds 5]
                          [--target-bytes 134217728] [--compact-rounds 3]
                          [--store DIR] [--demo-store URI] [--object-store s3|none] [--quick]
                          [--head-entries N [--head-live 20000]] [--json PATH]

With --head-entries N, the ``head`` row instead (`bench/store_head.py`): opening the head of a
store whose manifest has N shard entries (--head-live live shards, compacted) through its live set,
against listing its live files, with the storage calls of one open.

Stores measured:

  synthetic  --steps CartPole steps (expert episodes of 200 steps, epsilon 0.1) written with the
             project's own shard writer (`ShardCommitter.commit`, zstd, fsync), --steps-per-shard
             each, round-robin over --partitions partition logs: many small shards like the
             demo's (its median shard is 34 KiB). One store per --formats entry: "synthetic"
             (episode shards: one row per episode, the consumer's default) and
             "synthetic_tabular" (tabular shards: one row per step, so the files' raw columns are
             the steps). Built in a temporary folder, or in --store DIR/<format> (kept, and
             reused by a later run with the same parameters).
  demo       the shards of a `rlrec demo` run (--demo-store URI; default ./demo-data/shards when
             it exists; left out in --quick unless given).

Equal work, before and after compaction: each local store is copied (`shutil.copytree`) into a
folder beside it, on the same filesystem, --compact-rounds times; each copy is compacted with
`rlrec compact`'s code (`compact_unowned(min_age_s=0, target_bytes=--target-bytes, force=True)`;
the copies' owner leases are removed first: no consumer runs them), timed (compaction throughput:
steps of the replaced shards per second; median and spread over the copies). The reads then
compare the original store ("before") with the last compacted copy ("after"): the same episodes,
the same bytes of data, the same filesystem and page cache conditions (one warm-up round first,
not counted, reads every file of both).

Per store: files and their median size (from the manifest) before and after, and in alternated
rounds the seconds to read every step. Each round takes every reader in turn (the order rotates
every round) and reads before then after, or after then before (the order flips every round:
ABAB...); medians and spread (min..max) per reader and side, the raw rounds kept. Two reader
paths, each with pyarrow, polars and DuckDB:

  steps (rlrec.open)   ``rlrec.open(store)`` ``.to_pyarrow_dataset().to_table()``, ``.to_polars()``,
                       ``.to_duckdb()`` aggregated over every row (count, sum of reward): opening the
                       snapshot (reading the manifest), checking each shard's sha256 and decoding
                       every episode into one row per step. The per-episode decoding dominates and
                       does not depend on how episodes are spread over files: merging files speeds
                       this path up only by the per-file costs it saves.
  steps, pandas_arrow  ``rlrec.open(store).steps()`` (the Arrow table itself) and
                       ``.to_pandas(arrow_backed=True)``; with --object-store s3 also ``s3_steps``:
                       ``rlrec.open`` of the whole store (manifest and shards) uploaded to the S3
                       server, ``.steps()``. Issue 47's contract is judged as ratios within each
                       round (`RATIOS`: steps / files_pyarrow <= 2, pandas_arrow / steps <= 1.2,
                       s3_steps / s3_pyarrow <= 2), printed and kept as ``reads.ratios``.
  files (raw columns)  the snapshot's file list (``snapshot.files()``, listed before the clock
                       starts) read as stored, each tool in its best configuration:
                       ``pyarrow.dataset.dataset(files).to_table()`` (multithreaded),
                       ``polars.read_parquet(files)``, DuckDB ``read_parquet(files)`` (count and
                       the summed length of the packed episodes): no manifest, no sha256, no step
                       decoding -- what a plain reader given ``rlrec inspect --paths`` pays, and
                       where per-file overheads are most of the cost.
  S3 (raw columns)     with --object-store s3 (the default): the same files uploaded to moto's S3
                       server (127.0.0.1, a child process) and read there the same way: pyarrow
                       through ``pyarrow.fs.S3FileSystem``, polars through its own object_store
                       client (``storage_options``), DuckDB querying the pyarrow dataset of the
                       files (its replacement scan of an Arrow object: DuckDB's httpfs extension
                       downloads at run time, which this machine cannot, and reading through an
                       fsspec filesystem was seen parsing torn reads here, "don't know what
                       type"). Where stores live in production: each
                       file costs requests (size, footer, column chunks), and moto's ~1 ms answers
                       are a floor of a real bucket's 10-30 ms first byte.

Target of the issue: reading at least 5x faster after compaction on the small-shard (synthetic)
stores; bench/run.py judges the files paths (local disk and S3; pyarrow, polars, DuckDB) against it
on the synthetic stores and reports the rlrec.open path (and every figure of the demo's store).
On local disk a read costs about (files x per-file cost) + (bytes x decode cost); compaction
removes only the first term, so the speed-up is 1 + files x per-file / (bytes x decode): large for
pyarrow's ~0.7 ms per file, about 2-3x for polars' and DuckDB's ~0.1 ms on a page-cached disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

#: the tools, each read through two paths: one row per step via rlrec.open, and the files' raw columns
READERS = ("pyarrow", "polars", "duckdb")
#: rlrec.open(...).steps() and .to_pandas(arrow_backed=True): the steps table itself (issue 47)
STEPS_SIDES = ("steps", "pandas_arrow")
#: side names: "pyarrow" etc. via rlrec.open, "files_pyarrow" etc. over snapshot.files()
SIDES = (*READERS, *STEPS_SIDES, *(f"files_{r}" for r in READERS))
#: the same files' raw columns read from an S3 server (--object-store s3), and the whole store
#: (manifest and shards) read there by rlrec.open(...).steps()
S3_SIDES = (*(f"s3_{r}" for r in READERS), "s3_steps")
#: issue 47's performance contract, as ratios of two sides' seconds within each round:
#: (name, side, baseline side, at most)
RATIOS = (
    ("steps / raw pyarrow", "steps", "files_pyarrow", 2.0),
    ("to_pandas(arrow_backed) / steps", "pandas_arrow", "steps", 1.2),
    ("S3 steps / S3 raw pyarrow", "s3_steps", "s3_pyarrow", 2.0),
)
S3_BUCKET = "rlrec-bench"
#: the target of the "after compaction" rows: reads at least this many times faster
TARGET_SPEEDUP = 5.0
EPISODE_STEPS = 200
DEFAULT_TARGET_BYTES = 128 * 1024 * 1024


# ------------------------------------------------------------------------------ the stores


def build_synthetic(root: str, steps: int, steps_per_shard: int, partitions: int, fmt: str = "episodes") -> dict:
    """Write `steps` CartPole steps as `fmt` shards of `steps_per_shard` steps (whole episodes of
    `EPISODE_STEPS`), round-robin over `partitions` logs, with `ShardCommitter`; returns what
    was built. A folder that already holds the same build (its ``bench-store.json``) is reused."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    params = {"steps": steps, "steps_per_shard": steps_per_shard, "partitions": partitions, "format": fmt}
    marker = os.path.join(root, "bench-store.json")
    if os.path.exists(marker):
        with open(marker) as f:
            done = json.load(f)
        if done.get("params") == params:
            return {**done, "reused": True}
        raise SystemExit(f"--store {root} holds another build ({done.get('params')}); give an empty folder")
    if os.path.exists(root) and os.listdir(root):
        raise SystemExit(f"--store {root} is not empty and holds no bench-store.json; give an empty folder")
    committers = [ShardCommitter(root, "rl", p, fmt=fmt) for p in range(partitions)]
    per_shard = max(1, steps_per_shard // EPISODE_STEPS)
    t0 = time.perf_counter()
    written = shards = 0
    while written < steps:
        episodes = expert_cartpole_episodes(per_shard, seed=shards, max_steps=EPISODE_STEPS, epsilon=0.1)
        committers[shards % partitions].commit(episodes)
        written += sum(len(e.rewards) for e in episodes)
        shards += 1
    done = {"params": params, "shards": shards, "steps": written, "build_s": time.perf_counter() - t0}
    with open(marker, "w") as f:
        json.dump(done, f)
    return {**done, "reused": False}


def compact_copies(uri: str, copies: int, target_bytes: int, workdir: str) -> tuple[str, dict]:
    """Copy the local store `uri` `copies` times into `workdir` (beside it: the same filesystem)
    and compact each copy with `rlrec compact`'s code; returns the last compacted copy and the
    compaction figures (seconds and steps/s per copy, their median and spread)."""
    from rlrec.store.compaction import compact_unowned
    from rlrec.store.storage import Storage

    rounds = []
    copy = ""
    for i in range(copies):
        if copy:
            shutil.rmtree(copy)
        copy = os.path.join(workdir, f"copy{i}")
        shutil.copytree(uri, copy)
        shutil.rmtree(os.path.join(copy, "_owners"), ignore_errors=True)  # no consumer runs the copy
        before = {e.path: e.steps for e in _live_entries(copy)}
        t0 = time.perf_counter()
        results, refused = compact_unowned(
            Storage.from_uri(copy), min_age_s=0, target_bytes=target_bytes, force=True, watch_s=0
        )
        seconds = time.perf_counter() - t0
        if refused:
            raise RuntimeError(f"compaction of the copy refused partitions: {refused}")
        after = {e.path for e in _live_entries(copy)}
        steps = sum(n for path, n in before.items() if path not in after)  # steps of the replaced shards
        rounds.append(
            {
                "seconds": seconds,
                "steps": steps,
                "steps_per_s": steps / seconds if seconds > 0 else None,
                "replaced": sum(r.replaced for r in results),
                "written": sum(r.written for r in results),
                "skipped": [s for r in results for s in r.skipped],
            }
        )
    per_s = [r["steps_per_s"] for r in rounds if r["steps_per_s"]]
    secs = [r["seconds"] for r in rounds]
    return copy, {
        "target_bytes": target_bytes,
        "seconds": statistics.median(secs),
        "seconds_spread": [min(secs), max(secs)],
        "steps_per_s": statistics.median(per_s) if per_s else None,
        "steps_per_s_spread": [min(per_s), max(per_s)] if per_s else None,
        "rounds": rounds,
    }


# ------------------------------------------------------------------------------ measuring


def _live_entries(uri: str) -> list:
    import rlrec

    return list(rlrec.open(uri).entries)


def files_and_sizes(uri: str) -> dict:
    """Files (the live shards of the newest point, from the manifest) and their sizes."""
    import rlrec

    snap = rlrec.open(uri)
    sizes = sorted(e.bytes for e in snap.entries)
    return {
        "files": len(sizes),
        "median_bytes": statistics.median(sizes) if sizes else 0,
        "total_bytes": sum(sizes),
        "steps": snap.num_steps,
        "episodes": snap.num_episodes,
        "formats": sorted({e.format for e in snap.entries}),
    }


class BenchS3:
    """moto's S3 server (``rlrec.local.LocalS3``) in a child process on 127.0.0.1 -- its own
    interpreter, so the server's Python does not take the readers' GIL -- with the stores' files
    uploaded to it, and each tool's documented way to read ``s3://`` files.

    moto answers a request in about a millisecond on this machine; a real S3 bucket's first byte
    takes ~10-30 ms, so per-file costs here are a floor of the cloud's."""

    _CHILD = (
        "import sys\n"
        "from rlrec.local import LocalS3\n"
        "s3 = LocalS3().start()\n"
        "s3.create_bucket(sys.argv[1])\n"
        "print(s3.port, flush=True)\n"
        "sys.stdin.read()\n"
    )

    def __init__(self) -> None:
        import pyarrow.fs as pafs

        self._child = subprocess.Popen(
            [sys.executable, "-c", self._CHILD, S3_BUCKET], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self._child.stdout.readline() if self._child.stdout else ""
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError("the S3 server (moto) did not start")
        self.endpoint = f"127.0.0.1:{int(line)}"
        self._uploads = 0
        self.fs = pafs.S3FileSystem(
            endpoint_override=self.endpoint, scheme="http", access_key="testing", secret_key="testing",
            region="us-east-1",
        )  # fmt: skip

    def upload(self, root: str, name: str, files: list[str]) -> list[str]:
        """Copy `files` (local paths under `root`) to ``s3://rlrec-bench/<n>-<name>/`` (n counts the
        uploads: stores never share keys); their URIs."""
        import pyarrow.fs as pafs

        self._uploads += 1
        uris = []
        for f in files:
            key = f"{S3_BUCKET}/{self._uploads}-{name}/{os.path.relpath(f, root)}"
            pafs.copy_files(f, key, destination_filesystem=self.fs)
            uris.append(f"s3://{key}")
        return uris

    def polars_options(self) -> dict[str, str]:
        """polars' ``storage_options`` (its own object_store client) for this server."""
        return {
            "aws_endpoint_url": f"http://{self.endpoint}",
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "aws_region": "us-east-1",
            "aws_allow_http": "true",
        }

    def upload_store(self, root: str, name: str) -> Any:
        """Copy the whole store at `root` (manifest and shards) to ``s3://rlrec-bench/<n>-<name>-store/``;
        a `Storage` of it (what ``rlrec.open`` reads)."""
        import pyarrow.fs as pafs

        from rlrec.store.storage import Storage

        self._uploads += 1
        prefix = f"{S3_BUCKET}/{self._uploads}-{name}-store"
        pafs.copy_files(root, prefix, destination_filesystem=self.fs)
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # moto's (the URI cannot carry them)
            os.environ.setdefault(key, "testing")
        return Storage.from_uri(f"s3://{prefix}?endpoint_override={self.endpoint}&scheme=http&region=us-east-1")

    def dataset(self, uris: list[str]) -> Any:
        """The ``s3://`` files `uris` as one pyarrow dataset on this server."""
        import pyarrow.dataset as ds

        return ds.dataset([u.removeprefix("s3://") for u in uris], format="parquet", filesystem=self.fs)

    def close(self) -> None:
        if self._child.stdin:
            self._child.stdin.close()
        try:
            self._child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()


def _raw_duckdb_sql(files: list[str], source: str = "read_parquet(?)") -> str:
    """count(*) and a sum that reads a column's values (the packed episodes of episode shards),
    over `source` (the files as a parameter, or a Python variable DuckDB scans)."""
    import pyarrow.parquet as pq

    names = pq.read_schema(files[0]).names if files else []
    value = "sum(octet_length(item))" if "item" in names else "sum(rewards)" if "rewards" in names else "0"
    return f"SELECT count(*), {value} FROM {source}"


def read_once(
    side: str,
    uri: str,
    files: list[str],
    s3: BenchS3 | None = None,
    s3_files: list[str] | None = None,
    s3_store: Any = None,
) -> tuple[float, int]:
    """Seconds to read every step of `uri` with `side`, and the rows it read (rows of the files'
    own layout for the ``files_*`` and ``s3_*`` raw sides: episodes of episode shards, steps of
    tabular ones). The ``s3_*`` sides read `s3_files` (the same files, uploaded to `s3`), and
    ``s3_steps`` the store uploaded whole (`s3_store`)."""
    import duckdb
    import polars as pl
    import pyarrow.dataset as ds

    import rlrec

    sql = (
        _raw_duckdb_sql(files)
        if side == "files_duckdb"
        else _raw_duckdb_sql(files, "files_on_s3")
        if side == "s3_duckdb"
        else ""
    )
    if side.startswith("s3_") and (s3 is None or s3_files is None):
        raise ValueError(f"{side} needs the S3 server and the uploaded files")
    t0 = time.perf_counter()
    if side == "s3_pyarrow":
        rows = s3.dataset(s3_files).to_table().num_rows
    elif side == "s3_polars":
        rows = pl.read_parquet(s3_files, storage_options=s3.polars_options()).height
    elif side == "s3_duckdb":  # DuckDB scans the Arrow dataset (its replacement scan of a Python variable)
        files_on_s3 = s3.dataset(s3_files)  # noqa: F841 -- named in the SQL
        rows = int(duckdb.connect().execute(sql).fetchone()[0])
    elif side == "s3_steps":
        rows = rlrec.open(s3_store).steps().num_rows
    elif side == "steps":
        rows = rlrec.open(uri).steps().num_rows
    elif side == "pandas_arrow":
        rows = len(rlrec.open(uri).to_pandas(arrow_backed=True))
    elif side == "files_pyarrow":
        rows = ds.dataset(files, format="parquet").to_table().num_rows
    elif side == "files_polars":
        rows = pl.read_parquet(files).height
    elif side == "files_duckdb":
        rows = int(duckdb.connect().execute(sql, [files]).fetchone()[0])
    elif side == "pyarrow":
        rows = rlrec.open(uri).to_pyarrow_dataset().to_table().num_rows
    elif side == "polars":
        rows = rlrec.open(uri).to_polars().height
    elif side == "duckdb":
        rows = int(rlrec.open(uri).to_duckdb().aggregate("count(*) AS n, sum(reward) AS r").fetchall()[0][0])
    else:
        raise ValueError(side)
    return time.perf_counter() - t0, rows


def _stats(values: list[dict]) -> dict:
    secs = [v["seconds"] for v in values]
    return {"seconds": statistics.median(secs), "spread": [min(secs), max(secs)], "rows": values[0]["rows"]}


def _ratios(raw: dict[str, list[dict]]) -> dict:
    """`RATIOS` of one store: per round the side's seconds over its baseline's in that round;
    median, spread and whether the median meets the contract."""
    out = {}
    for name, side, base, limit in RATIOS:
        if raw.get(side) and raw.get(base):
            per_round = [a["seconds"] / b["seconds"] for a, b in zip(raw[side], raw[base])]
            median = statistics.median(per_round)
            out[name] = {
                "median": median,
                "spread": [min(per_round), max(per_round)],
                "rounds": per_round,
                "at_most": limit,
                "met": median <= limit,
            }
    return out


def measure_reads(stores: dict[str, str], rounds: int, s3: BenchS3 | None = None) -> dict:
    """Alternated rounds (one warm-up round first) of every side on every store of `stores`
    (``{"before": uri, "after": uri}``, or before only): per round the sides in a rotating order,
    each reading the stores back to back in an order that flips every round. With `s3`, each
    store's files are uploaded to it first and the ``s3_*`` sides read them there. Returns per
    store ``{side: {seconds, spread, rows}, "rounds": {side: [{seconds, rows}, ...]}}``."""
    import rlrec

    names = list(stores)
    files = {n: rlrec.open(uri).files() for n, uri in stores.items()}
    sides = SIDES + (S3_SIDES if s3 else ())
    s3_files = {n: s3.upload(stores[n], n, files[n]) for n in names} if s3 else {}
    s3_stores = {n: s3.upload_store(stores[n], n) for n in names} if s3 else {}
    raw: dict[str, dict[str, list[dict]]] = {n: {s: [] for s in sides} for n in names}
    for r in range(rounds + 1):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        for side in order:
            for n in names if r % 2 == 0 else reversed(names):
                seconds, rows = read_once(side, stores[n], files[n], s3, s3_files.get(n), s3_stores.get(n))
                if r > 0:
                    raw[n][side].append({"seconds": seconds, "rows": rows})
    out: dict[str, Any] = {}
    for n in names:
        out[n] = {"rounds": raw[n], **{side: _stats(values) for side, values in raw[n].items()}}
        out[n]["ratios"] = _ratios(raw[n])
        if n != names[0]:  # the same episodes and steps on both sides
            for side in sides:
                assert out[n][side]["rows"] == out[names[0]][side]["rows"], (side, n)
    return out


def measure(uri: str, rounds: int, copies: int, target_bytes: int, s3: BenchS3 | None = None) -> dict:
    """Files and reads of one store before and after compaction (a local store: compacted copies
    beside it, and with `s3` its files also read from there; a remote one is measured before only)."""
    before = files_and_sizes(uri)
    if "://" in uri or copies < 1:
        return {"before": {**before, "reads": measure_reads({"before": uri}, rounds)["before"]}, "after": None}
    parent = os.path.dirname(os.path.abspath(uri))
    work = tempfile.mkdtemp(prefix=".rlrec-bench-compact-", dir=parent)  # beside it: same filesystem
    try:
        copy, compaction = compact_copies(uri, copies, target_bytes, work)
        reads = measure_reads({"before": uri, "after": copy}, rounds, s3)
        return {
            "before": {**before, "reads": reads["before"]},
            "after": {**files_and_sizes(copy), "reads": reads["after"], "compaction": compaction},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000, help="steps of the synthetic store")
    ap.add_argument("--steps-per-shard", type=int, default=1_800, help="steps per shard (~34 KiB at 1,800)")
    ap.add_argument("--partitions", type=int, default=4, help="partition logs of the synthetic store")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per reader (after one warm-up round)")
    ap.add_argument(
        "--target-bytes", type=int, default=DEFAULT_TARGET_BYTES, help="a merged shard's size at most (rlrec compact)"
    )
    ap.add_argument("--compact-rounds", type=int, default=3, help="copies compacted (timed); 0: no compaction")
    ap.add_argument(
        "--formats",
        default="episodes,tabular",
        help="shard formats of the synthetic stores, comma-separated (episodes: one row per episode, "
        "tabular: one row per step) [episodes,tabular]",
    )
    ap.add_argument(
        "--store",
        default=None,
        help="build (or reuse) the synthetic stores here, one folder per format (default: a temp dir)",
    )
    ap.add_argument("--demo-store", default=None, help="a demo run's shards (default ./demo-data/shards if present)")
    ap.add_argument(
        "--quick", action="store_true", help="20k steps, 2 rounds, 1 compacted copy, no demo store unless given"
    )
    ap.add_argument(
        "--object-store",
        choices=("s3", "none"),
        default="s3",
        help="also read the files before and after compaction from this object store: s3 = moto's server "
        "on 127.0.0.1 in a child process [s3]",
    )
    ap.add_argument("--head-entries", type=int, default=0, help="measure the head row only (bench/store_head.py)")
    ap.add_argument("--head-live", type=int, default=20_000, help="live shards of the head row's store")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.head_entries:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "store_head", os.path.join(os.path.dirname(__file__), "store_head.py")
        )
        store_head = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(store_head)  # type: ignore[union-attr]

        head_args = ["--entries", str(args.head_entries), "--live", str(args.head_live), "--rounds", str(args.rounds)]
        head_args += ["--tail", str(min(500, args.head_entries // 10))]
        return store_head.main([*head_args, *(["--json", args.json] if args.json else [])])
    if args.quick:
        args.steps, args.rounds = min(args.steps, 20_000), min(args.rounds, 2)
        args.compact_rounds = min(args.compact_rounds, 1)
    demo = args.demo_store
    if demo is None and not args.quick and os.path.isdir(os.path.join("demo-data", "shards", "_manifest")):
        demo = os.path.join("demo-data", "shards")

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats or set(formats) - {"episodes", "tabular"}:
        ap.error(f"--formats: episodes and/or tabular, not {args.formats!r}")
    tmp = None if args.store else tempfile.mkdtemp(prefix="rlrec-bench-store-")
    measuring = (args.rounds, args.compact_rounds, args.target_bytes)
    stores: dict[str, Any] = {}
    s3 = BenchS3() if args.object_store == "s3" and args.compact_rounds > 0 else None
    measuring = (*measuring, s3)
    try:
        for fmt in formats:
            root = os.path.join(args.store or tmp, fmt)
            built = build_synthetic(root, args.steps, args.steps_per_shard, args.partitions, fmt)
            print(
                f"synthetic {fmt} store: {built['shards']} shards, {built['steps']:,} steps"
                + (" (reused)" if built["reused"] else f", built in {built['build_s']:.1f}s"),
                file=sys.stderr,
            )
            name = "synthetic" if fmt == "episodes" else f"synthetic_{fmt}"
            stores[name] = {"uri": root, "format": fmt, "built": built, **measure(root, *measuring)}
        if demo:
            stores["demo"] = {"uri": demo, **measure(demo, *measuring)}
    finally:
        if s3:
            s3.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "readers": list(READERS),
        "target_speedup_after_compaction": TARGET_SPEEDUP,
        "stores": stores,
    }
    for name, s in stores.items():
        for when in ("before", "after"):
            b = s[when]
            if b is None:
                continue
            line = ", ".join(
                f"{side} {b['reads'][side]['seconds']:.2f}s" for side in (*SIDES, *S3_SIDES) if side in b["reads"]
            )
            c = b.get("compaction")
            comp = f"; compacted at {c['steps_per_s']:,.0f} steps/s" if c and c["steps_per_s"] else ""
            print(
                f"{name} {when} compaction: {b['files']} files, median {b['median_bytes'] / 1024:.1f} KiB{comp}; "
                f"read all: {line}"
            )
            for rname, r in b["reads"].get("ratios", {}).items():
                print(
                    f"  {rname}: {r['median']:.2f}x (rounds {r['spread'][0]:.2f}-{r['spread'][1]:.2f}; "
                    f"contract <= {r['at_most']:g}x: {'met' if r['met'] else 'MISSED'})"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

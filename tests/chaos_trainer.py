"""The trainer's chaos run: a live consumer commits shards while the trainer is broken in every way.

    python -m tests.chaos_trainer [--seed S] [--kills 2] [--outage-s 10] [--workdir DIR]

Stack (all on 127.0.0.1, real parts): Tansu (memory); a producer thread logging synthetic
episodes through `EpisodeRecorder`; one `rlrec consume` process committing shards to a local S3
server (moto in a process of its own, tests.chaos.s3server); `rlrec train` processes reading that
store through a fault proxy (tests.faults), checkpointing and publishing to a local directory.

Timeline: the trainer trains; the proxy answers every request of the trainer with 503 for
`--outage-s` seconds (longer than the read retries' first backoff) -- the driver must log a
WARNING naming the store within 30 s, count it in ``storage_errors``, and train fresh shards
again after it with no restart; a Ray worker of the data path (the PreLearner actor's process)
is killed with SIGKILL -- training must go on, or the trainer must exit by itself (the stall
watchdog) and continue with ``--resume``; then `--kills` kill -9s of the trainer (its Ray
processes with it) at random moments, each followed by ``rlrec train --resume``; the producer
stops, the consumer drains, the trainer trains the rest and gets SIGTERM.

Check: every version directory under the publish root has a policy.json pinning its files; the
``new_shards`` of their lineage.json list every committed shard exactly once; each lineage's
cursor reopens exactly its shards; versions are strictly increasing in publication order (each
one's parent is the one before). The last stdout
line is ``shards=N trained_once=N missing=0 twice=0 versions_monotonic=yes``; the exit code is 0
only if the run found nothing wrong.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from rlrec.local import LocalBroker
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import Storage
from tests.chaos.s3server import S3Process
from tests.faults import FaultProxy

REPO = Path(__file__).resolve().parents[1]
BUCKET = "chaos-trainer"
#: a new group's first assignment waits session.timeout.ms / 2 on Tansu; heartbeats well inside it
CONSUMER_KAFKA = {"session.timeout.ms": 2000, "heartbeat.interval.ms": 500}
STORE_WARNING = "does not answer"


class Run:
    """One chaos run (see the module docstring); `run()` returns the exit code."""

    def __init__(self, seed: int, kills: int, outage_s: float, workdir: str | None) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.kills = kills
        self.outage_s = outage_s
        self.work = Path(workdir or tempfile.mkdtemp(prefix="rlrec-chaos-trainer-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.ck = self.work / "ck"
        self.out = f"s3://{BUCKET}/run"
        self.topic = f"chaos-trainer-{seed}-{os.getpid()}"
        self.t0 = time.monotonic()
        self.problems: list[str] = []
        self.trainer: subprocess.Popen | None = None
        self.trainer_log: Path | None = None
        self.starts = 0
        self.produced = 0
        self._stop_producing = threading.Event()

    def say(self, msg: str) -> None:
        print(f"{time.monotonic() - self.t0:7.1f}s  {msg}", flush=True)

    # -- stack --------------------------------------------------------------------------------

    def start_stack(self) -> None:
        self.s3 = S3Process(BUCKET, self.work / "s3.log")
        self.proxy = FaultProxy(self.s3.port)
        self.proxy.server.handle_error = lambda *a: None  # clients hanging up mid-outage
        creds = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        os.environ.update({**creds, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.s3.port}"})
        self.direct_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.trainer_env = {**self.direct_env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy.port}"}
        self.storage = Storage.from_uri(self.out)
        self.broker = LocalBroker("memory", log_path=self.work / "tansu.log").start()
        from rlrec.consumer.topics import create_topics, dlq_topic_name

        create_topics(self.broker.bootstrap_servers, {self.topic: 2, dlq_topic_name(self.topic): 2})
        self.say(
            f"stack up: Tansu {self.broker.bootstrap_servers}, S3 :{self.s3.port} (trainer via :{self.proxy.port})"
        )

    def start_consumer(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "rlrec",
            "consume",
            "--bootstrap-servers",
            self.broker.bootstrap_servers,
            "--topic",
            self.topic,
            "--group-id",
            f"{self.topic}-g",
            "--output",
            self.out,
            "--no-create-topics",
            "--max-file-age-s",
            "1",
            "--commit-interval-s",
            "0.5",
        ]
        for k, v in CONSUMER_KAFKA.items():
            cmd += ["--kafka-config", f"{k}={v}"]
        log = open(self.work / "consumer.log", "ab")
        self.consumer = subprocess.Popen(cmd, cwd=REPO, env=self.direct_env, stdout=log, stderr=log)
        self.say(f"consumer started (pid {self.consumer.pid})")

    def produce(self) -> None:
        """Log a few episodes every second until told to stop (a live deployment)."""
        from rlrec.producer import EpisodeRecorder
        from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes

        rec = EpisodeRecorder(
            self.broker.bootstrap_servers,
            topic=self.topic,
            policy_id="chaos",
            observation_space=OBS_SPACE,
            action_space=ACT_SPACE,
            env_id="synthetic",
        )
        i = 0
        while not self._stop_producing.is_set():
            record_episodes(rec, 6, seed=self.seed * 100_000 + i, min_len=20, max_len=60)
            if rec.flush(10) != 0:
                self.problems.append("the producer could not deliver its episodes")
            self.produced += 6
            i += 1
            self._stop_producing.wait(1.0)
        rec.close()

    def committed(self) -> list:
        return read_manifest(self.storage)

    # -- the trainer --------------------------------------------------------------------------

    def start_trainer(self) -> None:
        self.starts += 1
        self.trainer_log = self.work / f"trainer-{self.starts}.log"
        cmd = [
            sys.executable,
            "-m",
            "rlrec",
            "train",
            "--input",
            self.out,
            "--checkpoint-dir",
            str(self.ck),
            "--algo",
            "BC",
            "--promotion-gate",
            "off",
            "--resume",
            "--num-cpus",
            "2",
            "--checkpoint-interval",
            "2",
            "--keep-checkpoints",
            "2",
            "--min-time-s-per-iteration",
            "1",
            "--stall-timeout-s",
            "45",
            "--algo-config",
            "train_batch_size_per_learner=256",
            "--offline-config",
            "dataset_num_iters_per_learner=4",
        ]
        log = open(self.trainer_log, "ab")
        # a session of its own: a kill -9 takes its Ray processes with it, as a container's would
        self.trainer = subprocess.Popen(
            cmd, cwd=REPO, env=self.trainer_env, stdout=log, stderr=log, start_new_session=True
        )
        self.say(f"trainer #{self.starts} started (pid {self.trainer.pid}, --resume)")

    def trainer_output(self) -> str:
        return self.trainer_log.read_text(errors="replace") if self.trainer_log else ""

    def metrics(self) -> list[dict]:
        try:
            text = (self.ck / "metrics.jsonl").read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def wait(self, pred, timeout: float, what: str, interval: float = 0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = pred()
            if v:
                return v
            if self.trainer is not None and self.trainer.poll() is not None:
                return None
            time.sleep(interval)
        self.problems.append(f"timed out after {timeout:.0f}s waiting for {what}")
        return None

    def lines_since(self, t: float) -> list[dict]:
        return [r for r in self.metrics() if r.get("time", 0) >= t]

    def kill_trainer(self) -> None:
        """SIGKILL the trainer and every process of its session (its Ray)."""
        pgid = self.trainer.pid
        procs = []
        try:
            procs = psutil.Process(self.trainer.pid).children(recursive=True)
        except psutil.Error:
            pass
        self.trainer.kill()
        self.trainer.wait(30)
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        psutil.wait_procs(procs, timeout=15)

    def ray_worker(self) -> psutil.Process | None:
        """The trainer's PreLearner actor process (else its read task's)."""
        try:
            kids = psutil.Process(self.trainer.pid).children(recursive=True)
        except psutil.Error:
            return None
        found = {}
        for p in kids:
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            for kind in ("MapWorker", "ReadRlrecShardStream"):
                if title.startswith("ray::") and kind in title:
                    found.setdefault(kind, p)
        return found.get("MapWorker") or found.get("ReadRlrecShardStream")

    # -- the faults ---------------------------------------------------------------------------

    def trained_since(self, t: float) -> set[str]:
        """Shards committed after `t` (wall clock) that a metrics line counts as trained."""
        late = {e.path for e in self.committed() if e.commit_time > t}
        return late & set().union(*(set(r.get("new_shards", ())) for r in self.metrics()))

    def outage(self) -> None:
        """Shard reads fail for the first half (the driver still sees new shards in the manifest,
        the read task cannot read them), every request for the second half."""
        start_wall, start = time.time(), time.monotonic()
        half = self.outage_s / 2
        self.proxy.fail_matching(10**9, ".parquet")
        self.say(
            f"S3 outage: the trainer's shard reads answered 503 for {half:.0f}s, then every request for {half:.0f}s"
        )
        seen = self.wait(lambda: f"{STORE_WARNING} (shard read" in self.trainer_output(), 30, "the driver's WARNING")
        if seen:
            self.say(f"driver WARNING after {time.monotonic() - start:.1f}s: storage does not answer (shard read: ...)")
        time.sleep(max(0.0, start + half - time.monotonic()))
        self.proxy.fail_for(half)
        time.sleep(half)
        self.proxy.clear_rules()
        end = time.time()
        self.say("S3 outage over")
        got = self.wait(lambda: self.trained_since(start_wall), 90, "shards committed during the outage trained")
        if got:
            self.say(f"shards committed during the outage trained {time.time() - end:.1f}s after it, no restart")
        if not any(r.get("storage_errors") for r in self.lines_since(start_wall)):
            self.problems.append("no metrics line counted storage_errors during the outage")

    def kill_worker(self) -> None:
        w = self.wait(self.ray_worker, 30, "a Ray worker of the data path")
        if w is None:
            return
        title = " ".join(w.cmdline())[:60].strip()
        t = time.time()
        w.kill()
        self.say(f"kill -9 Ray worker {w.pid} ({title})")
        ok = self.wait(lambda: self.trained_since(t), 120, "shards committed after the worker kill trained")
        if ok:
            self.say(f"shards committed after the worker kill trained {time.time() - t:.1f}s after it, no restart")
        elif self.trainer.poll() is not None:
            tail = self.trainer_output().strip().splitlines()[-1:] or [""]
            self.say(f"trainer exited with {self.trainer.returncode} after the worker kill: {tail[0][:160]}")
            if self.trainer.returncode == 0:
                self.problems.append("the trainer exited 0 after a worker kill")
            self.start_trainer()

    def kill_at_random(self, k: int) -> None:
        delay = self.rng.uniform(1.0, 20.0)
        self.say(f"kill -9 #{k} of the trainer in {delay:.1f}s")
        time.sleep(delay)
        if self.trainer.poll() is not None:
            self.problems.append(f"the trainer had exited ({self.trainer.returncode}) before kill -9 #{k}")
        its = [r["iteration"] for r in self.metrics()]
        self.kill_trainer()
        self.say(f"kill -9 #{k}: trainer and its Ray killed (last iteration {its[-1] if its else None})")
        self.start_trainer()

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> int:
        producer = threading.Thread(target=self.produce, daemon=True)
        try:
            self.start_stack()
            self.start_consumer()
            producer.start()
            self.start_trainer()
            if self.wait(lambda: self.metrics(), 150, "the first iteration"):
                self.outage()
                self.kill_worker()
                for k in range(1, self.kills + 1):
                    self.kill_at_random(k)
                self.wait(
                    lambda: self.metrics() and self.metrics()[-1]["time"] > time.time() - 5, 150, "a resumed iteration"
                )
            self._stop_producing.set()
            producer.join(30)
            self.wait(lambda: sum(e.episodes for e in self.committed()) >= self.produced, 60, "the consumer to drain")
            keys = {e.path for e in self.committed()}
            self.say(f"producer stopped: {self.produced} episodes, {len(keys)} shards committed")
            self.wait(
                lambda: keys <= set().union(*(set(r.get("new_shards", ())) for r in self.metrics())),
                120,
                "every shard trained",
            )
            self.stop_trainer()
            return self.report(keys)
        finally:
            self._stop_producing.set()
            self.stop_stack()

    def stop_trainer(self) -> None:
        if self.trainer.poll() is not None:
            self.problems.append(f"the trainer had exited with {self.trainer.returncode} before the SIGTERM")
            return
        self.trainer.send_signal(signal.SIGTERM)
        try:
            rc = self.trainer.wait(90)
        except subprocess.TimeoutExpired:
            self.problems.append("the trainer did not stop within 90 s of SIGTERM")
            self.kill_trainer()
            return
        self.say(f"SIGTERM: trainer exited with {rc}")
        if rc != 143:  # 128 + SIGTERM after the clean stop
            self.problems.append(f"the trainer exited with {rc} on SIGTERM")

    def stop_stack(self) -> None:
        if self.trainer is not None and self.trainer.poll() is None:
            self.kill_trainer()
        c = getattr(self, "consumer", None)
        if c is not None and c.poll() is None:
            c.send_signal(signal.SIGTERM)
            try:
                c.wait(30)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait(10)
        for name in ("broker", "proxy", "s3"):
            thing = getattr(self, name, None)
            try:
                if thing is not None:
                    thing.close() if name == "proxy" else thing.stop()
            except Exception as e:
                self.say(f"cleanup of {name}: {e}")

    # -- the check ----------------------------------------------------------------------------

    def report(self, keys: set[str]) -> int:
        versions = check_publications(self.ck / "policies", self.problems)
        counts = Counter(k for v in versions for k in v["new_shards"])
        missing = len(keys - set(counts))
        twice = sum(1 for n in counts.values() if n > 1)
        unknown = set(counts) - keys
        if unknown:
            self.problems.append(f"{len(unknown)} shard(s) in lineages were never committed: {sorted(unknown)[:3]}")
        monotonic = versions_monotonic(versions)
        check_lineage_cursors(self.storage, versions, self.problems)
        trained_once = sum(1 for k in keys if counts.get(k) == 1)
        self.say(
            f"{len(versions)} versions published over {self.starts} trainer processes; "
            f"versions {versions[0]['policy_version'] if versions else '-'}..{versions[-1]['policy_version'] if versions else '-'}"
        )
        (self.work / "result.json").write_text(
            json.dumps({"shards": len(keys), "versions": len(versions), "problems": self.problems}, indent=1)
        )
        for p in self.problems:
            print(f"problem: {p}", flush=True)
        ok = not self.problems and missing == 0 and twice == 0 and monotonic and keys
        print(
            f"shards={len(keys)} trained_once={trained_once} missing={missing} twice={twice} "
            f"versions_monotonic={'yes' if monotonic else 'no'}",
            flush=True,
        )
        return 0 if ok else 1


def check_publications(root: Path, problems: list[str]) -> list[dict]:
    """Every version directory's lineage (policy.json present and pinning lineage.json), sorted by version."""
    out = []
    for d in sorted(root.glob("v*")):
        if not re.fullmatch(r"v\d{6}", d.name):
            continue
        try:
            spec = json.loads((d / "policy.json").read_text())
        except FileNotFoundError:
            problems.append(f"{d.name} has no policy.json (a half-written publication left behind)")
            continue
        lineage_bytes = (d / "lineage.json").read_bytes()
        if spec["files"].get("lineage.json") != hashlib.sha256(lineage_bytes).hexdigest():
            problems.append(f"{d.name}/lineage.json does not match its policy.json")
            continue
        lineage = json.loads(lineage_bytes)
        out.append({**lineage, "time": spec["time"]})
    return sorted(out, key=lambda v: v["policy_version"])


def check_lineage_cursors(storage: Storage, versions: list[dict], problems: list[str]) -> None:
    """Every version's lineage records a cursor (docs/TRAINER.md, "Lineage", L1) at which the
    store holds exactly its shards: the smallest point holding them (each log's last entry
    below it is one of them) and every one of them below it; its ranges name exactly the shards
    of its and the earlier versions' new_shards, as many as it counts."""
    from rlrec.store.snapshot import Cursor, CursorError, open_snapshot
    from rlrec.trainer.lineage import Lineage, LineageError

    trained: set[str] = set()  # every version's new_shards list each shard once: their union is what it trained
    for v in versions:
        trained |= set(v.get("new_shards") or ())
        name, cursor = f"v{v['policy_version']:06d}", v.get("cursor")
        if not cursor:
            problems.append(f"{name}/lineage.json records no cursor")
            continue
        try:
            snap = open_snapshot(storage, as_of=cursor)
            lin = Lineage.from_doc(v["policy_version"], v, True)
            shards = set(lin.shard_paths(snap.entries))
            got = {e.path for e in snap.subset(shards).entries}
            if lin.num_shards != len(shards):
                problems.append(f"{name}: its lineage counts {lin.num_shards} shards, its ranges name {len(shards)}")
        except (CursorError, LineageError) as e:
            problems.append(f"{name}: its lineage cursor does not reopen its shards: {e}")
            continue
        last = {(e.topic, e.partition): e for e in snap.entries}  # sorted: the last of each log wins
        ends = Cursor.parse(cursor).positions
        tight = all((e := last.get(k)) is not None and e.seq == n - 1 and e.path in shards for k, n in ends.items())
        if got != shards or shards != trained or not tight:
            problems.append(f"{name}: its lineage cursor {cursor} is not the point of exactly its shards")


def versions_monotonic(versions: list[dict]) -> bool:
    """Each version's parent is the one before it and it was published after it."""
    for prev, v in itertools.pairwise(versions):
        if v["parent_version"] != prev["policy_version"] or v["time"] <= prev["time"]:
            return False
    return not versions or versions[0]["parent_version"] is None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos_trainer", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1, help="seed of the kill moments and the episodes")
    p.add_argument("--kills", type=int, default=2, help="kill -9s of the trainer, each followed by --resume")
    p.add_argument("--outage-s", type=float, default=10.0, help="seconds the trainer's S3 requests fail")
    p.add_argument("--workdir", default=None, help="where logs, checkpoints and result.json go (default: a temp dir)")
    a = p.parse_args(argv)
    return Run(a.seed, a.kills, a.outage_s, a.workdir).run()


if __name__ == "__main__":
    sys.exit(main())

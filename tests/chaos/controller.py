"""The chaos controller: runs the stack, the producers and the consumers, and injects faults.

Stack (all on 127.0.0.1): Tansu with s3:// storage on its own S3 server (LocalBroker); the shard
store's S3 server behind a FaultProxy (tests.faults) that the consumers talk to (both S3 servers
are moto in processes of their own, tests.chaos.s3server); producer processes (tests.chaos.producer);
`rlrec consume` processes with a Prometheus port each.

Timeline (seeded): `kills` kill -9s, each of a consumer that holds partitions and has committed a
shard (read from its /metrics), followed by a replacement; `joins` membership changes (an extra
consumer, or a graceful leave and a new one when 3 run); `storage_faults` windows in which the
proxy stalls every request and then answers 503 (plus a few ambiguous 503s whose request did
reach the store); `foreign_outputs` consumers of another output with the same group id, each
starting its new store at the partitions' ends (--start-from latest), joining between two kills
and leaving 3-6 s after it wrote a shard there, once the group's offset of a partition is ahead
of the main store's position (checked: the store, not the group's offsets, decides where the main
output resumes); one broker restart. The moments are drawn from the seed; what is eligible for a
kill at that moment depends on timing, so two runs with one seed are alike, not identical.
Then: wait for the producers, read the topic, wait until the manifest holds every expected
episode and the group's offsets reached the end of every partition, stop the consumers
(SIGTERM), and check (tests.chaos.check) plus `rlrec inspect --verify`. While draining, a group
whose live consumers hold fewer than all partitions and that makes no progress for STALL_S seconds
has its consumers restarted, as an operator would, and the restart is counted (Tansu's group
coordinator can stall after a broker restart and a kill -9). With a time limit every wait is cut
to fit it. Consumers and producers die with the controller (parent-death signal); SIGTERM to the
controller stops them on the way out.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rlrec.consumer.topics import create_topics, dlq_topic_name
from rlrec.local import LocalBroker, _make_pdeathsig, free_port
from rlrec.store.manifest import PartitionLog, ShardEntry
from rlrec.store.storage import Storage
from tests.chaos.check import (
    Verdict,
    check,
    committed_offsets,
    scan_dead_letters,
    scan_tail,
    scan_topic,
)
from tests.chaos.s3server import S3Process
from tests.chaos.truth import read_truth
from tests.faults import FaultProxy

REPO = Path(__file__).resolve().parents[2]
BUCKET = "chaos-shards"
#: librdkafka settings of the consumers. Tansu on moto answers group requests more slowly as its
#: objects accumulate: with 3 s sessions a 1000-episode run fell into a storm of session timeouts
#: (each one a rebalance and a replay, which slowed the broker further) and did not drain in
#: 400 s; 10 s sessions keep members through it. Kills are noticed after one session either way.
CONSUMER_KAFKA = {
    "session.timeout.ms": 10000,
    "heartbeat.interval.ms": 2000,
    "topic.metadata.refresh.interval.ms": 3000,
}
MAX_CONSUMERS = 3
#: consumers run with this episode timeout; the first storage fault window outlasts it twice
EPISODE_TIMEOUT_S = 15.0
#: a dead-letter topic name the broker refuses ("Broker: Invalid topic") for the DLQ faults
REFUSED_DLQ = "bad topic!"
#: seconds the consumer of another output gets to hold partitions, commit a shard there and move
#: the group's offsets past the store's position before it leaves
FOREIGN_WAIT_S = 180.0
#: seconds a time-limited run keeps for stopping its consumers and checking the result
FINAL_CHECK_S = 150.0
#: seconds the drain may see no progress while partitions have no live owner before the
#: controller restarts the group's consumers (see `Chaos._restart_stalled_group`)
STALL_S = 90.0


@dataclass
class ChaosConfig:
    episodes: int
    kills: int
    seed: int = 1
    producers: int = 3
    partitions: int = 8
    duration: float | None = None  # seconds over which producers spread their episodes
    joins: int | None = None
    storage_faults: int | None = None
    dlq_faults: int = 1  # consumers that join with a dead-letter topic the broker refuses, then leave
    foreign_outputs: int = 1  # consumers of another output with the same group id that join, then leave
    broker_restart: bool = True
    workdir: str | None = None
    #: seconds the whole run may take (None: no limit); every wait is cut to fit, leaving
    #: FINAL_CHECK_S for stopping the consumers and the checks
    time_limit: float | None = None

    def __post_init__(self) -> None:
        if self.joins is None:
            self.joins = max(1, self.kills // 4)
        if self.storage_faults is None:
            self.storage_faults = max(1, self.kills // 6)
        if self.duration is None:
            events = self.kills + self.joins + self.storage_faults + self.dlq_faults + self.foreign_outputs
            events += int(self.broker_restart)
            self.duration = max(40.0, 8.0 * events, 0.05 * self.episodes)


@dataclass
class ConsumerProc:
    name: str
    proc: subprocess.Popen
    metrics_port: int
    foreign: bool = False  # writes another output (same group id): never killed, not counted at the end

    def metrics(self) -> dict[str, float]:
        """The consumer's Prometheus metrics ({} if it does not answer)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, _, val = line.rpartition(" ")
                try:
                    out[k] = float(val)
                except ValueError:
                    pass
        return out

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM, and SIGKILL if it has not exited within `timeout` seconds."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class Tally:
    kills: int = 0
    kills_skipped: int = 0
    rebalances: int = 0  # consumer group membership changes after the initial consumers
    storage_faults: int = 0
    dlq_faults: int = 0
    foreign_outputs: int = 0
    #: partitions whose group offset, set by a consumer of another output, was ahead of the
    #: store's position when that consumer left (the gap the phase exists to provoke)
    foreign_ahead: int = 0
    broker_restarts: int = 0
    #: times the drain found partitions without a live owner and no progress for STALL_S, and
    #: restarted the consumers as an operator would (Tansu's group coordinator stalled)
    stall_restarts: int = 0
    dead_letters_unacked: int = -1  # pending dead letters of the consumers when the run ends
    faults: list[str] = field(default_factory=list)  # every fault, as logged


class Chaos:
    """One chaos run (see the module docstring). `run()` returns the process exit code.

    Guarantees: the exit code is 0 only if every produced episode is committed exactly once and
    bit-identical to the ground truth, offsets agree with the manifest, `rlrec inspect --verify`
    passes, every planned kill happened and the broker kept every produced message; the last
    stdout line is exactly `lost=<n> duplicated=<n> dead_letters_unacked=<n>`.
    """

    def __init__(self, cfg: ChaosConfig, console: Console | None = None):
        self.cfg = cfg
        self.console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 120)
        self.rng = random.Random(cfg.seed)
        self.work = Path(cfg.workdir or tempfile.mkdtemp(prefix="rlrec-chaos-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.topic = f"chaos-{cfg.seed}-{os.getpid()}"
        self.scan_summary: dict | None = None  # the topic scan, as result.json keeps it
        self.group = f"chaos-group-{cfg.seed}-{os.getpid()}"
        self.output = f"s3://{BUCKET}/run"
        self.tally = Tally()
        self.consumers: list[ConsumerProc] = []
        self.producers: list[subprocess.Popen] = []
        self.t0 = time.monotonic()
        self._n = 0
        self.produced = 0
        self._fault_thread: threading.Thread | None = None
        self._committed_ids: set[str] = set()
        self._logs: dict[int, PartitionLog] = {}
        self.hold = self.work / "hold"

    # -- output -------------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self.t0:7.1f}s[/dim]  {msg}")

    def budget(self, wanted: float, keep: float = FINAL_CHECK_S) -> float:
        """`wanted` seconds, cut to what the run's time limit leaves after keeping `keep`
        seconds for what follows (at least 1 s, so a late step still looks once)."""
        if self.cfg.time_limit is None:
            return wanted
        left = self.t0 + self.cfg.time_limit - keep - time.monotonic()
        return max(1.0, min(wanted, left))

    # -- stack --------------------------------------------------------------------------------

    def _start_stack(self) -> None:
        self.shard_s3 = S3Process(BUCKET, self.work / "s3-shards.log")
        s3_port = self.shard_s3.port
        self.proxy = FaultProxy(s3_port)
        self.proxy.server.handle_error = lambda *a: None  # clients hanging up mid-fault: expected, not news
        creds = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        # consumers reach the shard store through the proxy; this process (checks) directly
        self.consumer_env = {**os.environ, **creds, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy.port}"}
        os.environ.update({**creds, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}"})
        self.direct_env = dict(os.environ)
        self.storage = Storage.from_uri(self.output)
        self.broker_s3 = S3Process("chaos-broker", self.work / "s3-broker.log")
        self.broker = LocalBroker("s3", s3=self.broker_s3, log_path=self.work / "tansu.log").start()
        n = self.cfg.partitions
        create_topics(
            self.broker.bootstrap_servers, {self.topic: n, dlq_topic_name(self.topic): n, self.foreign_dlq: n}
        )
        self.say(
            f"stack up: Tansu {self.broker.bootstrap_servers} (s3://{self.broker.bucket}), shard store "
            f"127.0.0.1:{s3_port} behind fault proxy :{self.proxy.port}, topic {self.topic} ({n} partitions)"
        )

    def _stop_stack(self) -> None:
        for c in self.consumers:
            if c.alive:
                c.proc.kill()
                c.proc.wait(10)
        for p in self.producers:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for name in ("broker", "proxy", "broker_s3", "shard_s3"):
            thing = getattr(self, name, None)
            try:
                if thing is not None:
                    thing.close() if name == "proxy" else thing.stop()
            except Exception as e:  # already down
                self.say(f"[yellow]cleanup of {name}: {e}[/yellow]")

    # -- processes ----------------------------------------------------------------------------

    def _start_producers(self) -> None:
        cfg = self.cfg
        share = [cfg.episodes // cfg.producers + (i < cfg.episodes % cfg.producers) for i in range(cfg.producers)]
        for i, n in enumerate(share):
            cmd = [
                sys.executable,
                "-m",
                "tests.chaos.producer",
                "--bootstrap-servers",
                self.broker.bootstrap_servers,
                "--topic",
                self.topic,
                "--index",
                str(i),
                "--episodes",
                str(n),
                "--seed",
                str(cfg.seed * 1000 + i),
                "--duration",
                str(cfg.duration),
                "--truth",
                str(self.work / f"truth-{i}.jsonl"),
                "--stats",
                str(self.work / f"producer-{i}.json"),
                "--hold",
                str(self.hold),
            ]
            log = open(self.work / f"producer-{i}.log", "ab")
            self.producers.append(subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=log, preexec_fn=_make_pdeathsig()))
        self.say(f"{cfg.producers} producers: {cfg.episodes} episodes over {cfg.duration:.0f}s")

    def start_consumer(self, dlq_topic: str | None = None, output: str | None = None) -> ConsumerProc:
        self._n += 1
        name, port = f"c{self._n}", free_port()
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
            self.group,
            "--output",
            output or self.output,
            "--no-create-topics",
            "--max-file-age-s",
            "1",
            "--commit-interval-s",
            "1",
            "--max-episodes-per-file",
            "100",
            "--reward-join-window-s",
            "2",
            "--episode-timeout-s",
            str(EPISODE_TIMEOUT_S),
            "--metrics-port",
            str(port),
        ]
        if dlq_topic is not None:
            cmd += ["--dlq-topic", dlq_topic]
        if output is not None:  # a new store at the partitions' ends: its group commits run ahead of ours
            cmd += ["--start-from", "latest"]
        for k, v in CONSUMER_KAFKA.items():
            cmd += ["--kafka-config", f"{k}={v}"]
        log = open(self.work / f"consumer-{name}.log", "ab")
        # a consumer dies with the controller (kill -9 included): none may outlive the run
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=self.consumer_env, stdout=log, stderr=log, preexec_fn=_make_pdeathsig()
        )
        c = ConsumerProc(name, proc, port, foreign=output is not None)
        self.consumers.append(c)
        what = f" of another output {output}" if output else f" with DLQ {dlq_topic!r}" if dlq_topic else ""
        self.say(f"start consumer {name} (pid {c.proc.pid}){what}")
        return c

    def alive(self) -> list[ConsumerProc]:
        """The running consumers of the output under test."""
        return [c for c in self.consumers if c.alive and not c.foreign]

    # -- faults -------------------------------------------------------------------------------

    def kill(self) -> None:
        deadline = time.monotonic() + 90
        while True:
            eligible = []
            for c in self.alive():
                m = c.metrics()
                if m.get("rlrec_assigned_partitions", 0) > 0 and m.get("rlrec_shards_committed_total", 0) > 0:
                    eligible.append((c, m))
            if eligible:
                break
            if time.monotonic() > deadline:
                self.tally.kills_skipped += 1
                self.say("[red]kill skipped: no consumer holds partitions and has committed a shard[/red]")
                return
            time.sleep(0.3)
        c, m = self.rng.choice(eligible)
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait(10)
        self.tally.kills += 1
        self.tally.rebalances += 1
        self._fault(
            f"kill -9 consumer {c.name} (pid {c.proc.pid}: {m['rlrec_assigned_partitions']:.0f} partitions, "
            f"{m['rlrec_shards_committed_total']:.0f} shards committed)"
        )
        time.sleep(self.rng.uniform(0, 3))
        self.start_consumer()
        self.tally.rebalances += 1

    def join(self) -> None:
        running = self.alive()
        if len(running) >= MAX_CONSUMERS:
            c = self.rng.choice(running)
            self.say(f"consumer {c.name} leaves the group (SIGTERM)")
            c.stop()
            self.tally.rebalances += 1
        self.start_consumer()
        self.tally.rebalances += 1

    def dlq_fault(self) -> None:
        """A consumer whose dead letters the broker refuses joins, takes partitions, dead-letters
        what comes (nothing acknowledged: its offsets must stay behind those letters), and leaves;
        the next owners replay from its committed offsets and dead-letter again, for real."""
        c = self.start_consumer(dlq_topic=REFUSED_DLQ)
        self.tally.rebalances += 1
        self.tally.dlq_faults += 1
        self._fault(f"consumer {c.name} joins with a dead-letter topic the broker refuses")
        time.sleep(self.rng.uniform(10, 15))
        m = c.metrics()
        c.stop()
        self.tally.rebalances += 1
        self.say(
            f"consumer {c.name} leaves (SIGTERM) with {m.get('rlrec_dead_letters_pending', 0):.0f} dead letters "
            f"unacknowledged, {m.get('rlrec_dead_letter_failures_total', 0):.0f} failed deliveries"
        )

    @property
    def foreign_dlq(self) -> str:
        """The dead-letter topic of the consumers of another output."""
        return f"{self.topic}.other-output.dlq"

    def foreign_output(self) -> None:
        """A consumer of another output joins with the same group id, takes partitions, commits
        the group's offsets past what it writes to its own store, and leaves: the main output's
        consumers resume those partitions from their store's position, not from the group's
        offsets, so nothing is missing from the output under test."""
        # its own dead-letter topic: it starts mid-episode, and what it dead-letters is not ours
        c = self.start_consumer(dlq_topic=self.foreign_dlq, output=str(self.work / "other-output"))
        self.tally.rebalances += 1
        self.tally.foreign_outputs += 1
        self._fault(f"consumer {c.name} of another output joins the group")
        # until it holds partitions, wrote a shard there and moved the group's offset of a
        # partition past our store's position (the gap the group's offsets would leave); on a
        # loaded machine a consumer can take over a minute to start, join and commit
        deadline = time.monotonic() + FOREIGN_WAIT_S
        while time.monotonic() < deadline and c.alive:
            m = c.metrics()
            if m.get("rlrec_assigned_partitions", 0) > 0 and m.get("rlrec_shards_committed_total", 0) > 0:
                break
            time.sleep(0.5)
        time.sleep(self.rng.uniform(3, 6))
        ahead = self._group_ahead_of_store()
        while not ahead and time.monotonic() < deadline and c.alive:
            time.sleep(1.0)
            ahead = self._group_ahead_of_store()
        m = c.metrics()
        self.tally.foreign_ahead += len(ahead)
        c.stop()
        self.tally.rebalances += 1
        self.say(
            f"consumer {c.name} of another output leaves (SIGTERM) holding "
            f"{m.get('rlrec_assigned_partitions', 0):.0f} partitions, after committing "
            f"{m.get('rlrec_episodes_committed_total', 0):.0f} episodes there; the group's offsets were ahead "
            f"of the store's position on partitions {sorted(ahead)}"
        )

    def _group_ahead_of_store(self) -> dict[int, tuple[int, int]]:
        """{partition: (the group's committed offset, the store's position)} where the group's
        offset is ahead: with the group's offsets deciding, a consumer would skip that stretch."""
        try:
            offsets = committed_offsets(self.broker.bootstrap_servers, self.group, self.topic, self.cfg.partitions)
        except Exception as e:  # the broker is restarting: counted as nothing ahead
            self.say(f"group offsets not available ({type(e).__name__}: {e})")
            return {}
        self.committed_ids()  # reads the logs' new entries
        out = {}
        for p, off in offsets.items():
            log = self._logs.get(p)
            position = log.resume_offset if log is not None else None
            if position is not None and off > position:
                out[p] = (off, position)
        return out

    def storage_fault(self) -> None:
        if self._fault_thread is not None:
            self._fault_thread.join()
        stall_s, stall_for = self.rng.uniform(0.3, 1.0), self.rng.uniform(2, 5)
        fail_for, swallow = self.rng.uniform(3, 8), self.rng.randint(2, 6)
        if self.tally.storage_faults == 0:  # the first outage outlasts the episode timeout twice
            fail_for = 2 * EPISODE_TIMEOUT_S + 1
        self.tally.storage_faults += 1
        self._fault(
            f"storage fault: every request stalls {stall_s:.2f}s for {stall_for:.1f}s, then 503s for "
            f"{fail_for:.1f}s, then {swallow} ambiguous 503s (request applied)"
        )

        def window() -> None:
            self.proxy.stall(stall_s)
            time.sleep(stall_for)
            self.proxy.stall(0)
            self.proxy.fail_for(fail_for)
            time.sleep(fail_for)
            self.proxy.swallow_next(swallow)
            self.say("storage fault window over")

        self._fault_thread = threading.Thread(target=window, daemon=True)
        self._fault_thread.start()

    def restart_broker(self) -> None:
        # producers first deliver everything and wait: see tests/chaos/producer.py on Tansu and
        # idempotent producers. The consumers keep running: they must ride through the restart.
        self.hold.touch()
        try:
            deadline = time.monotonic() + 120
            while not all(
                p.poll() is not None or Path(f"{self.hold}.{i}").exists() for i, p in enumerate(self.producers)
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError("producers did not hold within 120 s")
                time.sleep(0.05)
            self.say("producers hold (nothing in flight)")
            t = time.monotonic()
            self.broker.restart()
        finally:
            self.hold.unlink()
        self.tally.broker_restarts += 1
        self._fault(f"broker restarted (SIGTERM, same port and s3:// data) in {time.monotonic() - t:.1f}s")

    def _fault(self, msg: str) -> None:
        self.tally.faults.append(f"{time.monotonic() - self.t0:.1f}s {msg}")
        self.say(f"[bold yellow]{msg}[/bold yellow]")

    # -- progress -----------------------------------------------------------------------------

    def committed_ids(self) -> set[str]:
        """Episode ids in committed shards (manifest logs read incrementally, directly from S3)."""
        for p in range(self.cfg.partitions):
            log = self._logs.setdefault(p, PartitionLog(self.storage, self.topic, p))
            try:
                new = log.refresh()
            except Exception:  # not there yet
                continue
            for e in new:
                if isinstance(e, ShardEntry):
                    self._committed_ids.update(e.episode_ids)
        return self._committed_ids

    # -- the run ------------------------------------------------------------------------------

    def _timeline(self) -> list[tuple[float, str]]:
        cfg = self.cfg
        lo, hi = 0.1 * cfg.duration, 0.8 * cfg.duration
        plan = [(self.rng.uniform(lo, hi), "kill") for _ in range(cfg.kills)]
        plan += [(self.rng.uniform(lo, hi), "join") for _ in range(cfg.joins)]
        plan += [(self.rng.uniform(lo, hi), "storage") for _ in range(cfg.storage_faults)]
        plan += [(self.rng.uniform(lo, hi), "dlq") for _ in range(cfg.dlq_faults)]
        kills = sorted(t for t, what in plan if what == "kill")
        for i in range(cfg.foreign_outputs):  # between two kills where there are two
            at = (kills[0] + kills[1]) / 2 if len(kills) >= 2 and i == 0 else self.rng.uniform(lo, hi)
            plan.append((at, "foreign"))
        if cfg.broker_restart:
            plan.append((self.rng.uniform(0.3 * cfg.duration, 0.6 * cfg.duration), "broker"))
        return sorted(plan)

    def _wait_drained(self, expected: set[str], end_offsets: dict[int, int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        last_say = 0.0
        progress, progress_at = None, time.monotonic()
        while time.monotonic() < deadline:
            missing = len(expected - self.committed_ids())
            offsets = committed_offsets(self.broker.bootstrap_servers, self.group, self.topic, self.cfg.partitions)
            behind = sum(offsets.get(p, 0) < end for p, end in end_offsets.items())
            if not missing and not behind:
                return True
            if (missing, sum(offsets.values())) != progress:
                progress, progress_at = (missing, sum(offsets.values())), time.monotonic()
            elif time.monotonic() - progress_at > STALL_S and self._restart_stalled_group(progress_at):
                progress_at = time.monotonic()
            if time.monotonic() - last_say > 10:
                last_say = time.monotonic()
                self.say(f"draining: {missing} episodes not committed yet, {behind} partitions' offsets behind")
            time.sleep(1)
        return False

    def _restart_stalled_group(self, progress_at: float) -> bool:
        """If every live consumer answers and together they hold fewer partitions than the topic
        has, restart them all (SIGTERM, then as many fresh ones) and count it; True if it did.

        Tansu 0.6's group coordinator can keep a kill -9ed member's partitions assigned for good
        after a broker restart: consumers that join get nothing, the rest never rebalance. An
        operator restarts the consumers; so does the controller, after STALL_S seconds without
        progress, and the restart is counted and reported (`stall_restarts`). It changes nothing
        the check requires: every episode must still be committed exactly once. Consumers that
        hold every partition yet make no progress, and consumers that do not answer (still
        starting, or hung), are never restarted: that would hide a consumer's bug.
        """
        running = self.alive()
        metrics = {c.name: c.metrics() for c in running}
        if not running or not all(metrics.values()):
            return False
        held = {name: m.get("rlrec_assigned_partitions", 0) for name, m in metrics.items()}
        if sum(held.values()) >= self.cfg.partitions:
            return False
        self.tally.stall_restarts += 1
        self._fault(
            f"stalled group: no progress for {time.monotonic() - progress_at:.0f}s and the live consumers hold "
            f"{sum(held.values()):.0f} of {self.cfg.partitions} partitions ({held}); restarting them"
        )
        for c in running:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for c in running:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(10)
            self.tally.rebalances += 1
        for _ in range(max(1, len(running))):
            self.start_consumer()
            self.tally.rebalances += 1
        return True

    def run(self) -> int:
        cfg = self.cfg
        self.say(
            f"chaos run: episodes={cfg.episodes} kills={cfg.kills} joins={cfg.joins} "
            f"storage_faults={cfg.storage_faults} broker_restart={cfg.broker_restart} seed={cfg.seed} "
            f"workdir={self.work}"
        )
        problems: list[str] = []
        verdict = None
        verify_rc = None
        try:
            self._start_stack()
            for _ in range(2):
                self.start_consumer()
            self._start_producers()
            t_start = time.monotonic()
            for at, what in self._timeline():
                while time.monotonic() < t_start + at:
                    time.sleep(0.2)
                {
                    "kill": self.kill,
                    "join": self.join,
                    "storage": self.storage_fault,
                    "dlq": self.dlq_fault,
                    "foreign": self.foreign_output,
                    "broker": self.restart_broker,
                }[what]()
                self.say(f"committed so far: {len(self.committed_ids())} episodes")
            if self._fault_thread is not None:
                self._fault_thread.join()
            for i, p in enumerate(self.producers):
                rc = p.wait(self.budget(cfg.duration * 3 + 300))
                if rc != 0:
                    problems.append(f"producer {i} exited with {rc} (see {self.work}/producer-{i}.log)")
            stats = [
                json.loads((self.work / f"producer-{i}.json").read_text())
                for i in range(cfg.producers)
                if (self.work / f"producer-{i}.json").exists()
            ]
            truth = read_truth(sorted(self.work.glob("truth-*.jsonl")))
            self.produced = len(truth)
            self.say(
                f"producers done: {len(truth)} episodes, {sum(s['messages'] for s in stats)} messages "
                f"({sum(s['duplicate_messages'] for s in stats)} duplicate sends)"
            )
            delivered = sum(s["messages"] for s in stats)
            # Tansu on moto serves about one produce request's batch per partition and fetch, slower
            # as its objects accumulate: the scan's time grows with the messages
            scan = scan_topic(
                self.broker.bootstrap_servers,
                self.topic,
                cfg.partitions,
                at_least=delivered,
                timeout=self.budget(300 + 0.25 * delivered, keep=2 * FINAL_CHECK_S),
            )
            self.scan_summary = {**scan.summary(), "producers_delivered": delivered}
            expected = {eid for eid, t in truth.items() if t.committed}
            if not self._wait_drained(expected, scan.end_offsets, timeout=self.budget(300 + 0.1 * cfg.episodes)):
                problems.append("timed out waiting for every episode to commit and offsets to reach the end")
            self.tally.dead_letters_unacked = sum(
                int(c.metrics().get("rlrec_dead_letters_pending", 0)) for c in self.alive()
            )
            if self.tally.dead_letters_unacked:
                problems.append(f"{self.tally.dead_letters_unacked} dead letters unacknowledged when the run ends")
            for c in self.alive():
                c.proc.send_signal(signal.SIGTERM)
            for c in self.consumers:
                try:
                    c.proc.wait(60)
                except subprocess.TimeoutExpired:
                    problems.append(f"consumer {c.name} did not stop on SIGTERM within 60 s")
                    c.proc.kill()
            self.say("consumers stopped; checking")
            decided = scan.decisions
            tail = scan_tail(self.broker.bootstrap_servers, self.topic, scan, timeout=self.budget(120, keep=60))
            self.scan_summary = {**scan.summary(), "producers_delivered": delivered}
            if tail:
                self.say(f"{tail} messages came after the topic scan ({scan.decisions - decided} consumers' decisions)")
            if scan.messages - scan.decisions != delivered:
                problems.append(
                    f"after the consumers stopped the topic holds {scan.messages} messages ({scan.decisions} "
                    f"consumers' decisions), producers delivered {delivered}"
                )
            dlq = scan_dead_letters(self.broker.bootstrap_servers, self.topic, cfg.partitions)
            offsets = committed_offsets(self.broker.bootstrap_servers, self.group, self.topic, cfg.partitions)
            verdict = check(self.storage, truth, scan, dlq, offsets)
            verify_rc = subprocess.run(
                [sys.executable, "-m", "rlrec", "inspect", self.output, "--verify", "--json"],
                cwd=REPO,
                env=self.direct_env,
                capture_output=True,
            ).returncode
            if verify_rc != 0:
                problems.append(f"rlrec inspect --verify exited with {verify_rc}")
            if self.tally.kills_skipped:
                problems.append(f"{self.tally.kills_skipped} kill(s) found no eligible consumer")
            if self.tally.foreign_outputs and not self.tally.foreign_ahead:
                problems.append(
                    "no consumer of another output left the group's offsets ahead of the store's position: "
                    "the phase tested nothing"
                )
        except Exception as e:
            problems.append(f"chaos run failed: {type(e).__name__}: {e}")
            self.console.print_exception()
        finally:
            self._stop_stack()
        return self._report(verdict, problems, verify_rc)

    def _report(self, v: Verdict | None, problems: list[str], verify_rc: int | None) -> int:
        elapsed = time.monotonic() - self.t0
        if v is None:  # the run broke before the check: nothing is known
            v = Verdict(lost=-1, duplicated=-1)
        problems = problems + v.problems  # the run's own first: a short topic scan explains the verdict's
        ok = v.ok and not problems and verify_rc == 0
        t = Table(title=f"chaos run (seed {self.cfg.seed})")
        t.add_column("metric")
        t.add_column("value", justify="right")
        tl = self.tally
        rows = [
            ("episodes produced (empty ones: dead-lettered)", f"{self.produced} ({self.produced - v.expected})"),
            ("episodes committed", v.committed),
            ("shards", v.shards),
            ("kills (kill -9)", tl.kills),
            ("rebalances (membership changes)", tl.rebalances),
            ("partition claims after the first", v.claims),
            ("storage fault windows (the first longer than 2 episode timeouts)", tl.storage_faults),
            ("consumers with a refused dead-letter topic", tl.dlq_faults),
            ("consumers of another output with the same group id", tl.foreign_outputs),
            ("  partitions they left with the group's offset ahead of the store's position", tl.foreign_ahead),
            ("offsets a restart reads again (store position to partition end)", v.replay_tail),
            ("broker restarts", tl.broker_restarts),
            ("consumers restarted after a stalled group (Tansu's coordinator)", tl.stall_restarts),
            (
                "delayed rewards applied / dead-lettered late / both",
                f"{v.rewards_applied} / {v.rewards_dead_lettered} / {v.rewards_both}",
            ),
            ("dead letters", ", ".join(f"{k}={n}" for k, n in sorted(v.dead_letters.items())) or "0"),
            ("  of which re-sent events after an earlier owner's commit", v.resent_dead_lettered),
            ("mismatched", v.mismatched),
            ("inspect --verify", "ok" if verify_rc == 0 else f"rc={verify_rc}"),
            ("lost", v.lost),
            ("duplicated", v.duplicated),
            ("dead letters unacknowledged at the end", tl.dead_letters_unacked),
            ("time", f"{elapsed:.0f}s"),
        ]
        for k, val in rows:
            t.add_row(k, str(val))
        self.console.print(t)
        for p in problems[:40]:
            self.console.print(Text.assemble(("problem: ", "red"), p))
        result = {
            "config": asdict(self.cfg),
            "tally": asdict(tl),
            "verdict": {**asdict(v), "problems": problems[:200]},
            "verify_rc": verify_rc,
            "scan": self.scan_summary,
            "seconds": round(elapsed, 1),
            "ok": ok,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        (self.work / "result.json").write_text(json.dumps(result, indent=2, default=str))
        self.console.print(f"logs and result.json in {self.work}")
        self.console.file.flush()
        print(f"lost={v.lost} duplicated={v.duplicated} dead_letters_unacked={tl.dead_letters_unacked}", flush=True)
        return 0 if ok else 1

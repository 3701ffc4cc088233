"""`rlrec demo`: the closed loop on one machine.

Starts an embedded broker (Tansu, memory://) and local storage (the data dir, or a LocalS3
server with ``--s3``), then as child processes: the consumer (`rlrec consume`), the continuous
trainer (`rlrec train`, BC on every committed shard, with a promotion gate) and N simulated
deployed policies (`rlrec.demo.policy_process`). The policies start as the scripted CartPole
expert with epsilon-noise (policy version 0) and switch to each version the trainer publishes.
The gate publishes a version only if its evaluation is not worse than the deployed one (the
expert's measured return before the first publication); the expert's data stays in the
training data for good (no replay window), so the loop can improve and cannot collapse.

Data dir::

    demo.json  metrics.jsonl  shards/  trainer/{metrics.jsonl,checkpoints,policies}  keys/  logs/  report.html

``keys/`` holds the policy-signing key pair, generated on first start: the trainer signs every
published version with ``policy-signing.key``, the policy processes load only versions signed by
``policy-signing.pub``.

Ends at ``--duration``, at ``--until-return R`` (a published version evaluated >= R is in use by
a policy process) or on Ctrl-C; children are stopped in order (policies, then consumer and
trainer: SIGTERM, wait, SIGKILL only after a timeout), so everything recorded is committed.
Exit code: 0 (finished; target reached if one was set), 1 (a component failed, or the
target was not reached in time), 130 (Ctrl-C) / 143 (SIGTERM) after a clean stop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from rlrec.commands._common import shell_command
from rlrec.demo.dashboard import Collector, Dashboard, Snapshot, write_line
from rlrec.demo.datadir import DataDir, DataDirError, committed_by_version
from rlrec.demo.policy_process import POLICY_ID as POLICY_CHANNEL  # what the trainer publishes for
from rlrec.demo.processes import Child, stop_all
from rlrec.local import ray_on_loopback
from rlrec.options import check_choices, option

__all__ = ["DemoConfig", "run_demo"]

TOPIC = "rlrec.transitions"
#: FQE gradient steps of the demo trainer's --ope-report estimates
DEMO_FQE_STEPS = 1000
S3_BUCKET = "rlrec-demo"


@dataclass
class DemoConfig:
    """How `rlrec demo` runs; the fields declared with `option` are the command's options.

    Example:
        >>> DemoConfig(algo="marwil").algo
        'MARWIL'
    """

    data_dir: str = option(
        "demo-data",
        help="where shards, checkpoints, metrics, logs and the report go; a previous demo run there is replaced",
    )
    duration: float = option(600.0, help="stop after this many seconds")
    until_return: float = option(
        400.0, help="stop once a published policy evaluated at >= R is in use by a policy process (0: no target)"
    )
    settle_s: float = option(
        15.0, help="once the target is in use, keep running this long so the deployed returns show"
    )
    policies: int = option(3, name="policy-processes", help="simulated deployed policies (one process each)")
    steps_per_s: float = option(800.0, help="throttle of each policy process, env steps per second")
    epsilon: float = option(0.3, help="random-action probability of the scripted expert")
    policy_epsilon: float = option(0.05, help="random-action probability when acting with a published policy")
    s3: bool = option(
        False,
        help="put the shards on an embedded S3 server (moto) instead of the data dir (copied into the data dir at the end)",
    )
    algo: Literal["BC", "MARWIL"] = option("BC", normalize=str.upper, help="the trainer's algorithm")
    promotion_gate: bool = option(
        True,
        name="gate",
        help="publish a version only if its evaluation is not worse than the deployed one "
        "(--no-gate: publish every checkpoint's policy)",
    )
    canary_share: float = option(
        0.0,
        help="the policy processes opt in to a canary with this share of their episodes, and the gate puts "
        "each version it passes on canary (rlrec train --rollout canary): it is promoted or rolled back on "
        "the test of both arms' discounted returns, which the dashboard shows (0: no canary; at most 0.5)",
    )
    ope_report: bool = option(
        True,
        help="the trainer also estimates each candidate off-policy on held-out episodes (no gating): the "
        "dashboard and the report show the estimate beside the candidate's true discounted return",
    )
    checkpoint_interval: int = option(3, help="trainer iterations between candidate policies")
    trainer_cpus: int = option(2, help="CPUs for the trainer's Ray")
    seed: int = option(0, help="seed of the policies, the trainer and the evaluation")
    live: bool | None = option(
        None,
        help="the live dashboard (default: when stdout is a terminal); --no-live prints a compact line "
        "every few seconds",
    )
    report: bool = option(True, help="write report.html at the end")
    promotion_episodes: int = 10
    train_batch_size: int = 512
    lr: float = 1e-3
    max_file_age_s: float = 2.0  # consumer: a finished episode is committed within this
    partitions: int = 4
    refresh_s: float = 1.0
    line_every_s: float = 5.0
    extra_trainer_args: list = field(default_factory=list)

    def __post_init__(self) -> None:
        check_choices(self)
        if self.policies < 1 or self.checkpoint_interval < 1 or self.trainer_cpus < 1:
            raise ValueError("--policy-processes, --checkpoint-interval and --trainer-cpus must be at least 1")
        if self.duration <= 0:
            raise ValueError(f"--duration must be positive, got {self.duration:g}")
        if not (0.0 <= self.epsilon <= 1.0 and 0.0 <= self.policy_epsilon <= 1.0):
            raise ValueError("--epsilon and --policy-epsilon must be in [0, 1]")
        if not 0.0 <= self.canary_share <= 0.5:
            raise ValueError(f"--canary-share must be in [0, 0.5], got {self.canary_share:g}")
        if self.canary_share and not self.promotion_gate:
            raise ValueError(
                "--canary-share needs the promotion gate (a canary is what the gate passes): drop --no-gate"
            )


def canary_trainer_args(share: float) -> list[str]:
    """The trainer's canary options for the demo's CartPole services (none when `share` is 0):
    the test counts the share the policy processes serve, every discounted CartPole return lies in
    [0, 100] (reward 1 a step, gamma 0.99), and an episode (under a second at the demo's pace) is
    committed within 20 s.

    Args:
        share: the policy processes' ``--canary-fraction`` (the demo's ``--canary-share``).

    Example:
        >>> canary_trainer_args(0.0), canary_trainer_args(0.3)[:4]
        ([], ['--rollout', 'canary', '--canary-share', '0.3'])
    """
    if not share:
        return []
    return [
        "--rollout",
        "canary",
        "--canary-share",
        repr(float(share)),  # the exact value the policy processes get (str(share)), never rounded
        "--canary-return-min",
        "0",
        "--canary-return-max",
        "100",
        "--canary-episode-max-s",
        "20",
        "--canary-max-wait-s",
        "120",
    ]


def expert_return(epsilon: float, episodes: int = 20, seed: int = 10_000) -> float:
    """Mean return of the scripted expert with this epsilon (the gate's baseline)."""
    import gymnasium as gym
    import numpy as np

    from rlrec.commands.record_demo import scripted_action

    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    total = 0.0
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        done = False
        while not done:
            obs, r, te, tr, _ = env.step(scripted_action(obs, rng, epsilon)[0])
            total += float(r)
            done = te or tr
    env.close()
    return total / episodes


class _Signals:
    """First SIGINT/SIGTERM: stop cleanly. Second: stop waiting for children (kill them)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.hurry = threading.Event()
        self.signum: int | None = None
        self._old = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, h in self._old.items():
            signal.signal(sig, h)

    def _handle(self, signum, _frame) -> None:
        if self.stop.is_set():
            self.hurry.set()
        self.signum = self.signum or signum
        self.stop.set()


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    return ray_on_loopback(env)  # the demo's Ray (trainer) listens on 127.0.0.1 only


def _py() -> list[str]:
    return [sys.executable, "-m"]


class Demo:
    """One demo run (see module docstring). `run()` returns the exit code."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.dd = DataDir(cfg.data_dir)
        self.signals = _Signals()
        self.broker = None
        self.s3 = None
        self.consumer: Child | None = None
        self.trainer: Child | None = None
        self.policies: list[Child] = []
        self.collector: Collector | None = None
        self.desc: dict = {}
        self.shards_uri = self.dd.path("shards")
        self.trainer_dir = self.dd.path("trainer")
        self.env: dict[str, str] = {}
        self._target_version = 0
        self.outcome = {"reason": None, "failed": None, "target_reached_s": None, "target_used_s": None}

    # ------------------------------------------------------------------ start
    def _start_storage_and_broker(self, say) -> str:
        from rlrec.consumer.topics import create_topics, dlq_topic_name
        from rlrec.local import LocalBroker, LocalS3

        if self.cfg.s3:
            self.s3 = LocalS3().start()
            self.s3.create_bucket(S3_BUCKET)
            self.env.update(self.s3.env())
            os.environ.update(self.s3.env())  # for this process (summary, snapshot)
            self.shards_uri = f"s3://{S3_BUCKET}/shards"
            say(f"local S3 server: {self.s3.endpoint_url}  (shards at {self.shards_uri})")
        self.broker = LocalBroker("memory")
        self.broker.start()
        bootstrap = self.broker.bootstrap_servers
        create_topics(bootstrap, {TOPIC: self.cfg.partitions, dlq_topic_name(TOPIC): 1}, timeout=30)
        say(f"embedded broker: {bootstrap} (memory://), topic {TOPIC}")
        return bootstrap

    def _keys(self) -> tuple[str, str]:
        """The demo's policy-signing key pair, generated on first start ({data_dir}/keys)."""
        from rlrec.trainer.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_keys

        d = self.dd.path("keys")
        priv, pub = os.path.join(d, PRIVATE_KEY_FILE), os.path.join(d, PUBLIC_KEY_FILE)
        if not (os.path.exists(priv) and os.path.exists(pub)):
            generate_keys(d, overwrite=True)
        return priv, pub

    def _start_children(self, bootstrap: str, baseline: float | None) -> None:
        from rlrec.local import free_port

        cfg = self.cfg
        env = _child_env(self.env)
        logs = self.dd.path("logs")
        signing_key, public_key = self._keys()
        self.consumer_port = free_port()
        self.consumer = Child(
            "consumer",
            [
                *_py(),
                "rlrec",
                "consume",
                "--bootstrap-servers",
                bootstrap,
                "--topic",
                TOPIC,
                "--output",
                self.shards_uri,
                "--group-id",
                "rlrec-demo",
                "--partitions",
                str(cfg.partitions),
                "--no-create-topics",
                "--max-file-age-s",
                str(cfg.max_file_age_s),
                "--max-episodes-per-file",
                "200",
                "--commit-interval-s",
                "2",
                "--metrics-port",
                str(self.consumer_port),
            ],
            os.path.join(logs, "consumer.log"),
            env,
        ).start()
        targs = [
            "rlrec",
            "train",
            "--input",
            self.shards_uri,
            "--checkpoint-dir",
            self.trainer_dir,
            "--algo",
            cfg.algo,
            "--env",
            "CartPole-v1",
            "--checkpoint-interval",
            str(cfg.checkpoint_interval),
            "--num-cpus",
            str(cfg.trainer_cpus),
            "--map-batches-concurrency",
            "1",
            "--min-time-s-per-iteration",
            "1",
            "--seed",
            str(cfg.seed),
            "--algo-config",
            f"lr={cfg.lr}",
            "--algo-config",
            f"train_batch_size_per_learner={cfg.train_batch_size}",
            "--signing-key",
            signing_key,
            "--channel",
            POLICY_CHANNEL,
        ]
        if cfg.promotion_gate:
            targs += ["--promotion-gate", "--promotion-episodes", str(cfg.promotion_episodes)]
            if baseline is not None:
                targs += ["--promotion-baseline", f"{baseline:.3f}"]
            targs += canary_trainer_args(cfg.canary_share)
        else:  # every checkpoint's policy published, as asked (the trainer's default gates them)
            targs += ["--promotion-gate", "off", "--eval-interval", str(cfg.checkpoint_interval)]
        if cfg.ope_report:  # fewer FQE steps than the default (shared CPUs), a short wait at the stop
            targs += ["--ope-report", "--fqe-steps", str(DEMO_FQE_STEPS), "--evaluation-wait-s", "10"]
        self.trainer = Child(
            "trainer", _py() + targs + list(cfg.extra_trainer_args), os.path.join(logs, "trainer.log"), env
        ).start()
        penv = dict(env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # torch: one thread per policy
        for i in range(cfg.policies):
            self.policies.append(
                Child(
                    f"policy-{i}",
                    [
                        *_py(),
                        "rlrec.demo.policy_process",
                        "--bootstrap-servers",
                        bootstrap,
                        "--topic",
                        TOPIC,
                        "--policies",
                        os.path.join(self.trainer_dir, "policies"),
                        "--public-key",
                        public_key,
                        "--channel",
                        POLICY_CHANNEL,
                        "--index",
                        str(i),
                        "--epsilon",
                        str(cfg.epsilon),
                        "--policy-epsilon",
                        str(cfg.policy_epsilon),
                        "--steps-per-s",
                        str(cfg.steps_per_s),
                        "--seed",
                        str(cfg.seed * 1000 + i),
                        "--canary-fraction",
                        str(cfg.canary_share),
                    ],
                    os.path.join(logs, f"policy-{i}.log"),
                    penv,
                ).start()
            )

    def _describe(self, ended: float | None = None, **extra) -> None:
        from rlrec.consumer.topics import dlq_topic_name

        if not self.desc:
            self.desc = {
                "started": time.time(),
                "ended": None,
                "args": asdict(self.cfg),
                "shards_uri": self.shards_uri,
                "trainer_dir": self.trainer_dir,
                "s3_endpoint": self.s3.endpoint_url if self.s3 is not None else None,
                "topic": TOPIC,
                "dlq_topic": dlq_topic_name(TOPIC),
                "policies": self.cfg.policies,
            }
        self.desc["ended"] = ended
        self.desc.update(extra)
        self.dd.write_description(self.desc)

    # ------------------------------------------------------------------ loop
    def _target(self, snap: Snapshot, t0: float) -> bool:
        """--until-return: a published version evaluated >= R, and a policy process acting with it."""
        r = self.cfg.until_return
        if r <= 0:
            return False
        tail = self.collector.trainer
        if self.outcome["target_reached_s"] is None:
            good = tail.deployed_return if self.cfg.promotion_gate else tail.eval_return
            if good is not None and good >= r and tail.published_version:
                self.outcome["target_reached_s"] = round(time.time() - t0, 1)
                self._target_version = tail.published_version
        deployed = snap.policy_version is not None and snap.policy_version >= self._target_version
        # with --canary-share a version that passed the gate is served on canary first: in use there too
        on_canary = bool(self.cfg.canary_share) and self._target_version in (snap.policy_versions_in_use or ())
        if (
            self.outcome["target_reached_s"] is not None
            and self.outcome["target_used_s"] is None
            and (deployed or on_canary)
        ):
            self.outcome["target_used_s"] = round(time.time() - t0, 1)
            self.outcome["target_on_canary"] = not deployed
            if self.cfg.settle_s > 0:
                self.board.note = (
                    f"evaluation return >= {r:g} in use: showing the deployed policies for {self.cfg.settle_s:g} s more"
                )
        used = self.outcome["target_used_s"]
        return used is not None and time.time() - t0 >= used + self.cfg.settle_s

    def _failed_child(self) -> Child | None:
        for c in [self.consumer, self.trainer, *self.policies]:
            if c is not None and not c.alive():
                return c
        return None

    def _loop(self, board: Dashboard, t0: float) -> None:
        cfg = self.cfg
        metrics_path = self.dd.path("metrics.jsonl")
        while True:
            snap = self.collector.snapshot()
            write_line(metrics_path, snap)
            board.show(snap)
            self.last_snap = snap
            if self.signals.stop.is_set():
                self.outcome["reason"] = signal.Signals(self.signals.signum).name if self.signals.signum else "stop"
                return
            if self._target(snap, t0):
                self.outcome["reason"] = f"evaluation return >= {cfg.until_return:g} reached and in use"
                return
            if time.time() - t0 >= cfg.duration:
                self.outcome["reason"] = f"--duration {cfg.duration:g} s"
                return
            dead = self._failed_child()
            if dead is not None:
                self.outcome["reason"] = f"{dead.name} exited with code {dead.returncode}"
                self.outcome["failed"] = dead.name
                return
            self.signals.stop.wait(cfg.refresh_s)

    # ------------------------------------------------------------------ stop
    def _stop_children(self, say) -> list[str]:
        killed = []
        hurry = self.signals.hurry
        if self.policies:
            say("stopping the policies (each finishes its episode and flushes its recorder) ...")
            killed += stop_all(self.policies, 30, say, hurry)
            self._drain(say)
        rest = [c for c in (self.consumer, self.trainer) if c is not None]
        if rest:
            say("stopping the consumer (commits every finished episode) and the trainer (checkpoints) ...")
            killed += stop_all(rest, 120, say, hurry)
        return killed

    def _drain(self, say, timeout: float = 60.0) -> None:
        """Before the consumer stops: wait until it has committed every episode the (stopped)
        policies played, so that Ctrl-C leaves nothing unread in Kafka (a second Ctrl-C or
        `timeout` s stop the wait; what is left then is committed by the next run)."""
        if self.collector is None or self.consumer is None:
            return
        played = sum(int(c.status.get("episodes", 0)) for c in self.policies)
        deadline = time.monotonic() + timeout
        committed = self.collector.snapshot().episodes_committed
        while committed < played and time.monotonic() < deadline and not self.signals.hurry.is_set():
            if self.consumer.proc is None or self.consumer.proc.poll() is not None:
                break
            time.sleep(0.2)
            committed = self.collector.snapshot().episodes_committed
        if committed < played:
            say(
                f"the consumer committed {committed:,} of the {played:,} episodes played; stopping it anyway "
                "(the rest stays in Kafka for the next run)"
            )

    def _stop_stack(self) -> None:
        import gc

        gc.collect()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None

    def _snapshot_s3(self, say) -> None:
        """The local S3 server keeps data in memory: copy the shards into the data dir first."""
        import pyarrow.fs as pafs

        local = self.dd.path("shards")
        try:
            pafs.copy_files(self.shards_uri, local)
        except Exception as e:
            say(f"could not copy the shards from S3: {e}")
            return
        say(f"copied the shards from {self.shards_uri} to {local} (the local S3 server keeps them in memory only)")
        self.desc["shards_copied_from"] = self.shards_uri
        self.shards_uri = self.desc["shards_uri"] = local

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        cfg = self.cfg
        say = print
        say("rlrec demo: Ctrl-C stops it cleanly (a second Ctrl-C kills the processes instead of waiting)")
        try:
            if self.dd.prepare():
                say(f"cleared the previous demo run in {self.dd.root}")
        except (DataDirError, OSError) as e:
            print(f"rlrec demo: {e}", file=sys.stderr)
            return 2
        self.signals.install()
        board = None
        rc = 0
        t0 = time.time()
        self.last_snap = None
        try:
            baseline = expert_return(cfg.epsilon) if cfg.promotion_gate else None
            say(
                f"scripted expert (epsilon {cfg.epsilon:g}): mean return {baseline:.1f} over 20 episodes "
                "= what a published policy must not fall below"
                if baseline is not None
                else "no promotion gate"
            )
            bootstrap = self._start_storage_and_broker(say)
            self._describe(baseline_return=baseline)
            if self.signals.stop.is_set():
                raise KeyboardInterrupt
            self._start_children(bootstrap, baseline)
            self._describe(processes={c.name: c.pid for c in [self.consumer, self.trainer, *self.policies]})
            say(f"started the consumer, the trainer and {cfg.policies} policies; logs in {self.dd.path('logs')}")
            self.collector = Collector(
                self.policies, self.consumer_port, os.path.join(self.trainer_dir, "metrics.jsonl")
            )
            live = cfg.live if cfg.live is not None else sys.stdout.isatty()
            target = f", until evaluation return >= {cfg.until_return:g}" if cfg.until_return > 0 else ""
            board = Dashboard(
                f"rlrec demo  (Ctrl-C stops it cleanly; at most {cfg.duration:g} s{target})", live, cfg.line_every_s
            )
            self.board = board
            with board:
                self._loop(board, t0)
        except KeyboardInterrupt:
            self.outcome["reason"] = "interrupted during start-up"
        except Exception as e:
            self.outcome["reason"] = f"error: {e!r}"
            self.outcome["failed"] = "demo"
        finally:
            say(f"stopping ({self.outcome['reason']}) ...")
            killed = self._stop_children(say)
            try:
                self._stop_stack()
            except Exception as e:
                say(f"stopping the broker: {e}")
            summary = None
            try:
                summary = committed_by_version(self.shards_uri)
            except Exception as e:
                say(f"could not read the manifest: {e}")
            if self.last_snap is not None:  # final line: after the consumer's last commit
                final = self.collector.snapshot()
                if summary is not None:
                    final.episodes_committed, final.shards_committed = summary["episodes"], summary["shards"]
                    summary["episodes_played"] = sum(int(c.status.get("episodes", 0)) for c in self.policies)
                    summary["steps_played"] = final.steps_published
                write_line(self.dd.path("metrics.jsonl"), final)
            if self.s3 is not None and self.desc:
                self._snapshot_s3(say)
            if self.s3 is not None:
                self.s3.stop()
            if self.desc:
                self._describe(time.time(), outcome=self.outcome, killed=killed, summary=summary)
            self.signals.restore()
        report = self._report(say) if cfg.report and self.desc else None
        self._print_end(summary, report, time.time() - t0)
        if self.outcome["failed"]:
            for c in [self.consumer, self.trainer, *self.policies]:
                if c is not None and c.name == self.outcome["failed"]:
                    print(f"--- last lines of {c.log_path}:\n{c.log_tail()}", file=sys.stderr)
            rc = 1
        elif self.signals.signum is not None:
            rc = 128 + self.signals.signum
        elif cfg.until_return > 0 and self.outcome["target_used_s"] is None:
            print(
                f"rlrec demo: the evaluation return did not reach {cfg.until_return:g} within {cfg.duration:g} s",
                file=sys.stderr,
            )
            rc = 1
        return rc

    def _report(self, say) -> str | None:
        import importlib.util
        import subprocess

        if importlib.util.find_spec("rlrec.commands.report") is None:
            return None
        say("writing the report ...")
        try:
            r = subprocess.run(
                [*_py(), "rlrec", "report", self.dd.root],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=300,
                env=_child_env({}),
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            say(f"the report failed: {e}")
            return None
        path = self.dd.path("report.html")
        if r.returncode != 0 or not os.path.exists(path):
            say(f"the report failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-500:]}")
            return None
        return path

    def _print_end(self, summary: dict | None, report: str | None, elapsed: float) -> None:
        o = self.outcome
        print(f"\nrlrec demo ended after {elapsed:.0f} s: {o['reason']}")
        if o["target_reached_s"] is not None:
            print(
                f"  evaluation return >= {self.cfg.until_return:g}: published after {o['target_reached_s']} s, "
                f"in use by a policy after {o['target_used_s']} s"
                + (" (on canary, not promoted yet)" if o.get("target_on_canary") else "")
            )
        tail = self.collector.trainer if self.collector is not None else None
        if tail is not None and tail.last:
            ret = tail.deployed_return if tail.deployed_return is not None else tail.eval_return
            print(
                f"  trainer: {tail.last.get('iteration')} iterations, {tail.last.get('timesteps_trained'):,} "
                f"timesteps trained, published v{tail.published_version or 0} "
                f"(evaluation return {'-' if ret is None else f'{ret:.1f}'}), "
                f"{tail.promotions} promoted / {tail.rejections} held back by the gate"
            )
        if summary is not None:
            print(
                f"  committed: {summary['episodes']:,} episodes, {summary['steps']:,} steps in "
                f"{summary['shards']:,} shards (the policies played {summary.get('episodes_played', 0):,} "
                f"episodes, {summary.get('steps_played', 0):,} steps)"
            )
            for v, d in summary["by_version"].items():
                who = "scripted expert" if v == 0 else f"trainer's v{v}"
                print(f"    policy version {v} ({who}): {d['episodes']:,} episodes, mean return {d['return_mean']:.1f}")
        root = self.dd.root
        print(
            f"  data:        {self.shards_uri}\n  checkpoints: {os.path.join(self.trainer_dir, 'checkpoints')}"
            f"\n  policies:    {os.path.join(self.trainer_dir, 'policies')}\n  metrics:     "
            f"{os.path.join(root, 'metrics.jsonl')}, {os.path.join(self.trainer_dir, 'metrics.jsonl')}"
            f"\n  logs:        {os.path.join(root, 'logs')}"
        )
        if report:
            print(f"  report:      {report}")
        cli = shell_command()
        print(f"inspect:  {cli} inspect {self.shards_uri} --verify\nreport:   {cli} report {root}")


def run_demo(cfg: DemoConfig) -> int:
    return Demo(cfg).run()

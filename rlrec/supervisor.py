"""Several consumer processes of one group on one machine: `rlrec consume --processes N`.

Python runs one thread of a process at a time, so one `RecorderConsumer` uses about one core
(plus its encoding thread's Parquet and zstd work). On a machine with more cores, N processes in
one consumer group split the partitions and use N: each child is an ordinary `RecorderConsumer`
with the same group id, so every guarantee of one process holds unchanged (docs/GUARANTEES.md:
a partition has one owner, a rebalance fences the old one, episodes are committed exactly once).
This module only starts, watches and stops them (application layer: it sets up logging).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from rlrec.consumer.service import ConsumerConfig
from rlrec.store.retry import RetryPolicy

log = logging.getLogger(__name__)

#: a child that exits with this code met an error no restart can fix (e.g. the store ignores
#: create-once writes); the supervisor stops the others and exits with it
EXIT_CONFIG_ERROR = 2
#: the supervisor's exit code when a child keeps crashing (`RESTARTS.attempts`)
EXIT_CRASHING = 1
#: a child that exits with this code refused a gap in the store (`rlrec.consumer.resume.GapError`,
#: its one line logged): a sibling given the partition would refuse it too, so the supervisor
#: stops all and exits with EXIT_GAP_REFUSED (1, as `rlrec consume` without --processes)
EXIT_GAP = 3
EXIT_GAP_REFUSED = 1
#: how long a child waits for its siblings' imports before it subscribes anyway
START_GATE_S = 120.0
#: a child that ran this long before it crashed counts as having worked (its next crash is a first)
STABLE_AFTER_S = 60.0
#: restarts after quick crashes: 1 s, then 2 s; the third crash in a row, each within
#: STABLE_AFTER_S of its start, means the child is broken (a bad setting, a port in use): the
#: supervisor stops all and exits with EXIT_CRASHING. No jitter: one supervisor restarts one
#: child, there is no crowd of clients to spread out, and the log reads exactly.
RESTARTS = RetryPolicy(attempts=3, base_delay=1.0, max_delay=60.0, jitter=0)
#: how often a child checks that its supervisor still lives (an orphan stops gracefully)
PARENT_CHECK_S = 1.0


def split_config(config: ConsumerConfig, processes: int, index: int) -> ConsumerConfig:
    """Child `index`'s config. Memory budgets are the command's: each of `processes` children
    gets `max_open_bytes`, `max_buffered_bytes` and `max_open_episodes` divided by `processes`
    (rounded down, at least 1), so together they hold no more than configured; one episode's
    `max_episode_bytes` is not split (`check_split` refuses a share below it). Child i serves
    metrics on `metrics_port + i` (0: each picks a free port). Topics are created once, by the
    supervisor."""
    port = config.metrics_port
    return dataclasses.replace(
        config,
        max_open_bytes=max(1, config.max_open_bytes // processes),
        max_buffered_bytes=max(1, config.max_buffered_bytes // processes),
        max_open_episodes=max(1, config.max_open_episodes // processes),
        metrics_port=port + index if port else port,
        create_topics=False,
    )


def check_split(config: ConsumerConfig, processes: int) -> None:
    """Raise ValueError if a child's share of the open-episode budget could not hold one
    episode of `max_episode_bytes` (a single process would commit it; a child would evict it)."""
    share = config.max_open_bytes // processes
    if share < config.max_episode_bytes:
        raise ValueError(
            f"--max-open-bytes {config.max_open_bytes} split between {processes} processes leaves {share} "
            f"each, less than one episode's --max-episode-bytes {config.max_episode_bytes}: raise "
            "--max-open-bytes or lower --processes"
        )


@dataclass
class _Child:
    index: int
    process: Any  # multiprocessing.Process
    started: float
    crashes: int = 0  # quick crashes in a row before this start
    gate: Connection | None = None  # the supervisor's end of the start gate (None: started alone)


def _watch_parent(parent: int, stop) -> None:
    """Stop the child gracefully once its supervisor is gone (kill -9 of the supervisor leaves
    no consumer running unsupervised)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    log.error("the supervisor (pid %d) is gone; stopping", parent)
    stop()


def _child_main(
    config: ConsumerConfig,
    index: int,
    max_seconds: float | None,
    logging_args: tuple,
    gate: Connection | None,
    parent: int,
) -> None:
    """One child: log set-up, imports, the start gate (every sibling has imported: the group
    assigns once instead of rebalancing for each late joiner), then an ordinary consumer run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which says SIGTERM
    from rlrec.commands.consume import freeze_startup_objects
    from rlrec.consumer.resume import GapError
    from rlrec.consumer.service import RecorderConsumer
    from rlrec.logs import setup_logging
    from rlrec.store.storage import ConditionalWritesError

    setup_logging(*logging_args, worker=index)
    consumer = RecorderConsumer(config)
    signal.signal(signal.SIGTERM, consumer.stop)
    threading.Thread(target=_watch_parent, args=(parent, consumer.stop), daemon=True, name="rlrec-parent").start()
    freeze_startup_objects()
    if gate is not None:
        try:
            gate.send("ready")
            if not gate.poll(START_GATE_S):  # "go", or the supervisor is gone (EOF)
                log.warning("worker %d: siblings not ready after %.0f s; subscribing anyway", index, START_GATE_S)
        except (EOFError, OSError):
            pass
        gate.close()
    try:
        consumer.run(max_seconds=max_seconds, install_signals=False)
    except ConditionalWritesError as e:
        log.error("%s", e)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except GapError:  # logged by the consumer, in one line; the supervisor stops the others
        raise SystemExit(EXIT_GAP) from None


class ConsumerProcesses:
    """Runs `processes` consumer processes of one group and keeps them running.

    Guarantees: each child is a complete `RecorderConsumer` (exactly-once, fencing and dead
    letters hold per process as for separate `rlrec consume` commands) with a 1/N share of the
    memory budgets; SIGTERM or SIGINT to the supervisor reaches every child as SIGTERM, whenever
    it arrives, and the supervisor returns once all have exited; a child that dies (a crash,
    kill -9, the OOM killer) is started again after a backoff while the group hands its
    partitions to the others, until it crashes `RESTARTS.attempts` times in a row soon after
    starting; children stop gracefully if the supervisor is killed. `run()` returns 0 when every
    child ended by itself (`max_seconds`) or on a signal, `EXIT_CONFIG_ERROR` if a child met a
    configuration error, `EXIT_GAP_REFUSED` if a child refused a gap in the store (all stop at
    once: no restarts), `EXIT_CRASHING` if a child kept crashing or crashed too late to restart.
    """

    def __init__(
        self,
        config: ConsumerConfig,
        processes: int,
        max_seconds: float | None = None,
        logging_args: tuple = ("text", "INFO"),
    ):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        check_split(config, processes)
        self.config = config
        self.processes = processes
        self.logging_args = logging_args
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process holding librdkafka threads
        self._children: dict[int, _Child] = {}
        self._restart_at: dict[int, tuple[float, int]] = {}  # index -> (when, quick crashes so far)
        self._gated: set[int] = set()  # children at the start gate that have said "ready"
        self._stopping = False
        self._deadline = None if max_seconds is None else time.time() + max_seconds
        self.rc = 0

    def stop(self, *_: Any) -> None:
        """Stop every child gracefully (SIGTERM) and start no more; run() returns once all have
        exited. Safe to call from a signal handler at any point of run()."""
        self._stopping = True
        self._restart_at.clear()
        for c in list(self._children.values()):
            self._terminate(c)

    @staticmethod
    def _terminate(c: _Child) -> None:
        if c.process.exitcode is None:
            try:
                os.kill(c.process.pid, signal.SIGTERM)
            except ProcessLookupError:  # it has just ended
                pass

    def _start(self, index: int, gated: bool, crashes: int = 0) -> None:
        left = None if self._deadline is None else max(0.0, self._deadline - time.time())
        cfg = split_config(self.config, self.processes, index)
        ours, theirs = self._ctx.Pipe() if gated else (None, None)
        p = self._ctx.Process(
            target=_child_main,
            args=(cfg, index, left, self.logging_args, theirs, os.getpid()),
            name=f"rlrec-consume-{index}",
        )
        p.start()
        if theirs is not None:
            theirs.close()
        child = _Child(index, p, time.time(), crashes, ours)
        self._children[index] = child
        log.info("worker %d started (pid %d)", index, p.pid)
        if self._stopping:  # a signal arrived while it was being started
            self._terminate(child)

    def run(self, install_signals: bool = True) -> int:
        """Start the children and supervise them until all have ended (see the class docstring
        for the exit code); raises `ConditionalWritesError` before starting any if the store
        ignores create-once writes."""
        from rlrec.store.storage import Storage, require_conditional_writes

        cfg = self.config
        require_conditional_writes(Storage.from_uri(cfg.output), allow_unfenced=cfg.allow_unfenced_storage)
        if cfg.create_topics:
            from rlrec.consumer.topics import client_settings, create_topics

            create_topics(
                cfg.bootstrap_servers,
                {cfg.topic: cfg.partitions, cfg.dlq: cfg.partitions},
                client_config=client_settings(cfg.kafka_config),
            )
        if install_signals:
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        try:
            for i in range(self.processes):
                if self._stopping:
                    break
                self._start(i, gated=self.processes > 1)
            while self._children or self._restart_at:
                gates = [c.gate for c in self._children.values() if c.gate is not None]
                wait([c.process.sentinel for c in self._children.values()] + gates, timeout=0.5)
                self._open_gate()
                self._reap(time.time())
                self._restart_due(time.time())
        finally:
            if self._children:  # an exception above: leave no child unsupervised
                self.stop()
                for c in self._children.values():
                    c.process.join(60)
        return self.rc

    def _open_gate(self) -> None:
        """Tell the children at the start gate to subscribe once every one has said "ready",
        one of them has ended (the others must not wait for it) or the supervisor is stopping."""
        waiting = {i: c for i, c in self._children.items() if c.gate is not None}
        if not waiting:
            return
        for i, c in waiting.items():
            try:
                if c.gate.poll():
                    c.gate.recv()
                    self._gated.add(i)
            except (EOFError, OSError):  # it ended before saying so
                self._gated.add(i)
        everyone = len(waiting) == self.processes and waiting.keys() <= self._gated
        if not (everyone or len(waiting) < self.processes or self._stopping):
            return
        for c in waiting.values():
            try:
                c.gate.send("go")
            except OSError:  # it has ended
                pass
            c.gate.close()
            c.gate = None

    def _reap(self, now: float) -> None:
        for i, c in list(self._children.items()):
            code = c.process.exitcode
            if code is None:
                continue
            del self._children[i]
            if c.gate is not None:
                c.gate.close()
            c.process.close()
            if code == 0 or self._stopping:
                log.info("worker %d exited (code %s)", i, code)
                continue
            if code == EXIT_CONFIG_ERROR:
                log.error("worker %d exited with code %d (configuration); stopping all", i, code)
                self.rc = self.rc or code
                self.stop()
                continue
            if code == EXIT_GAP:  # its line says which partition and what to do
                log.error("worker %d refused a gap in the store (above); stopping all", i)
                self.rc = self.rc or EXIT_GAP_REFUSED
                self.stop()
                continue
            what = f"signal {-code}" if code < 0 else f"exit code {code}"
            crashes = 1 if now - c.started >= STABLE_AFTER_S else c.crashes + 1
            if RESTARTS.gives_up(crashes):
                log.error("worker %d died (%s), %d times in a row soon after starting; stopping all", i, what, crashes)
                self.rc = self.rc or EXIT_CRASHING
                self.stop()
            elif self._deadline is not None and now >= self._deadline:
                log.error("worker %d died (%s) after --max-seconds; not restarted", i, what)
                self.rc = self.rc or EXIT_CRASHING
            else:
                delay = RESTARTS.delay(crashes - 1)
                log.error("worker %d died (%s); its partitions move to the others; restart in %.0f s", i, what, delay)
                self._restart_at[i] = (now + delay, crashes)

    def _restart_due(self, now: float) -> None:
        for i, (at, crashes) in list(self._restart_at.items()):  # stop() may clear it meanwhile
            if self._deadline is not None and now >= self._deadline:
                self._restart_at.pop(i, None)
            elif now >= at and not self._stopping:
                self._restart_at.pop(i, None)
                self._start(i, gated=False, crashes=crashes)

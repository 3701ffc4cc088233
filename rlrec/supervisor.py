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
from multiprocessing.connection import wait
from typing import Any

from rlrec.consumer.service import ConsumerConfig

log = logging.getLogger(__name__)

#: a child that exits with this code met an error no restart can fix (e.g. the store ignores
#: create-once writes); the supervisor stops the others and exits with it
EXIT_CONFIG_ERROR = 2
#: how long the children wait for each other before they subscribe (imports included)
START_BARRIER_S = 120.0
#: restart delay after a crash: doubles per quick crash, from the first to the last
RESTART_BACKOFF_S = (1.0, 60.0)
#: a child that ran this long before it crashed restarts after the shortest delay again
STABLE_AFTER_S = 60.0
#: how often a child checks that its supervisor still lives (an orphan stops gracefully)
PARENT_CHECK_S = 1.0


def split_config(config: ConsumerConfig, processes: int, index: int) -> ConsumerConfig:
    """Child `index`'s config. Memory budgets are the command's: each of `processes` children
    gets an equal share of `max_open_bytes`, `max_buffered_bytes` and `max_open_episodes` (one
    episode's `max_episode_bytes` is not split); child i serves metrics on `metrics_port + i`
    (0: each picks a free port). Topics are created once, by the supervisor."""
    port = config.metrics_port
    return dataclasses.replace(
        config,
        max_open_bytes=max(1, config.max_open_bytes // processes),
        max_buffered_bytes=max(1, config.max_buffered_bytes // processes),
        max_open_episodes=max(1, -(-config.max_open_episodes // processes)),
        metrics_port=port + index if port else port,
        create_topics=False,
    )


@dataclass
class _Child:
    index: int
    process: Any  # multiprocessing.Process
    started: float
    crashes: int = 0  # quick crashes in a row: the backoff's exponent


def _watch_parent(parent: int, stop) -> None:
    """Stop the child gracefully once its supervisor is gone (kill -9 of the supervisor leaves
    no consumer running unsupervised)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    log.error("the supervisor (pid %d) is gone; stopping", parent)
    stop()


def _child_main(
    config: ConsumerConfig, index: int, max_seconds: float | None, logging_args: tuple, barrier, parent: int
) -> None:
    """One child: log set-up, imports, wait for the siblings (one group assignment instead of a
    rebalance per late joiner), then an ordinary consumer run."""
    from rlrec.commands.consume import freeze_startup_objects
    from rlrec.consumer.service import RecorderConsumer
    from rlrec.logs import setup_logging
    from rlrec.store.storage import ConditionalWritesError

    setup_logging(*logging_args, worker=index)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which says SIGTERM
    consumer = RecorderConsumer(config)
    signal.signal(signal.SIGTERM, consumer.stop)
    threading.Thread(target=_watch_parent, args=(parent, consumer.stop), daemon=True, name="rlrec-parent").start()
    freeze_startup_objects()
    if barrier is not None:
        try:
            barrier.wait(START_BARRIER_S)
        except threading.BrokenBarrierError:  # a sibling died or is slow: a rebalance later, not an error
            log.warning("worker %d: not every sibling started; subscribing anyway", index)
    try:
        consumer.run(max_seconds=max_seconds, install_signals=False)
    except ConditionalWritesError as e:
        log.error("%s", e)
        raise SystemExit(EXIT_CONFIG_ERROR) from None


class ConsumerProcesses:
    """Runs `processes` consumer processes of one group and keeps them running.

    Guarantees: each child is a complete `RecorderConsumer` (exactly-once, fencing and dead
    letters hold per process as for separate `rlrec consume` commands); SIGTERM or SIGINT to the
    supervisor reaches every child as SIGTERM and the supervisor waits for their graceful stop;
    a child that dies (a crash, kill -9, the OOM killer) is started again after a backoff while
    the group hands its partitions to the others; a child that exits with `EXIT_CONFIG_ERROR`
    stops them all. `run()` returns 0 when every child ended by itself or on a signal, else the
    first fatal child's exit code.
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
        self.config = config
        self.processes = processes
        self.max_seconds = max_seconds
        self.logging_args = logging_args
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process holding librdkafka threads
        self._children: dict[int, _Child] = {}
        self._restart_at: dict[int, tuple[float, int]] = {}  # index -> (when, crashes so far)
        self._stopping = False
        self._deadline = None if max_seconds is None else time.time() + max_seconds
        self.restarts = 0

    def stop(self, *_: Any) -> None:
        """Stop every child gracefully (SIGTERM); run() returns once they have exited."""
        self._stopping = True
        self._restart_at.clear()
        for c in self._children.values():
            if c.process.is_alive():
                os.kill(c.process.pid, signal.SIGTERM)

    def _start(self, index: int, barrier, crashes: int = 0) -> None:
        left = None if self._deadline is None else max(0.0, self._deadline - time.time())
        cfg = split_config(self.config, self.processes, index)
        p = self._ctx.Process(
            target=_child_main,
            args=(cfg, index, left, self.logging_args, barrier, os.getpid()),
            name=f"rlrec-consume-{index}",
        )
        p.start()
        self._children[index] = _Child(index, p, time.time(), crashes)
        log.info("worker %d started (pid %d)", index, p.pid)

    def run(self, install_signals: bool = True) -> int:
        """Start the children and supervise them until all have ended; raises
        `ConditionalWritesError` before starting any if the store ignores create-once writes."""
        from rlrec.store.storage import Storage, require_conditional_writes

        require_conditional_writes(
            Storage.from_uri(self.config.output), allow_unfenced=self.config.allow_unfenced_storage
        )
        if self.config.create_topics:
            from rlrec.consumer.topics import client_settings, create_topics

            cfg = self.config
            create_topics(
                cfg.bootstrap_servers,
                {cfg.topic: cfg.partitions, cfg.dlq: cfg.partitions},
                client_config=client_settings(cfg.kafka_config),
            )
        if install_signals:
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        barrier = self._ctx.Barrier(self.processes) if self.processes > 1 else None
        for i in range(self.processes):
            self._start(i, barrier)
        rc = 0
        while self._children or self._restart_at:
            sentinels = [c.process.sentinel for c in self._children.values()]
            wait(sentinels, timeout=0.5)
            now = time.time()
            for i, c in list(self._children.items()):
                code = c.process.exitcode
                if code is None:
                    continue
                del self._children[i]
                c.process.close()
                if barrier is not None:
                    barrier.abort()  # siblings still waiting for this one start without it
                if code == 0 or self._stopping:
                    log.info("worker %d exited (code %s)", i, code)
                    continue
                if code == EXIT_CONFIG_ERROR:
                    log.error("worker %d exited with code %d (configuration); stopping all", i, code)
                    rc = rc or code
                    self.stop()
                    continue
                crashes = 0 if now - c.started >= STABLE_AFTER_S else c.crashes + 1
                delay = min(RESTART_BACKOFF_S[1], RESTART_BACKOFF_S[0] * 2 ** max(0, crashes - 1))
                what = f"signal {-code}" if code < 0 else f"exit code {code}"
                log.error("worker %d died (%s); its partitions move to the others; restart in %.0f s", i, what, delay)
                self._restart_at[i] = (now + delay, crashes)
            for i, (at, crashes) in list(self._restart_at.items()):
                if self._deadline is not None and now >= self._deadline:
                    del self._restart_at[i]
                elif now >= at and not self._stopping:
                    del self._restart_at[i]
                    self.restarts += 1
                    self._start(i, None, crashes)
        return rc

"""`python -m tests.chaos --episodes N --kills K`: see tests/chaos/__init__.py."""

from __future__ import annotations

import argparse
import signal
import sys

from tests.chaos.controller import Chaos, ChaosConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    p.add_argument("--episodes", type=int, required=True, help="episodes the producers publish in all")
    p.add_argument("--kills", type=int, required=True, help="kill -9s of consumers that hold partitions and committed")
    p.add_argument("--seed", type=int, default=1, help="seed of the timeline and the producers' episodes")
    p.add_argument("--producers", type=int, default=3, help="producer processes")
    p.add_argument("--partitions", type=int, default=8, help="partitions of the transitions topic")
    p.add_argument("--duration", type=float, default=None, help="seconds over which episodes are produced")
    p.add_argument("--joins", type=int, default=None, help="extra consumers started (default: kills/4, at least 1)")
    p.add_argument(
        "--storage-faults", type=int, default=None, help="storage fault windows (default: kills/6, at least 1)"
    )
    p.add_argument(
        "--dlq-faults", type=int, default=1, help="consumers that join with a refused dead-letter topic, then leave"
    )
    p.add_argument(
        "--foreign-outputs",
        type=int,
        default=1,
        help="consumers of another output with the same group id that join between two kills, then leave",
    )
    p.add_argument("--no-broker-restart", dest="broker_restart", action="store_false", help="don't restart the broker")
    p.add_argument("--workdir", default=None, help="where logs, ground truth and result.json go (default: a temp dir)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds the whole run may take: every wait is cut to fit (default: no limit)",
    )
    a = p.parse_args(argv)
    if a.episodes < 1 or a.kills < 0 or a.producers < 1:
        p.error("--episodes and --producers must be >= 1, --kills >= 0")
    if a.time_limit is not None and a.time_limit <= 0:
        p.error("--time-limit must be > 0")
    # SIGTERM unwinds the run, so its consumers, producers and servers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = ChaosConfig(
        episodes=a.episodes,
        kills=a.kills,
        seed=a.seed,
        producers=a.producers,
        partitions=a.partitions,
        duration=a.duration,
        joins=a.joins,
        storage_faults=a.storage_faults,
        dlq_faults=a.dlq_faults,
        foreign_outputs=a.foreign_outputs,
        broker_restart=a.broker_restart,
        workdir=a.workdir,
        time_limit=a.time_limit,
    )
    return Chaos(cfg).run()


if __name__ == "__main__":
    sys.exit(main())

"""`rlrec demo`: the whole closed loop on one machine (see rlrec/demo/run.py).

Embedded broker + local storage, N simulated deployed CartPole policies (a scripted expert with
epsilon-noise at first, then each policy version the trainer publishes), the consumer and the
continuous trainer, with a live dashboard. Everything goes under --data-dir.
"""

from __future__ import annotations

import argparse

from rlrec.demo.run import DemoConfig
from rlrec.options import OptionSet

#: the options of `rlrec demo`, declared on `DemoConfig`
OPTIONS = OptionSet("demo", DemoConfig)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the closed loop locally: policies -> Kafka -> consumer -> shards -> trainer -> policies",
        description="Start an embedded broker and local storage, then several simulated deployed CartPole "
        "policies (each a process publishing through EpisodeRecorder), the consumer and the continuous "
        "trainer, and show a live dashboard. The policies start as a scripted expert with epsilon-noise and "
        "switch to every policy version the trainer publishes; a promotion gate publishes a version only if "
        "its evaluation is not worse than the deployed one. Ends at --duration, at --until-return, or on "
        "Ctrl-C (clean stop: everything recorded is committed). Exit code 0 when finished (and the target "
        "reached, if set), 1 when a component failed or the target was not reached in time, 130 after Ctrl-C.",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=_run, options=OPTIONS)


def _run(args: argparse.Namespace) -> int:
    import sys

    from rlrec.demo.run import run_demo

    try:
        cfg = OPTIONS.build(DemoConfig, OPTIONS.resolve(args))
    except ValueError as e:  # OptionError too
        print(f"rlrec demo: error: {e}", file=sys.stderr)
        return 2
    return run_demo(cfg)

"""`rlrec demo`: the whole closed loop on one machine (see rlrec/demo/run.py).

Embedded broker + local storage, N simulated deployed CartPole policies (a scripted expert with
epsilon-noise at first, then each policy version the trainer publishes), the consumer and the
continuous trainer, with a live dashboard. Everything goes under --data-dir.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from rlrec.demo.run import DemoConfig

    d = DemoConfig()
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
    p.add_argument(
        "--data-dir",
        default=d.data_dir,
        help=f"where shards, checkpoints, metrics, logs and the report go [{d.data_dir}]; "
        "a previous demo run there is replaced",
    )
    p.add_argument("--duration", type=float, default=d.duration, help=f"stop after this many seconds [{d.duration:g}]")
    p.add_argument(
        "--until-return",
        type=float,
        default=d.until_return,
        help="stop once a published policy evaluated at >= R is in use by a policy process "
        f"(0: no target) [{d.until_return:g}]",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=d.settle_s,
        help=f"once the target is in use, keep running this long so the deployed returns show [{d.settle_s:g}]",
    )
    p.add_argument("--policies", type=int, default=d.policies, help=f"simulated deployed policies [{d.policies}]")
    p.add_argument(
        "--steps-per-s",
        type=float,
        default=d.steps_per_s,
        help=f"throttle of each policy process, env steps per second [{d.steps_per_s:g}]",
    )
    p.add_argument(
        "--epsilon",
        type=float,
        default=d.epsilon,
        help=f"random-action probability of the scripted expert [{d.epsilon:g}]",
    )
    p.add_argument(
        "--policy-epsilon",
        type=float,
        default=d.policy_epsilon,
        help=f"random-action probability when acting with a published policy [{d.policy_epsilon:g}]",
    )
    p.add_argument(
        "--s3",
        action="store_true",
        help="put the shards on an embedded S3 server (moto) instead of the data dir "
        "(copied into the data dir at the end)",
    )
    p.add_argument("--algo", default=d.algo, help=f"BC or MARWIL [{d.algo}]")
    p.add_argument(
        "--no-promotion-gate", action="store_true", help="publish every checkpoint's policy (no evaluation gate)"
    )
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        default=d.checkpoint_interval,
        help=f"trainer iterations between candidate policies [{d.checkpoint_interval}]",
    )
    p.add_argument(
        "--trainer-cpus", type=int, default=d.trainer_cpus, help=f"CPUs for the trainer's Ray [{d.trainer_cpus}]"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--no-live",
        action="store_true",
        help="print a compact line every few seconds instead of "
        "the live dashboard (the default when stdout is not a terminal)",
    )
    p.add_argument("--no-report", action="store_true", help="do not write report.html at the end")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import sys

    from rlrec.demo.run import DemoConfig, run_demo

    if args.algo.upper() not in ("BC", "MARWIL"):
        print("rlrec demo: --algo must be BC or MARWIL (CartPole has discrete actions)", file=sys.stderr)
        return 2
    if args.policies < 1 or args.duration <= 0 or args.checkpoint_interval < 1:
        print("rlrec demo: --policies and --checkpoint-interval must be >= 1, --duration > 0", file=sys.stderr)
        return 2
    if not (0.0 <= args.epsilon <= 1.0 and 0.0 <= args.policy_epsilon <= 1.0):
        print("rlrec demo: --epsilon and --policy-epsilon must be in [0, 1]", file=sys.stderr)
        return 2
    cfg = DemoConfig(
        data_dir=args.data_dir,
        duration=args.duration,
        until_return=args.until_return,
        settle_s=args.settle_s,
        policies=args.policies,
        steps_per_s=args.steps_per_s,
        epsilon=args.epsilon,
        policy_epsilon=args.policy_epsilon,
        s3=args.s3,
        algo=args.algo.upper(),
        promotion_gate=not args.no_promotion_gate,
        checkpoint_interval=args.checkpoint_interval,
        trainer_cpus=args.trainer_cpus,
        seed=args.seed,
        live=False if args.no_live else None,
        report=not args.no_report,
    )
    return run_demo(cfg)

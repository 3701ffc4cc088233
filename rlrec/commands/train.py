"""`rlrec train`: continuous offline training on the shards the consumer commits.

Follows the manifest under --input (only committed shards are read), trains an RLlib offline
algorithm on fresh shards plus a replay window, writes {checkpoint-dir}/metrics.jsonl (one JSON
line per iteration), checkpoints every --checkpoint-interval iterations and on SIGTERM/SIGINT,
and publishes each checkpointed policy under {checkpoint-dir}/policies (load it with
`rlrec.load_policy`). --resume continues from the latest checkpoint: weights, optimizer state and
the cursor of shards already trained on. See docs/TRAINER.md.

Examples:
  rlrec train --input s3://bucket/exp --algo BC --env CartPole-v1 --checkpoint-dir s3://bucket/run1 \\
      --eval-interval 10
  rlrec train --input /data/exp --algo CQL --checkpoint-dir /ckpt/cql --resume --num-learners 1 \\
      --algo-config lr=3e-4 --algo-config train_batch_size_per_learner=512
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train continuously on committed shards (RLlib BC/MARWIL/CQL/IQL)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", required=True, help="the consumer's output URI or path (its manifest is followed)")
    p.add_argument("--algo", default="BC", help="BC, MARWIL, CQL or IQL [BC]")
    p.add_argument("--env", help="gymnasium env id for evaluation rollouts (spaces otherwise come from the shards)")
    p.add_argument("--checkpoint-dir", required=True, help="URI or path for checkpoints, metrics.jsonl and policies")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--num-learners", type=int, default=0, help="remote Learner actors (0: train in this process) [0]")
    p.add_argument("--num-gpus-per-learner", type=float, default=0.0, help="GPUs per Learner [0]")
    p.add_argument(
        "--eval-interval", type=int, default=0, help="evaluate every K iterations (needs --env; 0: never) [0]"
    )
    p.add_argument("--eval-episodes", type=int, default=5, help="episodes per evaluation [5]")
    p.add_argument("--max-iterations", type=int, help="stop after this many iterations (total, across resumes)")
    p.add_argument("--checkpoint-interval", type=int, default=10, help="checkpoint + publish every N iterations [10]")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints to keep [3]")
    p.add_argument(
        "--algo-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="AlgorithmConfig.training() option (repeatable), e.g. lr=1e-3, train_batch_size_per_learner=512",
    )
    p.add_argument(
        "--offline-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="AlgorithmConfig.offline_data() option (repeatable), e.g. dataset_num_iters_per_learner=20",
    )
    p.add_argument(
        "--map-batches-concurrency",
        type=int,
        help="PreLearner actors (map_batches concurrency) [1: works on a 2-CPU machine]",
    )
    p.add_argument("--policy-id", help="train on this policy's shards only")
    p.add_argument("--min-policy-version", type=int, help="skip shards recorded only by older policy versions")
    p.add_argument("--max-policy-version", type=int, help="skip shards recorded only by newer policy versions")
    p.add_argument(
        "--wait-for-data",
        action="store_true",
        help="train only while fresh shards are waiting (default: keep training on the replay window)",
    )
    p.add_argument("--min-time-s-per-iteration", type=float, default=1.0, help="RLlib min_time_s_per_iteration [1]")
    p.add_argument(
        "--fresh-fraction",
        type=float,
        default=0.5,
        help="share of reads going to fresh shards while a backlog exists (0 < f <= 1) [0.5]",
    )
    p.add_argument("--replay-shards", type=int, help="replay window: the N most recent trained shards")
    p.add_argument("--replay-max-age-s", type=float, help="replay window: shards committed within this many seconds")
    p.add_argument("--replay-policy-versions", type=int, help="replay window: shards of the K newest policy versions")
    p.add_argument(
        "--prelearner-mode",
        default="episodes",
        choices=("episodes", "buffer"),
        help="episodes: every timestep of each read chunk, shuffled at the Learner; buffer: RLlib's "
        "PreLearner episode-buffer sampling [episodes]",
    )
    p.add_argument(
        "--promotion-gate",
        action="store_true",
        help="publish a checkpoint's policy only if its evaluation (greedy, --promotion-episodes "
        "episodes of --env) is not worse than the deployed version's; decisions go to metrics.jsonl",
    )
    p.add_argument(
        "--promotion-baseline",
        type=float,
        help="with --promotion-gate: the return of what is deployed before the first publication",
    )
    p.add_argument("--promotion-episodes", type=int, default=10, help="episodes per promotion evaluation [10]")
    p.add_argument(
        "--signing-key",
        help="Ed25519 private key (PEM; `rlrec keys generate DIR` writes DIR/policy-signing.key): signs each "
        "published policy.json (policy.json.sig) and each checkpoint's index.json; --resume then refuses a "
        "checkpoint whose files do not match its signed index",
    )
    p.add_argument("--publish-dir", help="where to publish policies [{checkpoint-dir}/policies]")
    p.add_argument("--no-publish", action="store_true", help="do not publish policies")
    p.add_argument(
        "--metrics-port", type=int, help="serve the metrics on a Prometheus endpoint on this port (0: pick a free port)"
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="interface for the metrics server (0.0.0.0 in containers) [127.0.0.1]",
    )
    p.add_argument(
        "--num-cpus",
        type=int,
        help="CPUs of the Ray this command starts (default: all); not with --ray-address/RAY_ADDRESS",
    )
    p.add_argument(
        "--ray-address",
        help="join a running Ray cluster (GCS address host:port, or auto) instead of starting Ray here; "
        "default: $RAY_ADDRESS. rlrec must be installed on every node (same image) or shipped with "
        "--ray-runtime-env py_modules; AWS_*/GOOGLE_*/AZURE_* settings are forwarded to the workers "
        "as runtime_env env_vars (visible in the Ray dashboard: prefer instance roles for credentials)",
    )
    p.add_argument(
        "--ray-runtime-env",
        metavar="JSON",
        help='extra runtime_env for the job, e.g. \'{"py_modules": ["dist/rlrec-0.1.0-py3-none-any.whl"]}\'',
    )
    p.add_argument(
        "--read-tasks",
        type=int,
        default=1,
        help="never-ending read tasks sharing the shard feed (more help when reading shards is the limit) [1]",
    )
    p.add_argument("--seed", type=int)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text", help="text or json")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from rlrec.logs import setup_logging

    setup_logging(args.log_format, args.log_level)
    from rlrec.trainer.service import ContinuousTrainer, TrainerConfig, UnsupportedCombination, parse_kv

    try:
        cfg = TrainerConfig(
            input=args.input,
            checkpoint_dir=args.checkpoint_dir,
            algo=args.algo,
            env=args.env,
            resume=args.resume,
            num_learners=args.num_learners,
            num_gpus_per_learner=args.num_gpus_per_learner,
            eval_interval=args.eval_interval,
            eval_episodes=args.eval_episodes,
            max_iterations=args.max_iterations,
            checkpoint_interval=args.checkpoint_interval,
            keep_checkpoints=args.keep_checkpoints,
            algo_config=parse_kv(args.algo_config),
            offline_config=parse_kv(args.offline_config),
            map_batches_concurrency=args.map_batches_concurrency,
            policy_id=args.policy_id,
            min_policy_version=args.min_policy_version,
            max_policy_version=args.max_policy_version,
            wait_for_data=args.wait_for_data,
            min_time_s_per_iteration=args.min_time_s_per_iteration,
            fresh_fraction=args.fresh_fraction,
            replay_shards=args.replay_shards,
            replay_max_age_s=args.replay_max_age_s,
            replay_policy_versions=args.replay_policy_versions,
            prelearner_mode=args.prelearner_mode,
            publish=not args.no_publish,
            publish_dir=args.publish_dir,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            num_cpus=args.num_cpus,
            ray_address=args.ray_address,
            ray_runtime_env=args.ray_runtime_env,
            read_tasks=args.read_tasks,
            seed=args.seed,
            promotion_gate=args.promotion_gate,
            promotion_baseline=args.promotion_baseline,
            promotion_episodes=args.promotion_episodes,
            signing_key=args.signing_key,
        )
    except ValueError as e:
        print(f"rlrec train: {e}", file=sys.stderr)
        return 2
    try:
        trainer = ContinuousTrainer(cfg, install_signals=True)
    except ValueError as e:  # e.g. an unreadable --signing-key
        print(f"rlrec train: {e}", file=sys.stderr)
        return 2
    from rlrec.trainer.checkpoints import CheckpointVerificationError
    from rlrec.trainer.cluster import ClusterConfigError

    try:
        return trainer.run()
    except (UnsupportedCombination, CheckpointVerificationError, ClusterConfigError) as e:
        print(f"rlrec train: {e}", file=sys.stderr)
        return 2

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

Every option can also come from a config file (`--config FILE`, TOML or JSON, keys as the long
option names with dashes or underscores) or from `RLREC_<OPTION>` environment variables
(e.g. `RLREC_INPUT`, `RLREC_ALGO`). Precedence: command line, then environment, then config
file, then defaults. A config-file key that is no option of this command, or an RLREC_*
variable that is no option of any command, is an error.
"""

from __future__ import annotations

import argparse
import sys

from rlrec.logs import LogOptions
from rlrec.options import OptionSet
from rlrec.trainer.config import OPESettings, TrainerConfig

#: the options of `rlrec train`, declared on these dataclasses
OPTIONS = OptionSet("train", TrainerConfig, OPESettings, LogOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train continuously on committed shards (RLlib BC/MARWIL/CQL/IQL)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=_run, options=OPTIONS)


def _run(args: argparse.Namespace) -> int:
    try:
        opts = OPTIONS.resolve(args)
    except ValueError as e:  # OptionError
        print(f"rlrec train: error: {e}", file=sys.stderr)
        return 2
    from rlrec.logs import drop_native_notices, quiet_ray_logging, setup_logging

    setup_logging(opts["log_format"], opts["log_level"])
    from rlrec.trainer.service import ContinuousTrainer, UnsupportedCombination

    try:
        cfg = OPTIONS.build(TrainerConfig, opts, ope=OPTIONS.build(OPESettings, opts))
    except ValueError as e:
        print(f"rlrec train: error: {e}", file=sys.stderr)
        return 2
    quiet_ray_logging()  # imports RLlib (as the checks below do): after the option errors
    from rlrec.commands._common import open_output

    # UsageErrors (exit 2, one line) before Ray starts
    open_output(cfg.input, "--input")
    open_output(cfg.checkpoint_dir, "--checkpoint-dir")
    cfg.check_inputs()
    drop_native_notices()  # Ray's C++ notices, before Ray starts
    try:
        trainer = ContinuousTrainer(cfg, install_signals=True)
    except ValueError as e:  # e.g. an unreadable --signing-key
        print(f"rlrec train: error: {e}", file=sys.stderr)
        return 2
    from rlrec.trainer.checkpoints import CheckpointVerificationError, ResumeRefused
    from rlrec.trainer.cluster import ClusterConfigError

    try:
        return trainer.run()
    except (UnsupportedCombination, CheckpointVerificationError, ClusterConfigError, ResumeRefused) as e:
        print(f"rlrec train: error: {e}", file=sys.stderr)
        return 2

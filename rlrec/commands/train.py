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
import logging
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
    phase = logging.getLogger("rlrec.train").info  # start-up phases, said as each begins
    from rlrec.trainer.service import ContinuousTrainer, UnsupportedCombination

    try:
        cfg = OPTIONS.build(TrainerConfig, opts, ope=OPTIONS.build(OPESettings, opts))
    except ValueError as e:
        print(f"rlrec train: error: {e}", file=sys.stderr)
        return 2
    from rlrec.commands._common import open_output
    from rlrec.commands._signals import exit_code_after

    # UsageErrors (exit 2, one line) before Ray starts
    check_input(open_output(cfg.input, "--input"), cfg.input)
    make_checkpoint_dir(open_output(cfg.checkpoint_dir, "--checkpoint-dir"))
    phase("loading Ray and RLlib")
    quiet_ray_logging()  # imports RLlib (as the checks below do): after the option errors
    phase("checking --env and --algo-config")
    cfg.check_inputs()
    drop_native_notices()  # Ray's C++ notices, before Ray starts
    try:
        trainer = ContinuousTrainer(cfg, install_signals=True)
    except ValueError as e:  # e.g. an unreadable --signing-key
        print(f"rlrec train: error: {e}", file=sys.stderr)
        return 2
    from rlrec.trainer.checkpoints import CheckpointVerificationError, ResumeRefused
    from rlrec.trainer.cluster import ClusterConfigError
    from rlrec.trainer.publish_lease import PublishRootTaken

    trainer.install_signal_handlers()  # a clean stop from now on (again after ray.init, which sets its own)
    phase("looking for committed shards under %s", cfg.input)
    try:
        rc = trainer.run()
    except (
        UnsupportedCombination,
        CheckpointVerificationError,
        ClusterConfigError,
        ResumeRefused,
        PublishRootTaken,
    ) as e:
        print(f"rlrec train: error: {e}", file=sys.stderr)
        return 2
    code = exit_code_after(rc, trainer.stop_reason)
    if code != rc:
        phase("stopped by %s after a clean stop: exit code %d", trainer.stop_reason, code)
    return code


def check_input(storage, uri: str) -> None:
    """UsageError (exit 2) when --input can never hold shards: a folder of published policies, a
    checkpoint dir, a folder inside a store. A store that is not there yet is waited for (the
    trainer's waiting line says what it lacks).

    Example:
        >>> import tempfile, pathlib
        >>> from rlrec.store.storage import Storage
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "policies" / "v000001").mkdir(parents=True)
        >>> check_input(Storage.from_uri(str(root / "policies")), "ck/policies")
        Traceback (most recent call last):
        ...
        rlrec.errors.UsageError: --input: ck/policies holds published policy versions (v000001/ ...), not shards: give the --output of rlrec consume
    """
    from rlrec.errors import UsageError
    from rlrec.store.locate import locate_store

    try:
        where = locate_store(uri, storage)
    except Exception:  # unreachable now (StorageError, a refused credential): the trainer waits for the store
        return
    if where.mistake:
        raise UsageError(f"--input: {where.mistake}")


def make_checkpoint_dir(storage) -> None:
    """Create a local --checkpoint-dir at start (object stores have no folders to create)."""
    import os

    if storage.kind == "local":
        os.makedirs(storage.full_path(""), exist_ok=True)

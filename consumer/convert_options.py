"""The options of ``rlrec convert``: :class:`ConvertOptions`, declared once.

Each field declared with :func:`rlrec.options.option` is an option of ``rlrec convert`` (its
``--flag``, ``RLREC_*`` variable, config-file key and row in docs/CONFIG.md); the spaces and the
env id are filled in by the command. Standard library only (``rlrec --help`` imports it);
``rlrec.consumer.convert`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rlrec.options import check_choices, option

__all__ = ["ConvertOptions"]

#: the keys ``--schema KEY=COLUMN`` may map (RLlib's input_read_schema names, plus ours)
SCHEMA_KEYS = (
    "eps_id",
    "agent_id",
    "module_id",
    "obs",
    "actions",
    "rewards",
    "new_obs",
    "terminateds",
    "truncateds",
    "t",
    "infos",
    "dones",
    "policy_version",
)


@dataclass
class ConvertOptions:
    """How `rlrec convert` reads and labels its input (see `rlrec.consumer.convert`).

    Example:
        >>> ConvertOptions(input_format="sample-batch", incomplete="truncate").topic
        'converted'
    """

    input_format: Literal["tabular", "sample-batch"] = option("tabular", name="from", help="input format")
    schema: dict[str, str] = option(
        default_factory=dict,
        metavar="KEY=COLUMN",
        help="map a column of the input to one of our keys, like RLlib's input_read_schema, e.g. "
        f"--schema obs=observation; keys: {' '.join(SCHEMA_KEYS)}",
    )
    policy_id: str | None = option(
        None,
        help="policy id of every episode (default: module_id column, the MultiAgentBatch key, else default_policy)",
    )
    policy_version: int | None = option(
        None, help="policy version of every episode (default: policy_version / weights_seq_no column, else 0)"
    )
    allow_pickle: bool = option(
        False,
        help="decode RLlib's compressed columns (base64(LZ4(cloudpickle)) strings). This UNPICKLES, "
        "i.e. executes code from the data: only for recordings you trust",
    )
    incomplete: Literal["drop", "truncate", "error"] = option(
        "drop", help="episodes without a terminal row: drop them, mark them truncated, or fail"
    )
    topic: str = option(
        "converted",
        help="manifest topic name of the converted shards; episode ids already committed under it are skipped",
    )
    episodes_per_shard: int = option(1000, help="episodes per shard")
    compression: Literal["zstd", "snappy", "gzip", "lz4", "none"] = option("zstd", help="Parquet compression")
    #: filled in by the command: gymnasium spaces (None: from the files' metadata or inferred)
    observation_space: Any = None
    action_space: Any = None
    env_id: str = ""

    def __post_init__(self) -> None:
        check_choices(self)
        bad = sorted(set(self.schema) - set(SCHEMA_KEYS))
        if bad:
            raise ValueError(f"--schema: unknown key {bad[0]!r} (keys: {' '.join(SCHEMA_KEYS)})")
        empty = sorted(k for k, column in self.schema.items() if not str(column).strip())
        if empty:
            raise ValueError(f"--schema {empty[0]}=: give the input's column after '='")
        if self.episodes_per_shard < 1:
            raise ValueError(f"--episodes-per-shard must be at least 1, got {self.episodes_per_shard}")

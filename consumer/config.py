"""The consumer's options: :class:`ConsumerConfig`, the one declaration of ``rlrec consume``'s settings.

Each field declared with :func:`rlrec.options.option` is an option of ``rlrec consume``: its
``--flag``, its ``RLREC_*`` variable, its config-file key and its row in docs/CONFIG.md come from
it. Standard library only (``rlrec --help`` imports it); ``rlrec.consumer.service`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrec.options import check_choices, option
from rlrec.store.manifest_entries import is_writer_name

__all__ = ["ConsumerConfig"]

OnOverflow = Literal["truncate", "dead-letter"]


@dataclass
class ConsumerConfig:
    """Options of `rlrec consume` (names match the CLI flags)."""

    bootstrap_servers: str = option(help="Kafka bootstrap servers, host:port[,host:port]")
    output: str = option(
        help="output URI or path: /dir, file:///dir, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix"
    )
    topic: str = option("rlrec.transitions", help="transitions topic")
    group_id: str | None = option(
        None,
        help="consumer group id; run more processes with the same id to scale out (default: rlrec- and a hash "
        "of the output's kind, bucket and prefix, so each output has its own group); one group per output",
    )
    start_from: Literal["earliest", "latest"] = option(
        "earliest",
        help="where a partition the output store has never written is read from (the store's own position "
        "decides for every other partition)",
    )
    accept_gap: bool = option(
        False,
        help="read on from the topic's earliest offset when the store resumes a partition at an offset the "
        "topic no longer holds (episodes are missing from the store); without it the consumer refuses to start",
    )
    deployment: str | None = option(
        None, help="name of this deployment, recorded in the claims it writes (default: the host name)"
    )
    format: Literal["episodes", "tabular"] = option(
        "episodes", help="episodes (RLlib output_write_episodes=True) or tabular"
    )
    compression: Literal["zstd", "snappy", "gzip", "lz4", "none"] = option("zstd", help="Parquet compression")
    max_episodes_per_file: int = option(
        1000, help="roll a shard after this many episodes (RLlib output_max_rows_per_file)"
    )
    max_file_bytes: int = option(
        128 * 1024 * 1024, help="roll a shard at about this many bytes of episodes (output_max_file_size)"
    )
    max_file_age_s: float = option(
        60.0, help="write finished episodes at the latest this long after they finish (idle partitions too)"
    )
    reward_join_window_s: float = option(
        0.0, help="keep a finished episode this long for delayed rewards before writing it"
    )
    episode_timeout_s: float = option(600.0, help="an open episode with no event for this long is finalized")
    on_timeout: OnOverflow = option(
        "truncate", help="what a timeout does: truncate (write it as truncated) or dead-letter"
    )
    max_open_episodes: int = option(
        100_000, help="cap on episodes being assembled; over it the longest-idle is evicted"
    )
    max_open_bytes: int = option(
        1024 * 1024 * 1024,
        help="memory budget of all open episodes (observations, actions, infos, extra outputs); over it "
        "the longest-idle is evicted as --on-capacity says",
    )
    on_capacity: OnOverflow = option(
        "dead-letter",
        help="what eviction does: dead-letter (reason capacity) or truncate (single-agent episodes; a "
        "multi-agent one is dead-lettered)",
    )
    max_episode_bytes: int = option(64 * 1024 * 1024, help="memory budget of one open episode")
    on_episode_too_large: OnOverflow = option(
        "dead-letter",
        help="an episode over --max-episode-bytes: dead-letter (reason episode-too-large) or truncate "
        "(single-agent episodes; a multi-agent one is dead-lettered)",
    )
    validate_spaces: Literal["strict", "shape", "off"] = option(
        "strict",
        help="strict (dtypes, shapes, action ranges, finite obs/actions: out-of-space, non-finite-value), "
        "shape (dtypes and shapes only) or off",
    )
    max_buffered_bytes: int = option(
        512 * 1024 * 1024, help="budget of finished-but-unwritten episode bytes; over it, flush"
    )
    dlq_topic: str | None = option(None, help="dead-letter topic (default: {topic}.dlq)")
    partitions: int = option(8, help="partitions for topics this command creates")
    create_topics: bool = option(
        True, help="create the topic and its DLQ if missing (--no-create-topics: ops provision them)"
    )
    max_message_bytes: int = option(8 * 1024 * 1024, help="messages larger than this are dead-lettered (oversize)")
    #: dead letters are cut to fit this (the broker's default message.max.bytes is about 1 MB)
    dlq_max_message_bytes: int = 900_000
    commit_interval_s: float = option(5.0, help="how often offsets are committed when no flush did it")
    compact_after_s: float = option(
        0.0,
        name="compact_after",
        metavar="SECONDS",
        help="merge each owned partition's committed shards once they are this many seconds old into shards "
        "of up to --max-file-bytes on disk (their files' bytes as first committed, not the episodes' bytes in "
        "memory that roll a shard; and at most half the schema gate's decode limit) (0: never). A plain directory reader then sees old and merged files "
        "until retention: read the manifest's list (rlrec inspect --paths; docs/GUARANTEES.md)",
    )
    schema_registry_url: str | None = option(None, help="read Confluent-framed values through this schema registry")
    metrics_port: int | None = option(
        None, help="serve Prometheus /metrics and /healthz here (0: pick a free port; default: no server)"
    )
    metrics_host: str = option("127.0.0.1", help="interface for the metrics server (0.0.0.0 in containers)")
    allow_unfenced_storage: bool = option(
        False,
        help="start even if the output store ignores create-once writes (S3 If-None-Match; probed at "
        "start): LOSES writer fencing and episode deduplication - only with one consumer per "
        "partition guaranteed by other means",
    )
    kafka_config: dict[str, str] = option(
        default_factory=dict,
        help="librdkafka setting passed through, e.g. security.protocol=SASL_SSL (a table in a config file); "
        "auto.offset.reset is overridden (error: the output store says where each partition is read from)",
    )
    summary_interval_s: float = option(
        60.0,
        help="log what was committed (episodes, steps, shards) and the lag per partition every this many "
        "seconds, at INFO (0: never; each commit is logged at DEBUG, the first one at INFO)",
    )

    def __post_init__(self) -> None:
        check_choices(self)
        if self.compact_after_s < 0:
            raise ValueError(f"--compact-after must be >= 0 seconds, got {self.compact_after_s:g}")
        for flag, name in (("--group-id", self.group_id), ("--deployment", self.deployment)):
            if name is not None and not is_writer_name(name):  # a claim could not record it
                raise ValueError(f"{flag} must be 1-255 printable characters (no tab or newline), got {name[:40]!r}")

    @property
    def dlq(self) -> str:
        from rlrec.consumer.topics import dlq_topic_name  # Kafka's client: not at `rlrec --help`

        return self.dlq_topic or dlq_topic_name(self.topic)

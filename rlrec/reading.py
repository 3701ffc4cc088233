"""``rlrec.open``: a store's committed data pinned to a point of its manifest, or to the data a
published policy version was trained on (docs/TOOLS.md, "Reading a store")."""

from __future__ import annotations

from typing import Any

__all__ = ["open"]


def open(
    uri: Any,
    as_of: Any = None,
    *,
    policy_version: int | None = None,
    policies: str | None = None,
    held_out: bool = False,
    public_key: Any = None,
    allow_unsigned: bool = False,
    run_id: str | None = None,
    channel: str | None = None,
):
    """A `rlrec.store.snapshot_reader.Snapshot` of the store at `uri`.

    Either ``as_of`` (None: the newest point; a UNIX time; a cursor: `rlrec.store.snapshot.open_snapshot`)
    or ``policy_version=N, policies=URI``: the data published version N was trained on, reopened
    from the shard entries its signed lineage records, in the shards that hold them now
    (`rlrec.trainer.lineage.open_lineage`), with ``held_out=True`` the episodes it held out instead.

    Args:
        uri: the store (a path or URI, or a `Storage`).
        as_of: the point of the manifest (not with `policy_version`): a UNIX time, a `datetime`, a
            `date`, an ISO 8601 time ("2026-11-27T04:00:00Z") or a cursor.
        policy_version: a published policy version.
        policies: the publish root of the versions (required with `policy_version`; `rlrec train` publishes
            to ``{checkpoint_dir}/policies`` unless given another).
        held_out: with `policy_version`: the held-out episodes instead of the trained ones.
        public_key: with `policy_version`: the trainer's Ed25519 public key (default
            ``$RLREC_POLICY_PUBLIC_KEY``) that must have signed the version.
        allow_unsigned: with `policy_version`: accept an unsigned version.
        run_id: with `policy_version`: only a version signed for this run (as `load_policy` pins it).
        channel: with `policy_version`: only a version signed for this channel.

    Raises:
        CursorError: a bad point (`open_snapshot`).
        LineageError: both `as_of` and `policy_version`; `policy_version` without `policies`;
            an unknown version, an unsigned or tampered lineage, a lineage without a cursor.

    Example::

        >>> import tempfile
        >>> import rlrec
        >>> from rlrec.store.commit import ShardCommitter
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
        >>> root = tempfile.mkdtemp()
        >>> _ = ShardCommitter(root).commit(expert_cartpole_episodes(2))
        >>> rlrec.open(root).num_episodes
        2
        >>> rlrec.open(root, as_of=rlrec.open(root).cursor, policy_version=1, policies=root)
        Traceback (most recent call last):
        ...
        rlrec.trainer.lineage.LineageError: give as_of or policy_version, not both
    """
    if policy_version is None:
        from rlrec.trainer.lineage import LineageError

        for name, value in (
            ("policies", policies),
            ("held_out", held_out or None),
            ("run_id", run_id),
            ("channel", channel),
        ):
            if value is not None:
                raise LineageError(f"{name} needs policy_version")
        from rlrec.store.snapshot import open_snapshot

        return open_snapshot(uri, as_of=as_of)
    from rlrec.trainer.lineage import LineageError, open_lineage

    if as_of is not None:
        raise LineageError("give as_of or policy_version, not both")
    if policies is None:
        raise LineageError("policy_version needs policies= (the publish root, e.g. {checkpoint_dir}/policies)")
    return open_lineage(
        uri,
        policies,
        policy_version,
        held_out=held_out,
        public_key=public_key,
        allow_unsigned=allow_unsigned,
        run_id=run_id,
        channel=channel,
    )

"""What a published policy version is for: its run, its channel, its spaces, and the signed pointer.

Modelled on TUF (The Update Framework): signatures say *who* made a version; bindings say *what
it is for*, so that a signed version cannot be replayed, frozen or mixed in where it does not
belong by someone who can write the policies folder but holds no signing key.

* ``run_id``: chosen by the trainer at a run's first publication and kept across ``--resume``;
  signed in every ``policy.json`` and in the pointer.
* ``channel``: what the versions are published for (``rlrec train --channel``, default the
  policy id); signed in the same places.
* the signed pointer: ``latest.json`` (``policy_version``, ``path``, ``sha256`` of the version's
  ``policy.json``, ``run_id``, ``channel``, ``time``) plus ``latest.json.sig``, the Ed25519
  signature over its exact bytes.
* the canary pointer: ``canary.json`` (the fields of ``latest.json`` plus ``base_version``, the
  version ``latest.json`` names while the canary runs, and ``started``, when it began) plus
  ``canary.json.sig``: a candidate served to a share of episodes (``rlrec train --rollout
  canary``). It is followed only while ``latest.json`` names its ``base_version``, and the
  replay check of ``latest.json`` excuses the one version it names.
* the state file: a small JSON file a service owns, holding the newest version it has loaded
  through ``latest.json`` (``policy_version``) and the newest canary (``canary_version``), so
  that a restart never goes below either.

Torch-free and Ray-free (`rlrec.trainer.policy` imports it); gymnasium is imported only when a
space object is given.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHANNEL_RE",
    "DEFAULT_CHANNEL",
    "RUN_ID_RE",
    "Pins",
    "canary_pointer_bytes",
    "canonical_space",
    "check_name",
    "new_run_id",
    "pointer_bytes",
    "write_state_file",
]

#: run ids and channels name things the way policy ids do (``rlrec.producer.events.POLICY_ID_RE``)
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
CHANNEL_RE = RUN_ID_RE
#: the channel of a trainer without ``--channel`` and ``--policy-id``
DEFAULT_CHANNEL = "default"


def new_run_id() -> str:
    """A fresh run id: 32 lowercase hex digits (a random UUID).

    Example:
        >>> len(new_run_id())
        32
    """
    return uuid.uuid4().hex


def check_name(value: Any, what: str) -> str:
    """`value` if it is a usable run id or channel (``^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$``).

    Args:
        value: the run id or channel.
        what: its name in the error, e.g. ``"--channel"``.

    Raises:
        ValueError: it is not a string of that form.

    Example:
        >>> check_name("cartpole-prod", "--channel")
        'cartpole-prod'
    """
    if not isinstance(value, str) or not RUN_ID_RE.match(value):
        raise ValueError(f"{what} {str(value)[:60]!r} must match {RUN_ID_RE.pattern}")
    return value


def canonical_space(space: Any) -> str:
    """The canonical JSON text of a space: a gymnasium space, or its JSON form (a dict, as in
    ``policy.json``'s ``observation_space`` and ``action_space``), keys sorted, no spaces.

    Args:
        space: a ``gymnasium.Space`` or its `rlrec.producer.spaces.space_to_json` form.

    Example:
        >>> import gymnasium as gym
        >>> canonical_space(gym.spaces.Discrete(2))
        '{"dtype":"int64","n":2,"start":0,"type":"Discrete"}'
    """
    if not isinstance(space, dict):
        from rlrec.producer.spaces import dumps_space

        space = json.loads(dumps_space(space))
    return json.dumps(space, sort_keys=True, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class Pins:
    """What a service states about the versions it will load (None: not checked).

    ``observation_space`` / ``action_space`` are canonical JSON (`canonical_space`);
    ``max_pointer_age_s``: a pointer older than this is stale; ``state_file``: the local file
    holding the newest version this service has loaded."""

    run_id: str | None = None
    channel: str | None = None
    observation_space: str | None = None
    action_space: str | None = None
    state_file: str | None = None
    max_pointer_age_s: float | None = None

    @classmethod
    def of(
        cls,
        *,
        run_id: str | None = None,
        channel: str | None = None,
        observation_space: Any = None,
        action_space: Any = None,
        state_file: Any = None,
        max_pointer_age_s: float | None = None,
    ) -> Pins:
        """Pins from `load_policy`'s arguments (spaces as gymnasium spaces or JSON dicts).

        Raises:
            ValueError: a malformed run id or channel, or a negative age.

        Example:
            >>> Pins.of(channel="cartpole").binds_identity
            True
        """
        if run_id is not None:
            check_name(run_id, "run_id")
        if channel is not None:
            check_name(channel, "channel")
        if max_pointer_age_s is not None and not float(max_pointer_age_s) >= 0:
            raise ValueError(f"max_pointer_age_s must be >= 0, got {max_pointer_age_s!r}")
        return cls(
            run_id=run_id,
            channel=channel,
            observation_space=None if observation_space is None else canonical_space(observation_space),
            action_space=None if action_space is None else canonical_space(action_space),
            state_file=None if state_file is None else os.path.abspath(os.fspath(state_file)),
            max_pointer_age_s=None if max_pointer_age_s is None else float(max_pointer_age_s),
        )

    @property
    def binds_identity(self) -> bool:
        """Whether a run id or a channel is pinned (then only signed versions and pointers load)."""
        return self.run_id is not None or self.channel is not None


def pointer_bytes(
    version: int,
    path: str,
    sha256: str,
    *,
    run_id: str | None,
    channel: str | None,
    now: float | None = None,
    canary_floor: int = 0,
) -> bytes:
    """The exact bytes of a ``latest.json`` pointer (the bytes ``latest.json.sig`` signs).

    Args:
        version: the policy version it names.
        path: its directory (``v00000N``).
        sha256: the sha256 of that version's ``policy.json``.
        run_id: the run that published it (None: left out, as before run ids existed).
        channel: the channel it is published for (None: left out).
        now: its timestamp (default: the current time).
        canary_floor: the highest canary version above `version` that ended without a
            promotion (0: none; left out): services never serve a ``canary.json`` at or below it.

    Example:
        >>> json.loads(pointer_bytes(3, "v000003", "0" * 64, run_id="r1", channel="c", now=5.0))["channel"]
        'c'
    """
    doc: dict[str, Any] = {
        "policy_version": version,
        "path": path,
        "sha256": sha256,
        "time": time.time() if now is None else float(now),
    }
    if run_id is not None:
        doc["run_id"] = run_id
    if channel is not None:
        doc["channel"] = channel
    if canary_floor > version:
        doc["canary_floor"] = int(canary_floor)
    return json.dumps(doc, sort_keys=True).encode()


def canary_pointer_bytes(
    version: int,
    path: str,
    sha256: str,
    *,
    base_version: int,
    started: float,
    run_id: str | None,
    channel: str | None,
    now: float | None = None,
) -> bytes:
    """The exact bytes of a ``canary.json`` pointer (the bytes ``canary.json.sig`` signs): the
    fields of `pointer_bytes` plus ``base_version`` and ``started``.

    Args:
        version: the candidate version it names.
        path: its directory (``v00000N``).
        sha256: the sha256 of that version's ``policy.json``.
        base_version: the version ``latest.json`` names while the canary runs (0: none yet).
        started: when the canary began (UNIX time; episodes that began before are not evidence).
        run_id: the run that published it.
        channel: the channel it is published for.
        now: its timestamp (default: the current time).

    Example:
        >>> doc = json.loads(canary_pointer_bytes(5, "v000005", "0" * 64, base_version=4, started=9.0,
        ...     run_id="r1", channel="c", now=10.0))
        >>> doc["base_version"], doc["started"]
        (4, 9.0)
    """
    doc = json.loads(pointer_bytes(version, path, sha256, run_id=run_id, channel=channel, now=now))
    doc.update({"base_version": int(base_version), "started": float(started)})
    return json.dumps(doc, sort_keys=True).encode()


def write_state_file(
    path: str,
    version: int,
    run_id: str | None,
    channel: str | None,
    canary_version: int | None = None,
    *,
    sha256: str | None = None,
    canary_sha256: str | None = None,
    canary_floor: int = 0,
) -> None:
    """Replace the service's state file atomically (a temporary file beside it, fsync, rename).

    Args:
        path: the state file.
        version: the newest version this service has loaded through ``latest.json``.
        run_id: that version's run id (informational).
        channel: that version's channel (informational).
        canary_version: the newest canary version it has loaded (None: none; left out).
        sha256: the policy.json sha256 of `version` (None: left out): the same number with
            other bytes is refused.
        canary_sha256: the policy.json sha256 of `canary_version` (None: left out).
        canary_floor: the highest ``canary_floor`` of a ``latest.json`` it trusted (0: left
            out): a canary at or below it is never served again.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "policy-state.json")
        >>> write_state_file(p, 3, "r1", "cartpole")
        >>> json.load(open(p))["policy_version"]
        3
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    doc: dict[str, Any] = {"policy_version": int(version), "run_id": run_id, "channel": channel, "time": time.time()}
    if canary_version is not None:
        doc["canary_version"] = int(canary_version)
    for key, value in (("sha256", sha256), ("canary_sha256", canary_sha256)):
        if value is not None:
            doc[key] = str(value)
    if canary_floor:
        doc["canary_floor"] = int(canary_floor)
    data = json.dumps(doc, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(prefix=".policy-state-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise

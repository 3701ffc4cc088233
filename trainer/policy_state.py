"""A service's state file (``load_policy(state_file=)``): the newest deployed version and
canary it loaded, with their policy.json sha256, and the highest canary floor it trusted --
read before a version is loaded (`_check_state`), written after (`_remember`), never lowered.
docs/DEPLOY.md, "rollback: replay + delete"."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from rlrec.trainer.binding import Pins, write_state_file
from rlrec.trainer.policy_files import _SHA256_RE, LATEST, MAX_BYTES, PolicyLoadError, _Files, _json


@dataclass(frozen=True)
class _State:
    """A service's state file: the newest deployed version and canary it loaded (with their
    policy.json sha256 when recorded) and the highest canary floor it trusted."""

    version: int
    canary: int | None = None
    sha256: str | None = None
    canary_sha256: str | None = None
    canary_floor: int = 0
    run_id: str | None = None  # informational: the run and channel of the last version recorded
    channel: str | None = None


def _read_state(path: str) -> _State | None:
    """The service's state file (None: no file yet)."""
    directory, name = os.path.split(path)
    try:
        data = _Files(directory or ".").read(name, MAX_BYTES["state"])
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PolicyLoadError(f"state file {path}: {e}") from None
    doc = _json(data, f"state file {path}")
    version = doc.get("policy_version") if isinstance(doc, dict) else None
    if type(version) is not int or version < 0:
        raise PolicyLoadError(f"state file {path} holds no policy_version: refused (delete it to start over)")
    canary, floor = doc.get("canary_version"), doc.get("canary_floor", 0)
    if canary is not None and (type(canary) is not int or canary < 0):
        raise PolicyLoadError(f"state file {path}: canary_version {canary!r:.40} is not a version: refused")
    if type(floor) is not int or floor < 0:
        raise PolicyLoadError(f"state file {path}: canary_floor {floor!r:.40} is not a version: refused")
    shas = [doc.get(k) for k in ("sha256", "canary_sha256")]
    if any(v is not None and not (isinstance(v, str) and _SHA256_RE.match(v)) for v in shas):
        raise PolicyLoadError(f"state file {path}: a sha256 is not a sha256: refused")
    run_id, channel = (v if isinstance(v, str) else None for v in (doc.get("run_id"), doc.get("channel")))
    return _State(version, canary, shas[0], shas[1], floor, run_id, channel)


def _check_state(rel_dir: str, pins: Pins, canary: bool = False, sha256: str | None = None) -> None:
    """A version below the newest this service loaded through ``latest.json`` is refused; a
    canary below that or below the newest canary it ran is refused too (a canary runs above the
    deployed version, so one below what this service deployed is a replayed pointer), and so is
    a canary at or below the highest canary floor it trusted (a rolled-back canary). The same
    number with another policy.json sha256 (`sha256`, the pointer's) than the one it loaded is
    refused: a reused version number is not the version it ran."""
    if pins.state_file is None:
        return
    state = _read_state(pins.state_file)
    if state is None:
        return
    version = int(rel_dir[1:])
    newest, what, known = state.version, "", state.sha256
    if canary and state.canary is not None and state.canary > state.version:
        newest, what, known = state.canary, "the canary ", state.canary_sha256
    if version < newest:
        raise PolicyLoadError(
            f"{rel_dir} is older than {what}v{newest:06d}, which this service has loaded before "
            f"(state file {pins.state_file}): refused"
        )
    if version == newest and known is not None and sha256 is not None and sha256 != known:
        raise PolicyLoadError(
            f"{rel_dir}'s policy.json (sha256 {sha256:.12}) is not the {what}v{newest:06d} this service has loaded "
            f"before (sha256 {known:.12}, state file {pins.state_file}): a reused version number is refused"
        )
    if canary and version <= state.canary_floor:
        raise PolicyLoadError(
            f"{rel_dir} is at or below the canary floor v{state.canary_floor:06d} of a {LATEST} this service trusted "
            f"(state file {pins.state_file}): a canary that ended is not served again"
        )


def _check_state_deployed(root: str, pins: Pins) -> None:
    """Nothing deployed (no ``latest.json``) is refused when the state file records a deployed
    version: a deleted pointer is no reason to run what the service ran before it."""
    state = None if pins.state_file is None else _read_state(pins.state_file)
    if state is not None and state.version > 0:
        raise PolicyLoadError(
            f"no {LATEST} under {root}, but this service has loaded v{state.version:06d} before "
            f"(state file {pins.state_file}): refused"
        )


def _remember(model: Any, pins: Pins, canary: bool = False, canary_floor: int = 0) -> None:
    """Record a loaded version (or canary) and a trusted canary floor in the state file (never
    lowering any of them)."""
    if pins.state_file is None:
        return
    state = _read_state(pins.state_file) or _State(0)
    new = state
    if model is not None:
        sha = getattr(model, "spec_sha256", None)
        if canary and (state.canary is None or model.version > state.canary):
            new = replace(new, canary=model.version, canary_sha256=sha)
        elif not canary and model.version > state.version:
            new = replace(new, version=model.version, sha256=sha)
        elif not canary and model.version == state.version and state.sha256 is None and sha is not None:
            new = replace(new, sha256=sha)
    if canary_floor > new.canary_floor:
        new = replace(new, canary_floor=canary_floor)
    if new == state and os.path.exists(pins.state_file):
        return
    if model is not None:  # a floor noted without a version loaded keeps what the file recorded
        new = replace(new, run_id=model.spec.get("run_id"), channel=model.spec.get("channel"))
    try:
        write_state_file(
            pins.state_file,
            new.version,
            new.run_id,
            new.channel,
            new.canary,
            sha256=new.sha256,
            canary_sha256=new.canary_sha256,
            canary_floor=new.canary_floor,
        )
    except OSError as e:
        raise PolicyLoadError(f"cannot write the state file {pins.state_file}: {e}") from None


def _state_floor(pins: Pins) -> int:
    """The highest canary floor the state file recorded (0: none, or no state file)."""
    state = None if pins.state_file is None else _read_state(pins.state_file)
    return 0 if state is None else state.canary_floor

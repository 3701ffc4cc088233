"""The trainer's side of a canary: start one, then promote it or roll it back (`rlrec train --rollout canary`).

* start (`write_canary`): ``canary.json`` (+ ``.sig``) is written *before* the version's files,
  so a service restarting meanwhile finds the higher signed version excused by the canary
  pointer (`rlrec.trainer.policy`'s replay check) rather than refused as a replay; until the
  version's ``policy.json`` lands, services simply find the canary not loadable yet.
* promote (`end_canary` with ``promote=True``): ``latest.json`` is moved to the canary version,
  then ``canary.json`` is removed (meanwhile it names a version not above ``latest.json``'s, so
  it is not followed).
* roll back: services stop serving the canary -- its signed ``canary-ended.json`` (decision
  "rollback") is written, then ``canary.json`` removed -- and ``latest.json`` stays on the base
  version. The signed rollback record excuses the canary version wherever a version above
  ``latest.json``'s would refuse it (services' replay check, `signed_above`; the state file keeps
  a canary apart from the deployed version), so no weights are ever signed again as a new
  version: a rollback cannot turn an old or another channel's version into a new one. With
  nothing deployed before (base version 0) services go back to what they ran before.

Each decision with its evidence is written first, signed, as ``v{N}/rollout.json`` (+ ``.sig``)
of the canary version: a trainer resuming after a kill -9 between the steps carries out exactly
that decision, never judges again. ``v{N}/canary-ended.json`` (signed; after ``latest.json``
moved for a promotion) marks the canary over *before* ``canary.json`` is removed: services never
follow a canary pointer whose version holds it, so a replayed old ``canary.json`` (or pair with
``latest.json``) cannot bring back a decided canary. Every step is idempotent.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from rlrec.store.storage import Storage
from rlrec.trainer.binding import canary_pointer_bytes, pointer_bytes
from rlrec.trainer.policy import (
    CANARY,
    CANARY_ENDED,
    LATEST,
    MAX_BYTES,
    MAX_NEWER_VERSIONS,
    SPEC,
    PolicyLoadError,
    _json,
    _parse_latest,
    version_dir,
)
from rlrec.trainer.signing import SIG_SUFFIX, SignatureError, sign, verify

__all__ = [
    "ROLLOUT",
    "Above",
    "BaseUnknown",
    "TooManyVersions",
    "deployable",
    "deployed_version",
    "end_canary",
    "read_decision",
    "read_pointer",
    "refresh_canary",
    "repoint_latest",
    "scan_above",
    "signed_above",
    "write_canary",
]

log = logging.getLogger("rlrec.trainer")

#: the decision record of a canary version (signed like policy.json)
ROLLOUT = "rollout.json"


def read_pointer(storage: Storage, name: str = LATEST, signing_key: Any = None) -> dict | None:
    """The parsed pointer `name` (``latest.json`` or ``canary.json``) of a publish root; None
    only when it is absent.

    Args:
        storage: the publish root.
        name: ``latest.json`` or ``canary.json``.
        signing_key: the trainer's Ed25519 private key: the pointer must then carry a valid
            signature by it (an unsigned or forged pointer raises PolicyLoadError; the root
            is writable by others, the key is not).

    Raises:
        OSError: the pointer cannot be read now (absent is not an error).
        PolicyLoadError: it is malformed, or not signed by `signing_key`.

    Example:
        >>> read_pointer(Storage.from_uri("/tmp/rlrec-no-such-root"), CANARY) is None
        True
    """
    from rlrec.trainer.export import _read_small

    try:
        data = _read_small(storage, name, MAX_BYTES[name])
    except FileNotFoundError:
        return None
    if signing_key is not None:
        try:
            signature = _read_small(storage, name + SIG_SUFFIX, 1024)
            verify(signing_key.public_key(), data, signature)
        except FileNotFoundError:
            raise PolicyLoadError(f"{name} carries no signature ({name}{SIG_SUFFIX}): not this trainer's") from None
        except SignatureError:
            raise PolicyLoadError(f"{name}'s signature is not this trainer's key's: a forged pointer") from None
    return _parse_latest(data, name)


def deployed_version(storage: Storage, signing_key: Any, channel: str | None = None) -> int | None:
    """The version the signed ``latest.json`` names (0: absent), None when it is unusable
    (unsigned, forged, malformed, or -- with a key -- signed for another `channel` than this
    trainer's: logged as an ERROR). Raises OSError when it cannot be read."""
    try:
        pointer = read_pointer(storage, LATEST, signing_key)
    except PolicyLoadError as e:
        log.error("%s under %s is not used: %s", LATEST, storage.uri(), e)
        return None
    if pointer is not None and signing_key is not None and pointer.get("channel") != channel:
        log.error(
            "%s under %s is signed for channel %r, not this trainer's %r: not used",
            LATEST,
            storage.uri(),
            pointer.get("channel"),
            channel,
        )
        return None
    return 0 if pointer is None else int(pointer["policy_version"])


#: the most version directories (of any channel) above latest.json's that the trainer reads, as
#: services (`rlrec.trainer.policy_files.MAX_NEWER_VERSIONS`): more is refused loudly (OSError)
MAX_NEWER = MAX_NEWER_VERSIONS
#: the most version directories above the version it knows that the trainer reads to repair a
#: root with more than `MAX_NEWER` (`scan_above` with this window): more is refused loudly
MAX_REPAIR_SCAN = 100 * MAX_NEWER


def _ended(storage: Storage, d: str, signing_key: Any) -> str | None:
    """The decision the canary version directory `d` holds a record of (``canary-ended.json``:
    "promote", "rollback" or "abandoned"): signed by `signing_key` (any record without a key) and
    naming the version of `d` itself (a record copied from another version's directory is none);
    None without one. Raises OSError when it cannot be read now."""
    doc = _ended_record(storage, d, signing_key)
    return None if doc is None else doc["decision"]


def _ended_record(storage: Storage, d: str, signing_key: Any) -> dict | None:
    """`d`'s ``canary-ended.json`` as `_ended` accepts it (None: no such record)."""
    from rlrec.trainer.export import _read_small

    rel = f"{d}/{CANARY_ENDED}"
    try:
        data = _read_small(storage, rel, 4096)
        if signing_key is not None:
            verify(signing_key.public_key(), data, _read_small(storage, rel + SIG_SUFFIX, 1024))
        doc = _json(data, rel)
    except (FileNotFoundError, SignatureError, PolicyLoadError):
        return None
    if not isinstance(doc, dict) or type(doc.get("canary_version")) is not int or doc["canary_version"] != int(d[1:]):
        return None
    decision = doc.get("decision")
    if decision not in ("promote", "rollback", "abandoned") or not _bound(storage, d, doc, signing_key, rel):
        return None
    return doc


class TooManyVersions(OSError):
    """More version directories above the deployed version than a reader reads (`MAX_NEWER`,
    or `MAX_REPAIR_SCAN` for the trainer's repair)."""


def signed_above(storage: Storage, signing_key: Any, named: int, channel: str | None, canary_floor: int = 0) -> int:
    """The highest version above `named` that `signing_key` signed for `channel` and that was
    deployed: not a rolled-back canary (a signed ``canary-ended.json`` saying so), not the
    undecided one ``canary.json`` names (a canary whose signed ``canary-ended.json`` exists is
    decided, whatever a replayed ``canary.json`` says). When ``canary.json`` cannot be read, only
    versions whose signed ``canary-ended.json`` says "promote" count (an undecided canary is never
    taken for a deployed version), unless its signed ``rollout.json`` decided to promote it (a
    trainer killed before carrying that out). When there is one, a ``latest.json`` naming `named` is a
    replayed pointer (services refuse it and keep that version). `named` when there is none (or
    without a key). Versions at or below the canary floor -- `canary_floor` (the trainer's own)
    or the signed ``latest.json``'s naming `named` -- ended unpromoted: neither read nor counted
    against `MAX_NEWER`; more raise `TooManyVersions`."""
    return scan_above(storage, signing_key, named, channel, canary_floor, MAX_NEWER).deployed


@dataclass(frozen=True)
class Above:
    """What `scan_above` found above a version: the deployed version (`signed_above`), the floor
    the rollback records above it prove (over up to `MAX_REPAIR_SCAN` directories: every one above the deployed version is read, so no record steers which version that is), and the highest undecided canary
    above it (0: none): a canary version this key signed for the channel that neither a signed
    ``canary-ended.json`` nor a signed ``rollout.json`` decided -- nothing proves it was never
    promoted, so no pointer below it may be signed (`UndecidedCanary`)."""

    deployed: int
    floor: int
    undecided: int = 0


def scan_above(
    storage: Storage, signing_key: Any, named: int, channel: str | None, canary_floor: int, window: int
) -> Above:
    """`signed_above` and the floor the rollback records prove over at most `window` directories, with the highest
    undecided canary above the deployed version (`Above`)."""
    from rlrec.trainer.export import VERSION_DIR_RE, _verified_spec, signed_floor

    if signing_key is None:
        return Above(named, canary_floor)
    ended_upto = max(named, canary_floor, signed_floor(storage, named, signing_key, channel))
    unreadable = False
    try:
        canary = read_pointer(storage, CANARY, signing_key)
    except (OSError, PolicyLoadError) as e:
        canary, unreadable = None, True
        log.error(
            "%s under %s cannot be read (%s): only promoted canaries count as deployed above v%d",
            CANARY,
            storage.uri(),
            e,
            named,
        )
    running = None if canary is None else int(canary["policy_version"])
    names = sorted(
        (
            i.name
            for i in storage.list("")
            if i.is_dir and VERSION_DIR_RE.match(i.name) and int(i.name[1:]) > ended_upto
        ),
        reverse=True,
    )
    if len(names) > window:
        raise TooManyVersions(
            f"{len(names)} version directories above v{ended_upto} under {storage.uri()}, over the limit of {window}"
            + (" (services refuse such a root too)" if window == MAX_NEWER else "")
            + ": the deployed version cannot be found"
        )
    if window > MAX_NEWER and len(names) > MAX_NEWER:
        log.warning(
            "%d version directories above v%d under %s, over the limit of %d (services refuse such a root too): "
            "reading every one down to the deployed version",
            len(names),
            ended_upto,
            storage.uri(),
            MAX_NEWER,
        )
    floor, undecided = canary_floor, 0
    for d in names:  # every one: a window of the highest would let copied-in versions hide the deployed one
        try:
            _spec_bytes, spec = _verified_spec(storage, d, signing_key)
        except (OSError, SignatureError, ValueError, PolicyLoadError):
            continue
        if spec.get("channel") != channel:
            continue
        version = int(d[1:])
        ended = _ended(storage, d, signing_key)
        if ended in ("rollback", "abandoned"):
            if running is None or version < running:
                floor = max(floor, version)
            continue
        canary = version == running or spec.get("rollout") == "canary"
        if ended is None and (unreadable or canary):
            decision = read_decision(storage, version, signing_key)
            if decision is None or decision.get("decision") != "promote":
                if decision is None and canary and not undecided:
                    undecided = version  # the highest: names are read newest first
                continue  # put on canary and never promoted (its pointer removed or replayed): not deployed
        return Above(version, floor, undecided)
    return Above(named, floor, undecided)


def deployable(storage: Storage, signing_key: Any, version: int, channel: str | None) -> bool:
    """Whether `version` is a deployed version here as `signed_above` counts one: its
    ``policy.json`` verifies under this root with `signing_key` for `channel`, and it is no
    canary ended unpromoted nor one never promoted. A signed pointer naming another (copied from
    another root of the key and channel) names no deployed version. True without a key (an
    unsigned setup trusts its root). Raises OSError when it cannot be read now.

    Example:
        >>> deployable(Storage.from_uri("/tmp/rlrec-no-such-root"), None, 3, "prod")
        True
    """
    from rlrec.trainer.export import _verified_spec

    if signing_key is None:
        return True
    d = version_dir(version)
    try:
        _spec_bytes, spec = _verified_spec(storage, d, signing_key)
    except (FileNotFoundError, SignatureError, ValueError, PolicyLoadError):
        return False
    if spec.get("channel") != channel:
        return False
    ended = _ended(storage, d, signing_key)
    if ended in ("rollback", "abandoned"):
        return False
    return spec.get("rollout") != "canary" or ended == "promote" or _promoted(storage, d, signing_key)


def _promoted(storage: Storage, d: str, signing_key: Any) -> bool:
    """Whether canary version directory `d` holds this key's signed decision to promote it
    (``rollout.json``, `read_decision`): decided, though perhaps not carried out (a trainer
    killed before ``latest.json`` moved). Raises OSError when it cannot be read now."""
    decision = read_decision(storage, int(d[1:]), signing_key)
    return decision is not None and decision.get("decision") == "promote"


def read_decision(storage: Storage, version: int, signing_key: Any) -> dict | None:
    """The decision `end_canary` recorded for canary `version` (``rollout.json``, signed by
    `signing_key` when given); None when there is none or it is not this trainer's (logged).
    Raises OSError when it cannot be read now."""
    from rlrec.trainer.export import _read_small

    rel = f"{version_dir(version)}/{ROLLOUT}"
    try:
        data = _read_small(storage, rel, MAX_BYTES[SPEC])
        if signing_key is not None:
            verify(signing_key.public_key(), data, _read_small(storage, rel + SIG_SUFFIX, 1024))
        doc = _json(data, rel)
    except FileNotFoundError:
        return None
    except (PolicyLoadError, SignatureError) as e:
        log.error("%s is not this trainer's decision (%s): ignored", rel, e)
        return None
    if not isinstance(doc, dict) or doc.get("decision") not in ("promote", "rollback"):
        return None
    if doc.get("canary_version") != version or isinstance(doc.get("canary_version"), bool):
        log.error("%s records the decision of v%s, not of v%d: ignored", rel, doc.get("canary_version"), version)
        return None
    if not _bound(storage, version_dir(version), doc, signing_key, rel):
        return None
    return doc


#: the fields that bind a signed decision record to the version it decides
IDENTITY = ("sha256", "channel", "run_id")


def version_identity(storage: Storage, d: str, signing_key: Any) -> dict | None:
    """What binds a decision record to version directory `d`: the sha256 of its ``policy.json``
    (signed by `signing_key`, when given), its channel and the run that published it. None when
    that policy.json cannot be verified (absent, forged, junk). Raises OSError when it cannot be
    read now.

    Example:
        >>> version_identity(Storage.from_uri("/tmp/rlrec-no-such-root"), "v000001", None) is None
        True
    """
    from rlrec.trainer.export import _read_small, _verified_spec

    try:
        if signing_key is not None:
            spec_bytes, spec = _verified_spec(storage, d, signing_key)
        else:
            spec_bytes = _read_small(storage, f"{d}/{SPEC}", MAX_BYTES[SPEC])
            spec = _json(spec_bytes, f"{d}/{SPEC}")
    except (FileNotFoundError, SignatureError, ValueError, PolicyLoadError):
        return None
    if not isinstance(spec, dict) or spec.get("policy_version") != int(d[1:]):
        return None
    return {
        "sha256": hashlib.sha256(spec_bytes).hexdigest(),
        "channel": spec.get("channel"),
        "run_id": spec.get("run_id"),
    }


def _bound(storage: Storage, d: str, doc: dict, signing_key: Any, rel: str) -> bool:
    """Whether the decision record `doc` (read from `rel`) names the version `d` holds now: the
    sha256 of its verified policy.json, its channel and its run id (`version_identity`). A record
    of another version with the same number -- a reused number, another root's or channel's
    version, a record from before records were bound -- is no record (logged as an ERROR)."""
    ident = version_identity(storage, d, signing_key)
    if ident is not None and all(doc.get(k) == ident[k] for k in IDENTITY):
        return True
    log.error(
        "%s decides version sha256 %.12s channel %r run %r, not the %s there now: ignored (no decision)",
        rel,
        doc.get("sha256"),
        doc.get("channel"),
        doc.get("run_id"),
        "unverifiable one" if ident is None else f"sha256 {ident['sha256']:.12} channel {ident['channel']!r}",
    )
    return False


def _write_ended(storage: Storage, d: str, decision: Any, deployed: int, ident: dict, signing_key: Any) -> None:
    """Write the signed ``canary-ended.json`` of canary directory `d`, bound to its version (`ident`)."""
    ended = {"canary_version": int(d[1:]), "decision": decision, "deployed_version": deployed, **ident}
    _write_signed(storage, f"{d}/{CANARY_ENDED}", json.dumps(ended, sort_keys=True).encode(), signing_key)


def _write_signed(storage: Storage, rel: str, data: bytes, signing_key: Any) -> None:
    storage.write(rel, data)
    if signing_key is not None:
        storage.write(rel + SIG_SUFFIX, sign(signing_key, data))
    else:
        storage.delete(rel + SIG_SUFFIX)


def write_canary(
    storage: Storage, pub: Any, signing_key: Any, *, base_version: int, started: float, canary_floor: int = 0
) -> None:
    """Put the prepared publication `pub` (`rlrec.trainer.export.Publication`) on canary above
    `base_version`: ``canary.json`` first, then its files (`write_publication` without moving
    ``latest.json``). Idempotent.

    Args:
        storage: the publish root.
        pub: the candidate's publication.
        signing_key: the trainer's Ed25519 private key (signs the pointer).
        base_version: the version ``latest.json`` names (0: nothing deployed yet).
        started: when the canary began (kept across rewrites: episodes before it are no evidence).
        canary_floor: the highest canary the trainer ended without a promotion (its own,
            checkpointed): versions at or below it ended and are not read again.

    Example:
        >>> write_canary(storage, pub, key, base_version=4, started=time.time())  # doctest: +SKIP
    """
    from rlrec.trainer.export import reserve_version, write_publication

    sha = hashlib.sha256(pub.files[SPEC]).hexdigest()
    reserve_version(storage, pub.version, sha.encode())  # before canary.json names it
    _end_abandoned(storage, pub.version, signing_key)
    _end_orphans(storage, pub.version, base_version, signing_key, pub.channel, canary_floor)
    data = canary_pointer_bytes(
        pub.version,
        pub.directory,
        sha,
        base_version=base_version,
        started=started,
        run_id=pub.run_id,
        channel=pub.channel,
        now=started,
    )
    _write_signed(storage, CANARY, data, signing_key)
    write_publication(storage, pub, signing_key, pointer=False)


def refresh_canary(
    storage: Storage,
    version: int,
    signing_key: Any,
    *,
    base_version: int,
    started: float,
    channel: str | None,
    sha256: str | None = None,
    now: float | None = None,
) -> bool:
    """Rewrite ``canary.json`` (+ ``.sig``) whole for this trainer's running canary `version`,
    with a fresh time, from the trainer's own state and the version's signed ``policy.json``
    -- never from the stored pointer, so a torn pair (a failed or killed ``.sig`` write), a
    replayed or a deleted pointer is repaired at the next refresh. Services that check a
    pointer's age (``max_pointer_age_s``) stop serving the canary of a trainer that stopped
    judging it. False (logged) when the version's ``policy.json`` is not signed by this key for
    `channel` or is not the canary's (`sha256`). Without a key (an unsigned setup) the pointer
    is rewritten unsigned, so its time still tells services the trainer is judging it.

    Args:
        storage: the publish root.
        version: the running canary's version.
        signing_key: the trainer's Ed25519 private key.
        base_version: the version deployed below it (0: none).
        started: when the canary began.
        channel: this trainer's channel.
        sha256: the canary's policy.json sha256 as the trainer recorded it (None: not recorded).
        now: the pointer's time (default: now).

    Example:
        >>> refresh_canary(storage, 5, key, base_version=4, started=t0, channel="prod")  # doctest: +SKIP
        True
    """
    import time

    d = version_dir(version)
    try:
        spec_bytes, spec = _canary_spec(storage, d, signing_key)
    except (FileNotFoundError, SignatureError, ValueError, PolicyLoadError) as e:
        log.error("not refreshing %s: %s/%s cannot be verified (%s)", CANARY, d, SPEC, e)
        return False
    sha = hashlib.sha256(spec_bytes).hexdigest()
    if spec.get("channel") != channel or (sha256 is not None and sha != sha256):
        log.error("not refreshing %s: %s/%s is not this trainer's canary on channel %s", CANARY, d, SPEC, channel)
        return False
    data = canary_pointer_bytes(
        version,
        d,
        sha,
        base_version=base_version,
        started=started,
        run_id=spec.get("run_id"),
        channel=channel,
        now=time.time() if now is None else now,
    )
    _write_signed(storage, CANARY, data, signing_key)
    return True


def _canary_spec(storage: Storage, d: str, signing_key: Any) -> tuple[bytes, dict]:
    """(bytes, parsed) of ``d/policy.json``: verified with `signing_key`; without a key (an
    unsigned setup, whose services run with ``allow_unsigned``) read as it is."""
    from rlrec.trainer.export import _read_small, _verified_spec

    if signing_key is not None:
        return _verified_spec(storage, d, signing_key)
    spec_bytes = _read_small(storage, f"{d}/{SPEC}", MAX_BYTES[SPEC])
    spec = _json(spec_bytes, f"{d}/{SPEC}")
    if not isinstance(spec, dict) or spec.get("policy_version") != int(d[1:]):
        raise ValueError(f"{d}/{SPEC} is not the policy.json of {d}")
    return spec_bytes, spec


def repoint_latest(
    storage: Storage, version: int, signing_key: Any, channel: str | None, canary_floor: int = 0
) -> bool:
    """Write ``latest.json`` (+ ``.sig``) whole for `version`, from its ``policy.json`` signed by
    `signing_key` for `channel` (its run id taken from it): the trainer's repair of a pointer it
    owns that is torn, junk, or names another version than the one its own state says is
    deployed, or the re-sign of a rollback with a raised `canary_floor` (kept with the floor of
    the signed pointer it rewrites, `rlrec.trainer.export.signed_floor`). False (logged) when
    that policy.json is not this key's for `channel`.

    Example:
        >>> repoint_latest(storage, 4, key, "prod")  # doctest: +SKIP
        True
    """
    from rlrec.trainer.export import _verified_spec, _write_latest

    d = version_dir(version)
    try:
        spec_bytes, spec = _verified_spec(storage, d, signing_key)
    except (FileNotFoundError, SignatureError, ValueError, PolicyLoadError) as e:
        log.error("not re-pointing %s at %s: its %s cannot be verified (%s)", LATEST, d, SPEC, e)
        return False
    if spec.get("channel") != channel:
        log.error(
            "not re-pointing %s at %s: it is signed for channel %r, not %r", LATEST, d, spec.get("channel"), channel
        )
        return False
    from rlrec.trainer.export import signed_floor

    sha = hashlib.sha256(spec_bytes).hexdigest()
    floor = max(canary_floor, signed_floor(storage, version, signing_key, channel))
    pointer = pointer_bytes(version, d, sha, run_id=spec.get("run_id"), channel=channel, canary_floor=floor)
    _write_latest(storage, pointer, signing_key)
    return True


class UndecidedCanary(RuntimeError):
    """A canary version above the deployed one that no signed decision ended and that this
    trainer cannot prove was never promoted (docs/TRAINER.md, "An undecided canary under the
    root"): no new canary goes on until an operator settles it."""


class BaseUnknown(RuntimeError):
    """The trainer cannot tell which version is deployed under its publish root (an undecided
    canary above the one it would re-sign, or more version directories than it reads): it
    signs no pointer and puts no canary on until an operator settles the root."""


def undecided_text(version: int, base: int, why: str) -> str:
    """What `UndecidedCanary` says of undecided canary `version` above `base` (`why`: what names it)."""
    return (
        f"canary v{version} above v{base} {why} and holds no signed decision: this trainer cannot tell a canary "
        f"whose trainer died undecided from a promoted one whose records were deleted, so it signs nothing and "
        f"puts no new canary on; resume its trainer (--resume), or, if it was never promoted, delete "
        f"{version_dir(version)}/ (docs/TRAINER.md, 'An undecided canary under the root')"
    )


def _settle(storage: Storage, d: str, signing_key: Any, base: int, why: str) -> None:
    """Sign the end of undecided canary directory `d` when its own signed ``rollout.json``
    (bound to it, `read_decision`) decided it -- a trainer killed before carrying the decision
    out: "promote" stands, "rollback" is finished (its base re-signed with the canary floor
    raised to it while ``latest.json`` names that base: the kill may have come inside that
    re-sign). Without such a decision nothing proves it
    was never promoted (its records may have been deleted after a promotion): nothing is
    signed, and `UndecidedCanary` is raised (logged as an ERROR by the caller)."""
    version = int(d[1:])
    ident = version_identity(storage, d, signing_key)
    if ident is None:
        return  # no policy.json of this key there (deleted by an operator): nothing to serve or to end
    decision = read_decision(storage, version, signing_key)
    if decision is None:
        raise UndecidedCanary(undecided_text(version, base, why))
    promote = decision["decision"] == "promote"
    deployed = version if promote else int(decision.get("base_version") or 0)
    channel = ident["channel"]
    if not promote and deployed and deployed_version(storage, signing_key, channel) == deployed:
        # the rollback's re-sign of its base with the floor may be what the kill interrupted
        repoint_latest(storage, deployed, signing_key, channel, version)
    _write_ended(storage, d, decision["decision"], deployed, ident, signing_key)
    log.warning(
        "canary v%d's signed decision was %s: carried out, the next canary goes on", version, decision["decision"]
    )


def _end_abandoned(storage: Storage, version: int, signing_key: Any) -> None:
    """Before `version` goes on canary: a signed ``canary.json`` of this key naming another,
    undecided version (a fresh run over a killed one's) is settled by `_settle`: its signed
    decision is carried out, else `UndecidedCanary` (the trainer waits for an operator). Raises
    OSError when ``canary.json`` cannot be read now (retried later)."""
    if signing_key is None:
        return
    try:
        current = read_pointer(storage, CANARY, signing_key)
    except PolicyLoadError:
        return  # not this key's: services refuse it as well
    if current is None or int(current["policy_version"]) == version:
        return
    d = version_dir(int(current["policy_version"]))
    if _ended(storage, d, signing_key) is not None:  # an unsigned, copied or unbound record is none
        return
    _settle(storage, d, signing_key, int(current.get("base_version") or 0), f"is named by {CANARY}")


def _end_orphans(
    storage: Storage, version: int, base: int, signing_key: Any, channel: str | None, canary_floor: int = 0
) -> None:
    """Before `version` goes on canary above `base`: versions between them that this key signed
    for `channel` as canaries (``"rollout": "canary"`` in their policy.json) and that no decision
    ended -- their ``canary.json`` removed, so `_end_abandoned` does not see them -- are settled
    by `_settle` (their signed decision carried out, else `UndecidedCanary`). Versions at or
    below the canary floor -- `canary_floor` (the trainer's own: with nothing deployed there is
    no ``latest.json`` to carry one) or the signed ``latest.json``'s naming `base` -- ended
    already. Raises
    OSError when the root cannot be read now (retried later)."""
    from rlrec.trainer.export import VERSION_DIR_RE, _verified_spec, signed_floor

    if signing_key is None:
        return
    low = max(base, canary_floor, signed_floor(storage, base, signing_key, channel))
    names = sorted(
        i.name
        for i in storage.list("")
        if i.is_dir and VERSION_DIR_RE.match(i.name) and low < int(i.name[1:]) < version
    )
    if len(names) > MAX_NEWER:
        raise OSError(f"{len(names)} version directories between v{low} and v{version}, over the limit of {MAX_NEWER}")
    for d in names:
        try:
            _spec_bytes, spec = _verified_spec(storage, d, signing_key)
        except (FileNotFoundError, SignatureError, ValueError, PolicyLoadError):
            continue
        if spec.get("channel") != channel or spec.get("rollout") != "canary":
            continue
        if _ended(storage, d, signing_key) is None:
            _settle(storage, d, signing_key, base, "is named by no pointer")


def _remove_canary(storage: Storage, version: int) -> None:
    """Remove ``canary.json`` if it still names `version` (another canary's is left alone; an
    unusable one is removed)."""
    try:
        current = read_pointer(storage, CANARY)
    except PolicyLoadError:
        current = None
    if current is not None and current["policy_version"] != version:
        return
    storage.delete(CANARY)
    storage.delete(CANARY + SIG_SUFFIX)


def end_canary(
    storage: Storage,
    signing_key: Any,
    *,
    version: int,
    base_version: int,
    promote: bool,
    decision: dict,
    run_id: str | None,
    channel: str | None,
    sha256: str | None = None,
    canary_floor: int = 0,
) -> int:
    """Carry out a canary's decision (module docstring); the version ``latest.json`` names after it.

    ``latest.json`` is trusted only when this trainer's key signed it for `channel`: an unusable
    one is taken as "not carried out yet" by a promotion (which overwrites it); a rollback
    re-signs the base version (it stays deployed; nothing is republished), or the version the
    signed ``latest.json`` names when that is above the canary and deployed here (`deployable`:
    an operator's `rlrec.trainer.export.republish_policy` while the canary ran stays deployed; a
    pointer copied from another root, naming a version absent or not deployed here, is not kept).

    Args:
        storage: the publish root.
        signing_key: the trainer's Ed25519 private key.
        version: the canary version.
        base_version: the version deployed while it ran (0: none).
        promote: True promotes it, False rolls it back.
        decision: the decision and its evidence (written to ``rollout.json``).
        run_id: this run's id.
        channel: this run's channel.
        sha256: the canary's policy.json sha256 as the trainer recorded it (None: taken from
            the version's verified policy.json). Both records are bound to it, its channel and
            run id (`version_identity`); a promotion needs the stored policy.json to be it, a
            rollback is recorded even when that policy.json is missing or another.
        canary_floor: the highest canary the trainer ended without a promotion before this
            one: a rollback re-signs ``latest.json`` (the base) with the floor raised to
            `version`, so services never serve this canary again, whatever pointer is replayed.

    Returns:
        The deployed version now: the canary's after a promotion, `base_version` (or the
        version republished above the canary) after a rollback (0: nothing deployed).

    Example:
        >>> end_canary(storage, key, version=5, base_version=4, promote=False,  # doctest: +SKIP
        ...     decision=d, run_id=run_id, channel="cartpole")
        4
    """
    from rlrec.trainer.export import _read_small

    d = version_dir(version)
    ident = version_identity(storage, d, signing_key)
    if sha256 is not None and (ident is None or ident["sha256"] != sha256):
        if promote:
            raise PolicyLoadError(f"{d}/{SPEC} is not canary v{version}'s (sha256 {sha256:.12}): not promoted")
        ident = {"sha256": sha256, "channel": channel, "run_id": run_id}  # rolled back as the trainer knows it
    if ident is None:
        raise PolicyLoadError(f"{d}/{SPEC} cannot be verified: canary v{version}'s decision cannot be bound to it")
    decision = {**decision, **ident}
    _write_signed(storage, f"{d}/{ROLLOUT}", json.dumps(decision, sort_keys=True, indent=1).encode(), signing_key)
    deployed = base_version
    named = deployed_version(storage, signing_key, channel) if promote or signing_key is not None else None
    if named is not None and named > version and not deployable(storage, signing_key, named, channel):
        log.error(
            "%s names v%d, which is no version deployed under %s (a pointer copied from another root?): "
            "not kept by canary v%d's decision",
            LATEST,
            named,
            storage.uri(),
            version,
        )
        named = None
    if promote:
        if named is None or named < version:
            spec_bytes = _read_small(storage, f"{d}/{SPEC}", MAX_BYTES[SPEC])
            sha = hashlib.sha256(spec_bytes).hexdigest()
            _write_signed(storage, LATEST, pointer_bytes(version, d, sha, run_id=run_id, channel=channel), signing_key)
        deployed = version if named is None else max(named, version)
    elif signing_key is not None:
        if named is not None and named > version:  # deployed above it meanwhile (an operator's republish_policy)
            deployed = named
        if deployed:
            repoint_latest(storage, deployed, signing_key, channel, max(canary_floor, version))
    _write_ended(storage, d, decision.get("decision"), deployed, ident, signing_key)
    _remove_canary(storage, version)
    log.info("canary v%d %s: v%d is deployed", version, "promoted" if promote else "rolled back", deployed)
    return deployed

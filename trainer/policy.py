"""Published policies: verifying, loading and acting with torch only (never Ray).

Layout written by the trainer (`rlrec.trainer.export.publish_policy`) under the publish root
(default ``{checkpoint_dir}/policies``)::

    latest.json              {"policy_version": N, "path": "v00000N", "sha256": <sha256 of its policy.json>,
                              "run_id": R, "channel": C, "time": T}
    latest.json.sig          Ed25519 signature over the exact bytes of latest.json
    v00000N/policy.json      the spec: artifact_version 2, policy_version N, directory "v00000N",
                             run_id, channel, format ("safetensors" or "torchscript"), network (layer sizes,
                             activations, log-std clipping), action_dist, spaces, and "files":
                             the sha256 of every other file of the version
    v00000N/policy.json.sig  Ed25519 signature over the exact bytes of policy.json (when the
                             trainer has a signing key: `rlrec train --signing-key PATH`)
    v00000N/model.safetensors  the weights (tensors only) -- or model.pt (TorchScript) for module
                             configurations the spec cannot describe
    v00000N/lineage.json     the shards this version was trained on

`latest.json` is written last, so a reader never sees a half-published version.

Trust rules of `load_policy` (docs/TRAINER.md, "Published policies"): with a public key
(``public_key=`` or the file named by ``RLREC_POLICY_PUBLIC_KEY``) ``policy.json.sig`` is verified
before anything else of the version is read; then every file is checked against the sha256 in
the signed ``policy.json``, and a version whose directory or number disagrees with its
``policy.json`` is refused. Unsigned versions load only with ``allow_unsigned=True`` (safetensors;
warned), TorchScript only when signed or with ``allow_unsigned_code=True`` (warned: TorchScript is
code and can read and write files). ``latest.json``'s ``path`` must match ``^v\\d{6}$`` and its
sha256 must match; `Policy.poll` never moves to a lower version. The weights are rebuilt in plain
torch from the spec (`rlrec.trainer.policy_net`): no ``torch.jit.load``, no pickle.

Bindings (`rlrec.trainer.binding`; docs/DEPLOY.md, "Threat model"): ``latest.json.sig``, when
present, must verify; what the caller pins (``run_id``, ``channel``, ``observation_space``,
``action_space``, ``state_file``, ``max_pointer_age_s``) is checked on the pointer and on the
verified ``policy.json`` before the weights are read; a pointer below a version signed for the
same channel (by any run: a newer run may take a channel over) that is present under the root
is a replay and refused.

Canary (`rlrec.trainer.binding`, docs/DEPLOY.md "Canary rollout"): with ``canary_fraction`` a
`Policy` also follows ``canary.json`` and serves it per episode (`Policy.for_episode`); the
replay check excuses exactly the version a signed same-channel ``canary.json`` names above
``latest.json``'s version (`_canary_applies`, the one place).

Only this module, `rlrec.trainer.policy_files` (the root's files and pointers), `rlrec.trainer.policy_verify`
(verifying a version), `rlrec.trainer.policy_modules` (multi-module versions), `rlrec.trainer.policy_net`, `rlrec.trainer.signing`, `rlrec.trainer.binding`,
`rlrec.trainer.canary`, numpy, json, torch, safetensors and cryptography are imported (`rlrec.producer.spaces` and
gymnasium when a space object is pinned); URIs other than local paths go through
`rlrec.store.storage.Storage` (pyarrow's filesystems and, for gs:// and az://, the cloud's
client library; lazily).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from typing import Any

import numpy as np

from rlrec.trainer.binding import Pins
from rlrec.trainer.canary import (
    MAX_CANARY_AGE_S,
    assignment_info,
    check_canary_age,
    check_canary_fraction,
    in_canary,
)
from rlrec.trainer.policy_files import (  # the names other modules and tests import from here stay importable
    ARTIFACT_VERSION,
    CANARY,
    CANARY_ENDED,  # noqa: F401
    LATEST,
    LINEAGE,
    MAX_BYTES,
    MAX_JSON_DEPTH,  # noqa: F401
    MAX_NEWER_VERSIONS,  # noqa: F401
    SAFETENSORS_MODEL,  # noqa: F401
    SPEC,
    TORCHSCRIPT_MODEL,  # noqa: F401
    VERSION_DIR_RE,  # noqa: F401
    PolicyLoadError,
    UnsignedPolicyWarning,
    _Files,
    _json,
    _parse_latest,  # noqa: F401
    _Pointer,
    read_latest,
    version_dir,
)
from rlrec.trainer.policy_verify import (
    _canary_applies,
    _check_pointer_pins,
    _check_state_deployed,
    _load_version,
    _LoadedVersion,
    _never_deployed,
    _read_canary,
    _read_pointer,
    _remember,
    _spec_check,
    _stale_reason,
    _state_floor,
    _trust,
    read_lineage,
    version_from_artifact,  # noqa: F401
)

__all__ = [
    "ARTIFACT_VERSION",
    "Assignment",
    "Policy",
    "PolicyLoadError",
    "UnsignedPolicyWarning",
    "VersionActor",
    "load_policy",
    "read_latest",
    "read_lineage",
    "version_dir",
]

log = logging.getLogger("rlrec.policy")


# ------------------------------------------------------------------------------- acting


class VersionActor:
    """One loaded version of a `Policy`, to act for the whole of one episode (`Policy.for_episode`).

    Args:
        policy: the policy it belongs to (its sampling generator and `explore` default).
        model: the loaded version.
        canary: whether it is the canary version.
    """

    def __init__(self, policy: Policy, model: _LoadedVersion, canary: bool) -> None:
        self._policy = policy
        self._version = model
        self.canary = canary

    @property
    def policy_version(self) -> int:
        """The version to log for the episode (``begin_episode(policy_version=...)``)."""
        return self._version.version

    def act(self, obs: Any, explore: bool | None = None) -> tuple[Any, dict]:
        """As `Policy.act`, with this version.

        Example:
            >>> action, extra = actor.act(obs)  # doctest: +SKIP
        """
        p = self._policy
        return self._version.act(obs, p.explore if explore is None else explore, p._generator)

    def __repr__(self) -> str:
        return f"VersionActor(policy_version={self.policy_version}, canary={self.canary})"


class Assignment(tuple):
    """``(actor, policy_version)`` of one episode (`Policy.for_episode`): `actor` is a
    `VersionActor`, or None for the deployed share before anything is deployed (the service
    runs what it ran before and logs `policy_version` 0). `info` is what to merge into the
    episode's reset info while a canary runs (its randomized assignment; the trainer counts only
    episodes that log one), else ``{}``."""

    def __new__(cls, actor: VersionActor | None, policy_version: int, info: dict | None = None) -> Assignment:
        self = super().__new__(cls, (actor, policy_version))
        self.info = dict(info or {})
        return self

    @property
    def actor(self) -> VersionActor | None:
        return self[0]

    @property
    def policy_version(self) -> int:
        return self[1]

    @property
    def canary(self) -> bool:
        return self[0] is not None and self[0].canary


class Policy:
    """A verified published policy, ready to act; `poll()` switches to a newer published version.

    Guarantees: every loaded version passed the trust rules of the module docstring and the
    pins it was built with (run id, channel, spaces, state file, pointer age); the version in
    use never decreases (`poll` refuses a ``latest.json`` naming a lower version with
    `PolicyLoadError`); a refused or stale pointer leaves the current version in use; `act`
    uses one version from start to end even while `poll` swaps.

    With ``canary_fraction`` f > 0 it also follows ``canary.json`` (a candidate on trial,
    ``rlrec train --rollout canary``) while ``latest.json`` names the canary's base version, and
    `for_episode` serves it to the share f of episodes chosen by `rlrec.trainer.canary.in_canary`;
    a canary that is refused or ends (promoted, rolled back) leaves the deployed version serving
    every episode. `act` and the batch methods always use the deployed version.

    Readable by the caller: `stale_pointer` (the last poll found the pointer too old),
    `stale_pointers` (how many polls did), `refusals` (how many polls raised),
    `last_refusal` (the last refusal's message) and `canary_refusals` (canary pointers or
    versions refused)."""

    def __init__(
        self,
        root: str,
        *,
        version: int | None = None,
        explore: bool = False,
        seed: int | None = None,
        public_key: Any = None,
        allow_unsigned: bool = False,
        allow_unsigned_code: bool = False,
        run_id: str | None = None,
        channel: str | None = None,
        observation_space: Any = None,
        action_space: Any = None,
        state_file: Any = None,
        max_pointer_age_s: float | None = None,
        canary_fraction: float = 0.0,
        max_canary_age_s: float | None = MAX_CANARY_AGE_S,
        module_id: str | None = None,
    ) -> None:
        import torch

        try:
            self.canary_fraction = check_canary_fraction(canary_fraction)
        except (TypeError, ValueError) as e:
            raise PolicyLoadError(str(e)) from None
        if self.canary_fraction and version is not None:
            raise PolicyLoadError("canary_fraction follows the pointers: it cannot be used with version=")
        self._deployed: _LoadedVersion | None = None
        self._canary: _LoadedVersion | None = None
        self.canary_refusals = 0
        self._last_canary_refusal: str | None = None
        self.root = root
        self.explore = explore
        self._files = _Files(root)
        self._trust = dataclasses.replace(_trust(public_key, allow_unsigned, allow_unsigned_code), module_id=module_id)
        try:
            self._pins = Pins.of(
                run_id=run_id,
                channel=channel,
                observation_space=observation_space,
                action_space=action_space,
                state_file=state_file,
                max_pointer_age_s=max_pointer_age_s,
            )
        except (TypeError, ValueError) as e:
            raise PolicyLoadError(f"bad pin: {e}") from None
        try:
            self.max_canary_age_s = check_canary_age(max_canary_age_s)
        except ValueError as e:
            raise PolicyLoadError(f"bad max_canary_age_s: {e}") from None
        self._generator = torch.Generator()
        self._generator.manual_seed(int(seed) if seed is not None else int(np.random.SeedSequence().entropy % 2**63))
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self.stale_pointer = False
        self.stale_pointers = 0
        self.refusals = 0
        self.last_refusal: str | None = None
        self._canary_floor = _state_floor(self._pins)  # canaries at or below it ended: never served again
        if version is None and self.canary_fraction and not self._files.exists(LATEST):
            _check_state_deployed(self.root, self._pins)
            self._poll_canary()  # nothing deployed yet: a first version may be on canary
            if self._canary is None:
                raise PolicyLoadError(f"no policy is published under {root} (no {LATEST}, no usable {CANARY})")
            return
        if version is None:
            pointer = self._pointer()
            reason = _stale_reason(pointer, self._pins, self._trust, time.time())
            if reason is not None:
                raise PolicyLoadError(f"{reason}: a stale pointer is not followed")
            self._model = self._load_pointed(pointer)
            self._note_floor(pointer)
        else:
            rel_dir = version_dir(int(version))
            check = _spec_check(self._files, self._trust, self._pins, None)
            self._model = _load_version(self._files, rel_dir, self._trust, check=check)
        _remember(self._model, self._pins, canary_floor=self._canary_floor)
        if self.canary_fraction:
            self._poll_canary()

    @property
    def _model(self) -> _LoadedVersion:
        m = self._deployed
        if m is None:
            raise PolicyLoadError(
                f"nothing is deployed under {self.root} yet (only a canary): use for_episode(), whose "
                "other episodes run what the service ran before"
            )
        return m

    @_model.setter
    def _model(self, model: _LoadedVersion) -> None:
        self._deployed = model

    @property
    def canary_version(self) -> int | None:
        """The canary version served to a share of episodes now (None: no canary)."""
        c = self._canary
        return None if c is None else c.version

    def for_episode(self, episode_id: str) -> Assignment:
        """The version to run for a whole episode, and the version to log for it.

        The episode runs the canary when there is one and `rlrec.trainer.canary.in_canary`
        (episode_id, canary_fraction) holds: a salted hash of the id, so every replica and
        every restart choose alike; else the deployed version (``latest.json``'s). Before
        anything is deployed (only a canary published), the other episodes get ``(None, 0)``:
        run what the service ran before, and log policy version 0.

        Args:
            episode_id: the id the episode is recorded with.

        Returns:
            `Assignment` ``(actor, policy_version)``; keep the actor for the whole episode
            (a `poll` meanwhile does not change it). While a canary runs, log its ``info`` in
            the episode's reset info: only episodes that do are the canary test's evidence.

        Example:
            >>> a = policy.for_episode(eid)  # doctest: +SKIP
            >>> rec.begin_episode(obs, {**info, **a.info}, episode_id=eid, policy_version=a.policy_version)  # doctest: +SKIP
            >>> action, extra = a.actor.act(obs)  # doctest: +SKIP
            >>> action, extra = actor.act(obs)  # doctest: +SKIP
        """
        with self._lock:
            deployed, canary = self._deployed, self._canary
        if canary is None:
            if deployed is None:
                return Assignment(None, 0)
            return Assignment(VersionActor(self, deployed, False), deployed.version)
        arm = in_canary(episode_id, self.canary_fraction)
        info = assignment_info(canary.version, self.canary_fraction, arm, canary.spec_sha256)
        if arm:
            return Assignment(VersionActor(self, canary, True), canary.version, info)
        if deployed is None:
            return Assignment(None, 0, info)
        return Assignment(VersionActor(self, deployed, False), deployed.version, info)

    def _poll_canary(self) -> bool:
        """Follow ``canary.json`` (module docstring); True if the canary changed. A refused
        canary pointer or version is logged (once per message), counted in `canary_refusals`,
        and no canary is served."""
        try:
            pointer = _read_canary(self._files, self._trust, self.root)
            if pointer is not None:
                _check_pointer_pins(pointer, self._pins)
                stale = _stale_reason(pointer, self._pins, self._trust, time.time())
                if stale is not None:  # its trainer stopped re-signing it: nobody judges the canary
                    raise PolicyLoadError(stale)
                stale = _canary_age_reason(pointer, self.max_canary_age_s, time.time())
                if stale is not None:
                    raise PolicyLoadError(stale)
        except (OSError, PolicyLoadError) as e:
            return self._refuse_canary(str(e))
        deployed = self._deployed
        base = deployed.version if deployed is not None else 0
        channel = deployed.spec.get("channel") if deployed is not None else (pointer and pointer.channel)
        if not _canary_applies(pointer, base, channel, self._trust):
            return self._set_canary(None)
        if pointer.version <= self._canary_floor:
            return self._refuse_canary(
                f"{CANARY} names v{pointer.version}, at or below the canary floor v{self._canary_floor} of the "
                f"{LATEST} this service trusted: a canary that ended without a promotion is not served again"
            )
        current = self._canary
        if current is not None and current.version == pointer.version:
            return False
        try:
            check = _spec_check(self._files, self._trust, self._pins, pointer)
            model = _load_version(self._files, pointer.path, self._trust, pointer.doc.get("sha256"), check)
            model.spec_sha256 = pointer.doc.get("sha256")  # checked against its policy.json
            _remember(model, self._pins, canary=True)
        except (OSError, PolicyLoadError) as e:
            return self._refuse_canary(str(e))
        self._last_canary_refusal = None
        return self._set_canary(model)

    def _refuse_canary(self, why: str) -> bool:
        self.canary_refusals += 1
        if why != self._last_canary_refusal:
            log.warning("canary refused, the deployed version serves every episode: %s", why)
        self._last_canary_refusal = why
        return self._set_canary(None)

    def _set_canary(self, model: _LoadedVersion | None) -> bool:
        with self._lock:
            before, self._canary = self._canary, model
        ended = model is None and before is not None and before.version > self._canary_floor
        if ended and _never_deployed(self._files, self._trust, version_dir(before.version)):
            # the canary it served ended without a promotion (its signed, bound end record): never
            # served again here, whatever pointer is replayed (a first canary has no latest.json floor)
            self._canary_floor = before.version
            try:
                _remember(None, self._pins, canary_floor=self._canary_floor)
            except PolicyLoadError as e:
                log.warning("the canary floor v%d is not kept in the state file: %s", before.version, e)
        if (before is None) != (model is None) or (before is not None and before.version != model.version):
            if model is not None:
                log.info("canary v%d serves %.3g of episodes", model.version, self.canary_fraction)
            else:
                log.info("canary v%d ended: the deployed version serves every episode", before.version)
            return True
        return False

    def _pointer(self) -> _Pointer:
        pointer = _read_pointer(self._files, self._trust, self.root)
        _check_pointer_pins(pointer, self._pins)
        return pointer

    def _load_pointed(self, pointer: _Pointer) -> _LoadedVersion:
        check = _spec_check(self._files, self._trust, self._pins, pointer)
        model = _load_version(self._files, pointer.path, self._trust, pointer.doc.get("sha256"), check)
        model.spec_sha256 = pointer.doc.get("sha256")  # checked against its policy.json
        return model

    def _note_floor(self, pointer: _Pointer) -> None:
        """Keep the canary floor of a ``latest.json`` this service trusts (signed by the
        configured key, or no key configured; for the deployed version's channel): canaries at
        or below it ended without a promotion. The floor only rises (in the state file too), so
        a replayed older pointer cannot lower it."""
        if self._trust.public_key is not None and not pointer.signed:
            return
        deployed = self._deployed
        if deployed is not None and (
            pointer.channel != deployed.spec.get("channel") or pointer.version < deployed.version
        ):
            return
        if pointer.canary_floor > self._canary_floor:
            self._canary_floor = pointer.canary_floor
            _remember(None, self._pins, canary_floor=self._canary_floor)

    @property
    def policy_version(self) -> int:
        """The deployed version in use (0: none yet, only a canary)."""
        m = self._deployed
        return 0 if m is None else m.version

    @property
    def run_id(self) -> str | None:
        """The run that published the version in use (None: published before run ids)."""
        return self._model.spec.get("run_id")

    @property
    def channel(self) -> str | None:
        """The channel the version in use was published for (None: published before channels)."""
        return self._model.spec.get("channel")

    @property
    def signed(self) -> bool:
        """Whether the version in use carries a signature verified with the configured key."""
        return self._model.signed

    @property
    def spec(self) -> dict:
        return dict(self._model.spec)

    # -- batch API (what the equivalence tests compare with the RLModule)
    def action_dist_inputs(self, obs_batch: Any) -> np.ndarray:
        """Action distribution inputs for a batch of observations, ``(B, k)`` float32."""
        return self._model.forward(obs_batch).numpy().astype(np.float32)

    def deterministic_actions(self, obs_batch: Any) -> np.ndarray:
        """RLlib's ``to_deterministic().sample()`` per observation (see `PolicyDistribution`)."""
        m = self._model
        return m.dist.deterministic(m.forward(obs_batch)).numpy()

    def logp(self, obs_batch: Any, actions: Any) -> np.ndarray:
        """Log-probability of `actions` (distribution units) under each observation's distribution."""
        import torch

        m = self._model
        return m.dist.logp(m.forward(obs_batch), torch.as_tensor(np.asarray(actions))).numpy()

    # -- what off-policy evaluation needs (rlrec.trainer.ope.PolicyTarget; see _LoadedVersion)
    def action_probs(self, obs_batch: Any) -> np.ndarray:
        """Categorical policies: every action's probability per observation, ``(B, n)`` float64.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.

        Example:
            >>> policy.action_probs(obs_batch).sum(-1)  # doctest: +SKIP
            array([1., 1.])
        """
        return self._model.action_probs(obs_batch)

    def logp_env(self, obs_batch: Any, actions: Any) -> np.ndarray:
        """Log-probability of env-unit `actions` (as episodes record them) under the exploring policy.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.
            actions: ``(B,)`` or ``(B, *action_shape)`` actions as the environment took them.

        Example:
            >>> policy.logp_env(obs_batch, episode_actions)  # doctest: +SKIP
        """
        return self._model.logp_env(obs_batch, actions)

    def sample_env_actions(self, obs_batch: Any, n: int, seed: int = 0) -> np.ndarray:
        """`n` exploring actions per observation in env units, ``(B, n, *action_shape)``.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.
            n: samples per observation.
            seed: the sampling seed.

        Example:
            >>> policy.sample_env_actions(obs_batch, 8).shape  # doctest: +SKIP
            (2, 8, 1)
        """
        return self._model.sample_env_actions(obs_batch, n, seed)

    def greedy_env_actions(self, obs_batch: Any) -> np.ndarray:
        """The action ``act(obs, explore=False)`` takes for each observation, in env units.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.

        Example:
            >>> policy.greedy_env_actions(obs_batch)  # doctest: +SKIP
            array([1, 0])
        """
        return self._model.greedy_env_actions(obs_batch)

    # -- acting
    def act(self, obs: Any, explore: bool | None = None) -> tuple[Any, dict]:
        """One observation -> (action, extra_model_outputs) to pass to `EpisodeRecorder.log_step`.

        Args:
            obs: one observation.
            explore: sample from the policy's distribution (True) or take its most likely action
                (False); default: the `explore` given at construction.

        Returns:
            The action in env units and ``{"action_dist_inputs": ..., "action_logp": ...}``:
            the distribution's inputs, and the log-propensity of the action taken. Exploring,
            that is the action's log-probability under the distribution it was sampled from;
            with ``explore=False`` the choice is deterministic, its propensity is 1 and
            ``action_logp`` is 0.0. Data logged that way cannot be used by importance-weighted
            off-policy estimators (`rlrec.trainer.ope` reports them "not estimable"): log with
            ``explore=True`` to evaluate other policies on it later.

        Example:
            >>> action, extra = policy.act(obs, explore=True)  # doctest: +SKIP
            >>> rec.log_step(eid, action, reward, next_obs, extra_model_outputs=extra)  # doctest: +SKIP
        """
        with self._lock:
            m = self._model
        return m.act(obs, self.explore if explore is None else explore, self._generator)

    def poll(self) -> bool:
        """Switch to the version ``latest.json`` names if it is newer and passes every check.

        Returns:
            True if switched; False if the pointer names the version in use, or is stale
            (older than ``max_pointer_age_s``: logged, counted in `stale_pointers`,
            `stale_pointer` set, never followed).

        Raises:
            PolicyLoadError: the pointer or the version it names is refused (a lower version,
            another run or channel than pinned, other spaces, a replayed pointer, a failed
            verification); it is logged, counted in `refusals`, and the current version stays
            in use.

        Example:
            >>> if policy.poll():  # doctest: +SKIP
            ...     recorder.policy_version = policy.policy_version
        """
        try:
            return self._poll()
        except PolicyLoadError as e:
            self.refusals += 1
            if str(e) != self.last_refusal:
                log.warning("policy poll refused, v%d stays in use: %s", self.policy_version, e)
            self.last_refusal = str(e)
            raise

    def _poll(self) -> bool:
        if self._deployed is None and not self._files.exists(LATEST):
            return self._poll_canary()
        try:
            switched = self._poll_deployed()
        except PolicyLoadError:
            if self.canary_fraction:  # a refused latest.json never keeps serving a canary the trainer ended
                self._poll_canary()
            raise
        if self.canary_fraction:
            switched = self._poll_canary() or switched
        return switched

    def _poll_deployed(self) -> bool:
        pointer = self._pointer()
        current = self.policy_version
        if pointer.version < current:
            raise PolicyLoadError(f"{LATEST} names v{pointer.version}, older than v{current} in use: rollback refused")
        reason = _stale_reason(pointer, self._pins, self._trust, time.time())
        if reason is not None:
            self.stale_pointers += 1
            if not self.stale_pointer:
                log.warning("stale policy pointer, v%d stays in use: %s", current, reason)
            self.stale_pointer = True
            return False
        self.stale_pointer = False
        if pointer.version == current:
            self._note_floor(pointer)
            return False
        model = self._load_pointed(pointer)
        with self._lock:
            if model.version <= self.policy_version:
                return False
            _remember(model, self._pins)
            self._model = model
        self._note_floor(pointer)
        return True

    def start_polling(self, interval_s: float = 5.0, on_update: Any = None) -> None:
        """Poll in a daemon thread; `on_update(policy)` after each switch. Refusals are logged by
        `poll` (once per distinct message), other failures here; the current version stays in use."""

        def loop() -> None:
            last_error = None
            while not self._stop.wait(interval_s):
                try:
                    if self.poll() and on_update is not None:
                        on_update(self)
                    last_error = None
                except PolicyLoadError:
                    pass
                except Exception as e:  # keep acting with the current version
                    if str(e) != last_error:
                        log.warning("policy poll: %s", e)
                        last_error = str(e)

        if self._poller is None:
            self._poller = threading.Thread(target=loop, name="rlrec-policy-poll", daemon=True)
            self._poller.start()

    def stop_polling(self) -> None:
        self._stop.set()

    def lineage(self) -> dict:
        """The version's lineage.json (checked against its sha256 in policy.json when pinned)."""
        m = self._model
        rel_dir = version_dir(m.version)
        data = self._files.read(f"{rel_dir}/{LINEAGE}", MAX_BYTES[LINEAGE])
        want = m.files.get(LINEAGE)
        if want is not None and hashlib.sha256(data).hexdigest() != want:
            raise PolicyLoadError(f"{rel_dir}/{LINEAGE} does not match the sha256 in {SPEC}")
        return _json(data, f"{rel_dir}/{LINEAGE}")

    def __repr__(self) -> str:
        if self._deployed is None:
            return f"Policy({self.root!r}, policy_version=0, canary_version={self.canary_version})"
        canary = f", canary_version={self.canary_version}" if self.canary_fraction else ""
        return (
            f"Policy({self.root!r}, policy_version={self.policy_version}{canary}, "
            f"dist={self._model.dist.kind!r}, signed={self.signed})"
        )


def load_policy(
    uri: str,
    *,
    version: int | None = None,
    explore: bool = False,
    seed: int | None = None,
    wait_s: float = 0.0,
    public_key: Any = None,
    allow_unsigned: bool = False,
    allow_unsigned_code: bool = False,
    run_id: str | None = None,
    channel: str | None = None,
    observation_space: Any = None,
    action_space: Any = None,
    state_file: Any = None,
    max_pointer_age_s: float | None = None,
    canary_fraction: float = 0.0,
    max_canary_age_s: float | None = MAX_CANARY_AGE_S,
    module_id: str | None = None,
) -> Policy:
    """Load the latest (or a given) published policy, checked against what the service pins.

    Args:
        uri: a publish root (e.g. ``{checkpoint_dir}/policies``; a checkpoint dir with a
            ``policies/`` folder works too), a local path or a pyarrow filesystem URI.
        version: load this version instead of the one ``latest.json`` names.
        explore: `Policy.act` samples instead of taking the greedy action.
        seed: the sampling seed.
        wait_s: > 0: retry refusals for that long (a first publication, a publication in progress).
        public_key: the trainer's Ed25519 public key (a PEM file path, or the PEM text/bytes);
            default: the file named by ``RLREC_POLICY_PUBLIC_KEY``.
        allow_unsigned: load safetensors versions without a verified signature (warned).
        allow_unsigned_code: load TorchScript versions without a verified signature (warned).
        run_id: only versions and pointers signed for this run (`Policy.run_id` of a version
            you trust; kept across ``rlrec train --resume``).
        channel: only versions and pointers signed for this channel (``rlrec train --channel``).
        observation_space: the service's observation space (a gymnasium space or its JSON
            form): a version for another one is refused.
        action_space: the service's action space, likewise.
        state_file: a local JSON file this service owns: a version below the newest it has
            loaded before (across restarts) is refused; rewritten atomically after each load.
        max_pointer_age_s: a ``latest.json`` older than this is stale: not followed (here a
            `PolicyLoadError`; `Policy.poll` reports it and keeps the current version).
        canary_fraction: opt in to canaries (``rlrec train --rollout canary``): this share of
            episodes, chosen by a salted hash of the episode id (`rlrec.trainer.canary`), runs
            the candidate ``canary.json`` names; act with `Policy.for_episode`. 0: never; at
            most 0.5 (the test counts deployed episodes from the other half).
        max_canary_age_s: a ``canary.json`` signed longer ago than this is not served (default
            `rlrec.trainer.canary.MAX_CANARY_AGE_S`, an hour; the trainer re-signs its running
            canary's every `rlrec.trainer.canary.CANARY_RESIGN_S`): a replayed pointer of an
            ended canary, or a dead trainer's canary, stops being served. A positive finite number
            of seconds (anything else: `PolicyLoadError` at load), or None: no limit.
        module_id: of a multi-module version (``rlrec train --multi-agent``): serve this module's
            network as a single policy; without it such a version's `Policy.act` takes
            ``{agent_id: observation}`` and returns per-agent actions and extras, each agent
            acted for by its recorded module (`rlrec.trainer.policy_modules`).

    Raises:
        PolicyLoadError: nothing loadable is published, or it fails a check (module docstring;
            docs/TRAINER.md "Published policies").

    Example:
        >>> import gymnasium as gym  # doctest: +SKIP
        >>> env = gym.make("CartPole-v1")  # doctest: +SKIP
        >>> policy = load_policy(  # doctest: +SKIP
        ...     "s3://bucket/run1/policies", public_key="/etc/rlrec/policy-signing.pub",
        ...     channel="cartpole", observation_space=env.observation_space,
        ...     action_space=env.action_space, state_file="/var/lib/svc/policy-state.json")
        >>> action, extra = policy.act(obs)  # doctest: +SKIP
    """
    root = os.fspath(uri).rstrip("/")
    files = _Files(root)
    if (
        not files.exists(LATEST)
        and not files.exists(CANARY)
        and (files.exists(f"policies/{LATEST}") or files.exists(f"policies/{CANARY}"))
    ):
        root = f"{root}/policies"  # a checkpoint directory: its publish root (a first canary has no latest.json)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Policy(
                root,
                version=version,
                explore=explore,
                seed=seed,
                public_key=public_key,
                allow_unsigned=allow_unsigned,
                allow_unsigned_code=allow_unsigned_code,
                run_id=run_id,
                channel=channel,
                observation_space=observation_space,
                action_space=action_space,
                state_file=state_file,
                max_pointer_age_s=max_pointer_age_s,
                canary_fraction=canary_fraction,
                max_canary_age_s=max_canary_age_s,
                module_id=module_id,
            )
        except PolicyLoadError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def _canary_age_reason(pointer: Any, limit: float | None, now: float) -> str | None:
    """Why ``canary.json`` is too old to be served (None: it is not, or no limit)."""
    if limit is None:
        return None
    t = pointer.doc.get("time")
    if not isinstance(t, (int, float)):
        return f"{pointer.name} (v{pointer.version}) carries no time (max_canary_age_s={limit:g})"
    if now - t > limit:  # no exact age in the message: it is logged once, not at every poll
        return (
            f"{pointer.name} (v{pointer.version}) was signed more than max_canary_age_s={limit:g} s ago: "
            "its trainer stopped re-signing it (stopped, or the pointer is replayed)"
        )
    return None

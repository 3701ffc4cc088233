"""The trainer's publications: committed versions written to the publish root under its lease, numbered,
signed and pointed at (``latest.json``, or ``canary.json`` with ``--rollout canary``), with their lineage
(a part of `rlrec.trainer.service.ContinuousTrainer`).
"""

from __future__ import annotations

import time
from typing import Any

from rlrec.store.storage import StorageError
from rlrec.trainer.lineage import LineageError, add_seq, ranges_doc
from rlrec.trainer.publish_lease import PublishRootTaken
from rlrec.trainer.service_common import (
    LineageLost,
    _ranges_state,
    log,
    shard_places,
)


class PublishMixin:
    """The trainer's publications (mixed into `ContinuousTrainer`)."""

    def _write_publications(self) -> None:
        """Write the committed publications not written yet (oldest first); one that fails stays
        pending (in memory and in every later checkpoint) and is written again later."""
        from rlrec.trainer.canary_publish import write_canary
        from rlrec.trainer.export import VersionTaken, highest_version, write_publication

        while self._pending:
            pub = self._pending[0]
            self._check_lease()
            try:
                if pub.canary_base is not None:
                    self._start_canary_clock(pub)
                    write_canary(
                        self.publish_storage,
                        pub,
                        self.signing_key,
                        base_version=pub.canary_base,
                        started=float(pub.canary_started or pub.time),
                        canary_floor=self._canary_floor,
                    )
                else:
                    pointer = highest_version(self.publish_storage, self.signing_key) <= pub.version
                    write_publication(self.publish_storage, pub, self.signing_key, pointer=pointer)
                    if pointer:
                        self._deployed = max(self._deployed, pub.version)
            except LineageError as e:  # its data is gone: never deployed, not retried
                log.error("%s", e)
                self._pending.pop(0)
                if pub.canary_base is not None:
                    self._drop_refused_canary(pub.version)
                continue
            except VersionTaken as e:  # another publication holds its number: never written, not retried
                log.error("%s: policy v%d is dropped; the next version is numbered above it", e, pub.version)
                self._pending.pop(0)
                if pub.canary_base is not None and self.canary is not None and self.canary.version == pub.version:
                    self.canary = None
                continue
            except PublishRootTaken:
                raise
            except Exception as e:
                log.error("publishing policy v%d failed (%s); it is written again later", pub.version, e)
                return
            self._pending.pop(0)
            if pub.canary_base is not None:
                log.info("published policy v%d on canary above v%d", pub.version, pub.canary_base)
            else:
                log.info("published policy v%d", pub.version)

    def _start_canary_clock(self, pub: Any) -> None:
        """A canary starts when its ``canary.json`` lands, not when it was prepared: a
        publication pending through a publish-store outage (or until a resume) starts now, so
        its wall-clock limits do not count time it was not served. A rewrite of a pointer that
        already names it keeps its start."""
        from rlrec.trainer.canary_publish import read_pointer
        from rlrec.trainer.policy import CANARY, PolicyLoadError

        try:
            current = read_pointer(self.publish_storage, CANARY)
        except (OSError, PolicyLoadError):
            current = None
        if current is not None and current.get("policy_version") == pub.version:
            return
        pub.canary_started = time.time()
        if self.canary is not None and self.canary.version == pub.version and not self.canary.history:
            self.canary.started = pub.canary_started

    def _drop_refused_canary(self, version: int) -> None:
        """A canary whose publication was refused is no canary: its pointer goes (if it still
        names it; retried at the next look otherwise) and the next candidate is judged."""
        from rlrec.trainer.canary_publish import _remove_canary

        if self.canary is not None and self.canary.version == version:
            self.canary = None
        try:
            _remove_canary(self.publish_storage, version)
        except PublishRootTaken:
            raise
        except Exception as e:
            log.error(
                "removing the canary pointer of refused v%d failed (%s): services refuse it meanwhile", version, e
            )

    def _latest_version(self) -> int:
        """A canary's base: the version the signed ``latest.json`` names, never below the version
        this trainer itself deployed (`_deployed`, kept in its checkpoint). An unsigned, forged,
        older (replayed), another channel's or unreadable pointer is no base: the trainer's own
        record is (logged); nor is one naming a version above it that does not verify here as a
        deployed version (`deployable`: a pointer copied from another root).

        Raises:
            BaseUnknown: the deployed version cannot be known (`_repair`): nothing is signed."""
        from rlrec.trainer.canary_publish import deployable, deployed_version
        from rlrec.trainer.policy import LATEST

        known = self._deployed
        channel = self.cfg.publish_channel
        try:
            named = deployed_version(self.publish_storage, self.signing_key, channel)
            if (
                named is not None
                and named > known
                and not deployable(self.publish_storage, self.signing_key, named, channel)
            ):
                log.error(
                    "%s names v%d, which is no version deployed under %s (absent, not this key's for this channel, "
                    "or a canary never promoted: a pointer copied from another root?): not the canary's base",
                    LATEST,
                    named,
                    self.publish_storage.uri(),
                )
                named = None
        except OSError as e:
            log.warning("cannot read %s (%s): the canary's base is v%d, deployed by this trainer", LATEST, e, known)
            return known
        if named is None:  # unusable: torn, junk, another channel's, another root's
            return self._repair_latest(known)
        if named < known:
            log.error(
                "%s names v%d, below v%d which this trainer deployed (a replayed pointer?): the canary's base is v%d",
                LATEST,
                named,
                known,
                known,
            )
            return known
        return self._repair(
            named,
            f"{LATEST} names v{named}, but v%d, signed by this key for this channel and no "
            "canary, exists (a replayed or unfinished pointer: services refuse it)",
        )

    def _repair_latest(self, known: int) -> int:
        """The base under an unusable ``latest.json``: the trainer's own record, or above it the
        highest version its key signed for its channel that was deployed (`signed_above`; a fresh
        run has no record); ``latest.json`` is re-pointed at it (signed), so services restart
        again instead of refusing a torn or junk pointer until the next promotion. More version
        directories above it than the window are all read (`_signed_above`): rolled-back
        canaries never hide the deployed version.

        Raises:
            BaseUnknown: the deployed version cannot be known (`_repair`): nothing is signed."""
        from rlrec.trainer.policy import LATEST

        if self.signing_key is None:
            return known
        return self._repair(known, f"{LATEST} was unusable: v%d is the deployed version", unusable=True)

    def _repair(self, named: int, why: str, unusable: bool = False) -> int:
        """The deployed version at or above `named` (`_signed_above`); ``latest.json`` is
        re-pointed at it (signed) when it is above `named` or the pointer is `unusable` (`why` %
        it, logged) -- never, above `named`, below a canary that nothing proves was never
        promoted: then nothing is signed.

        Raises:
            BaseUnknown: an undecided canary lies above that version (`UndecidedCanary`'s text),
                or the versions above `named` are more than the trainer reads."""
        from rlrec.trainer.canary_publish import BaseUnknown, repoint_latest, undecided_text
        from rlrec.trainer.policy import LATEST

        try:
            found = self._signed_above(named)
        except BaseUnknown:
            raise
        except OSError as e:
            log.error("cannot read the versions above v%d (%s): the canary's base is v%d", named, e, named)
            return named
        if found.deployed <= named and not (unusable and found.deployed):
            return found.deployed
        if found.deployed > named and found.undecided > found.deployed:
            raise BaseUnknown(
                f"not re-pointing {LATEST} at v{found.deployed}: "
                + undecided_text(found.undecided, found.deployed, "lies above it")
            )
        log.error("%s: the canary's base, and %s is re-pointed at it", why % found.deployed, LATEST)
        repoint_latest(
            self.publish_storage, found.deployed, self.signing_key, self.cfg.publish_channel, self._canary_floor
        )
        return found.deployed

    def _signed_above(self, named: int) -> Any:
        """`rlrec.trainer.canary_publish.scan_above` `named` with the trainer's floor (an
        `Above`): every version directory down to the deployed version is read (up to
        `MAX_REPAIR_SCAN`, with a warning over the services' `MAX_NEWER`), and the floor it proves
        raises the trainer's: rolled-back canaries never hide the deployed version, nor stop a publication
        (`_end_orphans`), even in a fresh run with no ``latest.json`` to carry a floor.

        Raises:
            OSError: the root cannot be read now.
            BaseUnknown: more than `MAX_REPAIR_SCAN` version directories lie above `named`."""
        from rlrec.trainer.canary_publish import (
            MAX_REPAIR_SCAN,
            BaseUnknown,
            TooManyVersions,
            scan_above,
        )

        storage, key, channel = self.publish_storage, self.signing_key, self.cfg.publish_channel
        try:
            found = scan_above(storage, key, named, channel, self._canary_floor, MAX_REPAIR_SCAN)
        except TooManyVersions as e:
            raise BaseUnknown(
                f"{e}, so no canary goes on and no pointer is signed: remove the version directories under "
                f"{storage.uri()} that hold no policy.json signed by this trainer's key (junk, copies from other "
                f"roots) or old rolled-back canaries, until at most {MAX_REPAIR_SCAN} lie above v{named}"
            ) from None
        if found.floor > self._canary_floor:
            log.warning(
                "versions up to v%d above the deployed v%d ended unpromoted (signed rollback records): the canary floor",
                found.floor,
                found.deployed,
            )
            self._canary_floor = found.floor
        return found

    def hold_publish_lease(self, lease: Any) -> None:
        """Publish under `lease` (an acquired `rlrec.trainer.publish_lease.PublishLease`): every
        write to the publish root is fenced by it from now on (`FencedStorage`)."""
        from rlrec.trainer.publish_lease import FencedStorage

        self.publish_lease = lease
        raw = self.publish_storage.storage if isinstance(self.publish_storage, FencedStorage) else self.publish_storage
        self.publish_storage = FencedStorage(raw, lease)

    def _check_lease(self) -> None:
        """Raise `PublishRootTaken` unless this trainer still holds the publish root's lease."""
        if self.publish_lease is not None:
            self.publish_lease.check()

    @property
    def deployed_version(self) -> int:
        """The version ``latest.json`` names for this run (a canary's base while one runs; with
        ``--rollout canary``, the version this trainer's decisions left deployed)."""
        if self.canary is not None:
            return self.canary.base_version
        return self._deployed if self.cfg.rollout == "canary" else self.policy_version

    def publish(self, final: bool = False) -> None:
        """Publish the current policy as the next version, or hand it to its gate.

        ``--promotion-gate env`` evaluates it here and publishes it if it passes; ``ope``
        starts its off-policy evaluation in the background (`rlrec.trainer.ope_jobs`) and
        publishes it when the decision comes (`collect_evaluation`). With ``--ope-report`` (and
        no ope gate) the candidate's off-policy estimate is started in the background too.

        Args:
            final: the stop's checkpoint (no ``--ope-report`` estimate is started).

        Example:
            >>> trainer.publish()  # doctest: +SKIP
            >>> trainer.policy_version  # doctest: +SKIP
            1
        """
        from rlrec.trainer.promotion import export_candidate

        if self.canary is not None:
            log.info(
                "the candidate of iteration %d is not evaluated: canary v%d is still on trial",
                self.iteration,
                self.canary.version,
            )
            return
        version = self._next_version()
        if self.run_id is None:
            from rlrec.trainer.binding import new_run_id

            self.run_id = new_run_id()
            log.info(
                "run id %s (channel %s): signed into every policy version it publishes",
                self.run_id,
                self.cfg.publish_channel,
            )
        if self.cfg.promotion_gate == "ope":
            self._start_evaluation(version, gating=True)
            return
        artifact = None
        report = self.cfg.ope_report and not final
        if self.cfg.promotion_gate == "env" or report:
            try:
                if self.cfg.multi_agent:  # every module in one version (the env gate plays them all)
                    from rlrec.trainer.multi_agent_export import build_modules_artifact

                    artifact = build_modules_artifact(self.algo, self.modules)
                else:
                    artifact = export_candidate(self.algo, self.obs_space, self.act_space)
            except Exception as e:
                log.error("exporting candidate v%d failed (%s): not published", version, e)
                return
        if report:
            self._start_evaluation(version, gating=False, artifact=artifact)
        metadata = {"gamma": self._gamma()}
        try:
            lineage = self._lineage()
        except LineageLost:
            raise
        except Exception as e:
            log.error("publishing policy v%d failed: its lineage: %s (a later checkpoint publishes)", version, e)
            return
        if self.cfg.promotion_gate == "env":
            if not self._promote_env(version, artifact):
                return
            metadata["promotion"] = self.last_promotion
        self._publish(version, artifact, metadata, lineage)

    def _lineage(self) -> dict:
        """What a version published now records of its training (docs/TRAINER.md, "Lineage"):
        the shards new since the last version, and ``data``: the input store, the shards trained
        on (at least one row of each in a gradient step) as manifest seq ranges per partition
        log (``trained``; `trained_ranges`, kept in the checkpoint) and their number, the
        manifest cursor holding them (`rlrec.store.cursor.cursor_at`) and the holdout
        fraction whose held-out episodes of those shards were not trained on.

        Raises:
            LineageLost: a trained shard is in no partition log of the input (the trainer stops).
            StorageError: the store does not answer (a later checkpoint publishes)."""
        from rlrec.store.cursor import CursorError, cursor_at

        if self._lineage_lost is not None:
            raise LineageLost(
                f"no lineage can be recorded: {self._lineage_lost}; not publishing without one. Check --input "
                "(the store this run trained on); start a new run (another --checkpoint-dir) if its manifest "
                "lost those entries"
            )
        if not self._place_trained():
            raise StorageError(f"the manifest entries of {len(self._unplaced)} trained shard(s) are not read yet")
        ends = {k: rs[-1][1] for k, rs in self.trained_ranges.items() if rs}
        try:
            cursor = cursor_at(self.input, ends, self._log_firsts)
        except CursorError as e:  # a partition log of trained shards is gone from the input
            self._lineage_lost = str(e)
            return self._lineage()
        return {
            "iteration": self.iteration,
            "timesteps_trained": self.timesteps_trained,
            "shards": None,  # named by data["trained"]: a list of every shard would grow without bound
            "new_shards": sorted(self.since_publish),
            "data": {
                "input": self.input.uri(),
                "cursor": str(cursor),
                "trained": ranges_doc(self.trained_ranges),
                "trained_before": ranges_doc(self.published_ranges),
                **self._expired_before_publication(),
                "shards_trained": len(self.trained),
                "holdout_fraction": float(self.cfg.ope.holdout_fraction),
            },
        }

    def _expired_before_publication(self) -> dict:
        """``expired_before_publication``: the shards holding data the versions before had trained
        on (`published_ranges`) that retention removed since (`rlrec.trainer.lineage.removed_data`):
        the new version's lineage cannot reopen them, and its publication is not refused for them."""
        from rlrec.trainer.lineage import removed_data

        if not self.published_ranges:
            return {}
        try:
            _, lost = removed_data(self.input, {k: [tuple(r) for r in rs] for k, rs in self.published_ranges.items()})
        except Exception as e:  # the publication's own check reads the removal log again
            log.warning("reading the removal log of %s for the lineage failed: %s", self.input.uri(), e)
            return {}
        return {"expired_before_publication": sorted(lost)} if lost else {}

    def _note_trained(self, keys: Any) -> None:
        """Add the shards `keys` (just trained) to `trained_ranges`, by their manifest
        entries (`_place_trained`)."""
        self._unplaced |= set(keys)
        self._place_trained()

    def _place_trained(self) -> bool:
        """Find the manifest entries of the trained shards not placed yet: from the follower,
        else from the input's manifest (read once per call that needs it: a shard the follower
        no longer selects, a checkpoint without ranges). A shard in no partition log marks
        the lineage lost (`LineageLost` at the next publish); a store that does not answer
        leaves them for the next call. True when every trained shard is placed."""
        if not self._unplaced:
            return True
        od = self.algo.offline_data if self.algo is not None else None
        found = {k: od.seqs(k) if od is not None else None for k in self._unplaced}
        unknown = [k for k, e in found.items() if e is None]
        if unknown:
            try:
                by_path = shard_places(self.input)
            except StorageError as e:
                log.warning(
                    "reading the manifest of %s for the lineage failed (%s); retried later", self.input.uri(), e
                )
                by_path = None
            if by_path is not None:
                found.update({k: by_path.get(k) for k in unknown})
                lost = sorted(k for k in unknown if found[k] is None)
                if lost and self._lineage_lost is None:
                    self._lineage_lost = (
                        f"{len(lost)} trained shard(s) are in no partition log of {self.input.uri()}, e.g. {lost[0]}"
                    )
                    log.error("%s: no version can be published with a lineage", self._lineage_lost)
                self._unplaced -= set(lost)
        for k, place in found.items():
            if place is not None:
                key, seqs = place
                for q in seqs:
                    add_seq(self.trained_ranges.setdefault(key, []), q)
                self._unplaced.discard(k)
        return not self._unplaced

    def _publish(self, version: int, artifact: Any, metadata: dict, lineage: dict) -> bool:
        """Prepare `artifact` (None: export the Learner's weights now) as `version`, to be
        committed by the next checkpoint and written after it (`checkpoint`); True if it was."""
        from rlrec.trainer.export import prepare_publication

        if self.cfg.rollout == "canary":  # signed: a canary is deployed only once a decision promotes it
            metadata = {**metadata, "rollout": "canary"}
        try:
            if artifact is None and self.cfg.multi_agent:  # every module in one version
                from rlrec.trainer.multi_agent_export import build_modules_artifact

                artifact = build_modules_artifact(self.algo, self.modules)
            pub = prepare_publication(
                algo=self.algo,
                version=version,
                algo_name=self.cfg.algo,
                observation_space=self.obs_space,
                action_space=self.act_space,
                iteration=lineage["iteration"],
                timesteps_trained=lineage["timesteps_trained"],
                shards=lineage["shards"],
                new_shards=lineage["new_shards"],
                data=lineage["data"],
                parent_version=self.policy_version or None,
                signing_key=self.signing_key,
                artifact=artifact,
                metadata=metadata,
                run_id=self.run_id,
                channel=self.cfg.publish_channel,
            )
        except Exception as e:
            log.error("publishing policy v%d failed: %s", version, e)
            if self.last_promotion is not None and self.last_promotion["candidate_version"] == version:
                self.last_promotion["promoted"] = False  # not deployed after all
            return False
        candidate_return = None
        if self.last_promotion is not None and self.last_promotion["candidate_version"] == version:
            candidate_return = self.last_promotion.get("candidate_return")
        if self.cfg.rollout == "canary":
            import hashlib

            from rlrec.trainer.canary_publish import BaseUnknown
            from rlrec.trainer.policy import SPEC
            from rlrec.trainer.rollout import CanaryRun

            try:
                pub.canary_base, pub.canary_started = self._latest_version(), time.time()
            except BaseUnknown as e:
                log.error("not publishing policy v%d: %s", version, e)
                if self.last_promotion is not None and self.last_promotion["candidate_version"] == version:
                    self.last_promotion["promoted"] = False  # not deployed after all
                return False
            self.canary = CanaryRun(
                version=version,
                base_version=pub.canary_base,
                started=pub.canary_started,
                gamma=self._gamma() or 0.99,
                rule=self.cfg.canary_rule(),
                candidate_return=candidate_return,
                sha256=hashlib.sha256(pub.files[SPEC]).hexdigest(),
            )
            self._canary_next_look = 0.0
        elif candidate_return is not None:
            self.deployed_return = candidate_return
        self._pending.append(pub)
        self.published_ranges = _ranges_state(lineage["data"]["trained"])
        self.policy_version = version
        self.since_publish -= set(lineage["new_shards"])
        return True

    def _next_version(self) -> int:
        """One above this run's last version, above every version (signed by this trainer's key,
        when it has one) already under the publish root -- a fresh run or a rollback republished
        there is never overwritten -- and above every canary floor it knows (its own, and the
        signed ``latest.json``'s: services refuse a canary at or below it); a number whose
        directory exists already (even unsigned junk) is skipped."""
        from rlrec.trainer.export import VERSION_DIR_RE, highest_reserved, highest_version
        from rlrec.trainer.policy import version_dir

        storage = self.publish_storage
        try:
            signed = highest_version(storage, self.signing_key)
            present = max(signed, highest_reserved(storage, signed), self._pointer_floor())
            taken = {i.name for i in storage.list("") if i.is_dir and VERSION_DIR_RE.match(i.name)}
        except Exception as e:
            log.warning("cannot list the published versions (%s); numbering from v%d", e, self.policy_version)
            present, taken = 0, set()
        present = max(present, self._canary_floor)
        if present > self.policy_version:
            log.info("v%d is published already under %s: publishing above it", present, storage.uri())
        version = max(self.policy_version, present) + 1
        while version_dir(version) in taken:
            log.warning(
                "%s/ exists already under %s (not a version of this key): numbering above it",
                version_dir(version),
                storage.uri(),
            )
            version += 1
        return version

    def _pointer_floor(self) -> int:
        """The ``canary_floor`` of the ``latest.json`` this trainer's key signed for its channel
        (0: none, or no key). Raises OSError when it cannot be read now."""
        from rlrec.trainer.canary_publish import read_pointer
        from rlrec.trainer.policy import LATEST, PolicyLoadError

        if self.signing_key is None:
            return 0
        try:
            pointer = read_pointer(self.publish_storage, LATEST, self.signing_key)
        except PolicyLoadError:
            return 0
        if pointer is None or pointer.get("channel") != self.cfg.publish_channel:
            return 0
        return int(pointer.get("canary_floor") or 0)

    def _refresh_pointer(self) -> None:
        """Re-sign the pointer to this run's latest version, and ``canary.json`` while this run's
        canary runs and is still judged (a fresh time for services that check their age; a canary
        whose decision is held, not carried out yet, is not re-signed, so services stop serving it
        at their ``max_canary_age_s``), after this run has published. Without a signing key only ``canary.json`` is rewritten (unsigned: services
        refuse an unsigned ``latest.json`` for its age, but check a canary's by default)."""
        if self.run_id is None:
            return
        from rlrec.trainer.canary_publish import deployed_version, refresh_canary, repoint_latest
        from rlrec.trainer.export import refresh_latest
        from rlrec.trainer.policy import LATEST

        channel = self.cfg.publish_channel
        try:
            self._check_lease()
            deployed = self.deployed_version if self.signing_key is not None else 0
            if deployed and self.cfg.rollout == "canary":  # the pointers are the trainer's: rewritten from its state
                named = deployed_version(self.publish_storage, self.signing_key, channel)
                if named is None or named < deployed:
                    if repoint_latest(self.publish_storage, deployed, self.signing_key, channel, self._canary_floor):
                        log.error("%s named %s: re-pointed at v%d, the deployed version", LATEST, named, deployed)
                    deployed = 0
            if deployed:
                refresh_latest(
                    self.publish_storage,
                    version=deployed,
                    run_id=self.run_id,
                    channel=channel,
                    signing_key=self.signing_key,
                    canary_floor=self._canary_floor,
                )
            run = self.canary
            if run is not None and not self._pending and self._canary_decision is None:  # a decided canary ages out
                refresh_canary(
                    self.publish_storage,
                    run.version,
                    self.signing_key,
                    base_version=run.base_version,
                    started=run.started,
                    channel=channel,
                    sha256=run.sha256,
                )
        except PublishRootTaken:
            raise
        except Exception as e:
            log.error("refreshing the policy pointer failed: %s", e)

"""Publishing a partition log's committed shards (step 3 of the commit protocol, docs/GUARANTEES.md):
moving a shard from staging to its published path, and a new owner's roll-forward of the shards
committed but not known to be published -- the part of `rlrec.store.manifest.PartitionLog` that
publishes.
"""

from __future__ import annotations

import logging

from rlrec.store.localfs import EscapesRoot
from rlrec.store.log_reader import LogReader
from rlrec.store.manifest_entries import ShardEntry

__all__ = ["LogPublishing"]

log = logging.getLogger("rlrec.manifest")


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


class LogPublishing(LogReader):
    """The publishing methods of `rlrec.store.manifest.PartitionLog` (build that one: `recover`
    ends with its writer's check for a due log snapshot).
    """

    def publish(self, entry: ShardEntry, data: bytes | None = None) -> bool:
        """Move a committed shard from staging to its published path (idempotent).

        Returns True if this call published it, False if it was already published (or
        retention removed it).  If neither file exists and *data* (the shard's bytes, checked
        against the entry's sha256) is given, the published file is written from it -- unless
        a removal record names it (retention deleted it: never re-created, also when the
        record lands while it is written); otherwise FileNotFoundError.
        """
        st = self.storage
        try:
            st.move(entry.staging_path, entry.path)
            moved = True
        except FileNotFoundError:
            if st.exists(entry.path):  # published meanwhile (e.g. by a recovering owner)
                moved = False
            elif data is not None and _sha256(data) == entry.sha256 and not self._removed(entry):
                st.write(entry.path, data)
                if self._removed(entry):  # recorded meanwhile: retention's delete may have run already
                    st.delete(entry.path)
                    moved = False
                else:
                    moved = True
                    log.warning(
                        "%s/%d: staged file of seq %d was gone; published %s from memory",
                        self.topic,
                        self.partition,
                        entry.seq,
                        entry.path,
                    )
            elif data is not None and _sha256(data) == entry.sha256:  # removed by retention: not re-created
                log.info("%s/%d: shard seq %d was removed by retention: not republished", *self._where(entry))
                moved = False
            else:
                raise FileNotFoundError(
                    f"committed shard {entry.path} (seq {entry.seq}) has neither a published nor a staged file"
                ) from None
        with self._lock:
            self._unknown.pop(entry.seq, None)  # type: ignore[arg-type]
        return moved

    def _staging(self) -> tuple[list[tuple[ShardEntry, bool]], set[str]]:
        """(committed shards not known to be published, the files of their staging folders)."""
        with self._lock:
            self.refresh()
            cands = [self._unknown[s] for s in sorted(self._unknown)]
        present: set[str] = set()
        for d in sorted({_parent(e.staging_path) for e, _ in cands}):
            present.update(i.path for i in self.storage.list(d) if not i.is_dir)
        return cands, present

    def staged(self) -> list[ShardEntry]:
        """The committed shards not known to be published whose staging file exists: what
        `recover` would publish (a reader may ask; only the owner publishes). One listing per
        staging folder involved."""
        cands, present = self._staging()
        return [e for e, _ in cands if e.staging_path in present]

    def _where(self, e: ShardEntry) -> tuple[str, int, int | None]:
        return self.topic, self.partition, e.seq

    def _removed(self, e: ShardEntry, named: set | None = None) -> bool:
        """Whether retention removed shard `e` (a removal record names exactly its files): then
        its files are gone by design, not lost. Read only when a listed shard has no file;
        `named`: the files the records name (`_removed_files`), read once for many shards."""
        if named is None:
            named = self._removed_files()
        return (self.topic, self.partition, e.seq, e.path, e.staging_path) in named

    def _removed_files(self) -> set[tuple[str, int, int, str, str]]:
        """What the removal log's records name (a malformed record is logged and names nothing:
        its shards count as not removed, so one bad record never stops this partition)."""
        from rlrec.store.retention import read_removals  # retention builds on this module

        return {
            (f.topic, f.partition, f.seq, f.path, f.staging_path)
            for r in read_removals(self.storage, strict=False)
            for f in r.files
        }

    def recover(self) -> int:
        """Roll forward: publish every committed shard not known to be published whose staging
        file exists (the entries read since the newest snapshot and those a snapshot lists as
        unpublished).  Returns how many were published.  One listing per staging directory
        involved, whatever the history's length.

        A shard a snapshot listed as unpublished that has neither file is logged as an
        error (data loss, e.g. a manual delete) unless a removal record names it (retention
        deleted it); ``verify`` checks every shard.
        """
        cands, present = self._staging()
        published = 0
        named: set | None = None  # the files removal records name: read once, when first needed
        for e, listed in cands:
            if e.staging_path in present:
                try:
                    if self.publish(e):
                        published += 1
                        log.info("%s/%d: rolled forward shard seq %d -> %s", self.topic, self.partition, e.seq, e.path)
                    continue
                except EscapesRoot as err:  # a forged entry or a planted link: refused, left for verify
                    log.error(
                        "%s/%d: not publishing shard seq %d (%s -> %s): %s",
                        self.topic,
                        self.partition,
                        e.seq,
                        e.staging_path,
                        e.path,
                        err,
                    )
                    continue
                except FileNotFoundError:
                    pass
            elif (
                not listed
                or self.storage.exists(e.path)
                or self._removed(e, named := self._removed_files() if named is None else named)
            ):
                with self._lock:
                    self._unknown.pop(e.seq, None)  # type: ignore[arg-type]
                continue
            log.error(
                "%s/%d: committed shard seq %d lost: neither %s nor %s exists",
                self.topic,
                self.partition,
                e.seq,
                e.path,
                e.staging_path,
            )
            with self._lock:
                self._unknown.pop(e.seq, None)  # type: ignore[arg-type]
        with self._lock:
            self._maybe_snapshot()
        return published


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()

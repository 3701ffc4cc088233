"""The continuous trainer's per-iteration metrics: ``metrics.jsonl``, Prometheus gauges, a progress log line."""

from __future__ import annotations

import json
import logging
from typing import Any

from rlrec.store.storage import Storage, StorageError

__all__ = ["METRICS_FILE", "METRICS_SEGMENTS", "TrainerMetrics", "read_metrics_text"]

log = logging.getLogger("rlrec.trainer")

METRICS_FILE = "metrics.jsonl"
#: where an object store's full segments of metrics.jsonl go: ``metrics/{first iteration:012d}.jsonl``
METRICS_SEGMENTS = "metrics"


def _iteration(line: str) -> int | None:
    try:
        it = json.loads(line).get("iteration")
    except (ValueError, AttributeError):
        return None
    return it if isinstance(it, int) and not isinstance(it, bool) else None


def _segments(storage: Storage) -> list[str]:
    """The paths of the rolled segments, oldest first."""
    try:
        infos = storage.list(METRICS_SEGMENTS)
    except FileNotFoundError:
        return []
    names = sorted(i.path.rsplit("/", 1)[-1] for i in infos)
    return [f"{METRICS_SEGMENTS}/{n}" for n in names if n.endswith(".jsonl") and n[:-6].isdigit()]


def _read_lines(storage: Storage, path: str) -> list[str]:
    try:
        return [x for x in storage.read(path).decode("utf-8", errors="replace").splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def read_metrics_text(storage: Storage) -> str:
    """Every metrics line of a trainer's checkpoint dir, oldest first: the rolled segments (an
    object store's, `TrainerMetrics.ROLL_LINES` lines each) then ``metrics.jsonl``, each line once.

    Args:
        storage: the checkpoint dir.

    Raises:
        FileNotFoundError: no metrics were written there yet.

    Example:
        >>> import tempfile
        >>> st = Storage.from_uri(tempfile.mkdtemp())
        >>> m = TrainerMetrics(st, None, False)
        >>> m.write({"iteration": 1}); m.close()
        >>> read_metrics_text(st)
        '{"iteration": 1}\\n'
    """
    lines: list[str] = []
    for path in _segments(storage):
        lines += _read_lines(storage, path)
    last = max((it for it in map(_iteration, lines) if it is not None), default=None)
    if not storage.exists(METRICS_FILE) and not lines:
        raise FileNotFoundError(storage.uri(METRICS_FILE))
    for line in _read_lines(storage, METRICS_FILE):
        it = _iteration(line)
        if last is None or it is None or it > last:  # a roll interrupted before the file was reset
            lines.append(line)
    return "".join(x + "\n" for x in lines)


class TrainerMetrics:
    """One metrics record per training iteration, written to ``metrics.jsonl`` in the checkpoint dir.

    Guarantees: each :meth:`write` adds exactly one JSON line (no NaN/Infinity) and the line is
    readable when it returns -- appended and flushed on a local filesystem; on object stores, which
    cannot append, ``metrics.jsonl`` is rewritten with one atomic PUT (while the store does not
    answer, the lines wait in memory for the next successful rewrite -- the newest
    :attr:`MAX_UNWRITTEN_LINES` of them: a longer outage drops the oldest, counted in
    :attr:`lines_dropped`) and holds at most
    :attr:`ROLL_LINES` lines: a full file is rolled to ``metrics/{first iteration:012d}.jsonl``,
    so a PUT per iteration stays small however long the trainer runs (`read_metrics_text` reads
    them all back, each line once). :meth:`truncate_after`
    leaves only the lines of iterations up to a given one (none for None). With a *port*, the
    numeric fields named in :attr:`GAUGES` are served as Prometheus gauges ``rlrec_trainer_<name>``
    on *host* (0 picks a free port, then in :attr:`port`), set right after the line is written.
    The counter ``rlrec_trainer_storage_errors_total`` counts the input store's failed reads
    (:meth:`count_storage_errors`, from `rlrec.trainer.storage_health.StorageHealth`) as they
    happen, between lines too. With *progress*, one summary line per record goes to the log.
    """

    #: lines an object store's metrics.jsonl holds before it is rolled into a segment
    ROLL_LINES = 1000
    #: lines kept in memory while the store does not answer at most: a longer outage drops the
    #: oldest unwritten ones (counted in `lines_dropped`, ``rlrec_trainer_metrics_lines_dropped_total``)
    MAX_UNWRITTEN_LINES = 1000

    GAUGES = (
        "iteration",
        "policy_version",
        "timesteps_trained",
        "shards_total",
        "shards_new",
        "newest_shard_age_s",
        "learner_loss",
        "eval_return_mean",
        "learner_wait_share",
        "fresh_backlog",
        "shards_missing",
        "shards_skipped",
        "episodes_skipped",
    )

    def __init__(self, storage: Storage, port: int | None, progress: bool, host: str = "127.0.0.1") -> None:
        self.storage = storage
        self.progress = progress
        self.local = storage.kind == "local"
        self._lines: list[str] = []
        self._written = 0  # of `_lines`, those the store holds (the rest wait for the next rewrite)
        #: lines never written: dropped, oldest first, during an outage longer than MAX_UNWRITTEN_LINES lines
        self.lines_dropped = 0
        self._dropped_counter: Any = None
        self._f: Any = None
        self.gauges: dict[str, Any] = {}
        self._server: Any = None
        self._storage_errors: Any = None
        self.port: int | None = None  # where /metrics is served, once started
        if port is not None:
            from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

            reg = CollectorRegistry()
            self.gauges = {k: Gauge(f"rlrec_trainer_{k}", k.replace("_", " "), registry=reg) for k in self.GAUGES}
            self._storage_errors = Counter(
                "rlrec_trainer_storage_errors", "reads of the input store that failed (retried)", registry=reg
            )
            self._dropped_counter = Counter(
                "rlrec_trainer_metrics_lines_dropped",
                "metrics.jsonl lines dropped unwritten during a long outage of the checkpoint store",
                registry=reg,
            )
            self._server = start_http_server(port, addr=host, registry=reg)
            self.port = self._server[0].server_port
            log.info("metrics on http://%s:%d/metrics", host, self.port)

    def count_storage_errors(self, n: int) -> None:
        """Add `n` failed reads of the input store to ``rlrec_trainer_storage_errors_total``."""
        if self._storage_errors is not None and n > 0:
            self._storage_errors.inc(n)

    def truncate_after(self, iteration: int | None) -> None:
        """Drop lines of iterations after `iteration` (training lost by a crash); None: keep none."""

        def kept(lines: list[str]) -> list[str]:
            out = []
            for line in lines:
                it = _iteration(line)
                if iteration is not None and it is not None and it <= iteration:
                    out.append(line)
            return out

        last = None
        for path in _segments(self.storage):
            lines = _read_lines(self.storage, path)
            keep = kept(lines)
            if not keep:
                self.storage.delete(path)
                continue
            if keep != lines:
                self.storage.write(path, "".join(x + "\n" for x in keep).encode())
            last = max(it for it in map(_iteration, keep) if it is not None)
        current = [x for x in kept(_read_lines(self.storage, METRICS_FILE)) if last is None or _iteration(x) > last]
        self._lines = current
        self.storage.write(METRICS_FILE, "".join(x + "\n" for x in current).encode())
        self._written = len(current)

    def write(self, rec: dict) -> None:
        """Add *rec* (needs ``iteration``, ``policy_version``, ``timesteps_trained``, ``shards_total``,
        ``shards_new`` for the progress line) as one line; update the gauges; log the progress line."""
        line = json.dumps(rec, sort_keys=False, allow_nan=False)
        if self.local:
            if self._f is None:  # kept open (appending) until close()
                self._f = open(self.storage.full_path(METRICS_FILE), "a", encoding="utf-8")
            self._f.write(line + "\n")
            self._f.flush()
        else:  # object stores cannot append: rewrite the (small) file
            self._lines.append(line)
            self._bound_unwritten()
            data = "".join(x + "\n" for x in self._lines).encode()
            try:
                self.storage.write(METRICS_FILE, data)
                self._written = len(self._lines)
                if len(self._lines) >= self.ROLL_LINES:
                    self._roll(data)
            except StorageError as e:  # the store does not answer: the next line rewrites the file with this one
                log.warning("%s not written (%s); it is written with the next line", self.storage.uri(METRICS_FILE), e)
        for k, g in self.gauges.items():
            v = rec.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                g.set(v)
        if self.progress:
            ev = rec.get("eval_return_mean")
            age = rec.get("newest_shard_age_s")
            loss = rec.get("learner_loss")
            log.info(
                "iter %d  v%d  steps %d  shards %d (+%d)  newest %s  loss %s  wait %.0f%%%s",
                rec["iteration"],
                rec["policy_version"],
                rec["timesteps_trained"],
                rec["shards_total"],
                rec["shards_new"],
                f"{age:.1f}s" if age is not None else "-",
                f"{loss:.4f}" if loss is not None else "-",
                100 * (rec.get("learner_wait_share") or 0),
                f"  eval {ev:.1f}" if ev is not None else "",
            )

    def _bound_unwritten(self) -> None:
        """Keep at most `MAX_UNWRITTEN_LINES` unwritten lines: drop the oldest of them (never a
        line the store holds), count them and say so."""
        extra = len(self._lines) - self._written - self.MAX_UNWRITTEN_LINES
        if extra <= 0:
            return
        del self._lines[self._written : self._written + extra]
        self.lines_dropped += extra
        if self._dropped_counter is not None:
            self._dropped_counter.inc(extra)
        if self.lines_dropped == extra or self.lines_dropped % self.MAX_UNWRITTEN_LINES < extra:
            log.warning(
                "%s does not answer: %d metrics line(s) dropped unwritten so far (the newest %d are kept)",
                self.storage.uri(METRICS_FILE),
                self.lines_dropped,
                self.MAX_UNWRITTEN_LINES,
            )

    def _roll(self, data: bytes) -> None:
        """Move the full metrics.jsonl (`data`, just written) to its segment. Killed between the
        two writes, the segment and the file hold the same lines: readers take them once."""
        first = _iteration(self._lines[0])
        self.storage.write(f"{METRICS_SEGMENTS}/{(first if first is not None else 0):012d}.jsonl", data)
        self._lines = []
        self._written = 0
        self.storage.write(METRICS_FILE, b"")

    def close(self) -> None:
        """Close metrics.jsonl and stop the Prometheus server (idempotent)."""
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._server is not None:
            try:
                self._server[0].shutdown()
                self._server[0].server_close()
            except Exception:
                pass
            self._server = None

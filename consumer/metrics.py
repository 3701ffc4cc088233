"""Prometheus metrics of the consumer, served on `--metrics-port` with a `/healthz` endpoint."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from rlrec.consumer.assembly import Counters
from rlrec.store.finished import ACTION_LOGP

__all__ = ["MAX_PROPENSITY_SERIES", "ConsumerMetrics"]

#: most policy_id/policy_version label pairs of ``rlrec_steps_without_propensity_total``
MAX_PROPENSITY_SERIES = 64


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # no access log on stderr
        pass


class _AssemblyCollector(Collector):
    """`rlrec_assembly_total{what=...}`: the assemblers' shared `Counters`, read at scrape time."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    def collect(self):
        family = CounterMetricFamily(
            "rlrec_assembly",
            "what episode assembly did: events applied, duplicates, replays skipped, ...",
            labels=["what"],
        )
        for what, n in asdict(self.counters).items():
            family.add_metric([what], n)
        yield family


class ConsumerMetrics:
    """The consumer's counters, gauges and histograms, in a registry of their own.

    Args:
        assembly: the counters every assembler of the consumer counts into (exported as
            `rlrec_assembly_total`).
    """

    def __init__(self, assembly: Counters | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.assembly = assembly if assembly is not None else Counters()
        r.register(_AssemblyCollector(self.assembly))
        self.episodes_committed = Counter("rlrec_episodes_committed", "episodes in committed shards", registry=r)
        self.steps_committed = Counter("rlrec_steps_committed", "steps in committed shards", registry=r)
        self.shards_committed = Counter("rlrec_shards_committed", "shards committed", registry=r)
        self.bytes_committed = Counter("rlrec_bytes_committed", "shard bytes committed", registry=r)
        self.bytes_in = Counter("rlrec_bytes_consumed", "message bytes consumed", registry=r)
        self.dead_letters = Counter(
            "rlrec_dead_letters", "messages sent to the dead-letter topic", ["reason"], registry=r
        )
        self.dead_letter_failures = Counter(
            "rlrec_dead_letter_failures", "dead-letter deliveries that failed (produced again)", registry=r
        )
        self.dead_letters_pending = Gauge(
            "rlrec_dead_letters_pending", "dead letters not yet acknowledged by the broker", registry=r
        )
        self.registry_failures = Counter(
            "rlrec_registry_failures", "schema-registry lookups that failed (message read again)", registry=r
        )
        self.decisions = Counter(
            "rlrec_decisions",
            "early ends decided and written to the log (timeout, capacity, ...)",
            ["reason"],
            registry=r,
        )
        self.partition_count_changes = Counter(
            "rlrec_partition_count_changes", "changes of the topic's partition count seen", registry=r
        )
        self.flush_failures = Counter("rlrec_flush_failures", "shard flushes that failed (retried)", registry=r)
        self.fenced = Counter("rlrec_fenced", "times this consumer was fenced by a newer writer", registry=r)
        self.open_episodes = Gauge("rlrec_open_episodes", "episodes being assembled", registry=r)
        self.open_bytes = Gauge("rlrec_open_bytes", "bytes held by episodes being assembled", registry=r)
        self.buffered_bytes = Gauge("rlrec_buffered_bytes", "bytes of finished episodes not yet written", registry=r)
        self.assigned = Gauge("rlrec_assigned_partitions", "partitions owned", registry=r)
        self.paused_partitions = Gauge(
            "rlrec_paused_partitions", "partitions paused (storage or registry failing, budgets)", registry=r
        )
        self.lag = Gauge(
            "rlrec_consumer_lag", "high watermark - position (where the broker reports it)", ["partition"], registry=r
        )
        self.commit_latency = Histogram(
            "rlrec_commit_latency_seconds",
            "encode + write + manifest + publish",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.freshness = Histogram(
            "rlrec_freshness_seconds",
            "shard commit time - episode end time (producer clock)",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.steps_without_propensity = Counter(
            "rlrec_steps_without_propensity",
            "committed steps without a behaviour propensity (no action_logp extra model output), per policy "
            f"version (the {MAX_PROPENSITY_SERIES} most recently seen policy_id/policy_version pairs)",
            ["policy_id", "policy_version"],
            registry=r,
        )
        self._propensity_series: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._server: WSGIServer | None = None
        self.freshness_samples: list[float] = []  # kept for benchmarks (bounded)

    def on_commit(self, result, seconds: float, episodes) -> None:
        self.shards_committed.inc(result.shards)
        self.episodes_committed.inc(result.episodes)
        self.steps_committed.inc(result.steps)
        self.bytes_committed.inc(result.bytes)
        self.commit_latency.observe(seconds)
        now = time.time()
        for fe in episodes:
            if ACTION_LOGP not in fe.extra_model_outputs:  # per episode: it has the key at every step or none
                self.count_without_propensity(fe.policy_id, fe.policy_version, fe.length)
            f = max(0.0, now - fe.ended_ms / 1000.0)
            self.freshness.observe(f)
            if len(self.freshness_samples) < 1_000_000:
                self.freshness_samples.append(f)

    def count_without_propensity(self, policy_id: str, policy_version: int, steps: int) -> None:
        """Add `steps` committed without a propensity to ``rlrec_steps_without_propensity_total``.

        At most `MAX_PROPENSITY_SERIES` label pairs are exported: a new pair beyond them removes
        the least recently counted one (which starts from 0 if it is counted again).

        Args:
            policy_id: the episodes' policy.
            policy_version: their policy version.
            steps: the steps without ``action_logp``.

        Example:
            >>> m = ConsumerMetrics()
            >>> m.count_without_propensity("p", 3, 20)
            >>> m.registry.get_sample_value(
            ...     "rlrec_steps_without_propensity_total", {"policy_id": "p", "policy_version": "3"})
            20.0
        """
        key = (str(policy_id), str(policy_version))
        series = self._propensity_series
        if key in series:
            series.move_to_end(key)
        else:
            series[key] = None
            if len(series) > MAX_PROPENSITY_SERIES:
                old, _ = series.popitem(last=False)
                self.steps_without_propensity.remove(*old)
        self.steps_without_propensity.labels(*key).inc(steps)

    def serve(
        self, port: int, healthy: Callable[[], tuple[bool, str]] = lambda: (True, "ok"), host: str = "127.0.0.1"
    ) -> int:
        """Serve /metrics and /healthz on `port` (0 picks a free one); returns the port. /healthz
        answers 200 "ok" or 503 with the reasons `healthy()` gives."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ, start_response):
            if environ.get("PATH_INFO") == "/healthz":
                ok, reason = healthy()
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
                return [f"{reason}\n".encode()]
            return metrics_app(environ, start_response)

        self._server = make_server(host, port, app, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="rlrec-metrics", daemon=True).start()
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

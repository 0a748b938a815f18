"""The project's Prometheus metrics of a replica, mirrored into Ray Serve's metrics.

Ray Serve aggregates its replicas' metrics through Ray's metrics agent: each node's export port
(``ray start --metrics-export-port``) serves every replica's series, tagged with its
application, deployment and replica, for Prometheus to scrape and sum. A replica's
:class:`~pipelines.serve.metrics.Metrics` (its own registry, as bcg-serve's) gets a twin of each
counter, histogram and gauge there, named as here (Ray adds its ``ray_`` prefix:
``ray_bcg_serve_request_seconds_bucket{replica=...}``): counters and histograms as they are
counted (each is swapped for a tee that counts in both), gauges by :meth:`Mirror.push`, read from
the registry every few seconds. Importing this module imports neither Ray nor prometheus_client.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Mirror"]


class _Tee:
    """A prometheus_client counter or histogram (or one of its children) that also counts in its
    Ray twin, with the child's labels as the twin's tags."""

    def __init__(self, prom: Any, twin: Any, labelnames: tuple[str, ...], tags: dict[str, str] | None = None) -> None:
        self._prom = prom
        self._twin = twin
        self._labelnames = labelnames
        self._tags = tags or {}

    def labels(self, *values: Any, **named: Any) -> _Tee:
        tags = {k: str(v) for k, v in named.items()} or {k: str(v) for k, v in zip(self._labelnames, values)}
        return _Tee(self._prom.labels(*values, **named), self._twin, (), tags)

    def inc(self, amount: float = 1) -> None:
        self._prom.inc(amount)
        if amount > 0:
            self._twin.inc(amount, tags=self._tags)

    def observe(self, value: float) -> None:
        self._prom.observe(value)
        self._twin.observe(value, tags=self._tags)

    @contextlib.contextmanager
    def time(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._prom, name)


class Mirror:
    """Twins ``metrics``' counters and histograms now (call before anything counts) and its gauges
    at each :meth:`push`."""

    def __init__(self, metrics: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram
        from ray.serve import metrics as ray_metrics

        self._gauges: list[tuple[Any, Any, tuple[str, ...]]] = []
        for attr, prom in list(vars(metrics).items()):
            if not isinstance(prom, (Counter, Gauge, Histogram)):
                continue
            name, doc, labels = prom._name, prom._documentation, tuple(prom._labelnames)
            if isinstance(prom, Gauge):
                self._gauges.append((prom, ray_metrics.Gauge(name, doc, tag_keys=labels), labels))
                continue
            if isinstance(prom, Counter):
                twin = ray_metrics.Counter(name, doc, tag_keys=labels)
            else:
                bounds = [b for b in prom._upper_bounds if 0 < b < math.inf]
                twin = ray_metrics.Histogram(name, doc, boundaries=bounds, tag_keys=labels)
            setattr(metrics, attr, _Tee(prom, twin, labels))

    def push(self) -> None:
        """Every gauge's value now (those read by a function too) into its twin."""
        for prom, twin, labels in self._gauges:
            for family in prom.collect():
                for sample in family.samples:
                    if math.isfinite(sample.value):
                        twin.set(sample.value, tags={k: sample.labels[k] for k in labels})

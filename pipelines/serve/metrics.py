"""The server's Prometheus metrics, in a registry of its own (``GET /metrics``).

Counters: requests by answer status, images generated, requests dropped before they ran (by
reason), pipeline calls by what ran (``graphs`` where a denoiser graph replayed, ``eager`` where
none did, ``failed``, ``out_of_memory``: made again in smaller calls, ``stopped``: at a step's end,
every request it was for gone), denoiser forwards by kind
(``replay``, ``eager``, from the accelerator's counters), and the rows a call ran beyond its
images to reach its bucket (padded). Histograms: images and requests per pipeline call (the
batching), the bucket each call ran at, seconds per request (arrival to answer), in the queue
(arrival to its batch taken by the device worker), per batch served, of the pipeline calls that
made a request's images (``Engine.make``, its host work included; once per request), per image
(a call's seconds over its images) and per image encoded into its file (on the service's
encoding threads, base64 included). Together they split a request's latency:
scripts/bench_serve.py takes the differences of their ``_sum`` and ``_count`` around a run.
Gauges: queue depth, readiness, graph memory held (set after the warm-up and each call) and each
bucket's warm-up seconds.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# An image takes from milliseconds (a tiny model on a CPU) to minutes (a large one, many steps).
_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
# Encoding one image takes a millisecond (a tiny image) to a few hundred (a large PNG).
_ENCODE_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_SMOOTHING = 0.2  # weight of the newest pipeline call in the running mean behind Retry-After


class Metrics:
    """Every metric the server keeps; ``depth`` reads the queue's length when scraped."""

    def __init__(self, max_batch: int, depth: Callable[[], int], batch_sizes: Sequence[int] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        counts = tuple(float(b) for b in range(1, max_batch + 1))
        buckets = tuple(float(b) for b in sorted(set(batch_sizes or range(1, max_batch + 1))))
        self.requests = Counter("bcg_serve_requests", "Requests answered, by HTTP status", ["status"], registry=r)
        self.images = Counter(
            "bcg_serve_images", "Images generated (a request dropped while its batch ran counts too)", registry=r
        )
        self.dropped = Counter("bcg_serve_dropped", "Requests that gave up before their images were made, by "
                               "reason: disconnected, timeout (still queued: never computed), disconnected_running, "
                               "timeout_running (their batch had begun: nothing more made for them), shutdown",
                               ["reason"], registry=r)  # fmt: skip
        self.pipeline_calls = Counter("bcg_serve_pipeline_calls", "Pipeline calls, by what ran: graphs (a denoiser "
                                      "graph replayed), eager, failed, out_of_memory (made again smaller), stopped "
                                      "(at a step's end: every request it was for had given up)", ["ran"],
                                      registry=r)  # fmt: skip
        self.denoiser_calls = Counter("bcg_serve_denoiser_calls", "Denoiser forwards by kind: replay (a CUDA graph) "
                                      "or eager", ["kind"], registry=r)  # fmt: skip
        self.batch_images = Histogram("bcg_serve_batch_images", "Images per pipeline call", buckets=counts, registry=r)
        self.batch_requests = Histogram("bcg_serve_batch_requests", "Requests joined into one pipeline call",
                                        buckets=counts, registry=r)  # fmt: skip
        self.request_seconds = Histogram("bcg_serve_request_seconds", "Seconds from a generation request's arrival "
                                         "to its answer (200 only)", buckets=_SECONDS, registry=r)  # fmt: skip
        self.queue_seconds = Histogram("bcg_serve_queue_seconds", "Seconds a request waited before its pipeline call",
                                       buckets=_SECONDS, registry=r)  # fmt: skip
        self.batch_seconds = Histogram("bcg_serve_batch_seconds", "Seconds per batch served: its pipeline calls "
                                       "and any wait for device memory (encoding not included)", buckets=_SECONDS,
                                       registry=r)  # fmt: skip
        self.device_seconds = Histogram("bcg_serve_device_seconds", "Seconds of the pipeline calls (Engine.make, "
                                        "host work included) that made a request's images, once per request",
                                        buckets=_SECONDS, registry=r)  # fmt: skip
        self.encode_seconds = Histogram("bcg_serve_encode_seconds", "Seconds to encode one image into its file and "
                                        "base64 (on the encoding threads)", buckets=_ENCODE_SECONDS,
                                        registry=r)  # fmt: skip
        self.batch_size = Histogram("bcg_serve_batch_size", "The batch-size bucket each pipeline call ran at",
                                    buckets=buckets, registry=r)  # fmt: skip
        self.padded = Counter("bcg_serve_padded_rows", "Rows pipeline calls ran beyond their images to reach their "
                              "bucket (computed, then dropped)", registry=r)  # fmt: skip
        self.image_seconds = Histogram("bcg_serve_image_seconds", "Seconds per image: a pipeline call's seconds over "
                                       "its images (padded rows not counted)", buckets=_SECONDS, registry=r)  # fmt: skip
        self.graph_memory = Gauge("bcg_serve_graph_memory_bytes", "Device memory the captured graphs hold (their "
                                  "pool, static inputs and boundary buffers)", registry=r)  # fmt: skip
        self.warmup_seconds = Gauge("bcg_serve_warmup_seconds", "Seconds the warm-up spent on each batch size "
                                    "(compile included)", ["batch_size"], registry=r)  # fmt: skip
        self.queue_depth = Gauge("bcg_serve_queue_depth", "Requests waiting for the device", registry=r)
        self.queue_depth.set_function(lambda: float(depth()))
        self.ready = Gauge("bcg_serve_ready", "1 once the warm-up is done and until the server stops", registry=r)
        for status in ("200", "400", "404", "413", "429", "499", "500", "503", "504"):
            self.requests.labels(status)  # present at 0, so a scrape sees the whole set from the start
        for reason in ("disconnected", "timeout", "disconnected_running", "timeout_running", "shutdown"):
            self.dropped.labels(reason)
        for ran in ("graphs", "eager", "failed", "out_of_memory", "stopped"):
            self.pipeline_calls.labels(ran)
        for kind in ("replay", "eager"):
            self.denoiser_calls.labels(kind)
        self._lock = threading.Lock()
        self._mean_batch_seconds = math.nan

    def observe_batch(self, seconds: float) -> None:
        """One pipeline call took ``seconds``."""
        self.batch_seconds.observe(seconds)
        with self._lock:
            m = self._mean_batch_seconds
            self._mean_batch_seconds = seconds if math.isnan(m) else (1 - _SMOOTHING) * m + _SMOOTHING * seconds

    @property
    def mean_batch_seconds(self) -> float:
        """A running mean of the recent pipeline calls' seconds (NaN before the first)."""
        with self._lock:
            return self._mean_batch_seconds

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

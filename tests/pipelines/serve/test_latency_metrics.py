"""The metrics that split a request's latency (scripts/bench_serve.py reads them): the device
worker observes each request's queue wait and the seconds of the pipeline calls that made its
images, once per request; the encoding threads observe each image's encoding
(:func:`~pipelines.serve.service.encode_timed`), once per image encoded."""

from __future__ import annotations

import threading

from pipelines.serve.batcher import Batcher, Work
from pipelines.serve.metrics import Metrics
from pipelines.serve.rendered import EncodedImage
from pipelines.serve.service import encode_timed
from pipelines.serve.worker import DeviceWorker
from tests.pipelines.serve.test_engine import FakePipeline, engine, request


def samples(metrics: Metrics) -> dict[str, float]:
    return {s.name: s.value for f in metrics.registry.collect() for s in f.samples if not s.labels}


def test_encoding_is_observed_once_per_image_encoded_and_device_seconds_once_per_request() -> None:
    e = engine(FakePipeline())
    batcher = Batcher(max_queue=16, max_batch=4, max_wait=0.0)
    metrics = Metrics(4, lambda: batcher.depth)
    worker = DeviceWorker(batcher, metrics, lambda: e, lambda engine: None, lambda error: None)
    plans = [e.plan(request("a", n=2, seed=10)), e.plan(request("b", seed=3))]
    works = [Work(p.key, p.request.n, p) for p in plans]
    for w in works:
        batcher.submit(w)
    worker.start()
    made = [w.future.result(30) for w in works]
    batcher.close()
    worker.join(10)
    m = samples(metrics)
    assert m["bcg_serve_queue_seconds_count"] == 2 and m["bcg_serve_device_seconds_count"] == 2
    assert m["bcg_serve_device_seconds_sum"] > 0 and m["bcg_serve_encode_seconds_count"] == 0  # none encoded yet
    assert [[i.seed for i in images] for images in made] == [[10, 11], [3]]  # the engine's images, as they were
    encoded: list[EncodedImage] = []
    thread = threading.Thread(target=lambda: encoded.extend(encode_timed(made[0], metrics.encode_seconds)))
    thread.start()
    thread.join(30)
    assert len(encoded) == 2 and all(isinstance(g, EncodedImage) and g.b64_json for g in encoded)
    assert samples(metrics)["bcg_serve_encode_seconds_count"] == 2
    encode_timed(made[1], metrics.encode_seconds)
    after = samples(metrics)
    assert after["bcg_serve_encode_seconds_count"] == 3 and after["bcg_serve_encode_seconds_sum"] > 0
    text = metrics.render().decode()
    assert "# TYPE bcg_serve_encode_seconds histogram" in text and "# TYPE bcg_serve_device_seconds histogram" in text

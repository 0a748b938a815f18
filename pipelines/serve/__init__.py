"""bcg-serve: an HTTP server whose pipeline keeps its graphs warm for as long as it lives.

    bcg-serve --model z-image --resolutions 512x512 1024x1024 --batch-sizes 1 2 4 8 --compile
    curl -s localhost:8000/v1/images/generations -d '{"prompt": "a red fox", "size": "512x512"}'

OpenAI's ``POST /v1/images/generations`` and ``POST /v1/images/edits`` (PNG, JPEG or WebP as
``b64_json``, with ``seed``, ``steps``, ``guidance``, ``negative_prompt``, ``lora`` and an edit's
``strength`` as extensions), ``GET /v1/models`` (and ``/v1/models/{id}``), ``/health``,
``/ready`` and ``/metrics``; an invalid request is a 400 in OpenAI's error shape, and every
request leaves one access-log line. A call whose requests all gave up (``--timeout``, a client
gone) stops at its next step's end. Requests that can share one pipeline call (same size,
steps, guidance, negative prompt or not, adapter, text length) are joined, up to the largest
batch-size bucket that fits the device's memory, waiting at most ``--max-wait-ms``; a call runs
at the smallest bucket that holds its images (the warm-up captured only the buckets), and each
image keeps its own seed. With ``--batching continuous`` requests instead join running batches at
the next step boundary, each with its own steps, guidance and seed, leave them when done, and may
stream partial images (``stream``, ``partial_images``). One worker thread owns the device;
requests wait in a bounded queue (``--queue``; beyond, 429).

It lives in ``pipelines`` beside the CLI, a sibling front end over the generation core
(:mod:`pipelines.generation`): it takes the same model flags, prepares the pipeline the same
way, writes the same image record, and imports nothing of the CLI; it reaches ``accel`` through
its public API only. FastAPI, uvicorn and prometheus-client are
the optional extra ``[serve]``; importing this package imports none of them, nor torch.

The modules, one job each:

config      the flags (the model flags, the server's), checked as read
schema      the request body, checked: 400 in one line, nothing queued
edits       the multipart form of an edit, checked the same way, its image read
errors      the one-line JSON error every non-200 answer is
batcher     the bounded queue, and compatible requests joined into one call
admission   which batch-size buckets fit the device's memory, at start and per call
encode      an image as the file its request asked for (png, jpeg, webp)
rendered    a call's images as made (PIL, with their text), and as the answer carries them (encoded)
engine      a request planned against the model's defaults; a batch made into images at its
            bucket, its adapter picked
warmup      every size at every bucket captured, timed and measured per bucket
worker      the device worker: the one thread that calls the pipeline
running     --batching continuous: which running batch a request's images join
continuous  --batching continuous: the device worker that steps running batches
streaming   a request answered as OpenAI's image streaming events (partial images, then the image)
service     phases, and one request's way through the queue (timeout, disconnect)
metrics     Prometheus counters, gauges and histograms
access      the access log: a line and an id for every request
app         the routes, on FastAPI
startup     checks before the socket is bound; build, adapters and warm-up on the worker
lifecycle   socket, uvicorn, signals and exit status
ranks       --parallel: every rank builds and warms up; rank 0's calls sent to the others, which follow
ray         the same app and routes as a Ray Serve application, one replica per GPU (``--ray``; with
            ``--parallel``, one per N GPUs, its other ranks started by the replica)
ray_app     that application for ``serve run`` and KubeRay's ``RayService`` (its flags as ``argv``)
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run ``bcg-serve``; returns the exit status (see :func:`pipelines.serve.lifecycle.main`;
    with ``--ray``, :func:`pipelines.serve.ray.main`)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if "--ray" in args:
        from .ray import main as run_ray

        return run_ray(args)
    from .lifecycle import main as run

    return run(argv)

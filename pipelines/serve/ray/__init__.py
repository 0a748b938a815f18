"""bcg-serve past one GPU: the same FastAPI app and routes as a Ray Serve application.

    bcg-serve --ray --model z-image --resolutions 512x512 --min-replicas 1 --max-replicas 4 \\
        --lora ink=ink.safetensors --lora oil=oil.safetensors:0.8
    serve run pipelines.serve.ray_app:build argv="--model z-image --resolutions 512x512"

Two deployments. ``Frontend`` is the HTTP ingress (Ray Serve's FastAPI ingress around
:func:`pipelines.serve.app.create_app`): it checks each request as bcg-serve does (400s and
``/v1/models`` answered there) and hands it to ``Generator`` through a deployment handle, naming
its adapter as Ray's multiplexed model id, so it goes to a replica that holds the adapter.
``Generator`` is one replica per GPU (``num_gpus``): a whole bcg-serve engine (queue, memory
admission, batching, the device worker), built and warmed up in its constructor, so Ray routes
nothing to it before the warm-up is done. Ray Serve scales the replicas on their ongoing
requests (``target_ongoing_requests``); a replica takes at most ``--queue`` requests at once
(``max_ongoing_requests``), and when every replica is full and the handle's own queue too
(``max_queued_requests``), the frontend answers 429. Importing this package imports neither Ray
nor torch.

The modules, one job each:

flags      the Ray flags beside bcg-serve's, checked as read; Ray's deployment options made of them
slots      LoRA adapters hot-swapped into a replica's fixed adapter slots (multiplexing's loads)
mirror     the project's Prometheus metrics mirrored into Ray Serve's metrics, per replica
replica    the Generator: one engine, its adapters multiplexed, its health
followers  --parallel: a replica's other ranks, started by the replica, one per GPU
frontend   the ingress: the routes, a request handed to a replica, retried where one died
streams    a streamed request's events, made on a replica and carried by Ray's streaming calls
deploy     the application bound, run on a Ray cluster (started here or joined), and stopped
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """``bcg-serve --ray ...``; returns the exit status (see :func:`pipelines.serve.ray.deploy.main`)."""
    from .deploy import main as run

    return run(argv)

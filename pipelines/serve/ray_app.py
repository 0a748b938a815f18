"""bcg-serve as a Ray Serve application, for ``serve run`` and KubeRay's ``RayService``:

    serve run pipelines.serve.ray_app:build argv="--model z-image --resolutions 512x512 --max-replicas 4"
    BCG_SERVE_ARGS="--model z-image --resolutions 512x512" serve run pipelines.serve.ray_app:app

``argv`` (or ``BCG_SERVE_ARGS``) is ``bcg-serve --ray``'s flags (:mod:`pipelines.serve.ray`), read
the same way; ``--host``, ``--port`` and ``--ray-address`` are then ``serve run``'s (or the
RayService's ``http_options``) to set. Importing this module imports nothing heavy: ``app`` is made
when it is first read.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

__all__ = ["build"]  # and app, made when read (__getattr__)

ENV = "BCG_SERVE_ARGS"


def build(args: dict[str, Any]) -> Any:
    """Ray Serve's application builder: ``args["argv"]`` is bcg-serve's flags as one string."""
    from .ray.deploy import build_app

    return build_app(shlex.split(str(args.get("argv", ""))))


def __getattr__(name: str) -> Any:
    if name == "app":
        return build({"argv": os.environ.get(ENV, "")})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

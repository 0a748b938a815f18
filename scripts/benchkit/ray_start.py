"""A bcg-serve --ray replica's cold start, with an empty compile cache and then with the cache it
wrote (scripts/bench_ray_start.py): one Ray cluster on this machine, one application per run,
deleted after it, so each run's replica is a fresh process and only the cache on disk carries over.

Per run: the seconds from ``serve.run`` to its return (the replica built, its warm-up done: what a
replica that scales up costs before it takes traffic), the replica's own count of them (its
constructor to warm) and its warm-up's, per bucket, the first request's seconds through HTTP, and
the compile cache's files after the run.

``--no-ray``: where Ray is not installed, each run is a fresh Python process that builds the same
replica (:class:`pipelines.serve.ray.replica.Replica`, Ray-free) and waits for it to be warm: the
seconds from the process's start (its imports included) and from the replica's constructor; no
HTTP, no Ray actor's start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["parse_args", "run"]

APP = "bcg-serve-start"
RUNS = ("empty", "warm")


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, required=True, help="folder for ray_start.json and ray_start.md")
    p.add_argument("--compile-cache", type=Path, default=None,
                   help="the compile cache folder, on this machine's disk; it must be empty (default: a fresh one)")  # fmt: skip
    p.add_argument("--size", default=None, help="the first request's size (default: the first of --resolutions)")
    p.add_argument("--no-ray", action="store_true", help="each run a fresh process building the replica, no Ray")
    p.add_argument("serve_flags", nargs=argparse.REMAINDER, help="-- then bcg-serve's flags (and the Ray flags)")
    args = p.parse_args(argv)
    args.serve_flags = [f for f in args.serve_flags if f != "--"]
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(folder: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(folder))


def _one(argv: list[str], url: str, size: str) -> dict[str, Any]:
    import httpx
    from ray import serve

    from pipelines.serve.ray.deploy import build_app

    t0 = time.monotonic()
    serve.run(build_app(argv), name=APP, route_prefix="/", blocking=False)
    deployed = time.monotonic() - t0
    info = serve.get_deployment_handle("Generator", APP).describe.remote().result()
    t1 = time.monotonic()
    answer = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red fox in the snow", "size": size,
                                                               "seed": 1}, timeout=600)  # fmt: skip
    first = time.monotonic() - t1
    serve.delete(APP)
    return {"deploy_s": round(deployed, 2), "replica_start_s": round(info["start_seconds"], 2),
            "warmup_s": round(info["warmup_seconds"], 2),
            "warmup_buckets_s": {str(b): round(s, 2) for b, s in sorted(info["warmup_buckets"].items())},
            "first_request_s": round(first, 3), "first_request_status": answer.status_code}  # fmt: skip


def _one_process(argv: list[str]) -> dict[str, Any]:
    """One replica built and warmed up in a fresh process (:func:`child`)."""
    import subprocess
    import sys

    t0 = time.monotonic()
    scripts = Path(__file__).resolve().parents[1]
    paths = [str(scripts.parent), str(scripts)]
    code = f"import sys; sys.path[:0] = {paths!r}; from benchkit.ray_start import child; child({argv!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the replica's process failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"deploy_s": round(time.monotonic() - t0, 2), **row, "first_request_s": None, "first_request_status": "-"}


def child(argv: list[str]) -> None:
    """In a fresh process: the replica of ``argv`` built and warm; its timings as one JSON line."""
    from pipelines.serve.ray.replica import Replica

    replica = Replica(argv, max_models=1)
    replica.wait_ready()
    engine = replica.service.engine
    print(json.dumps({"replica_start_s": round(replica.start_seconds or 0.0, 2),
                      "warmup_s": round(engine.warmup_seconds, 2),
                      "warmup_buckets_s": {str(b): round(c.seconds, 2) for b, c in sorted(engine.warmup_costs.items())}}),
          flush=True)  # fmt: skip
    replica.stop()


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"# bcg-serve --ray: a replica's cold start ({result['date']})", "",
             f"`bcg-serve --ray {' '.join(result['flags'])}`", "", f"device: {result['device']}", "",
             "| compile cache | serve.run (or the process) to warm (s) | replica constructor to warm (s) | warm-up (s) | "
             "warm-up per bucket (s) | first request (s) | cache files after |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in result["runs"]:
        buckets = ", ".join(f"{b}: {s}" for b, s in row["warmup_buckets_s"].items())
        first = "-" if row["first_request_s"] is None else f"{row['first_request_s']} ({row['first_request_status']})"
        lines.append(f"| {row['cache']} | {row['deploy_s']} | {row['replica_start_s']} | {row['warmup_s']} | "
                     f"{buckets} | {first} | {row['cache_files']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _record(out: Path, result: dict[str, Any], row: dict[str, Any]) -> None:
    result["runs"].append(row)
    print(json.dumps(row), flush=True)
    (out / "ray_start.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "ray_start.md").write_text(_markdown(result))


def run(args: argparse.Namespace) -> int:
    import torch

    from pipelines.serve.ray.flags import parse_ray_args

    cache = args.compile_cache or Path(tempfile.mkdtemp(prefix="bcg-compile-cache-"))
    cache.mkdir(parents=True, exist_ok=True)
    if _files(cache):
        raise SystemExit(f"--compile-cache {cache}: not empty; the first run needs an empty cache")
    argv = [*args.serve_flags, "--compile-cache", str(cache), "--min-replicas", "1", "--max-replicas", "1"]
    config, _, serve_argv = parse_ray_args(argv)
    size = args.size or f"{config.resolutions[0][0]}x{config.resolutions[0][1]}"
    args.out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
                              "flags": argv, "ray": not args.no_ray, "runs": []}  # fmt: skip
    if args.no_ray:
        for name in RUNS:
            row = {"cache": name, **_one_process(serve_argv), "cache_files": _files(cache)}
            _record(args.out, result, row)
        print(_markdown(result))
        return 0
    import ray
    from ray import serve

    ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name in RUNS:
            row = {"cache": name, **_one(argv, f"http://127.0.0.1:{port}", size), "cache_files": _files(cache)}
            _record(args.out, result, row)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(_markdown(result))
    return 0

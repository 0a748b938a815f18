"""The parent of scripts/bench_breadth.py: one child process per family within its timeout, and
breadth.json and breadth.md after each."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .breadth_cli import resolve
from .breadth_table import table
from .rows import rnd
from .settings import ROOT, say

SCRIPT = ROOT / "scripts" / "bench_breadth.py"  # each child runs it with --worker


def _child_command(name: str, args: argparse.Namespace, result: Path) -> list[str]:
    cmd = [sys.executable, str(SCRIPT), "--worker", name, "--result", str(result), "--out", args.out]
    cmd += ["--size", args.size, "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed)]
    cmd += ["--variants", ",".join(args.variants), "--steps", ",".join(map(str, args.steps))]
    cmd += ["--repeats", str(args.repeats)]
    if args.decode:
        cmd.append("--decode")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def _tail(path: Path, lines: int = 3) -> str:
    with contextlib.suppress(OSError):
        text = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        return " | ".join(text[-lines:])[-600:]
    return ""


def run_child(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Family ``name`` in a child process, within ``--timeout``; its result (partial if it died)."""
    parts, logs = out / "parts", out / "logs"
    parts.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    result, log = parts / f"{name}.json", logs / f"{name}.log"
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as err:
        # A session of its own, so a timeout ends its helpers (inductor's compile workers) too.
        child = subprocess.Popen(_child_command(name, args, result), stderr=err, cwd=ROOT, start_new_session=True)
        try:
            rc: int | None = child.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = None
    row: dict[str, Any] = {"name": name, "variants": {}}
    with contextlib.suppress(OSError, ValueError):
        row = json.loads(result.read_text())
    row["wall_s"] = rnd(time.perf_counter() - t0, 1)
    if rc is None:
        done = row.get("variants") or {}
        running = "building" if "build_s" not in row else next((v for v in args.variants if v not in done), "?")
        row.update(status="timeout", reason=f"no result within --timeout {args.timeout:.0f} s (it was in: {running})")
    elif row.get("status") in (None, "running"):
        row.update(status="crashed", reason=f"the child exited with status {rc}: {_tail(log)}")
    return row


def save(results: dict[str, Any], out: Path, t0: float) -> None:
    """breadth.json (written whole, then renamed) and breadth.md."""
    results["elapsed_s"] = rnd(time.perf_counter() - t0, 1)
    tmp = out / "breadth.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(out / "breadth.json")
    (out / "breadth.md").write_text(table(results))


def run_families(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Every family of ``args`` in a child of its own; 2 for bad arguments."""
    from pipelines.zoo import NAMES

    try:
        args = resolve(args, NAMES)
    except ValueError as exc:
        print(f"bench_breadth.py: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(NAMES)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "config": {
            "argv": list(sys.argv[1:] if argv is None else argv),
            "families": names,
            "size": args.size,
            "device": args.device,
            "dtype": args.dtype,
            "decode": args.decode,
            "variants": args.variants,
            "steps": args.steps,
            "repeats": args.repeats,
            "timeout_s": args.timeout,
            "seed": args.seed,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "results": {},
    }
    say(f"breadth: {len(names)} families, size {args.size}, {args.device} {args.dtype}, {', '.join(args.variants)}")
    for i, name in enumerate(names, 1):
        say(f"[{i}/{len(names)}] {name}: starting (timeout {args.timeout:.0f} s)")
        row = run_child(name, args, out)
        results["results"][name] = row
        save(results, out, t0)
        g = (row.get("variants") or {}).get("graphs") or {}
        say(
            f"[{i}/{len(names)}] {name}: {row['status']} in {row['wall_s']} s"
            + (f"; graphs {g.get('graphs_used')}, equal {g.get('equal')}" if g.get("status") == "ok" else "")
            + (f"; {row.get('reason')}" if row["status"] != "ok" else "")
        )
    say(f"wrote {out / 'breadth.json'} and {out / 'breadth.md'} in {time.perf_counter() - t0:.0f} s")
    return 0

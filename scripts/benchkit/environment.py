"""The device and versions written beside every number."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from .settings import ROOT


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except Exception:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:
        return None


def _cpu_name() -> str:
    with contextlib.suppress(Exception):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


SOURCE_COMMIT_ENV = "BCG_SOURCE_COMMIT"


def collect_env(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": "cpu",
        "device_name": _cpu_name(),
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # A copied tree (a remote machine's copy of a checkout) may carry stale git metadata: the
        # runner that copied it names the commit instead.
        "git_commit": os.environ.get(SOURCE_COMMIT_ENV) or _run(["git", "rev-parse", "--short", "HEAD"]),
        "git_dirty": False if os.environ.get(SOURCE_COMMIT_ENV) else bool(_run(["git", "status", "--porcelain"])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device="cuda",
            device_name=torch.cuda.get_device_name(device),
            device_memory_gib=round(props.total_memory / 2**30, 1),
        )
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = (
            smi.splitlines()[0].strip() if smi else f"unknown (nvidia-smi absent; CUDA runtime {torch.version.cuda})"
        )
    return env

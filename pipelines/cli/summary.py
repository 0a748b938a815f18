"""The run's closing line: how many images, how fast, what ran and where the files went; the same
as one JSON object (``--json``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..generation.prepare import PreparedPipeline


def shown(path: Path) -> str:
    """``path`` as text stdout can always print: a name that is not UTF-8 keeps its escapes."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


def mode_phrase(mode: str, ran: set[str], device: Any) -> str:
    """``mode bcg``, or what ran instead of the mode asked for, and why."""
    if not ran or ran == {mode}:
        return f"mode {mode}"
    why = "no CUDA device" if device.type != "cuda" else "not every call found a captured graph; see --report"
    return f"mode {'/'.join(sorted(ran))} (--mode {mode} asked, {why})"


def where_written(written: Sequence[Path], folder: Path, single: Path | None, renamed: int, writes: bool,
                  layers: int = 0, suffix: str = ".png") -> str:  # fmt: skip
    """Where the images went: the file, or how many went into which folder; ``layers``: each image
    was written as that many layer files (``suffix`` theirs), which the line says how to find."""
    if not writes:
        return "rank 0 writes the files"
    if not written:
        return "nothing written"
    if single is not None and len(written) == 1:
        text = f"wrote {shown(written[0])}"
    else:
        text = f"wrote {len(written)} file(s) to {shown(folder)}{os.sep}"
    if renamed:
        text += f" ({renamed} under a free name, as their names were taken meanwhile)"
    if layers:
        text += f", each image as {layers} RGBA layers: NAME-layer0{suffix} to NAME-layer{layers - 1}{suffix}"
    return text


def summary_line(prepared: PreparedPipeline, tag: str, made: int, calls: int, seconds: float, ran: set[str],
                 where: str, truncated: int, unit: str = "image") -> str:  # fmt: skip
    """The closing line of a run that made ``made`` images (or videos: ``unit``) in ``calls``
    calls taking ``seconds`` (``ran``: the modes they ran in; ``truncated``: distinct prompts the
    text encoder cut)."""
    pipe, device = prepared.pipe, prepared.device
    what = [type(pipe).__name__, mode_phrase(prepared.settings.mode, ran, device)]
    if prepared.cache is not None:
        what.append(f"cache {prepared.cache}")
    what.append(str(device))
    graph_mib = pipe.accel.graph_memory_bytes() / 2**20 if prepared.accelerated else 0.0
    line = (
        f"{tag}{made} {unit}(s) in {seconds:.2f} s: warmup {prepared.warmup_seconds:.2f} s, "
        f"{seconds / made if made else 0.0:.3f} s/{unit}, "
        f"{calls * prepared.call.steps / seconds if seconds else 0.0:.1f} denoising steps/s, "
        f"graph memory {graph_mib:.1f} MiB ({', '.join(what)}); " + where
    )
    if truncated:
        line += f"; {truncated} prompt(s) cut at the text encoder's limit"
    return line


def summary_json(prepared: PreparedPipeline, made: int, calls: int, seconds: float, ran: set[str],
                 files: Sequence[dict[str, Any]], truncated: int, unit: str = "image") -> dict[str, Any]:  # fmt: skip
    """The run as ``--json`` prints it: each file written (path, prompt, seed, size, index), the
    counts and seconds of :func:`summary_line`, what ran and on what."""
    pipe = prepared.pipe
    return {
        "files": list(files),
        "made": made,
        "unit": unit,
        "calls": calls,
        "seconds": round(seconds, 4),
        "warmup_seconds": round(prepared.warmup_seconds, 4),
        "seconds_per_item": round(seconds / made, 4) if made else None,
        "steps": prepared.call.steps,
        "pipeline": type(pipe).__name__,
        "model": prepared.settings.model,
        "mode_asked": prepared.settings.mode,
        "modes_ran": sorted(ran),
        "device": str(prepared.device),
        "dtype": str(prepared.dtype).removeprefix("torch."),
        "cache": prepared.cache,
        "graph_memory_bytes": pipe.accel.graph_memory_bytes() if prepared.accelerated else 0,
        "prompts_cut": truncated,
    }

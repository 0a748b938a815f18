"""How far a generation request may go, each limit derived from the model or the machine.

A front end (the ``bcg-generate`` CLI) checks these before it runs anything, most of them before
it even builds the model, so an impossible request fails in seconds with a line that names the limit, rather than filling memory
for a minute until the kernel kills the process.

* **Seeds**: ``torch.Generator.manual_seed`` takes any 64-bit value, but it folds a negative seed
  onto a large positive one (``-1`` and ``2**64 - 1`` are the same generator). Seeds are kept in
  ``[0, 2**63 - 1]`` so that each number names one generator state and fits a signed 64-bit
  integer wherever it is recorded; image ``i`` of a run uses ``seed + i``, so the first seed may
  be at most ``2**63 - 1 - (images - 1)``.
* **Steps**: at most the scheduler's ``num_train_timesteps`` (1000 for every scheduler these
  pipelines ship): the model was trained on that many noise levels, so more steps only revisit
  the levels it already saw, at proportionally more cost. At least 2 where the scheduler has a
  ``shift_terminal`` (Qwen-Image's): stretching a one-step schedule divides by zero.
* **Resolution, by positions**: a denoiser with a fixed table of rotary position embeddings
  cannot place more image tokens per side than the table has rows (one token per 16 pixels:
  the VAE's factor 8 times the patch size 2). Z-Image: ``axes_lens`` of its transformer config,
  ``[1024, 512, 512]`` -> 512 tokens, 8192 pixels per side. Qwen-Image: diffusers'
  ``QwenEmbedRope`` holds 4096 positions; image rows and columns are centred (``scale_rope``), so
  a side of ``t`` tokens reaches position ``t // 2``, and the text's positions follow the image's
  (up to 1024 text tokens, the pipeline's own cap), so ``t // 2 + 1024 <= 4096``: 6145 tokens,
  98320 pixels per side (memory stops far earlier).
* **Resolution, by memory**: the activation peak of a call, estimated from the pipeline's VAE
  and denoiser without running them (:mod:`pipelines.memory_estimate`: how, and its calibration
  on measured peaks), must fit the memory the device has free after the weights are loaded.
* **Weights**: ``--size full`` builds 10B (Z-Image), 29B (Qwen-Image), 17B (FLUX.1-dev), 20B
  (Wan2.1-14B) or 7B (Wan2.1-1.3B) parameters, every text encoder included; their bytes, counted
  on the ``meta`` device from the release data (:mod:`pipelines.releases`), must fit the device's
  free memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .memory_estimate import (
    DENOISER_ELEMENTS_PER_TOKEN_WIDTH,
    MEMORY_MARGIN,
    MemoryEstimate,
    denoiser_bytes,
    estimate_activation_bytes,
    format_bytes,
    vae_decode_bytes,
)

__all__ = [
    "DEFAULT_MAX_STEPS",
    "DENOISER_ELEMENTS_PER_TOKEN_WIDTH",
    "MAX_SEED",
    "MAX_TEXT_TOKENS",
    "MEMORY_MARGIN",
    "LimitError",
    "MemoryEstimate",
    "PositionLimit",
    "available_memory",
    "check_memory",
    "check_positions",
    "check_seeds",
    "check_steps",
    "check_weights",
    "denoiser_bytes",
    "embedded_position_limit",
    "embedded_weight_bytes",
    "estimate_activation_bytes",
    "format_bytes",
    "host_available_memory",
    "pipeline_position_limit",
    "position_limit",
    "vae_decode_bytes",
]


MAX_SEED = 2**63 - 1
DEFAULT_MAX_STEPS = 1000  # num_train_timesteps of the schedulers of both embedded models
# The largest guidance scale taken. The models here are run at 0 to 7.5 (FLUX.1's distilled
# guidance 3.5, Qwen-Image's true CFG 4, Wan's 5); at a scale of hundreds every step overshoots
# (a 1e308 scale made NaN pixels after the whole call): refused at once, not after the work.
MAX_GUIDANCE = 100.0
MAX_TEXT_TOKENS = 1024  # QwenImagePipeline refuses max_sequence_length above this
QWEN_ROPE_POSITIONS = 4096  # rows of diffusers' QwenEmbedRope tables (torch.arange(4096))


class LimitError(ValueError):
    """A request beyond a limit; the message names the limit and where it comes from."""


# --------------------------------------------------------------------------------------------
# Seeds and steps
# --------------------------------------------------------------------------------------------
def check_seeds(seed: int, n_images: int) -> None:
    """``seed .. seed + n_images - 1`` within ``[0, MAX_SEED]``, else LimitError."""
    last = seed + max(n_images, 1) - 1
    if seed < 0 or last > MAX_SEED:
        top = MAX_SEED - max(n_images, 1) + 1
        raise LimitError(
            f"--seed {seed}: seeds are 0 to 2**63 - 1 and image i uses seed + i, so with "
            f"{n_images} image(s) the first seed must be between 0 and {top}"
        )


def check_steps(steps: int, scheduler_config: Mapping[str, Any] | None = None) -> None:
    """``1 <= steps <=`` the scheduler's ``num_train_timesteps``, else LimitError."""
    cap = DEFAULT_MAX_STEPS
    least = 1
    if scheduler_config is not None:
        trained = scheduler_config.get("num_train_timesteps")
        if isinstance(trained, int) and trained > 0:
            cap = trained
        terminal = scheduler_config.get("shift_terminal")
        if terminal and steps < 2:
            # FlowMatchEulerDiscreteScheduler stretches the schedule to end at shift_terminal by
            # dividing by (1 - its last sigma), which is 0 with a single step: a NaN image.
            raise LimitError(
                f"--steps {steps}: this scheduler (shift_terminal {terminal}) needs at least 2 steps; "
                "with one its schedule divides by zero"
            )
    if not least <= steps <= cap:
        raise LimitError(
            f"--steps {steps}: must be {least} to {cap}, the number of noise levels the scheduler was trained on "
            f"(num_train_timesteps); more steps only repeat them"
        )


# --------------------------------------------------------------------------------------------
# Resolution, by the denoiser's position embeddings
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PositionLimit:
    """The largest image a denoiser's position table can place, and why."""

    max_width: int
    max_height: int
    reason: str

    def check(self, width: int, height: int, what: str = "--resolution") -> None:
        if width > self.max_width or height > self.max_height:
            raise LimitError(
                f"{what} {width}x{height} is larger than {self.max_width}x{self.max_height}, "
                f"the most this model can place: {self.reason}"
            )


def position_limit(
    transformer_class: str,
    config: Mapping[str, Any],
    *,
    vae_scale_factor: int = 8,
    rope_positions: int | None = None,
) -> PositionLimit | None:
    """The position limit of a denoiser from its class name and config, or None (no fixed table).

    ``rope_positions``: the rows of Qwen-Image's RoPE table when read off a built model.
    """
    if transformer_class == "ZImageTransformer2DModel":
        patch = _first(config.get("all_patch_size"), 2)
        lens = list(config.get("axes_lens") or (1024, 512, 512))
        px = vae_scale_factor * patch
        return PositionLimit(
            max_width=lens[2] * px,
            max_height=lens[1] * px,
            reason=(
                f"its rotary position table (transformer axes_lens {lens}) has {lens[1]} rows per side and "
                f"each token covers {px} pixels"
            ),
        )
    if transformer_class == "QwenImageTransformer2DModel":
        patch = int(config.get("patch_size") or 2)
        rows = rope_positions or QWEN_ROPE_POSITIONS
        # A side of t tokens reaches position t // 2 and the text continues from there.
        tokens = 2 * (rows - MAX_TEXT_TOKENS) + 1
        px = vae_scale_factor * patch
        side = (tokens * px) // 16 * 16
        return PositionLimit(
            max_width=side,
            max_height=side,
            reason=(
                f"its RoPE table has {rows} positions; an image side of t tokens ({px} pixels each) reaches "
                f"position t/2 and up to {MAX_TEXT_TOKENS} text tokens follow it"
            ),
        )
    return None


def _first(value: Any, default: int) -> int:
    if isinstance(value, (list, tuple)) and value:
        return int(value[0])
    if isinstance(value, int):
        return value
    return default


def embedded_position_limit(model: str, size: str) -> PositionLimit | None:
    """The position limit of a built-in model, from its config alone (nothing is built)."""
    from .releases.configs import canonical_name, transformer_class, transformer_config

    name = canonical_name(model)
    if name is None:
        return None
    return position_limit(transformer_class(name).__name__, transformer_config(name, size))


def pipeline_position_limit(pipe: Any) -> PositionLimit | None:
    """The position limit of a built pipeline's transformer, or None."""
    transformer = getattr(pipe, "transformer", None)
    if transformer is None or not hasattr(transformer, "config"):
        return None
    rows = None
    pos_freqs = getattr(getattr(transformer, "pos_embed", None), "pos_freqs", None)
    if isinstance(pos_freqs, torch.Tensor):
        rows = int(pos_freqs.shape[0])
    scale = int(getattr(pipe, "vae_scale_factor", 8) or 8)
    return position_limit(type(transformer).__name__, dict(transformer.config), vae_scale_factor=scale,
                          rope_positions=rows)  # fmt: skip


def check_positions(limit: PositionLimit | None, resolutions: Iterable[tuple[int, int]], what: str) -> None:
    if limit is not None:
        for width, height in resolutions:
            limit.check(width, height, what)


# --------------------------------------------------------------------------------------------
# Memory the device has free
# --------------------------------------------------------------------------------------------
def host_available_memory() -> int | None:
    """Bytes this process can still allocate on the host: MemAvailable, capped by a cgroup limit."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_file, encoding="ascii") as f:
                usage = int(f.read().strip())
            if limit.isdigit() and int(limit) < 2**60:
                found.append(max(int(limit) - usage, 0))
        except (OSError, ValueError):
            pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            return None
    return min(found)


def available_memory(device: torch.device) -> int | None:
    """Bytes free for activations on ``device`` now, or None where it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # Blocks torch's caching allocator holds but does not use are free for this process.
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        return host_available_memory()
    return None


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------
def embedded_weight_bytes(model: str, size: str, dtype: torch.dtype) -> int:
    """Bytes of a built-in model's weights and buffers in ``dtype``, every component with weights
    constructed on the meta device (no storage) from its release data."""
    from .construction import constructing_on
    from .releases.configs import components, constructor

    total = 0
    for component in components(model):
        make = constructor(model, component, size)
        with constructing_on("meta", dtype):
            module = make()
        total += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    return total


def check_weights(model: str, size: str, device: str | torch.device, dtype: torch.dtype) -> None:
    """LimitError when the weights of built-in ``model`` at ``size`` cannot fit ``device``'s free memory.

    Without it, the full-size models on a CPU (Z-Image 38 GiB in float32) fill the host until the
    kernel kills the process: exit 137 and no message. The tiny models always fit, so their builds
    never wait for a count.
    """
    if size == "tiny":
        return
    target = torch.device(device)
    free = available_memory(target)
    if free is None:
        return
    need = embedded_weight_bytes(model, size, dtype)
    if need > free:
        raise LimitError(
            f"{model} at size {size!r} has {format_bytes(need)} of weights in "
            f"{str(dtype).removeprefix('torch.')} but {target} has {format_bytes(free)} free; "
            "size='tiny' builds in seconds anywhere"
        )


# --------------------------------------------------------------------------------------------
# Activations (estimated by pipelines.memory_estimate)
# --------------------------------------------------------------------------------------------
def check_memory(
    pipe: Any,
    device: torch.device,
    resolutions: Sequence[tuple[int, int]],
    batch: int,
    cfg: bool,
    graphs: bool,
) -> None:
    """LimitError when the largest call would not fit the memory ``device`` has free now."""
    free = available_memory(device)
    if free is None or not resolutions:
        return
    width, height = max(resolutions, key=lambda wh: (wh[0] * wh[1], wh))
    estimate = estimate_activation_bytes(pipe, width, height, batch, cfg, graphs)
    if estimate.total > free:
        fits = _largest_square(pipe, batch, cfg, graphs, free)
        hint = f"; about {fits}x{fits} fits at this batch size" if fits else ""
        raise LimitError(
            f"{width}x{height} with --batch-size {batch} needs about {format_bytes(estimate.total)} of {device} "
            f"memory ({estimate.describe()}) but {format_bytes(free)} is free{hint}"
        )


def _largest_square(pipe: Any, batch: int, cfg: bool, graphs: bool, free: int) -> int:
    """The largest square (a multiple of 16) whose estimate fits ``free``; 0 if none does."""
    # Activations grow with the pixel count, so scale from one probe and confirm.
    probe = 512
    per_pixel = estimate_activation_bytes(pipe, probe, probe, batch, cfg, graphs).total / probe**2
    if per_pixel <= 0:
        return 0
    side = int(math.sqrt(free / per_pixel)) // 16 * 16
    for _ in range(8):
        if side < 16 or estimate_activation_bytes(pipe, side, side, batch, cfg, graphs).total <= free:
            return max(side, 0)
        side = int(side * 0.95) // 16 * 16
    return 0

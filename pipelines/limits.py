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
* **Resolution, by memory**: the activation peak of a pipeline call is estimated as
  :data:`MEMORY_MARGIN` times the sum of (a) the VAE decode of the batch, simulated on the
  ``meta`` device (shapes only, no storage) with fused attention, counting the bytes of every
  live tensor, (b) the denoiser's activations, :data:`DENOISER_ELEMENTS_PER_TOKEN_WIDTH` elements
  of its dtype per token and hidden unit, and (c) the graph memory of the first capture (about
  twice the denoiser's activations) when graphs are captured. The margin and the denoiser factor
  are calibrated on measured peaks: full-size Z-Image at 1024x1024 in bf16 on an H200 peaked
  2738 MiB above its weights, against 2076 MiB estimated before the margin (3115 MiB with it);
  Qwen-Image (true CFG, one image) 4537 MiB against 4084 (6126) (``samples/bench/results.json``,
  ``e2e_peak_mb`` minus the weights); the tiny VAEs' decodes on a CPU in float32 took 1.31 to
  1.33 times the simulated peak (peak RSS). CFG is counted as a doubled batch in the denoiser
  (Z-Image batches it; Qwen-Image's two calls need less). The estimate is compared with the
  memory the device has free after the weights are loaded.
* **Weights**: ``--size full`` builds 10B (Z-Image), 29B (Qwen-Image), 17B (FLUX.1-dev), 20B
  (Wan2.1-14B) or 7B (Wan2.1-1.3B) parameters, every text encoder included; their bytes, counted
  on the ``meta`` device, must fit the device's free memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

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

logger = logging.getLogger(__name__)

MAX_SEED = 2**63 - 1
DEFAULT_MAX_STEPS = 1000  # num_train_timesteps of the schedulers of both embedded models
MAX_TEXT_TOKENS = 1024  # QwenImagePipeline refuses max_sequence_length above this
QWEN_ROPE_POSITIONS = 4096  # rows of diffusers' QwenEmbedRope tables (torch.arange(4096))
MEMORY_MARGIN = 1.5
DENOISER_ELEMENTS_PER_TOKEN_WIDTH = 16  # measured: 15.9 (Z-Image), 14.9 (Qwen-Image) at 1024x1024
_DEFAULT_TEXT_TOKENS = 512  # both pipelines' default max_sequence_length


class LimitError(ValueError):
    """A request beyond a limit; the message names the limit and where it comes from."""


def format_bytes(n: float) -> str:
    """``1.5 GiB``-style, for messages."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


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
    """The position limit of an embedded model, from its config alone (nothing is built)."""
    from .builders import canonical_name, transformer_class, transformer_config

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
# Memory
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


def embedded_weight_bytes(model: str, size: str, dtype: torch.dtype) -> int:
    """Bytes of an embedded model's weights and buffers in ``dtype``, counted on the meta device."""
    from .builders import build_modules

    total = 0
    for module in build_modules(model, size, device="meta", dtype=dtype).values():
        for t in (*module.parameters(), *module.buffers()):
            total += t.numel() * t.element_size()
    return total


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """An estimated activation peak (margin included) and its parts (without the margin)."""

    total: int
    vae: int
    denoiser: int
    graphs: int

    def describe(self) -> str:
        parts = [f"VAE decode {format_bytes(self.vae)}", f"denoiser {format_bytes(self.denoiser)}"]
        if self.graphs:
            parts.append(f"graph capture {format_bytes(self.graphs)}")
        return f"{', '.join(parts)}, times {MEMORY_MARGIN} margin"


class _LiveBytes:
    """Counts the bytes of tensors created under it and still alive (meta tensors included)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and not t._is_view() and id(t) not in counter._seen:
                        counter._add(t)
                return out

        self.mode = Mode()

    def _add(self, t: torch.Tensor) -> None:
        n = t.untyped_storage().nbytes()
        key = id(t)
        self._seen.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """SDPA that allocates only its output, as the fused kernels do (the meta device would
    otherwise model the math path, whose score matrix grows with the square of the tokens)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return query.new_empty((*query.shape[:-1], value.shape[-1]))

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def vae_decode_bytes(vae: Any, width: int, height: int, batch: int, scale: int = 8) -> int:
    """Peak bytes of live tensors while ``vae`` decodes ``batch`` images, simulated on meta."""
    config = dict(vae.config)
    channels = int(config.get("latent_channels") or config.get("z_dim") or 16)
    dtype = next(vae.parameters()).dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the VAE's dtype: a cast afterwards makes diffusers warn
    try:
        with torch.device("meta"):
            meta_vae = type(vae).from_config(config)
    finally:
        torch.set_default_dtype(previous)
    h, w = max(height // scale, 1), max(width // scale, 1)
    # Video-style VAEs (Qwen-Image's) take (batch, channels, frames, h, w).
    shapes = [(batch, channels, h, w), (batch, channels, 1, h, w)]
    if "temperal_downsample" in config or "temporal_downsample" in config:
        shapes.reverse()
    last: Exception | None = None
    for shape in shapes:
        counter = _LiveBytes()
        try:
            with torch.no_grad(), _fused_attention(), counter.mode:
                latents = torch.empty(shape, device="meta", dtype=dtype)
                out = meta_vae.decode(latents)
                del out, latents
            return counter.peak
        except Exception as e:  # the wrong rank for this VAE: try the other one
            last = e
    raise RuntimeError(f"cannot simulate {type(vae).__name__}.decode: {last}")


def _denoiser_width(config: Mapping[str, Any]) -> int | None:
    if config.get("dim"):
        return int(config["dim"])
    heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int):
        return heads * head_dim
    for key in ("hidden_size", "inner_dim"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def _spatial_patch(value: Any) -> int:
    # Video denoisers (Wan) give (frames, rows, columns); the image side is the last.
    if isinstance(value, (list, tuple)) and value:
        return int(value[-1])
    return int(value or 2)


def denoiser_bytes(transformer: Any, width: int, height: int, batch: int, scale: int = 8) -> int:
    """Activation bytes of one denoiser forward over ``batch`` rows (CFG doubles the rows)."""
    config = dict(getattr(transformer, "config", {}) or {})
    hidden = _denoiser_width(config)
    if hidden is None:
        return 0
    patch = _first(config.get("all_patch_size"), 0) or _spatial_patch(config.get("patch_size"))
    tokens = (height // (scale * patch)) * (width // (scale * patch)) + _DEFAULT_TEXT_TOKENS
    element = next(transformer.parameters()).element_size()
    return DENOISER_ELEMENTS_PER_TOKEN_WIDTH * batch * tokens * hidden * element


def estimate_activation_bytes(
    pipe: Any, width: int, height: int, batch: int, cfg: bool, graphs: bool
) -> MemoryEstimate:
    """Estimated activation peak of one call of ``pipe`` at ``width`` x ``height``.

    ``graphs``: CUDA graphs will be captured at this size (adds their pool).
    """
    scale = int(getattr(pipe, "vae_scale_factor", 8) or 8)
    vae = getattr(pipe, "vae", None)
    vae_bytes = 0
    if vae is not None:
        try:
            vae_bytes = vae_decode_bytes(vae, width, height, batch, scale)
        except Exception as e:  # an unusual VAE: estimate without it rather than refuse
            logger.debug("no VAE memory estimate: %s", e)
    transformer = getattr(pipe, "transformer", None)
    den = denoiser_bytes(transformer, width, height, batch * (2 if cfg else 1), scale) if transformer is not None else 0
    graph = 2 * den if graphs else 0
    total = int(MEMORY_MARGIN * (vae_bytes + den + graph))
    return MemoryEstimate(total=total, vae=vae_bytes, denoiser=den, graphs=graph)


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

"""The activation memory of one pipeline call, estimated before it runs (no storage allocated).

The peak is estimated as :data:`MEMORY_MARGIN` times the sum of (a) the VAE decode of the batch,
simulated on the ``meta`` device (shapes only, no storage) with fused attention, counting the bytes
of every live tensor, (b) the denoiser's activations, :data:`DENOISER_ELEMENTS_PER_TOKEN_WIDTH`
elements of its dtype per token and hidden unit, and (c) the graph memory of the first capture
(about twice the denoiser's activations) when graphs are captured. The margin and the denoiser
factor are calibrated on measured peaks of the full-size models on a GPU and of the tiny VAEs'
decodes on a CPU, each below its estimate with the margin (docs/benchmarks.md, "Measurements
behind the code"). CFG is counted as a doubled batch in the denoiser (Z-Image
batches it; Qwen-Image's two calls need less). :func:`pipelines.limits.check_memory` compares the
estimate with the memory the device has free after the weights are loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "DENOISER_ELEMENTS_PER_TOKEN_WIDTH",
    "MEMORY_MARGIN",
    "MemoryEstimate",
    "denoiser_bytes",
    "estimate_activation_bytes",
    "format_bytes",
    "vae_decode_bytes",
]

logger = logging.getLogger(__name__)

MEMORY_MARGIN = 1.5
DENOISER_ELEMENTS_PER_TOKEN_WIDTH = 16  # measured: 15.9 (Z-Image), 14.9 (Qwen-Image) at 1024x1024
_DEFAULT_TEXT_TOKENS = 512  # both pipelines' default max_sequence_length


def format_bytes(n: float) -> str:
    """``1.5 GiB``-style, for messages."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


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


def _spatial_patch(config: Mapping[str, Any]) -> int:
    """The side of the denoiser's patches: Z-Image's first ``all_patch_size``, else ``patch_size``."""
    lead = config.get("all_patch_size")
    if isinstance(lead, (list, tuple)) and lead and int(lead[0]):
        return int(lead[0])
    if isinstance(lead, int) and lead:
        return lead
    value = config.get("patch_size")
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
    patch = _spatial_patch(config)
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

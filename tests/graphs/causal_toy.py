"""A causal decoder in miniature that decodes frame by frame through a feature cache it is handed.

Modelled on diffusers' causal video VAEs (Qwen-Image's, Wan's): each causal convolution reads the
last frames the previous call stored in ``feat_cache[idx]`` and stores its own input's last frames
there, a resampler stores the string ``"Rep"`` on the first frame, and ``feat_idx[0]`` counts the
slots. :func:`decode` calls the decoder once per latent frame with the same cache, as the VAEs'
``_decode`` does: every call but the first reads what the one before it stored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CACHE_T = 2


class CausalConv(nn.Conv2d):
    """A convolution over (time, width), causal in time: earlier frames come from the cache."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, (3, 3))

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        pad_t = 2
        if cache is not None:
            x = torch.cat([cache, x], 2)
            pad_t -= cache.shape[2]
        return super().forward(F.pad(x, (1, 1, pad_t, 0)))


class Block(nn.Module):
    """A residual causal convolution that keeps its input's last frames for the next call."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = CausalConv(channels)

    def forward(self, x: torch.Tensor, feat_cache: list[Any], feat_idx: list[int]) -> torch.Tensor:
        idx = feat_idx[0]
        cache_x = x[:, :, -CACHE_T:].clone()
        if cache_x.shape[2] < 2 and feat_cache[idx] is not None:
            cache_x = torch.cat([feat_cache[idx][:, :, -1:], cache_x], 2)
        y = self.conv(F.silu(x), feat_cache[idx])
        feat_cache[idx] = cache_x
        feat_idx[0] += 1
        return x + y


class Resample(nn.Module):
    """Stores ``"Rep"`` on the first frame (no time convolution), the frames after it as a block does."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = CausalConv(channels)

    def forward(self, x: torch.Tensor, feat_cache: list[Any], feat_idx: list[int]) -> torch.Tensor:
        idx = feat_idx[0]
        if feat_cache[idx] is None:
            feat_cache[idx] = "Rep"
            feat_idx[0] += 1
            return x * 0.5
        cache_x = x[:, :, -CACHE_T:].clone()
        rep = isinstance(feat_cache[idx], str)
        if cache_x.shape[2] < 2:
            first = torch.zeros_like(cache_x) if rep else feat_cache[idx][:, :, -1:]
            cache_x = torch.cat([first, cache_x], 2)
        x = self.conv(x) if rep else self.conv(x, feat_cache[idx])
        feat_cache[idx] = cache_x
        feat_idx[0] += 1
        return x


class ToyCausalDecoder(nn.Module):
    """``forward(x, feat_cache, feat_idx)`` over ``x`` of shape (batch, channels, frames, width)."""

    def __init__(self, channels: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([Block(channels), Resample(channels), Block(channels)])
        for p in self.parameters():
            p.data.mul_(0.5)

    @property
    def slots(self) -> int:
        return len(self.layers)

    def forward(self, x: torch.Tensor, feat_cache: list[Any], feat_idx: list[int]) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, feat_cache, feat_idx)
        return torch.tanh(x)


def decode(decoder: Any, z: torch.Tensor, slots: int) -> tuple[torch.Tensor, list[Any]]:
    """Frame by frame through one feature cache (as diffusers' ``_decode``); the frames and the cache."""
    feat_cache: list[Any] = [None] * slots
    outs = []
    for i in range(z.shape[2]):
        # Contiguous: a graph reads its inputs from contiguous static buffers, and the CPU's
        # vectorised kernels round a strided view's elementwise ops otherwise than a dense tensor's.
        frame = z[:, :, i : i + 1].contiguous()
        outs.append(decoder(frame, feat_cache=feat_cache, feat_idx=[0]))
    return torch.cat(outs, 2), feat_cache

"""A small transformer whose forward holds three kinds of uncapturable work, for the GPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from accel import eager_on_graph


def scale_by_host_list(x: torch.Tensor) -> torch.Tensor:
    # torch.tensor(list, device=cuda) copies from pageable host memory: illegal inside a capture.
    w = torch.tensor([0.5, 1.0, 1.5, 2.0], device=x.device, dtype=x.dtype)
    return x * w.repeat(x.shape[-1] // 4)


def normalise_by_item(x: torch.Tensor) -> torch.Tensor:
    # .item() synchronises with the host.
    m = x.abs().amax().item()
    return x / (m + 1.0)


def halve_positive_rows(x: torch.Tensor) -> torch.Tensor:
    # nonzero has a data-dependent output shape (and syncs); the break's own output does not.
    rows = (x[..., 0] > 0).nonzero(as_tuple=True)
    out = x.clone()
    out[rows] = out[rows] * 0.5
    return out


eager_scale = eager_on_graph(scale_by_host_list)
eager_normalise = eager_on_graph(normalise_by_item)
eager_halve = eager_on_graph(halve_positive_rows)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class ToyTransformer(nn.Module):
    """Blocks with an eager break after some of them (``breaks``: block index -> function)."""

    def __init__(self, dim: int = 128, heads: int = 4, depth: int = 4, breaks: dict | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.breaks = breaks if breaks is not None else {0: eager_scale, 1: eager_normalise, 2: eager_halve}
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = x + t[:, None, None]
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i in self.breaks:
                x = self.breaks[i](x)
        return self.out(x)

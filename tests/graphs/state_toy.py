"""A prefix K/V cache in miniature, in the two forms diffusers' newer DiTs keep one across the steps of a call.

``ToyPrefixModel`` runs a few attention layers over a joint sequence ``[prefix, target]``. At step 0
(``mode="extract"``) it runs the whole sequence and keeps each layer's prefix keys and values; at
later steps (``mode="cached"``) it runs the target tokens only and attends to the kept prefix.

* Given (Qwen-Image 2.1's ``QwenImage21KVCache``): the caller makes a :class:`ToyCache` per call
  and passes it at every step; extract stores cloned K/V into ``cache.layers[i].k`` and ``.v``.
* Returned (FLUX.2 klein KV's ``Flux2KVCache``): extract makes the cache itself and returns
  ``(out, cache)``; the caller passes it back at later steps.

:func:`denoise` is a pipeline call's loop: cond and uncond branches (two caches of one structure,
alternating), a few steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class ToyLayerCache:
    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None or self.v is None:
            raise RuntimeError("the cache is empty")
        return self.k, self.v


class ToyCache:
    def __init__(self, layers: int) -> None:
        self.layers = [ToyLayerCache() for _ in range(layers)]
        self.prefix_len = 0

    def layer(self, i: int) -> ToyLayerCache:
        return self.layers[i]


class ToyPrefixModel(nn.Module):
    def __init__(self, width: int = 8, layers: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    @property
    def num_layers(self) -> int:
        return len(self.qkv)

    def _attend(
        self, i: int, x: torch.Tensor, cache: ToyLayerCache | None, mode: str | None, prefix: int
    ) -> torch.Tensor:
        q, k, v = self.qkv[i](x).chunk(3, dim=-1)
        if mode == "extract" and cache is not None:
            cache.store(k[:, :prefix].clone(), v[:, :prefix].clone())
        elif mode == "cached" and cache is not None:
            k_ref, v_ref = cache.get()
            k, v = torch.cat([k_ref, k], 1), torch.cat([v_ref, v], 1)
        w = torch.softmax(q @ k.transpose(1, 2) / k.shape[-1] ** 0.5, dim=-1)
        return x + self.out[i](w @ v)

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        kv_cache: ToyCache | None = None,
        mode: str | None = None,
        prefix: int = 0,
    ) -> torch.Tensor:
        """The given form: ``kv_cache`` is the caller's, filled at extract."""
        h = x + t.view(-1, 1, 1)
        for i in range(self.num_layers):
            h = self._attend(i, h, kv_cache.layer(i) if kv_cache is not None else None, mode, prefix)
        return h[:, prefix:] if mode == "extract" else h

    def forward_returning(self, x: torch.Tensor, t: torch.Tensor, kv_cache: ToyCache | None = None, **how: Any) -> Any:
        """The returned form: extract makes the cache and returns it beside the output (``how``:
        ``mode`` and ``prefix``, as :meth:`forward` takes them)."""
        mode, prefix = how.get("mode"), how.get("prefix", 0)
        if mode == "extract":
            kv_cache = ToyCache(self.num_layers)
            kv_cache.prefix_len = prefix
        out = self.forward(x, t, kv_cache, mode, prefix)
        return (out, kv_cache) if mode == "extract" else (out,)


def inputs(
    seed: int, batch: int = 1, prefix: int = 5, target: int = 4, width: int = 8, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    made = {name: torch.randn(batch, prefix, width, generator=g) for name in ("cond", "uncond")}
    made["latents"] = torch.randn(batch, target, width, generator=g)
    return {name: t.to(device) for name, t in made.items()}


def denoise(
    fn: Callable[..., Any],
    model: ToyPrefixModel,
    seed: int,
    steps: int = 3,
    *,
    returned: bool = False,
    device: str = "cpu",
) -> tuple[torch.Tensor, list[ToyCache]]:
    """One pipeline call: true CFG, a prefix cache per branch filled at step 0 and read after.

    Returns the final latents and both caches as they were left (for comparing state)."""
    data = inputs(seed, width=model.qkv[0].in_features, device=device)
    prefix = data["cond"].shape[1]
    latents = data["latents"]
    caches: dict[str, ToyCache | None] = {
        name: (None if returned else ToyCache(model.num_layers)) for name in ("cond", "uncond")
    }
    for step in range(steps):
        t = torch.full((latents.shape[0],), 1.0 - step / steps, device=device)
        preds = {}
        for name in ("cond", "uncond"):
            if step == 0:
                x = torch.cat([data[name], latents], 1)
                out = fn(x, t, kv_cache=caches[name], mode="extract", prefix=prefix)
                if returned:
                    out, caches[name] = out
                preds[name] = out
            else:
                out = fn(latents, t, kv_cache=caches[name], mode="cached")
                preds[name] = out[0] if returned else out
        latents = latents - 0.1 * (preds["uncond"] + 2.0 * (preds["cond"] - preds["uncond"]))
    kept = [c for c in caches.values() if c is not None]
    return latents, kept

"""Qwen-Image 2.1's prefix K/V cache as request-scoped state, on emulated CUDA graphs.

diffusers 0.42's ``QwenImage21Transformer2DModel`` takes a ``QwenImage21KVCache`` that its pipeline
makes per call (one per guidance branch): at step 0 (``kv_cache_mode="extract"``) each block stores
cloned prefix K/V into ``kv_cache.layer_caches[i].k`` and ``.v``; at later steps (``"cached"``)
each block reads them. The forward's preamble (token layout, masks, RoPE, ``prefix_len``) syncs
with the host and is a recipe's to run outside the graph; what the graph core must carry is the
block loop with the cache: here the runner captures the model's own blocks, fed by the preamble
of an eager forward, and every result (the forward's output, and both caches at every step) is
compared bit for bit with the stock forward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache, QwenImage21Transformer2DModel

from accel.graphs.runner import GraphRunner
from tests.helpers.emulator import emulate_cuda

TEXT, COND, TARGET = (6, 3), (1, 2, 2), (1, 4, 4)  # text runs around one condition-image slot; latent grids
WIDTH = 32


def tiny() -> QwenImage21Transformer2DModel:
    torch.manual_seed(0)
    model = QwenImage21Transformer2DModel(
        in_channels=16,
        out_channels=16,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=WIDTH,
        axes_dims_rope=(4, 6, 6),
    )
    return model.eval()


def branch(seed: int, latents: torch.Tensor, cond_latents: torch.Tensor) -> dict[str, Any]:
    """One guidance branch's call, as the pipeline makes it: condition image first, target last
    (on the latents' device, in their dtype)."""
    g = torch.Generator().manual_seed(seed)
    device, dtype = latents.device, latents.dtype
    cond_slots, target_slots = COND[1] * COND[2] // 4, TARGET[1] * TARGET[2] // 4
    vlm = TEXT[0] + cond_slots + TEXT[1]
    img_mask = torch.zeros(1, vlm + target_slots, dtype=torch.bool)
    img_mask[0, TEXT[0] : TEXT[0] + cond_slots] = True
    img_mask[0, vlm:] = True
    text_mask = torch.ones(1, vlm, dtype=torch.bool)
    text_mask[0, -1] = False  # a padded prompt position: never attended to
    return {
        "hidden_states": torch.cat([cond_latents, latents], 1),
        "encoder_hidden_states": torch.randn(1, vlm, WIDTH, generator=g).to(device, dtype),
        "encoder_hidden_states_mask": text_mask.to(device),
        "img_shapes": [[COND, TARGET]],
        "img_mask": img_mask.to(device),
    }


class Split:
    """The stock forward with its block loop run by ``loop`` (eager blocks, or a runner over them):
    the first block's call runs the whole loop on what the forward's own preamble hands it, the
    other blocks' calls pass their input through, and the rest of the forward runs as it is."""

    def __init__(self, model: QwenImage21Transformer2DModel, loop: Any) -> None:
        self.model, self.loop = model, loop

    def __call__(self, **call: Any) -> torch.Tensor:
        blocks = self.model.transformer_blocks
        kv_cache = call.get("kv_cache")

        def whole_loop(hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            kwargs.pop("layer_cache")
            return self.loop(hidden_states, kv_cache=kv_cache, **kwargs)

        blocks[0].forward = whole_loop
        for block in blocks[1:]:
            block.forward = lambda hidden_states, **kwargs: hidden_states
        try:
            return self.model(**call, return_dict=False)[0]
        finally:
            for block in blocks:
                del block.forward


def block_loop(model: QwenImage21Transformer2DModel) -> Any:
    """The forward's block loop, as a function of what the preamble hands it and the cache."""
    blocks = list(model.transformer_blocks)

    def loop(hidden_states: torch.Tensor, *, kv_cache: QwenImage21KVCache | None, **kwargs: Any) -> torch.Tensor:
        for i, block in enumerate(blocks):
            layer_cache = kv_cache.get_layer(i) if kv_cache is not None else None
            hidden_states = type(block).forward(block, hidden_states=hidden_states, layer_cache=layer_cache, **kwargs)
        return hidden_states

    return loop


def denoise(
    fn: Any,
    seed: int,
    steps: int = 3,
    cfg: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], list[QwenImage21KVCache]]:
    """One pipeline call: a cache per guidance branch, extract at step 0, cached after; the noise
    predictions of every step and the caches as they were left."""
    g = torch.Generator().manual_seed(100 + seed)
    latents = torch.randn(1, TARGET[1] * TARGET[2], 16, generator=g).to(device, dtype)
    cond_latents = torch.randn(1, COND[1] * COND[2], 16, generator=g).to(device, dtype)
    names = ("cond", "uncond") if cfg else ("cond",)
    calls = {name: branch(2 * seed + k, latents, cond_latents) for k, name in enumerate(names)}
    caches = {name: QwenImage21KVCache(3) for name in names}
    preds = []
    for step in range(steps):
        t = torch.full((1,), 1.0 - step / steps, device=device, dtype=dtype)
        out = {}
        for name in names:
            call = {**calls[name], "hidden_states": torch.cat([cond_latents, latents], 1)}
            mode = "extract" if step == 0 else "cached"
            out[name] = fn(**call, timestep=t, kv_cache=caches[name], kv_cache_mode=mode)[:, -latents.shape[1] :]
        pred = out["uncond"] + 4.0 * (out["cond"] - out["uncond"]) if cfg else out["cond"]
        preds.append(pred)
        latents = latents - 0.2 * pred
    return preds, list(caches.values())


def same_caches(a: list[QwenImage21KVCache], b: list[QwenImage21KVCache]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.k, y.k) and torch.equal(x.v, y.v)
        for ca, cb in zip(a, b)
        for x, y in zip(ca.layer_caches, cb.layer_caches, strict=True)
    )


@pytest.mark.parametrize("cfg", [True, False], ids=["true-cfg", "no-cfg"])
def test_the_block_loop_with_the_cache_replays_every_step_and_equals_the_stock_forward(
    monkeypatch: pytest.MonkeyPatch, cfg: bool
) -> None:
    emulate_cuda(monkeypatch)
    model = tiny()
    stock = lambda **call: model(**call, return_dict=False)[0]  # noqa: E731
    runner = GraphRunner(block_loop(model), name="qwen-image-2.1 blocks")
    runner.state_types = frozenset({QwenImage21KVCache})
    accelerated = Split(model, runner)
    with torch.no_grad():
        want, _ = denoise(stock, 0, cfg=cfg)
        with runner.capturing():
            got, _ = denoise(accelerated, 0, cfg=cfg)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        warm = runner.stats()
        # Extract (empty caches) and cached (full ones): two graphs for both branches.
        assert warm.captures == 2 and warm.eager_calls == 0 and not runner.blocked, runner.blocked
        for seed in (1, 2, 3):
            want, want_caches = denoise(stock, seed, cfg=cfg)
            got, caches = denoise(accelerated, seed, cfg=cfg)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), seed
            assert same_caches(caches, want_caches)
    st = runner.stats()
    branches = 2 if cfg else 1
    assert st.misses == 0 and st.eager_calls == 0 and st.captures == 2
    assert st.replays - warm.replays == 3 * 3 * branches
    # Without CFG a call's cache is copied into the cached graph once, then found in place; the two
    # branches' caches of true CFG alternate on one graph and are copied at every step.
    assert (st.state_bytes_kept > warm.state_bytes_kept) is not cfg

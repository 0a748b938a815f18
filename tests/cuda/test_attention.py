"""FlashAttention-3 (the fa3-fwd wheel) on a Hopper GPU: the backends of accel/hooks/attention/fa3.py
at the models' shapes, in CUDA graphs and compiled, and ``attention="fa3"`` on full-size Z-Image.

* bf16: within bf16 rounding of cuDNN's attention (exact attention, other sums); key-padding
  masks in the seqused form against SDPA's masked attention, on the kept queries;
* float8: per-head scales and smoothed keys, printed beside plain casts, within a few percent;
* a plain ``torch.cuda.CUDAGraph`` captures each (mask compaction included: no host sync) and
  its replay, output poisoned first, equals the eager call bit for bit; compiled (fullgraph) too;
* full-size Z-Image (512x512): ``attention="fa3"`` graphs replay bit for bit with the same model
  run without graphs, shuffled calls, outputs poisoned; ``quantize="fp8"`` with it measures the
  attention layers, and the graphs of the float8 model (float8 attention included), compiled,
  equal it without graphs.

Distances are printed; the bench (scripts/bench_fp8.py) publishes them at 1024x1024.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch.nn.functional as F

from accel import accelerate_pipeline
from accel.graphs.tree import tensors
from accel.hooks.attention import fa3
from accel.hooks.attention.backends import FA3, FA3_FP8
from accel.hooks.recipes.mask_backends import backends_in_use
from pipelines.builders import build_pipeline

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
SIZE = (512, 512)
PROMPTS = ["a red fox in fresh snow at dawn", "an isometric cutaway of a tiny underground library lit by lanterns"]
# (batch, tokens, heads): Z-Image and Qwen-Image (true CFG joined) at 1024x1024.
SHAPES = [(1, 4224, 30), (2, 4296, 24)]


@pytest.fixture(autouse=True)
def hopper() -> None:
    why = fa3.why_not_fa3(torch.device(DEVICE))
    if why is not None:
        pytest.skip(f"FlashAttention-3: {why}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _sdpa(q, k, v, mask=None):  # type: ignore[no-untyped-def]
    t = [x.transpose(1, 2) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*t, attn_mask=mask).transpose(1, 2)


def _qkv(batch: int, tokens: int, heads: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(DEVICE).manual_seed(seed)
    return [torch.randn(batch, tokens, heads, 128, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(3)]


def _replays_as_eager(fn, *inputs: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """``fn(*inputs)`` captured in a plain CUDA graph: its replay (output poisoned, inputs new)
    equals the eager call bit for bit."""
    static = [x.clone() for x in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    for s in static:
        if s.is_floating_point():
            s.copy_(torch.randn_like(s))
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, fn(*static)), "the replay differs from the eager call"


@torch.no_grad()
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_and_float8_attention_at_the_models_shapes(shape: tuple[int, int, int]) -> None:
    q, k, v = _qkv(*shape, seed=0)
    k = k + 2 * torch.randn(1, 1, shape[2], 128, device=DEVICE, dtype=torch.bfloat16)  # keys share an offset
    ref = _sdpa(q, k, v)
    out = fa3.fa3_attention(q, k, v)
    q8, qs = fa3.quantize_heads(q)
    k8, ks = fa3.quantize_heads(k)
    v8, vs = fa3.quantize_heads(v)
    plain = fa3._call(q8, k8, v8, None, None, False, (qs, ks, vs))
    fp8 = fa3.fa3_fp8_attention(q, k, v)
    print(
        f"\n{shape}: FA3 bf16 {_rel(out, ref):.4f}, float8 per-head scales {_rel(plain, ref):.4f}, "
        f"with smoothed keys {_rel(fp8, ref):.4f} (relative L2 to cuDNN)"
    )
    # Smoothing subtracts what every score of a query shares: it may only help (a little noise aside).
    assert _rel(out, ref) < 0.01 and _rel(fp8, ref) < 0.06 and _rel(fp8, ref) <= 1.05 * _rel(plain, ref)
    for fn in (fa3.fa3_attention, fa3.fa3_fp8_attention):
        _replays_as_eager(fn, q, k, v)
        compiled = torch.compile(fn, fullgraph=True)
        assert torch.equal(compiled(q, k, v), compiled(q, k, v))
        _replays_as_eager(compiled, q, k, v)
    torch._dynamo.reset()


@torch.no_grad()
def test_key_padding_masks_in_the_seqused_form_are_captured_without_a_host_sync() -> None:
    batch, text, image, heads = 2, 96, 1024, 24
    q, k, v = _qkv(batch, text + image, heads, seed=1)
    mask = torch.ones(batch, text + image, dtype=torch.bool, device=DEVICE)
    mask[0, 66:text] = False  # Qwen-Image's padded text: kept, padding, then the image
    mask[1, 21:text] = False
    ref = _sdpa(q, k, v, mask[:, None, None, :])
    for fn, limit in ((fa3.fa3_attention, 0.01), (fa3.fa3_fp8_attention, 0.06)):
        out = fn(q, k, v, attn_mask=mask[:, None, None, :])
        rel = _rel(out[mask], ref[mask])
        print(f"\n{fn.__name__} with a key-padding mask: {rel:.4f} from SDPA's masked attention")
        assert rel < limit
        _replays_as_eager(lambda q, k, v, m, fn=fn: fn(q, k, v, attn_mask=m[:, None, None, :]), q, k, v, mask)


def _call(pipe, prompt: str, seed: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return pipe(
        prompt=prompt,
        width=SIZE[0],
        height=SIZE[1],
        num_inference_steps=4,
        guidance_scale=0.0,
        generator=torch.Generator(DEVICE).manual_seed(seed),
        output_type="latent",
    ).images


def _replays_equal_without_graphs(pipe) -> list[str]:  # type: ignore[no-untyped-def]
    runner = pipe.accel.runners["transformer"]
    cases = [(p, s) for p in PROMPTS for s in (0, 1)]
    random.Random(0).shuffle(cases)
    replays, mismatches = runner.counts.replays, []
    for prompt, seed in cases:
        runner.enabled = False
        want = _call(pipe, prompt, seed)
        runner.enabled = True
        for entry in runner.store.entries.values():
            for chain in entry.tree.chains.values():
                for t in tensors(chain.output):
                    if t.is_floating_point():
                        t.fill_(float("nan"))
        out = _call(pipe, prompt, seed)
        if not torch.equal(out, want):
            mismatches.append(f"{prompt[:12]!r} seed {seed}: max diff {(out.float() - want.float()).abs().max():.4g}")
    assert runner.counts.replays > replays
    return mismatches


@torch.no_grad()
def test_z_image_attention_fa3_graphs_and_float8_attention_equal_the_model_without_graphs(tmp_path) -> None:
    pipe = build_pipeline("z-image", "full", device=DEVICE, dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    try:
        stock = {p: _call(pipe, p, 0) for p in PROMPTS}
        accelerate_pipeline(pipe, attention="fa3")
        assert set(backends_in_use(pipe.transformer)) == {FA3}
        pipe.accel.warmup([SIZE], prompts=PROMPTS, progress=False)
        for p in PROMPTS:
            rel = _rel(_call(pipe, p, 0), stock[p])
            print(f"\nZ-Image attention='fa3' {p[:12]!r}: {rel:.4f} from the stock pipeline (cuDNN)")
            assert rel < 0.02
        mismatches = _replays_equal_without_graphs(pipe)
        assert "not bit for bit cuDNN's attention" in pipe.accel.report()
        pipe.accel.restore()
        assert not mismatches, mismatches

        torch._dynamo.reset()
        accelerate_pipeline(pipe, attention="fa3", quantize="fp8", compile=True, compile_cache_dir=tmp_path / "k")
        pipe.accel.warmup([SIZE], prompts=PROMPTS, progress=False)
        sel = pipe.accel.quantization.selection
        print("\n" + "\n".join(pipe.accel.quantization.describe()))
        assert sel is not None and sel.attention_backend is not None and sel.error <= sel.budget
        in_use = backends_in_use(pipe.transformer)
        assert set(in_use.get(FA3_FP8, [])) == set(sel.attention) and set(in_use.get(FA3, [])) == set(
            sel.attention_kept
        )
        for p in PROMPTS:
            print(f"Z-Image float8 (attention {len(sel.attention)} layers): {_rel(_call(pipe, p, 0), stock[p]):.4f}")
        mismatches = _replays_equal_without_graphs(pipe)
        pipe.accel.restore()
        assert not mismatches, mismatches
    finally:
        del pipe
        gc.collect()
        torch.cuda.empty_cache()

"""The fused Ulysses attention moves data exactly as diffusers' does (two gloo processes)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import launch_ranks

WORLD = 2


def test_fused_attention_nests_and_puts_diffusers_class_back() -> None:
    from diffusers.models import attention_dispatch as dispatch

    from accel.graphs import patches
    from accel.parallel import ulysses

    stock = dispatch.TemplatedUlyssesAttention
    first, second = ulysses.fused_attention(), ulysses.fused_attention()
    assert first is not None and second is not None
    assert dispatch.TemplatedUlyssesAttention is ulysses.FusedUlyssesAttention
    assert any("TemplatedUlyssesAttention" in line for line in patches.active())
    first.undo()
    assert dispatch.TemplatedUlyssesAttention is ulysses.FusedUlyssesAttention  # one hold left
    second.undo()
    assert dispatch.TemplatedUlyssesAttention is stock
    second.undo()  # one too many: harmless
    assert dispatch.TemplatedUlyssesAttention is stock
    assert not any("TemplatedUlyssesAttention" in line for line in patches.active())


def test_a_ulysses_group_keeps_a_calls_new_graphs_only_where_no_rank_failed() -> None:
    """``agree_on_capture`` on a one-rank gloo group: its real all-reduce, a runner's new keys."""
    import torch.distributed as dist

    from accel.parallel import ulysses
    from accel.parallel.agreement import Agreement
    from accel.parallel.layout import Layout
    from accel.parallel.process import Liveness

    class Runner:  # what agree_on_capture reads of a graph runner, and the drops it asks for
        def __init__(self, keys: list[str], blocked: dict[str, str]) -> None:
            self.keys, self.blocked = keys, blocked
            self.dropped: list[tuple[list[str], str]] = []

        def block(self, keys: list[str], reason: str) -> None:
            self.dropped.append((list(keys), reason))

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group(backend="gloo")
        agreement = Agreement(Liveness(30.0), lambda: Layout("ulysses", 1, 0, cfg=1, ulysses=1))
        captured = Runner(["old", "new"], {})
        ulysses.agree_on_capture(agreement, group, captured, "transformer", {"old"}, set())
        assert captured.dropped == []
        failed = Runner(["old", "new"], {"bad": "BreakError: boom"})
        ulysses.agree_on_capture(agreement, group, failed, "transformer", {"old"}, set())
        assert failed.dropped == [
            (["new"], "another rank failed to capture this call; every rank runs it eagerly (collectives in step)")
        ]
        failed_before = Runner(["old"], {"bad": "BreakError: boom"})
        ulysses.agree_on_capture(agreement, group, failed_before, "transformer", {"old"}, {"bad"})
        assert failed_before.dropped == []
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_fused_equals_diffusers_ulysses_on_two_processes(tmp_path: Path) -> None:
    procs = launch_ranks(__file__, WORLD, tmp_path, str(tmp_path))
    try:
        codes = [p.wait(timeout=120) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("the ranks did not finish in 120 s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD)]
    assert codes == [0] * WORLD, "\n".join(logs)
    for r in range(WORLD):
        res = torch.load(tmp_path / f"result{r}.pt")
        assert res["cases"] == 6
        for name, fused, stock in res["pairs"]:
            assert fused.shape == stock.shape and fused.is_contiguous(), name
            assert torch.equal(fused, stock), f"rank {r}, {name}: max abs {(fused - stock).abs().max():.3g}"
        assert res["fell_back"] == ["return_lse", "grad", "float mask"], res["fell_back"]
        # SDPA's memory-efficient kernel takes a mask only with its key axis contiguous; with
        # any other stride it falls back to the math kernel (batch 2: 5x slower end to end).
        assert res["mask_strides"] == [1, 1], res["mask_strides"]


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from diffusers.models import attention_dispatch as dispatch
    from torch.distributed.device_mesh import init_device_mesh

    from accel.parallel import ulysses

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    config = types.SimpleNamespace(
        context_parallel_config=types.SimpleNamespace(ulysses_degree=WORLD, _ulysses_mesh=mesh)
    )
    ops = (dispatch._native_attention_forward_op, dispatch._native_attention_backward_op)
    stock = dispatch.TemplatedUlyssesAttention
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    # (batch, tokens, heads, dim, scale, masked): a masked case is a Qwen-Image-style boolean key
    # mask of this rank's tokens, which diffusers all-gathers and the fused version sends along.
    cases = [
        (1, 24, 4, 16, None, False),
        (2, 17, 6, 8, None, False),
        (1, 9, 2, 32, 0.5, False),
        (3, 5, 4, 8, None, False),
        (1, 12, 4, 16, None, True),
        (2, 7, 2, 8, 0.3, True),
    ]
    mask_strides: list[int] = []

    def forward_op(ctx: Any, q: Any, k: Any, v: Any, attn_mask: Any, *rest: Any, **kw: Any) -> Any:
        if attn_mask is not None:
            mask_strides.append(attn_mask.stride(-1))
        return ops[0](ctx, q, k, v, attn_mask, *rest, **kw)

    held = ulysses.fused_attention()
    assert held is not None
    for batch, tokens, heads, dim, scale, masked in cases:
        q, k, v = (torch.randn(batch, tokens, heads, dim, generator=gen) for _ in range(3))
        mask = None
        if masked:
            mask = torch.rand(batch, 1, 1, tokens, generator=gen) > 0.4
            mask[..., 0] = True  # no query without a key
        with torch.no_grad():
            fused = dispatch.TemplatedUlyssesAttention.apply(
                q, k, v, mask, 0.0, False, scale, False, False, forward_op, ops[1], config
            )
            ref = stock.apply(q, k, v, mask, 0.0, False, scale, False, False, *ops, config)
        pairs.append((f"{batch}x{tokens}x{heads}x{dim}{' masked' if masked else ''}", fused, ref))
    # Calls it does not cover reach diffusers' class.
    fell_back: list[str] = []
    calls: list[Any] = []

    class Spy:
        @staticmethod
        def apply(*args: Any) -> Any:
            calls.append(args)
            return stock.apply(*args)

    ulysses._stock = Spy
    q, k, v = (torch.randn(1, 8, 2, 8, generator=gen) for _ in range(3))
    with torch.no_grad(), pytest.raises(ValueError, match="return_lse"):
        dispatch.TemplatedUlyssesAttention.apply(q, k, v, None, 0.0, False, None, False, True, *ops, config)
    fell_back += ["return_lse"] if calls else []
    calls.clear()
    qg = q.clone().requires_grad_(True)
    dispatch.TemplatedUlyssesAttention.apply(qg, k, v, None, 0.0, False, None, False, False, *ops, config)
    fell_back += ["grad"] if calls else []
    calls.clear()
    with torch.no_grad():
        additive = torch.zeros(1, 1, 1, 8)
        dispatch.TemplatedUlyssesAttention.apply(q, k, v, additive, 0.0, False, None, False, False, *ops, config)
    fell_back += ["float mask"] if calls else []
    ulysses._stock = stock
    held.undo()
    assert dispatch.TemplatedUlyssesAttention is stock
    torch.save(
        dict(cases=len(cases), pairs=pairs, fell_back=fell_back, mask_strides=mask_strides), out / f"result{rank}.pt"
    )
    # Both ranks done before either tears gloo down: once, in CI, one rank aborted at the end
    # ("terminate called without an active exception") with its peer already gone.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))

"""A module nobody here wrote: diffusers' Qwen-Image transformer called with a text mask.

Its mask handling builds a device tensor from a Python int (a pageable host-to-device copy), so
the stock forward cannot be captured whole. Marking that one helper as an eager break, from the
outside, makes it capturable, and replays equal eager bit for bit; the recipe's helper, which fills
the length on the device, captures with the rest.
"""

from __future__ import annotations

import pytest
import torch

from accel import GraphRunner, eager_on_graph

pytestmark = pytest.mark.cuda

qwen_mod = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")

DEV = torch.device("cuda")


def _small_qwen() -> torch.nn.Module:
    torch.manual_seed(0)
    return (
        qwen_mod.QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=3,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=64,
            axes_dims_rope=(8, 12, 12),
        )
        .to(DEV, torch.bfloat16)
        .eval()
    )


def _call_kwargs(h: int, w: int, txt: int, valid: int, seed: int) -> dict:
    g = torch.Generator(device=DEV).manual_seed(seed)
    mask = torch.zeros(1, txt, dtype=torch.long, device=DEV)
    mask[:, :valid] = 1
    return dict(
        hidden_states=torch.randn(1, h * w, 64, device=DEV, generator=g).bfloat16(),
        encoder_hidden_states=torch.randn(1, txt, 64, device=DEV, generator=g).bfloat16(),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(1, device=DEV, generator=g).bfloat16(),
        img_shapes=[[(1, h, w)]],
        return_dict=False,
    )


@torch.no_grad()
def test_stock_forward_with_mask_cannot_be_captured_whole() -> None:
    model = _small_qwen()
    runner = GraphRunner(model, name="qwen-stock")
    kw = _call_kwargs(16, 16, 32, 20, seed=0)
    with runner.capturing():
        out = runner(**kw)
    assert torch.equal(out[0], model(**kw)[0])  # ran eagerly instead
    assert runner.stats().captures == 0 and runner.stats().capture_failures == 1
    (reason,) = runner.blocked.values()
    assert "pinned" in reason or "capture" in reason.lower(), reason


@pytest.mark.parametrize("helper", ["eager break", "the recipe's"])
@torch.no_grad()
def test_the_mask_helper_made_capturable_replays_bit_exact(monkeypatch, helper: str) -> None:
    """Marked an eager break from the outside, or the recipe's helper that fills the length on the
    device (pipelines/families/qwen_image/mask_helper.py): then the forward is one segment."""
    from pipelines.families.qwen_image.mask_helper import text_seq_len_from_mask

    if helper == "eager break":
        fn = eager_on_graph(qwen_mod.compute_text_seq_len_from_mask)
    else:
        fn = text_seq_len_from_mask
    monkeypatch.setattr(qwen_mod, "compute_text_seq_len_from_mask", fn)
    model = _small_qwen()
    runner = GraphRunner(model, name="qwen-mask")
    with runner.capturing():
        runner(**_call_kwargs(16, 16, 32, 20, seed=0))
    st = runner.stats()
    assert st.captures == 1 and st.capture_failures == 0, runner.blocked
    assert st.segments_per_entry == [2 if helper == "eager break" else 1]
    for seed in range(1, 11):
        kw = _call_kwargs(16, 16, 32, 10 + seed, seed=seed)  # mask values change, shape does not
        ref = model(**kw)[0]
        out = runner(**kw)[0]
        assert torch.equal(out, ref), f"seed {seed}"
    assert runner.stats().replays == 11

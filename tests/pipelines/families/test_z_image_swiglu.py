"""Z-Image's SwiGLU feed-forward under its recipe's compiled form (pipelines/families/z_image/recipe.py,
accel/hooks/compiled/fused.py) on the CPU: with the library's float8 layers the down projection
takes the SiLU and the product into its one-pass quantization, the same bits as diffusers' path
(the op is the modules' arithmetic here); with bf16 or torchao layers nothing changes."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_z_image import FeedForward

from accel.hooks.fp8.scaled_mm import ScaledMMFloat8
from pipelines.builders import build_transformer
from pipelines.families.z_image.recipe import ZImageRecipe
from tests.helpers.float8_on_cpu import count_silu_mul


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return count_silu_mul(monkeypatch)


@torch.no_grad()
@pytest.mark.parametrize("layers", [("w1", "w2", "w3"), ("w1", "w3")], ids=["float8 down", "bf16 down"])
def test_the_recipes_form_gives_diffusers_bits_and_fuses_only_a_float8_down_projection(counted, layers) -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"ff": FeedForward(32, 64)}).to(torch.bfloat16)
    assert ScaledMMFloat8().quantize(model, [f"ff.{n}" for n in layers]) == [f"ff.{n}" for n in layers]
    x = (torch.randn(2, 7, 32) * 3).bfloat16()
    want = model["ff"](x)
    undo = ZImageRecipe().compiled_forms(model)
    assert "forward" in vars(model["ff"])
    assert torch.equal(model["ff"](x), want)
    assert counted == ([1] if "w2" in layers else [])
    undo()
    assert "forward" not in vars(model["ff"])


def test_the_form_goes_into_every_block_of_the_tiny_model_and_out_again(counted) -> None:
    t = build_transformer("z-image", "tiny", dtype=torch.bfloat16)
    undo = ZImageRecipe().compiled_forms(t)
    ffs = [m for m in t.modules() if type(m) is FeedForward]
    assert ffs and all("forward" in vars(m) for m in ffs)
    undo()
    assert not any("forward" in vars(m) for m in ffs)

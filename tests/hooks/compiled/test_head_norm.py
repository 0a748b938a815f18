"""The per-head RMS norm and rotation in one op (accel/hooks/compiled/head_norm.py) on the CPU: its
reference is diffusers' modules' arithmetic bit for bit (RMSNorm, the cast the attention makes,
the rotary product, the cached keys' concatenation); the op is opaque to dynamo; its Triton kernel
under Triton's interpreter (tests/helpers/interpreted.py, skipped without Triton: docs/development.md)
gives the reference's bits, strided inputs and a prefix included."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from diffusers.models.normalization import RMSNorm

from accel import head_norm_rope
from accel.hooks.compiled import head_norm
from accel.hooks.compiled.head_norm import head_norm_rope_reference
from pipelines.families.qwen_image.forms import rotate_pairs
from tests.helpers.interpreted import faithful, run_child
from tests.helpers.traced import traced

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from accel.hooks.compiled.head_norm_kernel import LAUNCH_OPTIONS, head_norm_rope_kernel
except ImportError:  # the CPU environment leaves Triton out (docs/development.md)
    head_norm_rope_kernel = None

needs_triton = pytest.mark.skipif(head_norm_rope_kernel is None, reason="needs Triton (docs/development.md says how)")

EPS = 1e-6
# (batch, tokens, heads, D, prefix): Qwen-Image 2.1's head size, a smaller one, a cached prefix.
SHAPES = [(1, 9, 2, 128, 0), (2, 13, 3, 128, 5), (2, 7, 4, 64, 3)]


def _inputs(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random (not unit) rows as a strided view of a projection's output (the keys' third of a
    fused QKV), a weight about 1, a complex table of unit frequencies and a cached prefix."""
    g = torch.Generator().manual_seed(seed)
    batch, tokens, heads, d, p = shape
    qkv = torch.randn(batch, tokens, 3 * heads * d, generator=g) * 3 + 0.5
    x = qkv.bfloat16()[..., heads * d : 2 * heads * d].unflatten(-1, (heads, d))
    weight = (torch.randn(d, generator=g) * 0.3 + 1).bfloat16()
    freqs = torch.polar(torch.ones(tokens, d // 2), torch.rand(tokens, d // 2, generator=g) * 6.3)
    prefix = torch.randn(batch, p, heads, d, generator=g).bfloat16() if p else None
    return x, weight, freqs, prefix


def _modules(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, prefix: torch.Tensor | None) -> torch.Tensor:
    """Qwen-Image 2.1's attention as diffusers runs it: norm_k(key).to(value.dtype), the complex
    rotary product, the cached keys in front."""
    norm = RMSNorm(x.shape[-1], eps=EPS).to(weight.dtype)
    norm.weight.data.copy_(weight)
    y = norm(x).to(x.dtype)
    rotated = torch.view_as_real(torch.view_as_complex(y.float().reshape(*y.shape[:-1], -1, 2)) * freqs[:, None])
    out = rotated.flatten(3).type_as(y)
    return out if prefix is None else torch.cat([prefix, out], dim=1)


@torch.no_grad()
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_the_reference_is_the_modules_arithmetic(shape: tuple[int, ...], weight_dtype: torch.dtype) -> None:
    x, weight, freqs, prefix = _inputs(shape)
    weight = weight.to(weight_dtype)
    want = _modules(x, weight, freqs, prefix)
    got = head_norm_rope_reference(x, weight, EPS, torch.view_as_real(freqs), prefix)
    assert got.dtype == x.dtype and torch.equal(got, want)
    # The op on the CPU is the reference; the real-arithmetic rotation (the compiled form) agrees.
    assert torch.equal(head_norm_rope(x, weight, EPS, torch.view_as_real(freqs), prefix), want)
    norm = RMSNorm(x.shape[-1], eps=EPS).to(weight_dtype)
    norm.weight.data.copy_(weight)
    real = rotate_pairs(norm(x).to(x.dtype), freqs[:, None])
    assert torch.equal(real, want[:, shape[-1] :])  # shape[-1]: the prefix's tokens


def test_bad_shapes_raise_one_line() -> None:
    x, weight, freqs, prefix = _inputs(SHAPES[1])
    with pytest.raises(ValueError, match="head_norm_rope takes x"):
        head_norm_rope(x, weight[:-2], EPS, torch.view_as_real(freqs), prefix)
    with pytest.raises(ValueError, match="head_norm_rope takes x"):
        head_norm_rope(x, weight, EPS, torch.view_as_real(freqs)[:-1], prefix)
    with pytest.raises(ValueError, match="head_norm_rope takes x"):
        head_norm_rope(x, weight, EPS, torch.view_as_real(freqs), prefix[..., :-1])


def test_dynamo_keeps_the_op_opaque() -> None:
    x, weight, freqs, prefix = _inputs(SHAPES[1])
    f = torch.view_as_real(freqs)

    def fn(x: torch.Tensor, f: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        return head_norm_rope(x, weight, EPS, f, prefix) * 2

    out, seen = traced(fn, x, f, prefix)
    assert torch.ops.bcg_diffusers.head_norm_rope.default in seen
    assert torch.equal(out, head_norm_rope_reference(x, weight, EPS, f, prefix) * 2)


def _ptx(**options: Any) -> str:
    """The kernel for an H100 as the op launches it at Qwen-Image 2.1's shapes (Triton's launcher
    marks integer arguments divisible by 16 as such: every pointer and stride there)."""
    signature = {
        **dict.fromkeys(("x_ptr", "w_ptr", "out_ptr"), "*bf16"),
        "f_ptr": "*fp32",
        **dict.fromkeys(("N", "TOKENS", "HEADS", "stride_xb", "stride_xt", "stride_xh", "stride_ob", "PREFIX"), "i32"),
        **dict.fromkeys(("EPS", "HALF", "ROWS"), "constexpr"),
    }
    names = list(signature)
    aligned = ("x_ptr", "w_ptr", "out_ptr", "f_ptr", "N", "TOKENS", "HEADS", "stride_xb", "stride_xt", "stride_xh")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*aligned, "stride_ob")}
    source = ASTSource(
        fn=head_norm_rope_kernel, signature=signature, constexprs={"EPS": EPS, "HALF": 64, "ROWS": 32}, attrs=attrs
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})
    return compiled.asm["ptx"]


@needs_triton
def test_on_an_h100_rows_move_in_16_byte_accesses_and_the_rotation_rounds_each_product() -> None:
    ptx = _ptx(**LAUNCH_OPTIONS)
    # Each row read and written whole (the pairs split and joined in registers), even behind a
    # prefix of any length (the offset is a multiple of a row of heads).
    assert "st.global.v4.b32" in ptx and "st.global.b16" not in ptx
    assert "ld.global.v4.b32" in ptx
    # The control: with LLVM's contraction a product and the difference after it are one FMA.
    assert "fma.rn.f32" in _ptx(enable_fp_fusion=True) and "fma.rn.f32" not in ptx


# -- under Triton's interpreter ---------------------------------------------------------------------


def _interpret() -> dict[str, Any]:
    """In the child: per shape, the share of values the kernel gives otherwise than the reference,
    with the interpreter's conversions made faithful and as they are."""
    out: dict[str, Any] = {}
    for on in (True, False):
        with faithful(on):
            for shape in SHAPES:
                x, weight, freqs, prefix = _inputs(shape)
                f = torch.view_as_real(freqs)
                got = head_norm.launch(head_norm_rope_kernel, x, weight, EPS, f, prefix)
                want = head_norm_rope_reference(x, weight, EPS, f, prefix)
                key = f"{'faithful' if on else 'as it is'} {shape}"
                out[key] = [list(got.shape) == list(want.shape), (got != want).float().mean().item()]
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return run_child("tests.hooks.compiled.test_head_norm")


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_under_the_interpreter_is_the_reference(interpreted: dict[str, Any], shape: tuple[int, ...]) -> None:
    same_shape, differ = interpreted[f"faithful {shape}"]
    assert same_shape and differ == 0.0
    # The control: the interpreter's own truncating conversions move most values.
    assert interpreted[f"as it is {shape}"][1] > 0.1


if __name__ == "__main__":
    print(json.dumps(_interpret()))

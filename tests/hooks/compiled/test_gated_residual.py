"""A residual's gated update in one op (accel/hooks/compiled/gated_residual.py) on the CPU: its
reference is diffusers' arithmetic bit for bit (Qwen-Image 2.1's ``hidden + gate.tanh() * out``
with the gate's rows spread by ``_select_modulation_rows``); the op is opaque to dynamo; its
Triton kernel under Triton's interpreter (tests/helpers/interpreted.py, skipped without Triton:
docs/development.md) gives the reference's bits, with and without the target-token mask; with ``tanh=False`` the rows are taken as already
through tanh."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage21 as q21

from accel import gated_residual
from accel.hooks.compiled import gated_residual as module
from accel.hooks.compiled.gated_residual import gated_residual_reference
from tests.helpers.interpreted import faithful, run_child
from tests.helpers.traced import traced

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from accel.hooks.compiled.gated_residual_kernel import LAUNCH_OPTIONS, gated_residual_kernel
except ImportError:  # the CPU environment leaves Triton out (docs/development.md)
    gated_residual_kernel = None

needs_triton = pytest.mark.skipif(gated_residual_kernel is None, reason="needs Triton (docs/development.md says how)")

# (batch, tokens, D, masked): one 1024-channel tile and a tail of tokens, a power-of-two width.
SHAPES = [(1, 11, 2048, False), (2, 9, 1024, True), (2, 5, 64, True), (3, 4, 256, False)]


def _inputs(shape: tuple[Any, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random (not unit) hidden states and outputs, gate rows spread over tanh's curve, a mask
    with both kinds of tokens."""
    g = torch.Generator().manual_seed(seed)
    batch, tokens, d, masked = shape
    hidden = (torch.randn(batch, tokens, d, generator=g) * 4).bfloat16()
    out = (torch.randn(batch, tokens, d, generator=g) * 2 + 0.3).bfloat16()
    gate = (torch.randn(batch + masked, d, generator=g) * 1.5).bfloat16()
    mask = (torch.arange(tokens) % 3 != 0) if masked else None
    return hidden, out, gate, mask


def _diffusers(hidden: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return hidden + q21._select_modulation_rows(gate, mask).tanh() * out


@torch.no_grad()
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_reference_and_the_cpu_op_are_diffusers_arithmetic(shape: tuple[Any, ...]) -> None:
    hidden, out, gate, mask = _inputs(shape)
    want = _diffusers(hidden, out, gate, mask)
    assert torch.equal(gated_residual_reference(hidden, out, gate, mask), want)
    assert torch.equal(gated_residual(hidden, out, gate, mask), want)
    # The rows already through tanh (a compiled caller's): the same bits, not a second tanh.
    rows = gate.tanh()
    assert torch.equal(gated_residual_reference(hidden, out, rows, mask, tanh=False), want)
    assert torch.equal(gated_residual(hidden, out, rows, mask, tanh=False), want)
    assert not torch.equal(gated_residual(hidden, out, rows, mask), want)


def test_bad_shapes_raise_one_line() -> None:
    hidden, out, gate, mask = _inputs(SHAPES[1])
    with pytest.raises(ValueError, match="gated_residual takes hidden"):
        gated_residual(hidden, out, gate[:-1], mask)  # a mask needs the last row
    with pytest.raises(ValueError, match="gated_residual takes hidden"):
        gated_residual(hidden, out[:, :-1], gate, mask)
    with pytest.raises(ValueError, match="gated_residual takes hidden"):
        gated_residual(hidden, out, gate, mask.int())


def test_dynamo_keeps_the_op_opaque() -> None:
    hidden, out, gate, mask = _inputs(SHAPES[1])

    def fn(hidden: torch.Tensor, out: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return gated_residual(hidden, out, gate, mask) * 2

    got, seen = traced(fn, hidden, out, gate, mask)
    assert torch.ops.bcg_diffusers.gated_residual.default in seen
    assert torch.equal(got, _diffusers(hidden, out, gate, mask) * 2)


@needs_triton
@pytest.mark.parametrize("masked", [False, True])
def test_on_an_h100_tiles_move_in_16_byte_accesses_without_fma(masked: bool) -> None:
    """The kernel for an H100 at Qwen-Image 2.1's width, as the op launches it (Triton's launcher
    marks pointers and sizes divisible by 16 as such)."""
    signature = {
        **dict.fromkeys(("x_ptr", "y_ptr", "g_ptr"), "*bf16"),
        "mask_ptr": "*i1",
        "out_ptr": "*bf16",
        **dict.fromkeys(("N", "SEQ", "ROWS_BEFORE_LAST"), "i32"),
        **dict.fromkeys(("D", "HAS_MASK", "TOKENS", "CHANNELS"), "constexpr"),
    }
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("x_ptr", "y_ptr", "g_ptr", "mask_ptr", "out_ptr", "N", "SEQ")}  # fmt: skip
    constexprs = {"D": 4096, "HAS_MASK": masked, "TOKENS": 8, "CHANNELS": 1024}
    source = ASTSource(fn=gated_residual_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **LAUNCH_OPTIONS}).asm[
        "ptx"
    ]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx and "st.global.b16" not in ptx
    assert "fma.rn.f32" not in ptx  # the product rounded to bf16 before the sum, as the tensor ops


# -- under Triton's interpreter ---------------------------------------------------------------------


def _interpret() -> dict[str, Any]:
    """In the child: per shape, the share of values the kernel gives otherwise than the reference,
    with the interpreter's conversions made faithful and as they are."""
    result: dict[str, Any] = {}
    for on in (True, False):
        with faithful(on):
            for shape in SHAPES:
                hidden, out, gate, mask = _inputs(shape)
                got = module.launch(gated_residual_kernel, hidden, out, gate, mask)
                want = gated_residual_reference(hidden, out, gate, mask)
                key = f"{'faithful' if on else 'as it is'} {shape}"
                result[key] = [list(got.shape) == list(want.shape), (got != want).float().mean().item()]
                if on:
                    got = module.launch(gated_residual_kernel, hidden, out, gate.tanh(), mask, tanh=False)
                    result[f"tanh given {shape}"] = [
                        list(got.shape) == list(want.shape),
                        (got != want).float().mean().item(),
                    ]
    return result


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return run_child("tests.hooks.compiled.test_gated_residual")


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_under_the_interpreter_is_the_reference(interpreted: dict[str, Any], shape: tuple[Any, ...]) -> None:
    same_shape, differ = interpreted[f"faithful {shape}"]
    assert same_shape and differ == 0.0
    same_shape, differ = interpreted[f"tanh given {shape}"]
    assert same_shape and differ == 0.0
    # The control: the interpreter's own truncating conversions move many values.
    assert interpreted[f"as it is {shape}"][1] > 0.05


if __name__ == "__main__":
    print(json.dumps(_interpret()))

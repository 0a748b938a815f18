"""What a GPU kernel does, read from the name CUPTI records for it.

:func:`kind` names what a kernel does: cuBLAS / CUTLASS / nvjet GEMMs (float8 ones apart), flash /
cuDNN / memory-efficient attention, inductor's fused Triton kernels (whose names list the aten ops
they fuse: ``triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3``), ATen's own elementwise, copy
and norm kernels, and the runtime's memcpy / memset records. Kinds:

==============  =================  ==========================================================
kind            group              what
==============  =================  ==========================================================
fp8_gemm        GEMM               float8 matrix products (``torch._scaled_mm``: cuBLASLt's
                                   ``nvjet_qq*`` and ``*_e4m3*`` kernels, CUTLASS rowwise)
gemm            GEMM               other matrix products (bf16: cuBLAS, CUTLASS, nvjet, inductor
                                   mm templates, split-K reductions, implicit-GEMM convolutions)
quant           fp8 quantization   activations quantized for a float8 product: a row's amax,
                                   the scale, the clamp and cast to float8 (with whatever
                                   producer inductor fused them into: a norm, an activation)
attention       attention          fused attention (flash, cuDNN SDPA, fmha) and softmax
norm            norm/elementwise   layer / group / RMS norms (a fused kernel with a norm in it)
activation      norm/elementwise   GELU, SiLU, sigmoid, tanh
rope            norm/elementwise   rotary embeddings, read from their ops: complex views and
                                   products, sin / cos, ``cat`` / ``stack`` with ``neg``
elementwise     norm/elementwise   other pointwise and reduction kernels
copy            copies/casts       memcpy, memset, ``copy_``, ``_to_copy``, ``cat``, clones,
                                   fills, gathers: data moved, nothing computed
other           other              anything else (collectives, sorting, unknown libraries)
==============  =================  ==========================================================

A fused kernel gets the kind of the op that dominates it: attention, then a product, then float8
quantization (a norm that also quantizes its output for the next product is ``quant``: that is the
fusion float8 needs), then a norm's reduction, then rope, then an activation; one that only moves
data is a copy. Names are matched case-insensitively; nothing here imports torch. Where a profiled
step's time goes, by kind, is :mod:`benchkit.timeline`'s.
"""

from __future__ import annotations

import re

__all__ = ["DESCRIPTIONS", "GROUPS", "KINDS", "fused_ops", "kind"]

KINDS: tuple[str, ...] = (
    "fp8_gemm",
    "gemm",
    "quant",
    "attention",
    "norm",
    "activation",
    "rope",
    "elementwise",
    "copy",
    "other",
)
GROUPS: dict[str, str] = {
    "fp8_gemm": "GEMM",
    "gemm": "GEMM",
    "quant": "fp8 quantization",
    "attention": "attention",
    "norm": "norm/elementwise",
    "activation": "norm/elementwise",
    "rope": "norm/elementwise",
    "elementwise": "norm/elementwise",
    "copy": "copies/casts",
    "other": "other",
}
DESCRIPTIONS: dict[str, str] = {
    "fp8_gemm": "float8 matrix products (torch._scaled_mm: nvjet_qq*, *e4m3*, CUTLASS rowwise)",
    "gemm": "other matrix products: bf16 (cuBLAS, CUTLASS, nvjet, inductor mm templates)",
    "quant": "float8 quantization of activations (amax, scale, clamp, cast), with what is fused into it",
    "attention": "fused attention (flash, cuDNN SDPA, fmha), softmax",
    "norm": "layer / group / RMS norms, with what is fused into them",
    "activation": "GELU, SiLU, sigmoid, tanh",
    "rope": "rotary embeddings (complex products, sin/cos, cat/stack with neg)",
    "elementwise": "other pointwise and reduction kernels",
    "copy": "memcpy, memset, copy_, _to_copy, cat, clone, fill, gather",
    "other": "everything else",
}

# -- inductor's Triton kernels ----------------------------------------------------------------
# triton_{poi|red|per|tem|...}_fused_<aten ops joined by "_">_<n>: the ops are those of the FX
# nodes the kernel came from (inductor's default "original_aten" descriptive names).
_TRITON = re.compile(r"^triton_(?P<kind>[a-z]+)(?:_fused)?(?P<ops>(?:_.*?)??)(?:_\d+)*$")
# Op names with underscores of their own, joined so that splitting on "_" keeps them whole.
_MULTI_WORD = tuple(
    sorted(
        (
            "native_layer_norm",
            "native_group_norm",
            "native_batch_norm",
            "layer_norm",
            "group_norm",
            "batch_norm",
            "rms_norm",
            "var_mean",
            "to_copy",
            "view_as_complex",
            "view_as_real",
            "unsafe_view",
            "constant_pad_nd",
            "as_strided",
            "scaled_dot_product",
            "flex_attention",
            "index_put",
            "index_select",
            "slice_scatter",
            "select_scatter",
            "masked_fill",
            "new_zeros",
            "new_empty",
            "new_ones",
            "zeros_like",
            "ones_like",
            "empty_like",
            "full_like",
            "lift_fresh",
            "scaled_mm",
        ),
        key=len,
        reverse=True,
    )
)
_TRITON_ATTENTION = {"softmax", "scaleddotproduct", "flexattention", "attention", "sdpa"}
_TRITON_NORM = {
    "nativelayernorm",
    "nativegroupnorm",
    "nativebatchnorm",
    "layernorm",
    "groupnorm",
    "batchnorm",
    "rmsnorm",
    "rms",
    "rsqrt",
    "varmean",
}
_TRITON_ROPE = {"viewascomplex", "viewasreal", "complex", "polar", "rotary", "rope", "sin", "cos"}
_ACTIVATIONS = {"gelu", "silu", "sigmoid", "tanh", "relu", "mish", "softplus", "glu", "hardswish"}
_TRITON_GEMM = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution"}
# A float8 activation's scale is its row's largest magnitude (amax, or abs and max); its values
# are divided by it, clamped to e4m3's range and cast (clamp, to_copy and div or reciprocal).


def _quantizes(tokens: set[str]) -> bool:
    if "exp" in tokens:  # a clamped exponential is a softmax's or a schedule's, not a scale's
        return False
    if "amax" in tokens or {"abs", "max"} <= tokens:
        return True
    return {"clamp", "tocopy"} <= tokens and bool(tokens & {"div", "reciprocal"})


_MOVEMENT = {
    "tocopy",
    "copy",
    "clone",
    "cat",
    "stack",
    "view",
    "unsafeview",
    "reshape",
    "flatten",
    "permute",
    "transpose",
    "t",
    "expand",
    "slice",
    "select",
    "narrow",
    "split",
    "unbind",
    "squeeze",
    "unsqueeze",
    "contiguous",
    "alias",
    "asstrided",
    "constantpadnd",
    "pad",
    "repeat",
    "roll",
    "flip",
    "index",
    "indexselect",
    "indexput",
    "gather",
    "scatter",
    "slicescatter",
    "selectscatter",
    "fill",
    "zeros",
    "ones",
    "full",
    "empty",
    "newzeros",
    "newempty",
    "newones",
    "zeroslike",
    "oneslike",
    "emptylike",
    "fulllike",
    "liftfresh",
    "detach",
}

# -- everything else: substrings of the lower-cased (demangled) name, checked in this order ----
_ATTENTION = ("flash", "fmha", "sdpa", "attention", "attn", "softmax")
_GEMM = (
    "gemm",
    "gemv",
    "nvjet",
    "xmma",
    "cutlass",
    "cublas",
    "matmul",
    "wgmma",
    "s16816",
    "h16816",
    "s1688",
    "hmma",
    "fprop",
    "convolution",
)
_NORM = (
    "layer_norm",
    "layernorm",
    "group_norm",
    "groupnorm",
    "rms_norm",
    "rmsnorm",
    "batch_norm",
    "batchnorm",
    "rowwisemoments",
    "computefusedparams",
)
_ROPE = ("complex", "rotary")
# The element types of float8 products and casts (cuBLASLt's e4m3 kernels, CUTLASS's float_e4m3_t,
# the rowwise kernels' f8f8bf16, ATen's casts to Float8_e4m3fn).
# The library's own one-pass quantization kernels (accel/hooks/fp8/row_quant_kernel.py and
# norm_quant_kernel.py, the modulated LayerNorm that writes float8 rows) are named for what they
# do, not for their float8 type.
_FP8 = ("e4m3", "e5m2", "float8", "fp8", "f8f8", "quantize_rows", "norm_rows")
# nvjet's kernels name their element types first: "qq" (two float8 operands) against "tst", "hsh".
_NVJET_TYPES = re.compile(r"nvjet_(?:sm\d+_)?([a-z]+)")
_COPY = (
    "memcpy",
    "memset",
    "copy",
    "catarray",
    "fillfunctor",
    "fill_kernel",
    "index_elementwise",
    "indexselect",
    "index_select",
    "gather",
    "scatter",
)
_ELEMENTWISE = ("elementwise", "reduce_kernel", "functor", "pointwise", "triton")


def fused_ops(name: str) -> tuple[str, tuple[str, ...]] | None:
    """``(triton kind, ops)`` of an inductor Triton kernel name, else None.

    ``"triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3"`` ->
    ``("red", ("tocopy", "add", "mean", "mul", "pow", "rsqrt"))``: multi-word aten ops are
    joined (``_to_copy`` -> ``tocopy``), the trailing kernel number dropped.
    """
    m = _TRITON.match(name.strip().lower())
    if m is None:
        return None
    ops = m.group("ops")
    for word in _MULTI_WORD:
        ops = ops.replace(word, word.replace("_", ""))
    return m.group("kind"), tuple(t for t in ops.split("_") if t)


def _triton_kind(triton: str, ops: tuple[str, ...]) -> str:
    tokens = set(ops)
    if tokens & _TRITON_ATTENTION:
        return "attention"
    if "scaledmm" in tokens:
        if triton == "tem":
            return "fp8_gemm"
        # A reduction or pointwise kernel is never the product (cuBLAS runs it, or a template):
        # inductor names it after the _scaled_mm its ops were traced from, the activation's
        # quantization (H100, Z-Image fp8: `triton_red_fused__scaled_mm__to_copy_abs_amax_...`,
        # 9.6 ms a step, had been counted as float8 products).
        tokens.discard("scaledmm")
    if triton == "tem":  # templates: matmuls (and convolutions) unless flex attention, above
        return "gemm"
    if tokens & _TRITON_GEMM:
        return "gemm"
    if _quantizes(tokens):
        return "quant"
    if tokens & _TRITON_NORM:
        return "norm"
    if tokens & _TRITON_ROPE or ("neg" in tokens and tokens & {"cat", "stack"}):
        return "rope"
    if tokens & _ACTIVATIONS:
        return "activation"
    if tokens and tokens <= _MOVEMENT:
        return "copy"
    return "elementwise"


def _nvjet_fp8(n: str) -> bool:
    m = _NVJET_TYPES.search(n)
    return m is not None and m.group(1).startswith("q")


def kind(name: str) -> str:
    """What the kernel called ``name`` does: one of :data:`KINDS`."""
    triton = fused_ops(name)
    if triton is not None:
        return _triton_kind(*triton)
    n = name.lower()
    if n.startswith(("memcpy", "memset")):  # the runtime's own records: "Memcpy DtoD (Device -> Device)"
        return "copy"
    if "nccl" in n:  # collectives, before "gather" calls an all-gather a copy
        return "other"
    if any(s in n for s in _ATTENTION):  # before GEMM: flash kernels are CUTLASS templates
        return "attention"
    fp8 = any(s in n for s in _FP8) or _nvjet_fp8(n)
    if any(s in n for s in _GEMM):
        return "fp8_gemm" if fp8 else "gemm"
    if fp8:  # a float8 type, no product: a cast to float8
        return "quant"
    for found, substrings in (
        ("norm", _NORM),
        ("activation", tuple(_ACTIVATIONS)),
        ("rope", _ROPE),  # before copy: the copy out of a complex view is the rotary's
        ("copy", _COPY),
        ("elementwise", _ELEMENTWISE),
    ):
        if any(s in n for s in substrings):
            return found
    return "other"

"""Recipe for Qwen-Image 2.1 (diffusers' QwenImage21Transformer2DModel).

The forward runs with its host-side token layout factored out into one keyed eager break and
everything after it captured (:mod:`pipelines.families.qwen_image_21.layout`); the recipe reads
each call's masks before the runner (:meth:`QwenImage21Recipe.route_call`), once per call. The K/V
cache (``kv_cache=``, a new ``QwenImage21KVCache`` per pipeline call, filled at step 0 "extract"
and read by the "cached" steps) is passed through untouched and named as request-scoped state
(``state_types``): the graph core keys it by structure and puts back what the extract step stores
into it.

The text is not padded to buckets: each image token's RoPE frame position counts the text
before it, so padding moves the image's positions (not exact even in real arithmetic). Each text
length is a signature of its own; warm up with the prompts real calls use.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from accel import GenerationDefaults, GenericRecipe, fuse_swiglu_inputs

from ..qwen_image.forms import qwen_rope_in_real_arithmetic
from .fused_norms import fuse_norm_quantization
from .head_norms import fuse_head_norms
from .layout import LAYOUT_KWARG, MODULE, LayoutMemo, layout_forward
from .models import FAMILY
from .residuals import fuse_residuals

__all__ = ["TEXT_ENCODER_BREAKS", "QwenImage21Recipe", "fuse_swiglu"]

logger = logging.getLogger(__name__)

_QWEN3_VL = "transformers.models.qwen3_vl.modeling_qwen3_vl"
# Qwen3-VL's functions that sync with the host, each a pure function of its inputs: the causal
# mask's all-ones check (as Qwen2.5-VL's, for Qwen-Image), and where a condition image is read:
# the vision tower (its grid read on the host), the placeholder count check, the 3D RoPE
# positions (grouped on the host) and the deepstack features put at the image's positions
# (a boolean index-put).
TEXT_ENCODER_BREAKS = (
    "transformers.masking_utils._ignore_causal_mask_sdpa",
    f"{_QWEN3_VL}.Qwen3VLModel.get_image_features",
    f"{_QWEN3_VL}.Qwen3VLModel.get_placeholder_mask",
    f"{_QWEN3_VL}.Qwen3VLModel.compute_3d_position_ids",
    f"{_QWEN3_VL}.Qwen3VLTextModel._deepstack_process",
)


def fuse_swiglu(module: torch.nn.Module) -> Callable[[], None]:
    """``module``'s SwiGLU feed-forwards (``out(silu(gate_layer(x)) * proj(x))``) hand a float8 down
    projection of the library's their factors, which its one-pass quantization multiplies
    (:func:`accel.fuse_swiglu_inputs`; ``compile=True``); the returned undo takes them out."""
    swiglu = sys.modules[MODULE].QwenImage21SwiGLUFeedForward
    why = "qwen-image-2.1: a float8 down projection quantizes silu(gate) * up in one pass (compile=True)"
    return fuse_swiglu_inputs(module, swiglu, gate="gate_layer", up="proj", down="out", why=why)


class QwenImage21Recipe(GenericRecipe):
    """The host-side token layout as one keyed eager break; the rest of the forward captured.

    The warm-up is the generic one (real prompts through the pipeline, true CFG on and off, an
    ``image`` or ``use_kv_cache`` where ``call_kwargs`` name them).
    """

    name = "qwen-image-2.1"
    denoiser_classes = ("QwenImage21Transformer2DModel",)
    diffusers_versions = ">=0.42,<0.43"
    # The K/V cache the pipeline makes per call: request-scoped state, keyed by its structure, the
    # extract step's stores put back by every replay (accel.graphs.stores).
    state_types = (QwenImage21KVCache,)
    # quantize="fp8" makes the library's float8 layers (accel/hooks/fp8/scaled_mm.py): with the
    # forms below they took the float8 call under torchao's on an H100 (docs/benchmarks.md).
    fp8_layers = "scaled-mm"
    # quantize="fp8" keeps these in bf16 from the start: the input projections, the timestep
    # embedder, the shared modulation, the output norm and projection (as for Qwen-Image).
    fp8_keep = (
        "img_in",
        "txt_in.*",
        "time_text_embed.*",
        "modulation.*",
        "norm_out.linear",
        "proj_out",
        # With attention="fa3", the attention too (bf16 FlashAttention-3): quantizing the queries
        # and the prefix and step's keys and values every step costs more than the float8 kernel
        # saves at this model's sizes (docs/benchmarks.md).
        "transformer_blocks.*.attn",
    )

    # With compile=True, each block's gates take their tanh per modulation row (any layers), and
    # with the library's float8 layers the modulated norms write their float8 consumers' input in
    # one pass (fused_norms.py). Set it False on the class before accelerate_pipeline to compare.
    fused_norm_fp8 = True
    # With compile=True, the query and key head norms and their rotation run as one op each, the
    # keys written behind the cached prefix (head_norms.py; any layers; measured faster on an H100,
    # docs/benchmarks.md). Set it False on the class before accelerate_pipeline to compare.
    fused_head_norms = True
    # With compile=True, each block's two gated residual updates run as one op each (residuals.py;
    # any layers, reading the gates' rows from fused_norms.py's _modulate; measured faster on an
    # H100, docs/benchmarks.md). Set it False on the class before accelerate_pipeline to compare.
    fused_residuals = True
    # With compile=True, fused_head_norms and the library's float8 layers, the value projections
    # of the steps that read the K/V cache write behind the cached values, without the
    # concatenation's pass (head_norms.py; measured faster on an H100, docs/benchmarks.md). Set it
    # False on the class before accelerate_pipeline to compare.
    values_behind_prefix = True
    # With compile=True, each block makes its modulation's small tensors in its compiled graph:
    # both gates' rows through tanh for the residual op (with fused_residuals, residuals.py) and the
    # scales' rows contiguous for the modulated norm op (with fused_norm_fp8, fused_norms.py), where
    # the ops took an ATen tanh or copy each: 128 fewer launches a step. Off until measured on a GPU
    # (bench_fp8.py --form-flip modulation_in_block).
    modulation_in_block = False

    def __init__(self) -> None:
        self.layouts = LayoutMemo()

    def wrap_forward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        forward = layout_forward(fn, self.layouts)
        if forward is None:
            logger.warning(
                "qwen-image-2.1: %s is not diffusers 0.42's QwenImage21Transformer2DModel.forward; the stock forward "
                "runs (its host syncs keep it eager)",
                getattr(fn, "__qualname__", fn),
            )
            return fn
        return forward

    def route_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # The masks' values read from the pipeline's own tensors, once per call (the same tensors
        # come at every step): the layout break then reads nothing, so no step waits on the GPU.
        if args or not isinstance(kwargs.get("img_mask"), torch.Tensor):
            return args, kwargs
        token = self.layouts.masks_token(kwargs["img_mask"], kwargs.get("encoder_hidden_states_mask"))
        return args, {**kwargs, LAYOUT_KWARG: token}

    def compiled_forms(self, module: torch.nn.Module) -> Callable[[], None]:
        # The same complex rotary product as Qwen-Image's (pipelines/families/qwen_image/forms.py);
        # a float8 down projection of the library's takes the SwiGLU into its quantization, and float8
        # layers of the library's take their input from the modulated norm (fused_norms.py); the
        # head norms and rotation run as one op (head_norms.py), and so may the gated residual
        # updates (residuals.py).
        if type(module).__module__ != MODULE:
            return lambda: None
        undo = [qwen_rope_in_real_arithmetic(MODULE), fuse_swiglu(module)]
        if self.fused_head_norms:
            undo.append(fuse_head_norms(values_behind=self.values_behind_prefix))
        if self.fused_norm_fp8:
            undo.append(fuse_norm_quantization(module, contiguous_scales=self.modulation_in_block))
        if self.fused_residuals:
            undo.append(fuse_residuals(module, tanh_in_block=self.modulation_in_block))
        return lambda: [u() for u in reversed(undo)] and None

    def component_breaks(self) -> dict[str, tuple[str, ...]]:
        return {"text_encoder": TEXT_ENCODER_BREAKS}

    def generation_defaults(self) -> GenerationDefaults:
        return GenerationDefaults(**FAMILY.generation)  # the family's (models.py)

"""Rotary embeddings in real arithmetic, for Qwen-Image's and Z-Image's compiled blocks.

Both models rotate queries and keys as complex numbers: ``view_as_complex(x.float())`` times a
complex frequency table. Inductor has no complex kernels, so with ``compile=True`` every rotation
is a separate ATen kernel reading and writing fp32 (samples/profile/: 2.5-3% of a 1024x1024 step,
plus the RMS norm that feeds it writing fp32 instead of bf16). The same product written on the real
and imaginary parts, ``(a*c - b*d, a*d + b*c)`` in fp32, is one pointwise expression inductor
fuses into the norm before it and the cast after it.

Equal to diffusers' complex product in real arithmetic, and bit for bit on the CPU, but not
promised bit for bit on CUDA (a fused multiply-add may round once where the complex kernel rounds
twice): applied only with ``compile=True``, whose rule is graphs equal to the same compiled model
without graphs. The code each form replaces is diffusers 0.42's (the recipes pin that range).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from accel import patch, unpatched

__all__ = ["qwen_rope_in_real_arithmetic", "rotate_pairs", "z_image_rope_in_real_arithmetic"]

WHY = "rotary embeddings in real arithmetic (compile=True)"


def rotate_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x``'s last dimension read as (real, imaginary) pairs, times the complex ``freqs``
    (broadcast to the pairs), in fp32, returned in ``x``'s dtype: diffusers'
    ``view_as_real(view_as_complex(x.float()...) * freqs).flatten(-2).type_as(x)``, in real ops."""
    f = torch.view_as_real(freqs)
    cos, sin = f[..., 0], f[..., 1]
    real, imag = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    out = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return out.flatten(-2).type_as(x)


# -- Qwen-Image: the module-level helper its attention processor calls -----------------------------
QWEN_MODULE = "diffusers.models.transformers.transformer_qwenimage"


def qwen_rope_in_real_arithmetic() -> Callable[[], None]:
    """Qwen-Image's ``apply_rotary_emb_qwen(..., use_real=False)`` in real arithmetic until the
    returned undo is called (other uses of the helper run diffusers' code)."""
    mod = sys.modules[QWEN_MODULE]
    original = unpatched(mod, "apply_rotary_emb_qwen")

    def apply_rotary_emb_qwen(
        x: torch.Tensor, freqs_cis: Any, use_real: bool = True, use_real_unbind_dim: int = -1
    ) -> torch.Tensor:
        if use_real or not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_complex():
            return original(x, freqs_cis, use_real, use_real_unbind_dim)
        return rotate_pairs(x, freqs_cis.unsqueeze(1))  # diffusers: freqs_cis.unsqueeze(1)

    return patch(mod, "apply_rotary_emb_qwen", apply_rotary_emb_qwen, why=WHY).undo


# -- Z-Image: the rotation is a closure inside the processor's __call__ -----------------------------
def _z_image_processor_class() -> type:
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    class RealRopeZSingleStreamAttnProcessor(ZSingleStreamAttnProcessor):
        """diffusers 0.42's ``ZSingleStreamAttnProcessor.__call__``, line for line, but for the
        rotation, done by :func:`rotate_pairs`."""

        def __call__(
            self,
            attn: Any,
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None,
            freqs_cis: torch.Tensor | None = None,
        ) -> torch.Tensor:
            query = attn.to_q(hidden_states)
            key = attn.to_k(hidden_states)
            value = attn.to_v(hidden_states)

            query = query.unflatten(-1, (attn.heads, -1))
            key = key.unflatten(-1, (attn.heads, -1))
            value = value.unflatten(-1, (attn.heads, -1))

            if attn.norm_q is not None:
                query = attn.norm_q(query)
            if attn.norm_k is not None:
                key = attn.norm_k(key)

            def apply_rotary_emb(x_in: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
                with torch.amp.autocast("cuda", enabled=False):
                    return rotate_pairs(x_in, freqs_cis.unsqueeze(2))

            if freqs_cis is not None:
                query = apply_rotary_emb(query, freqs_cis)
                key = apply_rotary_emb(key, freqs_cis)

            dtype = query.dtype
            query, key = query.to(dtype), key.to(dtype)

            if attention_mask is not None and attention_mask.ndim == 2:
                attention_mask = attention_mask[:, None, None, :]

            hidden_states = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )

            hidden_states = hidden_states.flatten(2, 3)
            hidden_states = hidden_states.to(dtype)

            output = attn.to_out[0](hidden_states)
            if len(attn.to_out) > 1:
                output = attn.to_out[1](output)

            return output

    return RealRopeZSingleStreamAttnProcessor


def z_image_rope_in_real_arithmetic(model: torch.nn.Module) -> Callable[[], None]:
    """Give ``model``'s Z-Image attention modules a processor whose rotation is in real arithmetic
    until the returned undo is called. Only diffusers' own processor is replaced (its instance
    settings, such as a parallel config, carried over); any other is left alone."""
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    cls = _z_image_processor_class()
    held = []
    for module in model.modules():
        processor = vars(module).get("processor")
        if type(processor) is ZSingleStreamAttnProcessor:
            replacement = cls()
            vars(replacement).update(vars(processor))
            held.append(patch(module, "processor", replacement, why=WHY, where="dict"))
    return lambda: [p.undo() for p in reversed(held)] and None

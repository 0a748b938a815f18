"""True CFG's two denoiser calls per step, which the pipeline runs under ``cache_context("cond")``
and ``("uncond")``: which branch a call is, its output uncomputed (what the rank that does not
compute it returns under ``parallel="cfg"``), and the two joined into one batch-2 call
(``cfg_batch``).

When the calls are joined (text buckets, image size, the Ulysses degree) is the recipe's decision
(:meth:`~pipelines.families.qwen_image.recipe.QwenImageRecipe.batch_cfg`), which pads both texts
to one length first; this module only joins what it is given.
"""

from __future__ import annotations

from typing import Any

import torch

from accel import tree

__all__ = ["BATCHED_TENSORS", "CFG_BRANCHES", "PER_SAMPLE_LISTS", "join_calls", "output_like"]

# True CFG's two calls per step, by the cache_context the pipeline runs them under.
CFG_BRANCHES = {"cond": 0, "uncond": 1}
# A denoiser call's per-sample arguments, when two calls are joined into one batch.
BATCHED_TENSORS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "guidance")
PER_SAMPLE_LISTS = ("img_shapes", "txt_seq_lens")


def output_like(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a call of the denoiser ``module`` returns, uncomputed: ``proj_out``'s width over the
    call's image tokens, in the dtype the call computes in, as ``return_dict`` asks."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor):
        raise ValueError("qwen-image: a denoiser call without hidden_states cannot be split for parallel='cfg'")
    proj = module.proj_out
    dtype = proj.weight.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    out = hidden.new_empty((*hidden.shape[:-1], proj.out_features), dtype=dtype)
    if kwargs.get("return_dict", True):
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)
    return (out,)


def join_calls(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any] | None:
    """The keyword arguments of one call computing both (their texts already padded to one
    length): :data:`BATCHED_TENSORS` concatenated along the batch, :data:`PER_SAMPLE_LISTS`
    appended, everything else equal in both. None where they cannot join (a tensor of another
    shape, dtype or device, a tensor or setting not known to join, two different settings)."""
    joined: dict[str, Any] = {}
    for key, a in first.items():
        b = second[key]
        if key in BATCHED_TENSORS and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dim() == 0 or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                return None
            joined[key] = torch.cat([a, b])
        elif key in PER_SAMPLE_LISTS and isinstance(a, list) and isinstance(b, list):
            joined[key] = a + b
        elif tree.tensors(a) or tree.tensors(b) or a != b:
            return None  # a tensor or setting the recipe does not know how to join
        else:
            joined[key] = a
    return joined

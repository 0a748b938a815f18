"""Qwen-Image's text-mask helper as a function that captures: :func:`text_seq_len_from_mask`.

diffusers' ``compute_text_seq_len_from_mask`` builds a device tensor from a Python int whenever a
text mask is passed: a pageable host-to-device copy, illegal inside a capture, and one that waits
for the GPU to finish what it was given before. :func:`mask_helper_on_device` puts in the same
function with that tensor filled on the device, so it captures with the rest of the forward; a
helper that is not diffusers' own becomes an eager break instead. The code it stands in for is
diffusers 0.42's (the recipe pins that range).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from accel import eager_on_graph, patch, unpatched

__all__ = ["mask_helper_on_device", "text_seq_len_from_mask"]


def text_seq_len_from_mask(
    encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """diffusers 0.42's ``compute_text_seq_len_from_mask``, the fallback length of a sample
    without text made on the device (a fill) instead of copied from the host: the same values,
    and it captures. A host copy there would make it a break, and the copy waits for the GPU to
    finish what it was given before, at every call."""
    batch_size, text_seq_len = encoder_hidden_states.shape[:2]
    if encoder_hidden_states_mask is None:
        return text_seq_len, None, None
    if encoder_hidden_states_mask.shape[:2] != (batch_size, text_seq_len):
        raise ValueError(
            f"`encoder_hidden_states_mask` shape {encoder_hidden_states_mask.shape} must match "
            f"(batch_size, text_seq_len)=({batch_size}, {text_seq_len})."
        )
    if encoder_hidden_states_mask.dtype != torch.bool:
        encoder_hidden_states_mask = encoder_hidden_states_mask.to(torch.bool)
    device = encoder_hidden_states.device
    position_ids = torch.arange(text_seq_len, device=device, dtype=torch.long)
    active_positions = torch.where(encoder_hidden_states_mask, position_ids, position_ids.new_zeros(()))
    has_active = encoder_hidden_states_mask.any(dim=1)
    fallback = torch.full((), text_seq_len, dtype=torch.long, device=device)
    per_sample_len = torch.where(has_active, active_positions.max(dim=1).values + 1, fallback)
    return text_seq_len, per_sample_len, encoder_hidden_states_mask


def mask_helper_on_device(modname: str) -> Callable[[], None]:
    """Put :func:`text_seq_len_from_mask` in the module's helper while the returned undo is not
    called (each denoiser's install holds one patch; the last undo puts diffusers' function back).
    A helper that is not diffusers' own becomes an eager break instead."""
    mod = sys.modules[modname]
    original = unpatched(mod, "compute_text_seq_len_from_mask")
    if getattr(original, "__module__", None) == modname:
        why = "qwen-image: the text-mask helper without its host copy"
        return patch(mod, "compute_text_seq_len_from_mask", text_seq_len_from_mask, why=why).undo
    eager = eager_on_graph(original, name="qwen-image text mask to length")

    def compute_text_seq_len_from_mask(encoder_hidden_states, encoder_hidden_states_mask):  # type: ignore[no-untyped-def]
        # Without a mask the helper only reads a shape: no need to split the graph.
        fn = original if encoder_hidden_states_mask is None else eager
        return fn(encoder_hidden_states, encoder_hidden_states_mask)

    why = "qwen-image: the text-mask helper as an eager break"
    return patch(mod, "compute_text_seq_len_from_mask", compute_text_seq_len_from_mask, why=why).undo

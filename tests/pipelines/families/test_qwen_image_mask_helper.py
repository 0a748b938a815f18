"""Qwen-Image's text-mask helper as the recipe puts it in (pipelines/families/qwen_image/mask_helper.py):
diffusers' ``compute_text_seq_len_from_mask`` with the fallback length filled on the device, not
copied from the host, so it captures with the rest of the forward instead of being a break that
waits for the GPU at every call. Same values as diffusers' own; installed only over diffusers' own."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage as qwen_mod

from accel import accelerate_pipeline, unpatched
from pipelines.families.qwen_image.mask_helper import text_seq_len_from_mask
from tests.helpers.after_warmup import as_on_cuda, tiny


@pytest.mark.parametrize("dtype", [torch.long, torch.bool])
def test_the_helper_gives_diffusers_values_without_a_host_copy(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    text = torch.randn(4, 9, 8, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.4).to(dtype)
    mask[1] = 0  # a sample without text takes the full length
    mask[2, -1] = 1  # a gap before the last token: the length counts to it
    # diffusers' own, whatever another test's pipeline still has patched in
    stock = unpatched(qwen_mod, "compute_text_seq_len_from_mask")
    want = stock(text, mask)
    monkeypatch.setattr(torch, "as_tensor", lambda *a, **k: pytest.fail("copied a value from the host"))
    got = text_seq_len_from_mask(text, mask)
    assert got[0] == want[0] == 9 and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[1].dtype == want[1].dtype and got[1].tolist()[1] == 9
    assert text_seq_len_from_mask(text, None) == (9, None, None)
    with pytest.raises(ValueError, match="must match"):
        text_seq_len_from_mask(text, mask[:, :5])
    # The control: diffusers' own copies the length from the host.
    with pytest.raises(pytest.fail.Exception, match="copied a value from the host"):
        stock(text, mask)


def test_the_recipe_puts_it_in_over_diffusers_own_and_its_graphs_hold_it(monkeypatch: pytest.MonkeyPatch) -> None:
    as_on_cuda(monkeypatch)  # pageable host copies fail a capture, as on a GPU
    pipe = tiny("qwen-image")
    stock = qwen_mod.compute_text_seq_len_from_mask  # as it is now (another pipeline may hold a patch)
    accelerate_pipeline(pipe)
    assert qwen_mod.compute_text_seq_len_from_mask is text_seq_len_from_mask
    pipe.accel.warmup([(64, 64)], progress=False)
    st = pipe.accel.stats()["transformer"]
    # Text padded to a bucket comes with a mask: the helper runs inside the one segment.
    assert st.captures > 0 and st.capture_failures == 0 and set(st.segments_per_entry) == {1}, st
    pipe.accel.restore()
    assert qwen_mod.compute_text_seq_len_from_mask is stock

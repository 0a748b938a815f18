"""The walk beyond the denoiser, on the CPU: which components get runners, what restore gives back,
known breaks marked while accelerated, and a located capture failure in the report."""

from __future__ import annotations

import torch
import transformers.masking_utils as masking_utils

from accel import accelerate_pipeline
from accel.graphs import discover
from accel.hooks.components import components
from accel.hooks.graph_hook import HOOK_NAME, graph_hook_of
from accel.hooks.options import AcceleratorOptions
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate


def _latents(pipe, seed: int = 0) -> torch.Tensor:
    return generate(pipe, "a lighthouse on a cliff in a storm", seed=seed, output_type="pt")


def test_text_encoder_and_vae_decoder_get_runners_and_restore_gives_them_back() -> None:
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    decoder_forward = type(pipe.vae.decoder).forward
    reference = _latents(pipe)
    accelerate_pipeline(pipe)
    assert set(pipe.accel.runners) == {"transformer", "text_encoder", "vae.decoder"}
    assert set(pipe.accel.recipes) == {"transformer"}  # components use the generic recipe, no recipe of their own
    for module in (pipe.text_encoder, pipe.vae.decoder):
        hook = graph_hook_of(module)
        assert hook is not None and hook.component and not hook.compiled
        assert hook.runner.config.verify  # a component's graph is compared with eager before it is kept
    # On the CPU nothing is captured: the call is the stock one, bit for bit.
    assert torch.equal(_latents(pipe), reference)
    assert "vae.decoder (Decoder, recipe generic" in pipe.accel.report()
    pipe.accel.restore()
    for module in (pipe.text_encoder, pipe.vae.decoder, pipe.transformer):
        assert graph_hook_of(module) is None
        assert "forward" not in module.__dict__
        assert not hasattr(module, "_diffusers_hook")
    assert type(pipe.vae.decoder).forward is decoder_forward


def test_components_can_be_left_out_and_run_on_every_rank_under_parallel() -> None:
    pipe = build_pipeline("qwen-image", "tiny")
    accelerate_pipeline(pipe, text_encoder=False)
    assert set(pipe.accel.runners) == {"transformer", "vae.decoder"}
    accelerate_pipeline(pipe, vae=False)  # other options re-install
    assert set(pipe.accel.runners) == {"transformer", "text_encoder"}
    assert graph_hook_of(pipe.vae.decoder) is None
    pipe.accel.restore()
    # One image on several processes: every rank runs them with graphs of its own (they hold no
    # collectives); leaving one out still leaves it out.
    assert components(pipe, AcceleratorOptions(parallel="cfg")) == ["text_encoder", "vae.decoder"]
    assert components(pipe, AcceleratorOptions(parallel="ulysses", vae=False)) == ["text_encoder"]
    assert components(pipe, AcceleratorOptions()) == ["text_encoder", "vae.decoder"]


def test_known_text_encoder_break_is_marked_while_accelerated_and_given_back() -> None:
    pipe = build_pipeline("qwen-image", "tiny")
    other = build_pipeline("qwen-image", "tiny")
    # Pipelines earlier in this process that were never restored may hold the mark already.
    before = masking_utils._ignore_causal_mask_sdpa
    original = getattr(before, "__wrapped__", before)
    accelerate_pipeline(pipe)
    accelerate_pipeline(other)
    marked = masking_utils._ignore_causal_mask_sdpa
    assert getattr(marked, "__bcg_eager__", False) and marked.__wrapped__ is original
    pipe.accel.restore()  # the other pipeline's text encoder still needs it
    assert masking_utils._ignore_causal_mask_sdpa is marked
    other.accel.restore()
    assert masking_utils._ignore_causal_mask_sdpa is before
    # Without the text encoder's runner nothing is marked.
    accelerate_pipeline(pipe, text_encoder=False)
    assert masking_utils._ignore_causal_mask_sdpa is before
    pipe.accel.restore()


def test_options_reject_non_bools_for_the_new_switches() -> None:
    for name in ("text_encoder", "vae", "auto_breaks"):
        try:
            AcceleratorOptions(**{name: "yes"})
        except ValueError as e:
            assert name in str(e)
        else:  # pragma: no cover - the assertion is the test
            raise AssertionError(f"{name}='yes' was accepted")


def test_a_located_capture_failure_is_named_in_the_report() -> None:
    pipe = build_pipeline("z-image", "tiny")
    accelerate_pipeline(pipe)
    runner = pipe.accel.runners["text_encoder"]
    site = discover.BreakSite(
        function="transformers.masking_utils._ignore_causal_mask_sdpa",
        filename="transformers/masking_utils.py",
        lineno=1,
        line="if padding_mask.all():",
        error="RuntimeError: operation not permitted when stream is capturing",
    )
    runner.found_breaks.append(site)
    assert pipe.accel.found_breaks == {"text_encoder": [site]}
    assert f"capture broke at: {site}" in pipe.accel.report()
    pipe.accel.restore()
    assert graph_hook_of(pipe.text_encoder) is None and HOOK_NAME


def test_components_notice_offload_at_their_own_call() -> None:
    # A text encoder runs before the pipeline's per-call check, and the VAE decoder's offload
    # hooks sit on the VAE: each component must see offloading where it is called.
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    accelerate_pipeline(pipe)
    runners = pipe.accel.runners
    assert runners["text_encoder"].enabled and runners["vae.decoder"].enabled
    pipe.text_encoder.__dict__["_hf_hook"] = object()  # what accelerate's cpu offload attaches
    pipe.encode_prompt(prompt="a red fox", device=torch.device("cpu"), do_classifier_free_guidance=False)
    assert not runners["text_encoder"].enabled and runners["vae.decoder"].enabled
    pipe.vae.__dict__["_hf_hook"] = object()
    _latents(pipe)
    assert not runners["vae.decoder"].enabled
    assert "accelerate offload hooks" in pipe.accel.report()
    del pipe.text_encoder.__dict__["_hf_hook"], pipe.vae.__dict__["_hf_hook"]
    pipe.accel.restore()

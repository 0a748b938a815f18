"""The state guard on tiny pipelines with emulated graphs: a replay never runs a forward the model
would not run now.

Each test captures (a warm-up over exactly the calls it makes), replays, then makes changes a user
makes after a capture, one at a time, to the accelerated pipeline and to a stock pipeline with the
same weights; after each, a call of both must be equal bit for bit, and run on graphs (captured for
the new state, or kept from before), never eagerly unless graphs are off on purpose.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry, attention_backend
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from accel import accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate

NAMES = ["qwen-image", "z-image"]
PROCESSORS = {"qwen-image": QwenDoubleStreamAttnProcessor2_0, "z-image": ZSingleStreamAttnProcessor}
# A method (not the forward) each denoiser calls on a submodule.
METHODS = {"qwen-image": ("transformer_blocks.0", "_modulate"), "z-image": ("t_embedder", "timestep_embedding")}
# A submodule whose forward a user replaces.
FORWARDS = {"qwen-image": "transformer_blocks.0.img_mlp", "z-image": "layers.0.feed_forward"}


def _pipe(name: str) -> Any:
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any) -> torch.Tensor:
    return generate(pipe, negative_prompt="blurry", guidance=4.0, steps=2, seed=3)


def _accelerated(name: str, **options: Any) -> Any:
    pipe = _pipe(name)
    accelerate_pipeline(pipe, text_encoder=False, vae=False, **options)
    with pipe.accel.runners["transformer"].capturing():
        _call(pipe)
    return pipe


def scaled(out: Any, by: float) -> Any:
    if isinstance(out, tuple):
        return (out[0] * by, *out[1:])
    return out * by


def user_processor(base: type) -> type:
    """A processor as IP-Adapter, regional prompting or attention-map tools write one: the stock
    one, its output scaled by an attribute."""

    class UserProcessor(base):  # type: ignore[misc, valid-type]
        def __init__(self, scale: float = 1.25) -> None:
            super().__init__()
            self.scale = scale

        @functools.wraps(base.__call__)
        def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
            out = super().__call__(attn, *args, **kwargs)
            return tuple(o * self.scale for o in out) if isinstance(out, tuple) else out * self.scale

    return UserProcessor


def _set_processors(pipe: Any, name: str) -> Any:
    proc = user_processor(PROCESSORS[name])()
    t = pipe.transformer
    if hasattr(t, "set_attn_processor"):
        t.set_attn_processor(proc)
    else:  # Z-Image's model has no set_attn_processor: each attention module's own setter
        for m in t.modules():
            if "processor" in vars(m):
                m.set_processor(proc)
    return proc


def _replace_method(pipe: Any, name: str) -> None:
    path, attr = METHODS[name]
    module = pipe.transformer.get_submodule(path)
    stock = getattr(module, attr)
    setattr(module, attr, lambda *a, **k: scaled(stock(*a, **k), 0.9))


def _replace_forward(pipe: Any, name: str) -> None:
    module = pipe.transformer.get_submodule(FORWARDS[name])
    stock = type(module).forward
    module.forward = lambda *a, **k: stock(module, *a, **k) * 0.9


def _restore_forward(pipe: Any, name: str) -> None:
    del pipe.transformer.get_submodule(FORWARDS[name]).forward


# (label, change, does it change the image, does it keep graphs on)
Change = tuple[str, Callable[[Any, str], Any], bool, bool]
CHANGES: list[Change] = [
    ("the user's attention processors", _set_processors, True, True),
    ("a processor attribute in place", lambda p, n: setattr(_processor(p), "scale", 0.5), True, True),
    ("set_attention_backend", lambda p, n: p.transformer.set_attention_backend("_native_math"), True, True),
    ("reset_attention_backend", lambda p, n: _reset_backend(p), True, True),
    ("train mode", lambda p, n: p.transformer.train(), False, True),
    ("eval mode again", lambda p, n: p.transformer.eval(), False, True),
    ("gradient checkpointing", lambda p, n: p.transformer.enable_gradient_checkpointing(), False, True),
    ("a method replaced on a submodule", _replace_method, True, True),
    ("a forward replaced on a submodule", _replace_forward, True, False),
    ("the forward given back", _restore_forward, True, True),
]


def _reset_backend(pipe: Any) -> None:
    # diffusers resets the processors' backend but leaves its process-wide one as set.
    pipe.transformer.reset_attention_backend()
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def _processor(pipe: Any) -> Any:
    return next(m.processor for m in pipe.transformer.modules() if "processor" in vars(m))


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_changes_after_a_capture_replay_what_the_stock_pipeline_runs(name: str, emulated, caplog) -> None:
    pipe, stock = _accelerated(name), _pipe(name)
    st = pipe.accel.stats()["transformer"]
    before = _call(pipe)
    assert torch.equal(before, _call(stock)) and pipe.accel.stats()["transformer"].replays > st.replays
    hook = pipe.accel.hooks["transformer"]
    for label, change, changes_image, graphs_on in CHANGES:
        change(pipe, name)
        change(stock, name)
        st = pipe.accel.stats()["transformer"]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="accel"):
            got = _call(pipe)
        want = _call(stock)
        assert torch.equal(got, want), f"{label}: max diff {(got - want).abs().max()}"
        assert not changes_image or not torch.equal(got, before), f"{label} did not change the image"
        after = pipe.accel.stats()["transformer"]
        assert hook.active is graphs_on, f"{label}: {hook.inactive_reason}"
        if graphs_on:
            assert after.eager_calls == st.eager_calls, f"{label}: ran eagerly"
            said = [r.getMessage() for r in caplog.records if r.name == "accel.hooks.graph_hook"]
            assert len(said) <= 1, said  # one line per change
        before = got
    # The context manager around a call: its own graphs, and the ones before once it is gone.
    with attention_backend("_native_math"):
        got, want = _call(pipe), _call(stock)
    assert torch.equal(got, want) and not torch.equal(got, before)
    captures = pipe.accel.stats()["transformer"].captures
    assert torch.equal(_call(pipe), before)
    assert pipe.accel.stats()["transformer"].captures == captures  # switched back: no capture


@torch.no_grad()
def test_a_state_change_says_what_changed_in_one_line_and_report_lists_it(emulated, caplog) -> None:
    name = "z-image"
    pipe = _accelerated(name)
    _call(pipe)
    proc = _set_processors(pipe, name)
    with caplog.at_level(logging.INFO, logger="accel"):
        _call(pipe)
    said = [r.getMessage() for r in caplog.records if "processor changed" in r.getMessage()]
    base, new = PROCESSORS[name].__name__, type(proc).__name__
    assert len(said) == 1, said
    assert said[0].startswith(f"transformer: noise_refiner.0.attention.processor changed ({base} -> {new})")
    assert "more; graphs for this state are captured on the next call" in said[0]  # every block's, one line
    report = pipe.accel.report()
    assert "guard, last call: state switched (" in report and f"-> {new}" in report
    _call(pipe)
    assert "guard, last call: nothing changed" in pipe.accel.report()


@torch.no_grad()
def test_graphs_stay_off_while_a_processor_cannot_be_watched(emulated, caplog) -> None:
    class SlotProcessor(ZSingleStreamAttnProcessor):
        __slots__ = ("scale",)

    name = "z-image"
    pipe, stock = _accelerated(name), _pipe(name)
    for p in (pipe, stock):
        p.transformer.layers[0].attention.set_processor(SlotProcessor())
    with caplog.at_level(logging.WARNING, logger="accel"):
        assert torch.equal(_call(pipe), _call(stock))
        _call(pipe)
    said = [r.getMessage() for r in caplog.records if "cannot be watched" in r.getMessage()]
    assert len(said) == 1 and "layers.0.attention.processor (SlotProcessor" in said[0], said
    hook = pipe.accel.hooks["transformer"]
    assert not hook.active and "cannot be watched" in hook.inactive_reason
    pipe.transformer.layers[0].attention.set_processor(ZSingleStreamAttnProcessor())
    _call(pipe)
    assert hook.active


@torch.no_grad()
def test_a_component_follows_its_state_too(emulated) -> None:
    """The text encoder's attention implementation lives in its transformers config."""
    name = "qwen-image"
    pipe, stock = _pipe(name), _pipe(name)
    accelerate_pipeline(pipe, capture_on_miss=True, vae=False)
    before = _call(pipe)
    for p in (pipe, stock):
        p.text_encoder.set_attn_implementation("eager")
    st = pipe.accel.stats()["text_encoder"]
    got = _call(pipe)
    assert torch.equal(got, _call(stock))
    after = pipe.accel.stats()["text_encoder"]
    assert after.captures > st.captures and after.eager_calls == st.eager_calls
    assert not torch.equal(got, before) or after.captures > st.captures


def _taylorseer(name: str) -> Any:
    from diffusers.hooks import TaylorSeerCacheConfig

    ids = [r"^layers\.\d+\.attention$"] if name == "z-image" else None  # diffusers' names Qwen-Image's
    return TaylorSeerCacheConfig(cache_identifiers=ids, cache_interval=2, disable_cache_before_step=1)


def _cache(pipe: Any, name: str, cache: str) -> None:
    from diffusers.hooks import (
        FirstBlockCacheConfig,
        MagCacheConfig,
        apply_first_block_cache,
        apply_mag_cache,
        apply_taylorseer_cache,
    )

    t = pipe.transformer
    if cache == "FirstBlockCache":
        apply_first_block_cache(t, FirstBlockCacheConfig(threshold=10.0))  # caches every step it may
    elif cache == "TaylorSeer":
        apply_taylorseer_cache(t, _taylorseer(name))
    elif cache == "MagCache":
        ratios = [1.0] * 3
        apply_mag_cache(t, MagCacheConfig(threshold=0.5, num_inference_steps=3, mag_ratios=ratios, retention_ratio=0.2))
    elif cache == "DBCache":
        cache_dit = pytest.importorskip("cache_dit")
        config = cache_dit.DBCacheConfig(
            residual_diff_threshold=100.0, Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1
        )
        cache_dit.enable_cache(pipe, cache_config=config)


SETUPS = ["plain", "FirstBlockCache", "TaylorSeer", "MagCache", "DBCache", "cfg_batch"]


# Z-Image batches its guidance branches itself: joined branches are Qwen-Image's.
@pytest.mark.parametrize(
    ("name", "setup"), [(n, s) for n in NAMES for s in SETUPS if not (n == "z-image" and s == "cfg_batch")]
)
@torch.no_grad()
def test_an_unchanged_pipeline_never_drops_or_switches_graphs(name: str, setup: str, emulated, caplog) -> None:
    """What caches, joined guidance branches and the text encoder rewrite every call is not a change."""
    pipe = _pipe(name)
    _cache(pipe, name, setup)
    accelerate_pipeline(pipe, capture_on_miss=True, vae=False)
    if setup == "cfg_batch":  # installed only on CUDA by accelerate_pipeline; as there
        from accel.hooks.cfg_batch import apply_cfg_batch

        hook = pipe.accel.hooks["transformer"]
        apply_cfg_batch(pipe.transformer, hook.recipe, pipe.accel.guard, name="transformer", user=pipe.accel)
    followers = {n: h.follower for n, h in pipe.accel.hooks.items()}
    generate(pipe, negative_prompt="blurry", guidance=4.0, steps=3, seed=0)
    keys = {n: (f.epoch, f.state) for n, f in followers.items()}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="accel.hooks.graph_hook"):
        for seed in (1, 2, 3):
            generate(pipe, negative_prompt="blurry", guidance=4.0, steps=3, seed=seed)
            assert all(not f.events for f in followers.values()), {n: f.events for n, f in followers.items()}
    assert {n: (f.epoch, f.state) for n, f in followers.items()} == keys
    said = [r.getMessage() for r in caplog.records if r.name == "accel.hooks.graph_hook"]
    assert not [m for m in said if "changed" in m or "dropped" in m], said
    st = pipe.accel.stats()
    assert st["transformer"].replays > 0 and st["transformer"].evictions == 0
    pipe.accel.restore()

"""bcg-generate --cache (CPU, the tiny models): each step cache is applied the way its library
documents, before accelerate_pipeline, really skips denoiser work, and is recorded in the PNG text
and the summary; knobs that do not fit are refused before anything is built (the cases are in
test_run.py's BEFORE_BUILD)."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from pipelines.builders import build_transformer
from pipelines.cli import main
from pipelines.cli.arguments import build_parser
from pipelines.generation import caches as generation_caches
from pipelines.generation import prepare as generation_prepare

FAST = ["--model", "qwen-image", "--resolution", "64x64", "--quiet"]
HAS_CACHE_DIT = importlib.util.find_spec("cache_dit") is not None


def png_text(path: Path) -> dict[str, str]:
    with Image.open(path) as im:
        im.load()
        return dict(im.text)


class _Calls:
    """Counts the calls of the last block's attention query projection, made in each run, and
    the order in which the cache and the accelerator were applied. ``last_attention``: where a
    denoiser keeps that attention module (default Qwen-Image's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, last_attention: Any = None) -> None:
        import accel

        self.attention = 0
        self.order: list[str] = []
        real_build, real_apply, real_accelerate = (
            generation_prepare.build_model,
            generation_prepare.apply_cache,
            accel.accelerate_pipeline,
        )

        def build(*args: Any, **kwargs: Any) -> Any:
            pipe = real_build(*args, **kwargs)
            attention = (
                last_attention(pipe.transformer) if last_attention else pipe.transformer.transformer_blocks[-1].attn
            )
            attention.to_q.register_forward_hook(self._count)
            return pipe

        def apply(*args: Any, **kwargs: Any) -> str:
            self.order.append("cache")
            return real_apply(*args, **kwargs)

        def accelerate(*args: Any, **kwargs: Any) -> Any:
            self.order.append("accelerate")
            return real_accelerate(*args, **kwargs)

        monkeypatch.setattr(generation_prepare, "build_model", build)
        monkeypatch.setattr(generation_prepare, "apply_cache", apply)
        monkeypatch.setattr(accel, "accelerate_pipeline", accelerate)

    def _count(self, *args: Any) -> None:
        self.attention += 1


def test_without_a_cache_every_step_runs_every_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the cached runs below are measured against: true CFG, two denoiser calls a step."""
    calls = _Calls(monkeypatch)
    assert main([*FAST, "--steps", "3", "--out", str(tmp_path / "plain.png")]) == 0
    assert calls.attention == 2 * 3
    assert "cache" not in png_text(tmp_path / "plain.png")


@pytest.mark.parametrize(
    "argv,steps,recorded",
    [
        (["--cache", "fbc", "--cache-threshold", "1e9"], 4, "fbc threshold=1e+09"),
        # TaylorSeer computes the first 3 steps (disable_cache_before_step), then predicts some.
        (["--cache", "taylorseer", "--cache-interval", "2"], 6,
         "taylorseer cache_interval=2 disable_cache_before_step=3 max_order=1"),
        (["--cache", "magcache", "--cache-threshold", "1e9", "--cache-ratios", "1,1,1,1"], 4,
         "magcache threshold=1e+09 max_skip_steps=3 retention_ratio=0.2 ratios=1,1,1,1"),
    ],
    ids=["fbc", "taylorseer", "magcache"],
)  # fmt: skip
def test_diffusers_caches_skip_work_and_are_recorded(
    argv: list[str], steps: int, recorded: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    calls = _Calls(monkeypatch)
    assert main([*argv, *FAST, "--steps", str(steps), "--out", str(tmp_path / "cached.png")]) == 0
    assert 0 < calls.attention < 2 * steps  # some steps skipped the block
    assert calls.order == ["cache", "accelerate"]  # the cache before the accelerator
    assert png_text(tmp_path / "cached.png")["cache"] == recorded
    assert f", cache {recorded}, cpu)" in capsys.readouterr().out


def test_taylorseer_patterns_for_z_image_style_transformers() -> None:
    """Z-Image names its attention layers.N.attention, which TaylorSeer's defaults do not match."""
    z = build_transformer("z-image", "tiny", device="meta")
    q = build_transformer("qwen-image", "tiny", device="meta")
    assert generation_caches.taylorseer_identifiers(z) == [generation_caches.LAYERS_ATTENTION]
    assert any(name == "layers.1.attention" for name, _ in z.named_modules())
    assert (
        generation_caches.taylorseer_identifiers(q) is None
    )  # diffusers' own patterns match transformer_blocks.N.attn


def test_a_cache_mixin_model_without_attention_is_refused() -> None:
    from diffusers import ModelMixin
    from diffusers.models.cache_utils import CacheMixin

    class NoAttention(ModelMixin, CacheMixin):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    request = generation_caches.cache_request("taylorseer", None, None, None)
    assert request is not None
    with pytest.raises(generation_caches.InputError, match="finds no attention module of NoAttention"):
        generation_caches.check_supported(request, NoAttention(), "SomePipeline")
    fbc = generation_caches.cache_request("fbc", None, None, None)
    assert fbc is not None
    generation_caches.check_supported(fbc, NoAttention(), "SomePipeline")  # a CacheMixin: fbc may try


def test_dbcache_without_cache_dit_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cache_dit" else real(name, *a))

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("refused before a model is built")

    monkeypatch.setattr(generation_prepare, "build_model", no_build)
    assert main(["--cache", "dbcache", "--out", str(tmp_path / "out"), *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert err == 'bcg-generate: error: --cache dbcache uses cache-dit, which is not installed: pip install ' \
                  '"bcg-diffusers[cache-dit]"'  # fmt: skip
    assert not (tmp_path / "out").exists()


def _fake_cache_dit(seen: list[tuple[Any, Any]]) -> types.ModuleType:
    @dataclasses.dataclass
    class DBCacheConfig:  # cache-dit 1.5's fields that matter here, with its defaults
        Fn_compute_blocks: int = 8
        Bn_compute_blocks: int = 0
        residual_diff_threshold: float = 0.08

    module = types.ModuleType("cache_dit")
    module.__spec__ = importlib.machinery.ModuleSpec("cache_dit", None)
    module.DBCacheConfig = DBCacheConfig  # type: ignore[attr-defined]
    module.enable_cache = lambda pipe, cache_config: seen.append((pipe, cache_config))  # type: ignore[attr-defined]
    return module


def test_dbcache_goes_through_cache_dits_enable_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a stand-in cache_dit: the documented call, the threshold passed, cache-dit's other
    defaults kept except Fn_compute_blocks, which must leave the tiny model's 2 blocks one to cache."""
    seen: list[tuple[Any, Any]] = []
    monkeypatch.setitem(sys.modules, "cache_dit", _fake_cache_dit(seen))
    calls = _Calls(monkeypatch)
    out = tmp_path / "db.png"
    assert main(["--cache", "dbcache", "--cache-threshold", "0.2", "--steps", "2", "--out", str(out), *FAST]) == 0
    ((pipe, config),) = seen
    assert type(pipe).__name__ == "QwenImagePipeline"
    assert (config.residual_diff_threshold, config.Fn_compute_blocks, config.Bn_compute_blocks) == (0.2, 1, 0)
    assert calls.order == ["cache", "accelerate"]
    assert png_text(out)["cache"] == "dbcache residual_diff_threshold=0.2 Fn_compute_blocks=1 Bn_compute_blocks=0"


@pytest.mark.skipif(not HAS_CACHE_DIT, reason='cache-dit is an optional extra: pip install "bcg-diffusers[cache-dit]"')
def test_dbcache_with_cache_dit_skips_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _Calls(monkeypatch)
    steps = 10  # cache-dit computes its first 8 steps (max_warmup_steps)
    argv = ["--cache", "dbcache", "--cache-threshold", "1e9", "--steps", str(steps), *FAST]
    assert main([*argv, "--out", str(tmp_path / "db.png")]) == 0
    assert 0 < calls.attention < 2 * steps
    assert png_text(tmp_path / "db.png")["cache"].startswith("dbcache residual_diff_threshold=1e+09 ")


def test_help_states_each_methods_own_defaults() -> None:
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    text = " ".join(build_parser().format_help().split())
    assert f"First Block Cache (--cache-threshold, default {FirstBlockCacheConfig().threshold:g})" in text
    assert f"TaylorSeer (--cache-interval, default {TaylorSeerCacheConfig().cache_interval})" in text
    magcache = {f.name: f.default for f in dataclasses.fields(MagCacheConfig)}
    assert f"--cache-threshold, default {magcache['threshold']:g}); dbcache" in text
    if HAS_CACHE_DIT:
        import cache_dit

        dbcache = {f.name: f.default for f in dataclasses.fields(cache_dit.DBCacheConfig)}
        assert f"residual_diff_threshold, default {dbcache['residual_diff_threshold']:g};" in text


@pytest.mark.parametrize("method", ["fbc", "taylorseer", "magcache"])
def test_diffusers_caches_run_on_z_image_too(method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Z-Image has no CacheMixin in diffusers 0.42: accelerate_pipeline gives its caches their
    cache context and the block's argument name, so the diffusers way works for it as well (the
    help says so: tests/pipelines/cli/test_help_claims.py)."""
    calls = _Calls(monkeypatch, last_attention=lambda t: t.layers[-1].attention)
    steps = 6
    knobs = {"fbc": ["--cache-threshold", "1e9"], "taylorseer": ["--cache-interval", "2"],
             "magcache": ["--cache-threshold", "1e9", "--cache-ratios", "1,1,1,1"]}  # fmt: skip
    argv = ["--model", "z-image", "--resolution", "64x64", "--quiet", "--steps", str(steps), "--cache", method]
    assert main([*argv, *knobs[method], "--out", str(tmp_path / "z.png")]) == 0
    assert png_text(tmp_path / "z.png")["cache"].startswith(method)
    assert 0 < calls.attention < steps  # guidance 0: one denoiser call a step; some skipped the block

"""The run's progress (:mod:`pipelines.cli.progress`) through each denoising step's callback
(:mod:`pipelines.generation.steps`): on a terminal one tqdm bar counts the steps of every call and the
images made; elsewhere (a file, a CI log) no bar is drawn, only log lines of their own; --quiet
silences the libraries' bars too (transformers' weight loading); a step callback leaves the image
as it was."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest
import torch

from pipelines.builders import build_pipeline
from pipelines.cli import main
from pipelines.cli import progress as cli_progress
from pipelines.generation.steps import CallStopped, StepWatch

FAST = ["--resolution", "32x32", "--steps", "3", "--num-images", "2", "--seed", "1"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_bar_counts_every_step_and_the_images(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(cli_progress, "BAR_INTERVAL", 0.0)  # every step drawn, however fast
    assert main([*FAST, "--out", str(tmp_path)]) == 0
    drawn = terminal.getvalue()
    frames = [f for f in drawn.replace("\n", "\r").split("\r") if f.startswith("generating:")]
    assert any("| 6/6 [" in f and "image 2/2" in f for f in frames), frames[-3:]
    counted = {int(m.group(1)) for f in frames if (m := re.search(r"\| (\d+)/6 \[", f))}
    assert {1, 2, 4, 5} <= counted  # the steps inside each call, not only the calls' ends


def test_off_a_terminal_progress_is_log_lines_and_no_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(cli_progress, "LINE_INTERVAL", 0.0)  # a line at every step
    with caplog.at_level(logging.INFO, logger="bcg-generate"):
        assert main([*FAST, "--out", str(tmp_path)]) == 0
    lines = [r.getMessage() for r in caplog.records if "generating:" in r.getMessage()]
    steps = [line.split("generating: ")[1].split(",")[0] for line in lines]
    assert steps == ["step 1/3 of call 1/2", "step 2/3 of call 1/2", "step 3/3 of call 1/2", "call 1/2 done",
                     "step 1/3 of call 2/2", "step 2/3 of call 2/2", "step 3/3 of call 2/2", "call 2/2 done"]  # fmt: skip
    assert "image 2/2 made" in lines[-1] and "left" not in lines[-1]
    assert "\r" not in capsys.readouterr().err  # no bar drawn into a file


def test_quiet_silences_transformers_weight_loading_bar(tmp_path: Path) -> None:
    from transformers.utils import logging as transformers_logging

    try:
        assert main([*FAST, "--quiet", "--out", str(tmp_path)]) == 0
        assert not transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()


def test_a_step_callback_leaves_the_image_bit_for_bit_and_stop_ends_the_call() -> None:
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)

    def call(**extra: object) -> torch.Tensor:
        g = torch.Generator().manual_seed(3)
        return pipe("a fox", height=32, width=32, num_inference_steps=3, generator=g, output_type="pt", **extra).images

    seen: list[int] = []
    assert torch.equal(call(), call(callback_on_step_end=StepWatch(on_step=seen.append)))
    assert seen == [1, 2, 3]
    with pytest.raises(CallStopped, match="stopped after step 2"):
        call(callback_on_step_end=StepWatch(stop=lambda: len(seen) >= 5, on_step=seen.append))


@pytest.mark.parametrize("name", ["z-image", "qwen-image"])
def test_graphs_stay_valid_after_a_call_stopped_at_a_step(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server stops a call whose requests all gave up at a step's end. On emulated CUDA graphs
    (replays read recorded tensors, as on a GPU), with a step cache whose state spans the call
    (First Block Cache, its threshold high enough that steps are cached): a call stopped at its
    second step, then whole calls, give the cached pipeline's eager latents bit for bit."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    from accel import accelerate_pipeline
    from pipelines.generation.steps import end_stopped_call
    from tests.helpers.emulator import emulate_pipelines

    emulate_pipelines(monkeypatch)
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=10.0))
    guidance = dict(true_cfg_scale=4.0) if name == "qwen-image" else dict(guidance_scale=4.0)

    def call(seed: int, **extra: object) -> torch.Tensor:
        return pipe("a fox in the snow", negative_prompt="blurry", height=32, width=48, num_inference_steps=4,
                    generator=torch.Generator().manual_seed(seed), output_type="latent", **guidance,
                    **extra).images  # fmt: skip

    accelerate_pipeline(pipe, mode="eager")
    want = [call(seed) for seed in (1, 2)]
    pipe.accel.restore()
    accelerate_pipeline(pipe, capture_on_miss=True)
    assert torch.equal(call(1), want[0])  # captured on the way
    with pytest.raises(CallStopped):
        call(2, callback_on_step_end=StepWatch(stop=lambda: True))
    end_stopped_call(pipe)
    assert torch.equal(call(2), want[1]) and torch.equal(call(1), want[0])
    stats = pipe.accel.stats()["transformer"]
    assert stats.replays > 0 and stats.eager_calls == 0
    pipe.accel.restore()

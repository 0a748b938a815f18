"""bcg-generate and long prompts (CPU, the tiny models): the text encoder reads a limited number of
tokens; a prompt beyond it is said once, with the counts, and the PNG text records how many
tokens were read. The counts are checked against what the pipelines really encode."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from PIL import Image

from pipelines.builders import build_pipeline
from pipelines.cli import main
from pipelines.generation import prepare as generation_prepare
from pipelines.generation.prompts import count_tokens

FAST = ["--resolution", "64x64", "--steps", "2", "--quiet"]
LONG = " ".join(f"word{i}" for i in range(2000))


def png_text(path: Path) -> dict[str, str]:
    with Image.open(path) as im:
        im.load()
        return dict(im.text)


@pytest.mark.parametrize("model", ["z-image", "qwen-image"])
def test_token_counts_are_what_the_pipeline_encodes(model: str) -> None:
    pipe = build_pipeline(model, "tiny")
    for prompt in ("a red fox", "a red fox " * 40, LONG):
        count = count_tokens(pipe, prompt)
        assert count is not None and count.limit == 512
        if model == "z-image":
            (embeds,), _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=512)
            encoded = embeds.shape[0]
        else:
            encoded = pipe.encode_prompt(prompt, max_sequence_length=512)[0].shape[1]
        assert encoded == min(count.tokens, count.limit), prompt[:30]
    assert count.truncated and count.tokens > 2000  # LONG: every word at least one token


def test_a_cut_prompt_is_said_once_with_the_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["--prompt", LONG, "--prompt", "a short one", "--resolution", "64x64", "32x32",
            "--steps", "1", "--quiet", "--out", str(out)]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="bcg-generate"):
        assert main(argv) == 0
    said = [r.getMessage() for r in caplog.records if "tokens but" in r.getMessage()]
    assert len(said) == 1, said  # two calls of the long prompt, one warning
    tokens = int(said[0].split(" takes ")[1].split()[0])
    assert tokens > 2000 and "ZImagePipeline reads the first 512: the rest is ignored" in said[0]
    assert "'word0 word1 word2 word3 word4 word5 w...'" in said[0]  # shown short
    files = sorted(out.iterdir())
    texts = [png_text(p) for p in files]
    long_ones = [t for t in texts if t["prompt"] == LONG]  # the PNG keeps the whole prompt...
    assert len(long_ones) == 2 and {t["prompt_tokens"] for t in long_ones} == {f"{tokens} (the first 512 read)"}
    short = {t["prompt_tokens"] for t in texts if t["prompt"] == "a short one"}  # ...and says how much was read
    assert len(short) == 1 and int(short.pop()) < 20
    assert "; 1 prompt(s) cut at the text encoder's limit" in capsys.readouterr().out


def test_a_cut_negative_prompt_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    argv = ["--model", "qwen-image", "--negative-prompt", LONG, "--out", str(tmp_path / "q.png"), *FAST]
    with caplog.at_level(logging.WARNING, logger="bcg-generate"):
        assert main(argv) == 0
    said = [r.getMessage() for r in caplog.records if "tokens but" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the negative prompt 'word0") and "QwenImagePipeline" in said[0]


def test_the_size_of_the_run_is_said_before_the_build(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompts file far longer than meant (1.4 million lines) was accepted without a word."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(3000)), encoding="utf-8")

    def stop(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(generation_prepare, "build_model", stop)
    with caplog.at_level(logging.INFO, logger="bcg-generate"):
        argv = ["--prompts-file", str(prompts), "--resolution", "64x64", "32x32", "--out", str(tmp_path / "o")]
        assert main(argv) == 130
    assert "6000 image(s) to make: 3000 prompt(s) x 2 resolution(s) x 1 in calls of 1" in caplog.text

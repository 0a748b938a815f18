"""bcg-serve's own flags, read without a server: the names the model is served under, the most
steps a request may ask for, and the size a request gets by default (OpenAI's clients')."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.serve.config import DEFAULT_MAX_STEPS, UsageError, parse_args, served_names


def test_the_model_is_served_under_its_names(tmp_path: Path) -> None:
    assert served_names("z-image", None) == ("z-image", "zimage", "z_image")  # a built-in model's aliases
    assert served_names("Tongyi-MAI/Z-Image-Turbo", None) == ("Tongyi-MAI/Z-Image-Turbo", "Z-Image-Turbo")
    folder = tmp_path / "zimage-tiny"
    folder.mkdir()
    assert served_names(str(folder), None) == ("zimage-tiny", str(folder))  # not the folder's whole path first
    assert served_names("z-image", ["gpt-image-1", "dall-e-3", "gpt-image-1"]) == ("gpt-image-1", "dall-e-3")
    config = parse_args(["--served-model-name", "house-model", "dall-e-3"])
    assert config.names == ("house-model", "dall-e-3")


def test_defaults_and_limits_of_the_servers_flags() -> None:
    config = parse_args([])
    assert config.resolutions == ((1024, 1024),) and config.max_steps == DEFAULT_MAX_STEPS == 100
    assert parse_args(["--max-steps", "1000"]).max_steps == 1000
    for argv, says in ((["--max-steps", "0"], "must be at least 1"), (["--served-model-name", "a b"], "one word")):
        with pytest.raises(UsageError, match=says):
            parse_args(argv)


def test_the_denoiser_keeps_every_graph_the_warm_up_captures(tmp_path: Path) -> None:
    from pipelines.serve.config import GRAPHS_PER_CASE
    from tests.helpers.lora_files import make_lora_file

    for name in ("a", "b"):
        make_lora_file("z-image", tmp_path / f"{name}.safetensors", seed=1)
    one = parse_args(["--model", "z-image"]).settings.max_entries
    config = parse_args(["--model", "z-image", "--resolutions", "512x512", "1024x1024", "--batch-sizes", "1", "2",
                         "4", "--lora", f"a={tmp_path / 'a.safetensors'}",
                         "--lora", f"b={tmp_path / 'b.safetensors'}:0.5"])  # fmt: skip
    assert config.settings.max_entries == GRAPHS_PER_CASE * 2 * 3 * 3
    assert config.settings.accelerate_options()["max_entries"] == config.settings.max_entries
    assert one is not None and one >= GRAPHS_PER_CASE

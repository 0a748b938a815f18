"""What the help texts of bcg-generate and bcg-serve claim about support is what the code does: which
built-in model takes which step cache, which makes videos and at what frame counts, what --lora
takes in each tool, which extra each optional feature needs (the built-in models' records are
checked against the models themselves in tests/pipelines/families/test_catalog.py)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from pipelines.builders import build_transformer
from pipelines.cli.arguments import build_parser
from pipelines.families.catalog import MODELS, video_model_names
from pipelines.generation.caches import KNOBS, NOT_ON, CacheRequest, check_supported, support_text
from pipelines.generation.errors import InputError
from pipelines.generation.extras import install_command
from pipelines.releases.configs import MODEL_NAMES, pipeline_class
from pipelines.serve.config import UsageError
from pipelines.serve.config import build_parser as serve_parser
from pipelines.serve.config import parse_args as serve_args
from tests.helpers.lora_files import make_lora_file


def _text(parser_help: str) -> str:
    """The help with its line breaks and indents as single spaces, as a reader reads it."""
    return " ".join(parser_help.split())


GENERATE = _text(build_parser().format_help())
SERVE = _text(serve_parser().format_help())
DIFFUSERS_CACHES = [m for m in KNOBS if CacheRequest(m).diffusers_hook]


def _refused(method: str, model: str) -> bool:
    request = CacheRequest(method, ratios=(1.0,) if method == "magcache" else None)
    try:
        check_supported(request, build_transformer(model, "tiny", device="meta"), pipeline_class(model).__name__)
    except InputError:
        return True
    return False


def test_the_cache_support_the_help_states_is_what_the_cli_refuses() -> None:
    """Every built-in model and every diffusers cache, checked as the CLI checks them before a build."""
    refused = {(method, model) for method in DIFFUSERS_CACHES for model in MODEL_NAMES if _refused(method, model)}
    assert refused == {(method, model) for method, (models, _) in NOT_ON.items() for model in models}
    assert _text(support_text()) in GENERATE and _text(support_text()) in SERVE
    assert "z-image included" in GENERATE
    assert not re.search(r"z-image (does|do) not", GENERATE), "the caches run on z-image"


def test_the_video_models_the_help_names_are_those_that_make_videos() -> None:
    videos = {m.name for m in MODELS if "num_frames" in inspect.signature(pipeline_class(m.name).__call__).parameters}
    assert set(video_model_names()) == videos
    assert f"--frames video models only ({', '.join(video_model_names())}), 4k+1: the VAE packs 4 frames" in GENERATE
    assert {m.frames_per_latent for m in MODELS if m.video} == {4}


def test_lora_help_says_what_each_tool_takes(tmp_path: Path) -> None:
    assert "--lora FILE[:SCALE]" in GENERATE and "NAME=FILE" not in GENERATE
    assert "--lora NAME=FILE[:SCALE]" in SERVE and "--lora FILE[:SCALE]" not in SERVE
    # ... and what each takes: a file alone is refused by the server, whose requests pick adapters by name.
    lora = make_lora_file("z-image", tmp_path / "style.safetensors")
    with pytest.raises(UsageError, match=r"--lora takes NAME=FILE\[:SCALE\] here"):
        serve_args(["--lora", str(lora)])
    assert serve_args(["--lora", f"style={lora}:0.5"]).settings.loras[0].name == "style"


@pytest.mark.parametrize("extra", ["cache-dit", "video", "fp8"])
def test_the_help_names_the_install_command_of_each_extra(extra: str) -> None:
    assert install_command(extra) in GENERATE

"""pipelines.lora on the tiny Z-Image and Qwen-Image pipelines (CPU): adapters loaded through
diffusers equal diffusers' own loading, switching between them equals a stock pipeline that
switched, and each bad input is one LoraError line that leaves the pipeline as it was."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipelines.builders import build_pipeline
from pipelines.lora import LoraError, LoraSpec, activate, check_lora_file, describe_loras, load_loras, parse_lora
from tests.helpers.generate import generate
from tests.helpers.lora_files import make_lora_file

NAMES = ["z-image", "qwen-image"]


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog, with diffusers' records too (its logger does not propagate to the root's)."""
    lg = logging.getLogger("diffusers")
    lg.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING)
    try:
        yield caplog
    finally:
        lg.removeHandler(caplog.handler)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _pipe(name: str) -> Any:
    pipe = build_pipeline(name, "tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any) -> torch.Tensor:
    return generate(pipe, size=(32, 32), steps=2, seed=3)


# --------------------------------------------------------------------------------------------
# parse_lora: no file is read
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, path, scale, name",
    [
        ("a.safetensors", "a.safetensors", 1.0, None),
        ("dir/a.safetensors:0.5", "dir/a.safetensors", 0.5, None),
        ("a.safetensors:-1.25", "a.safetensors", -1.25, None),
        ("a.safetensors:1e-1", "a.safetensors", 0.1, None),
        ("style=dir/a.safetensors:0.8", "dir/a.safetensors", 0.8, "style"),
        ("ink_2=a.safetensors", "a.safetensors", 1.0, "ink_2"),
        ("C:\\loras\\a.safetensors", "C:\\loras\\a.safetensors", 1.0, None),  # a drive, not a scale
        ("odd:name.safetensors", "odd:name.safetensors", 1.0, None),
        ("odd:name.safetensors:2", "odd:name.safetensors", 2.0, None),
        ("a b=c.safetensors", "a b=c.safetensors", 1.0, None),  # not a name: part of the file's
    ],
)
def test_parse_lora(text: str, path: str, scale: float, name: str | None) -> None:
    assert parse_lora(text) == LoraSpec(Path(path), scale, name)


@pytest.mark.parametrize(
    "text, says",
    [
        ("a.safetensors:nan", "the scale 'nan' is not a finite number"),
        ("a.safetensors:inf", "the scale 'inf' is not a finite number"),
        ("a.safetensors:-inf", "is not a finite number"),
        ("a.safetensors:strong", "the scale 'strong' is not a number"),
        ("a.safetensors:", "the scale '' is not a number"),
        ("style=", "names no file"),
        (":0.5", "names no file"),
        ("", "names no file"),
    ],
)
def test_parse_lora_refuses(text: str, says: str) -> None:
    with pytest.raises(LoraError, match=None) as info:
        parse_lora(text)
    assert says in str(info.value)
    assert "\n" not in str(info.value)


def test_spec_checks_its_scale_and_name() -> None:
    for scale in (math.nan, math.inf, True, "1"):
        with pytest.raises(LoraError, match="is not a finite number"):
            LoraSpec(Path("a.safetensors"), scale)  # type: ignore[arg-type]
    with pytest.raises(LoraError, match="letters, digits"):
        LoraSpec(Path("a.safetensors"), 1.0, "has.dot")  # peft's ModuleDict keys cannot hold a '.'
    specs = [LoraSpec(Path("/x/a.safetensors"), 1.0), LoraSpec(Path("b.safetensors"), 0.5, "b")]
    assert describe_loras(specs) == "a.safetensors:1, b.safetensors:0.5"  # file names, not folders


# --------------------------------------------------------------------------------------------
# check_lora_file: the header only
# --------------------------------------------------------------------------------------------
def test_check_lora_file(tmp_path: Path) -> None:
    good = make_lora_file("z-image", tmp_path / "good.safetensors")
    check_lora_file(LoraSpec(good))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    save_file({}, str(tmp_path / "empty.safetensors"))
    (tmp_path / "old.bin").write_bytes(b"pickle")
    cases = {
        "missing.safetensors": "does not exist",
        "junk.safetensors": "is not a safetensors file",
        "empty.safetensors": "holds no tensors",
        "old.bin": "is a pickled checkpoint",
        ".": "is a folder",
    }
    for name, says in cases.items():
        with pytest.raises(LoraError) as info:
            check_lora_file(LoraSpec(tmp_path / name))
        assert says in str(info.value) and "\n" not in str(info.value), str(info.value)
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.safetensors"
        locked.write_bytes(good.read_bytes())
        locked.chmod(0)
        with pytest.raises(LoraError, match="cannot be read: Permission denied"):
            check_lora_file(LoraSpec(locked))


# --------------------------------------------------------------------------------------------
# Loading and switching, against diffusers' own calls
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_loaded_adapters_equal_diffusers_loading_and_switch_like_it(name: str, tmp_path: Path) -> None:
    a = make_lora_file(name, tmp_path / "a.safetensors", seed=1)
    b = make_lora_file(name, tmp_path / "b.safetensors", seed=2, alpha=4)

    stock = _pipe(name)
    plain = _call(stock)
    stock.load_lora_weights(str(a), adapter_name="a")
    stock.load_lora_weights(str(b), adapter_name="b")
    stock.set_adapters(["a", "b"], [0.7, 1.0])
    both = _call(stock)
    stock.set_adapters(["b"], [1.0])
    only_b = _call(stock)

    pipe = _pipe(name)
    specs = load_loras(pipe, [parse_lora(f"{a}:0.7"), parse_lora(str(b))])
    assert [(s.name, s.scale) for s in specs] == [("a", 0.7), ("b", 1.0)]
    assert torch.equal(_call(pipe), both)
    assert not torch.equal(both, plain)  # the adapters change the image
    activate(pipe, [specs[1]])
    assert torch.equal(_call(pipe), only_b)
    activate(pipe, [])
    assert torch.equal(_call(pipe), plain)  # LoRA off: the pipeline's own forward
    activate(pipe, specs)
    assert torch.equal(_call(pipe), both)


def test_adapter_names_are_made_unique_and_names_given_are_kept(tmp_path: Path) -> None:
    a = make_lora_file("z-image", tmp_path / "my.style v2.safetensors")
    pipe = _pipe("z-image")
    specs = load_loras(pipe, [LoraSpec(a), LoraSpec(a, 0.5), LoraSpec(a, 0.2, "ink")])
    assert [s.name for s in specs] == ["my_style_v2", "my_style_v2-2", "ink"]
    assert pipe.get_active_adapters() == ["my_style_v2", "my_style_v2-2", "ink"]
    more = load_loras(pipe, [LoraSpec(a)], activate_all=False)  # a second call: names taken stay taken
    assert [s.name for s in more] == ["my_style_v2-3"]
    with pytest.raises(LoraError, match="adapter name 'ink' is already loaded"):
        load_loras(pipe, [LoraSpec(a, 1.0, "ink")])


# --------------------------------------------------------------------------------------------
# A LoRA for another model: one line, and the pipeline as it was
# --------------------------------------------------------------------------------------------
def _variants(tmp_path: Path) -> dict[str, Path]:
    z = load_file(str(make_lora_file("z-image", tmp_path / "z.safetensors")))
    q = load_file(str(make_lora_file("qwen-image", tmp_path / "q.safetensors")))
    files = {
        "q": tmp_path / "q.safetensors",
        "no prefix": {k.removeprefix("transformer."): v for k, v in z.items()},
        "text encoder": {k.replace("transformer.", "text_encoder.", 1): v for k, v in z.items()},
        "other shapes": {k: torch.randn(v.shape[0] + 1, v.shape[1]) for k, v in z.items()},
        "not a lora": {"transformer.layers.0.attention.to_q.weight": torch.randn(4, 4)},
        "partial": {**z, **q},
    }
    out = {}
    for label, content in files.items():
        if isinstance(content, Path):
            out[label] = content
            continue
        out[label] = tmp_path / f"{label.replace(' ', '-')}.safetensors"
        save_file(content, str(out[label]))
    return out


REFUSED = [
    (
        "q",
        "is a LoRA for another model: none of the 6 modules it adapts (e.g. transformer_blocks.0.attn.to_k) "
        "is in ZImageTransformer2DModel",
    ),
    ("no prefix", "holds no weights for ZImageTransformer2DModel: diffusers reads a LoRA's under 'transformer.'"),
    ("text encoder", "its keys start with 'text_encoder.'; a LoRA for another model?"),
    (
        "other shapes",
        "does not fit ZImageTransformer2DModel's shapes (noise_refiner.0.attention.to_q.lora_A.weight: "
        "[5, 64] in the file, [4, 64] in the model)",
    ),
    ("not a lora", "holds weights for ZImageTransformer2DModel but no LoRA's"),
]


def test_a_lora_for_another_model_is_one_line_and_leaves_the_pipeline_as_it_was(
    tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    files = _variants(tmp_path)
    good = tmp_path / "z.safetensors"
    pipe = _pipe("z-image")
    plain = _call(pipe)
    for label, says in REFUSED:
        logs.clear()
        with pytest.raises(LoraError) as info:
            load_loras(pipe, [LoraSpec(good), LoraSpec(files[label])])  # the good one first
        message = str(info.value)
        assert says in message and "\n" not in message, (label, message)
        assert message.startswith(repr(str(files[label]))), message
        assert not any(a for a in pipe.get_list_adapters().values()), label  # the good one removed again
        assert _warnings(logs) == [], label  # diffusers' story held back
    assert torch.equal(_call(pipe), plain)


def test_a_lora_that_adapts_modules_the_model_lacks_loads_with_one_warning(
    tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    partial = _variants(tmp_path)["partial"]
    pipe = _pipe("z-image")
    load_loras(pipe, [LoraSpec(partial)])
    assert _warnings(logs) == [  # ours, not diffusers' list of every key
        f"{str(partial)!r}: 6 of the 18 modules it adapts are not in ZImageTransformer2DModel and are left out "
        "(e.g. transformer_blocks.0.attn.to_k)"
    ]
    stock = _pipe("z-image")
    stock.load_lora_weights(str(partial), adapter_name="partial")
    assert torch.equal(_call(pipe), _call(stock))


def test_a_pipeline_without_a_lora_loader_is_refused() -> None:
    class NoLoader:
        transformer = torch.nn.Linear(1, 1)

    with pytest.raises(LoraError, match="NoLoader cannot load LoRAs"):
        load_loras(NoLoader(), [LoraSpec(Path("a.safetensors"))])


def test_a_denoiser_lora_for_flux_loads_without_the_text_encoders_note(
    tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    """FLUX.1's loader also looks for CLIP keys and warns that a denoiser's LoRA has none."""
    lora = make_lora_file("flux", tmp_path / "flux.safetensors")
    pipe = _pipe("flux")
    (spec,) = load_loras(pipe, [LoraSpec(lora, 0.5)])
    assert _warnings(logs) == []
    assert pipe.get_list_adapters()["transformer"] == [spec.name]

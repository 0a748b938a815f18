"""The released configs as data (pipelines/families/*/release.py, pipelines/releases/ and
pipelines/zoo/families/): every built-in model's components construct from their data at the tiny
size (on the CPU) and at the full size (on the meta device: no storage), with the data's values in
their configs; reads are copies; the weight count of the limits equals the builders' modules; the
zoo's data is complete and its order does not depend on the process's hash seed.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedConfig

from pipelines import builders, limits, zoo
from pipelines.construction import constructing_on
from pipelines.families import catalog
from pipelines.releases import configs
from pipelines.releases.spec import TOKENIZERS

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = [(name, component) for name in configs.MODEL_NAMES for component in configs.components(name)]

pytestmark = pytest.mark.usefixtures("few_threads")


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively: configs store either, depending on where they were read."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# Where a config class stores a value of the data under another name: transformers 5's T5 configs
# always tie their embeddings and keep the release's `tie_word_embeddings=False` (T5 v1.1's) as
# "do not scale the decoder's outputs".
RENAMED = {
    ("T5Config", "tie_word_embeddings"): "scale_decoder_outputs",
    ("UMT5Config", "tie_word_embeddings"): "scale_decoder_outputs",
}
# Values a config class drops: Qwen2.5-VL's text config keeps no window when use_sliding_window is False.
DROPPED = {("Qwen2_5_VLTextConfig", "sliding_window")}


def _assert_config_has(module: torch.nn.Module, data: dict[str, Any], but: tuple[str, ...] = ()) -> None:
    """Every value of the release data (``but`` those keys) is in the constructed module's config."""
    config = module.config
    for key, value in data.items():
        if key in but:
            continue
        key = RENAMED.get((type(config).__name__, key), key)
        got = getattr(config, key) if isinstance(config, PreTrainedConfig) else config[key]
        if isinstance(got, PreTrainedConfig):  # a vision-language model's text or vision part
            for sub, v in value.items():
                if sub in but or (type(got).__name__, sub) in DROPPED:
                    continue
                assert _plain(getattr(got, sub)) == _plain(v), f"{key}.{sub}"
        else:
            assert _plain(got) == _plain(value), key


def _data(name: str, component: str, size: str) -> dict[str, Any]:
    return configs.components(name)[component].config(size)


@pytest.mark.parametrize("name, component", COMPONENTS)
def test_tiny_components_construct_from_their_data(name: str, component: str) -> None:
    module = configs.constructor(name, component, "tiny")()
    part = configs.components(name)[component]
    assert type(module) is part.cls
    assert 0 < sum(p.numel() for p in module.parameters()) < 5e6
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in module.parameters())
    data = _data(name, component, "tiny")
    replaced: tuple[str, ...] = ()
    if part.tokenizer is not None:
        # The tokenizer's vocabulary and special ids are added to the data: the rest is as written.
        tok = configs.build_tokenizers(name)[component.replace("text_encoder", "tokenizer")]
        text = module.config.text_config if "text_config" in data else module.config
        assert text.vocab_size == (len(tok) + 63) // 64 * 64
        eos = tok.convert_tokens_to_ids("<|im_end|>") if part.tokenizer == "qwen" else tok.eos_token_id
        assert text.eos_token_id == eos
        replaced = ("vocab_size",)
    _assert_config_has(module, data, but=replaced)


@pytest.mark.parametrize("name, component", COMPONENTS)
def test_full_components_construct_on_meta(name: str, component: str) -> None:
    with constructing_on("meta", torch.bfloat16):
        full = configs.constructor(name, component, "full")()
    params = list(full.parameters())
    assert params and all(p.is_meta for p in params)  # nothing allocated
    assert torch.get_default_dtype() == torch.float32
    _assert_config_has(full, _data(name, component, "full"))
    tiny = configs.constructor(name, component, "tiny")()
    assert sum(p.numel() for p in params) > 10 * sum(p.numel() for p in tiny.parameters())


def test_release_data_is_complete() -> None:
    seen: dict[str, str] = {}
    for name, release in configs.RELEASES.items():
        assert release.name == name
        for alias in (name, *catalog.known_model(name).aliases):  # type: ignore[union-attr]
            assert alias == alias.lower().strip() and alias not in seen, alias
            seen[alias] = name
            assert builders.canonical_name(alias.upper()) == name
        for component, part in configs.components(name).items():
            assert set(part.configs) == set(configs.SIZES), (name, component)
            if component.startswith("text_encoder"):
                assert part.config_class is not None and part.tokenizer in TOKENIZERS, (name, component)
        assert builders.pipeline_class(name).__name__ == catalog.known_model(name).pipeline  # type: ignore[union-attr]
        assert isinstance(builders.build_scheduler(name), release.scheduler_class)
    assert seen == configs.ALIASES


def test_reads_are_copies() -> None:
    first = configs.vae_config("z-image", "full")
    first["block_out_channels"].append(1)
    first["latent_channels"] = 0
    again = configs.vae_config("z-image", "full")
    assert again["block_out_channels"] == [128, 256, 512, 512] and again["latent_channels"] == 16
    text = configs.text_encoder_config("qwen-image", "full")
    text.text_config.hidden_size = 1
    assert configs.text_encoder_config("qwen-image", "full").text_config.hidden_size == 3584
    scheduler = configs.scheduler_config("wan-1.3b")
    scheduler["flow_shift"] = 0.0
    assert configs.scheduler_config("wan-1.3b")["flow_shift"] == 3.0
    assert configs.scheduler_config("wan")["flow_shift"] == 5.0


def test_one_text_encoder_models_have_no_second() -> None:
    for name in ("z-image", "qwen-image", "wan"):
        with pytest.raises(ValueError, match=f"^{name} has one text encoder; only flux has a text_encoder_2$"):
            builders.build_text_encoder(name, device="meta", component="text_encoder_2")


@pytest.mark.parametrize("name", configs.MODEL_NAMES)
def test_the_limits_count_the_builders_modules(name: str) -> None:
    """The weight count reads the release data directly; it must count what the builders build."""
    modules = builders.build_modules(name, "full", device="meta", dtype=torch.bfloat16)
    built = sum(t.numel() * t.element_size() for m in modules.values() for t in (*m.parameters(), *m.buffers()))
    assert set(modules) == set(configs.components(name))
    assert limits.embedded_weight_bytes(name, "full", torch.bfloat16) == built > 2e9


def test_zoo_data_is_complete() -> None:
    for name, fam in zoo.FAMILIES.items():
        for field in ("denoiser_configs", "vae_configs", "geometry", "embeddings"):
            assert set(getattr(fam, field)) == set(zoo.SIZES), (name, field)
        for field in ("extras", "attributes"):
            assert set(getattr(fam, field)) <= set(zoo.SIZES), (name, field)
        assert set(fam.embeddings["tiny"]) == set(fam.embeddings["full"]), name


def test_no_set_orders_the_data() -> None:
    """Seeded embeddings are drawn in the order a family declares them, so no data module may build
    a mapping from a set: its order (and with it which draw each embedding gets) would follow the
    process's hash seed. SD3.5's and SDXL's pooled embeddings once did."""
    modules = sorted((ROOT / "pipelines" / "zoo" / "families").glob("*.py"))
    modules += sorted((ROOT / "pipelines" / "releases").glob("*.py"))
    modules += sorted((ROOT / "pipelines" / "families").glob("*/release.py"))
    modules += sorted((ROOT / "pipelines" / "families").glob("*/models.py"))
    assert len(modules) > 20
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            is_set = isinstance(node, (ast.Set, ast.SetComp))
            is_set |= (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("set", "frozenset")
            )
            assert not is_set, f"{path.name}:{node.lineno}: a set in the release data"

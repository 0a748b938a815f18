"""The zoo's families: full configs with the released models' parameter counts (on the meta device:
no storage), embeddings of the released shapes, tiny builds of every family without text encoders,
and one tiny call per family through the stock pipeline.
"""

from __future__ import annotations

import diffusers
import pytest
import torch

from pipelines import zoo

# The released checkpoints' denoiser and VAE parameter counts (the inventory of the full-size
# breadth run on an H200, each model built at its published config.json).
RELEASED_PARAMS = {
    "flux": {"transformer": 11_901_408_320, "vae": 83_819_683},
    "flux2": {"transformer": 32_223_281_152, "vae": 84_046_115},
    "sd3": {"transformer": 8_056_627_520, "vae": 83_819_683},
    "sdxl": {"unet": 2_567_463_684, "vae": 83_653_863},
    "wan": {"transformer": 14_288_491_584, "vae": 126_892_531},
    "ltx": {"transformer": 1_923_385_472, "vae": 419_193_649},
    "hunyuan-video": {"transformer": 12_821_012_544, "vae": 246_478_803},
    "hunyuan-video-1.5": {"transformer": 8_326_608_160, "vae": 1_260_634_115},
    "sana": {"transformer": 1_604_462_752, "vae": 312_250_275},
    "pixart-sigma": {"transformer": 610_856_096, "vae": 83_653_863},
    "chroma": {"transformer": 8_899_983_424, "vae": 83_819_683},
    "cogview4": {"transformer": 6_369_118_272, "vae": 414_501_539},
    "hidream": {"transformer": 17_105_733_184, "vae": 83_819_683},
    "lumina2": {"transformer": 2_609_769_152, "vae": 83_819_683},
    "qwen-image-edit": {"transformer": 20_430_401_088, "vae": 126_892_531},
}
# The same run's input shapes: what each pipeline's own text encoders produce.
RELEASED_EMBEDDINGS = {
    "flux": {"prompt_embeds": (1, 512, 4096), "pooled_prompt_embeds": (1, 768)},
    "flux2": {"prompt_embeds": (1, 512, 15360)},
    "sd3": {"prompt_embeds": (1, 333, 4096), "pooled_prompt_embeds": (1, 2048)},
    "sdxl": {"prompt_embeds": (1, 77, 2048), "pooled_prompt_embeds": (1, 1280)},
    "wan": {"prompt_embeds": (1, 512, 4096), "negative_prompt_embeds": (1, 512, 4096)},
    "ltx": {"prompt_embeds": (1, 128, 4096), "prompt_attention_mask": (1, 128)},
    "hunyuan-video": {"prompt_embeds": (1, 256, 4096), "pooled_prompt_embeds": (1, 768)},
    "hunyuan-video-1.5": {"prompt_embeds": (1, 1000, 3584), "prompt_embeds_2": (1, 256, 1472)},
    "sana": {"prompt_embeds": (1, 300, 2304), "prompt_attention_mask": (1, 300)},
    "pixart-sigma": {"prompt_embeds": (1, 300, 4096), "negative_prompt_attention_mask": (1, 300)},
    "chroma": {"prompt_embeds": (1, 512, 4096), "prompt_attention_mask": (1, 512)},
    "cogview4": {"prompt_embeds": (1, 128, 4096), "negative_prompt_embeds": (1, 16, 4096)},
    "hidream": {"prompt_embeds_t5": (1, 128, 4096), "prompt_embeds_llama3": (32, 1, 128, 4096)},
    "lumina2": {"prompt_embeds": (1, 256, 2304), "prompt_attention_mask": (1, 256)},
    "qwen-image-edit": {"prompt_embeds": (1, 1400, 3584), "prompt_embeds_mask": (1, 1400)},
}
RELEASED_GEOMETRY = {"wan": (480, 832, 33), "ltx": (512, 704, 121), "hunyuan-video": (544, 960, 33)}
# Qwen-Image-Edit resizes its input image to a megapixel whatever the output size, so even its tiny
# VAE encodes 1024x1024 pixels: 15 s on a CPU. It is built, not called, here.
NOT_CALLED = {"qwen-image-edit"}


pytestmark = pytest.mark.usefixtures("few_threads")


def test_sixteen_families_in_table_order():
    assert zoo.NAMES[:4] == ("flux", "flux2", "sd3", "sdxl") and len(zoo.NAMES) == 16
    assert set(zoo.NAMES) == {*RELEASED_PARAMS, "wan-1.3b"}
    with pytest.raises(ValueError, match=r"unknown zoo family 'nope'.*flux"):
        zoo.family("nope")
    with pytest.raises(ValueError, match="size must be one of"):
        zoo.build("flux", "medium")


@pytest.mark.parametrize("name", sorted(RELEASED_PARAMS))
def test_full_configs_have_the_released_parameter_counts(name):
    assert zoo.parameter_counts(name, "full") == RELEASED_PARAMS[name]
    assert torch.get_default_dtype() == torch.float32  # construction left no default behind


def test_wan_1_3b_is_the_small_wan():
    counts = zoo.parameter_counts("wan-1.3b", "full")
    assert counts["transformer"] == pytest.approx(1.42e9, rel=0.01)  # Wan2.1-T2V-1.3B
    assert counts["vae"] == RELEASED_PARAMS["wan"]["vae"]


@pytest.mark.parametrize("name", sorted(RELEASED_EMBEDDINGS))
def test_full_embeddings_have_the_encoders_shapes(name):
    specs = zoo.family(name).embeddings["full"]
    for key, shape in RELEASED_EMBEDDINGS[name].items():
        assert specs[key].shape == shape, key


def test_usual_geometry():
    for name, (h, w, frames) in RELEASED_GEOMETRY.items():
        geo = zoo.family(name).geometry["full"]
        assert (geo.height, geo.width, geo.frames) == (h, w, frames), name
    assert zoo.family("flux").geometry["full"].as_kwargs() == {"height": 1024, "width": 1024}
    assert zoo.family("wan").geometry["tiny"].as_kwargs()["num_frames"] == 5


def test_embeddings_are_seeded_random_and_masks_pad_at_the_end():
    a = zoo.embeddings("lumina2", "tiny", seed=3)
    b = zoo.embeddings("lumina2", "tiny", seed=3)
    c = zoo.embeddings("lumina2", "tiny", seed=4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["prompt_embeds"], c["prompt_embeds"])
    assert a["prompt_embeds"].std() > 0.5
    mask = a["prompt_attention_mask"]
    assert mask.dtype == torch.int64 and mask[:, 0].all()
    real = int(mask.sum())
    assert mask[0, :real].all() and not mask[0, real:].any()  # leading real tokens, padding after
    half = zoo.embeddings("ltx", "tiny", dtype=torch.bfloat16)
    assert half["prompt_embeds"].dtype == torch.bfloat16 and half["prompt_attention_mask"].dtype == torch.bool
    assert zoo.embeddings("chroma", "tiny", dtype=torch.bfloat16)["prompt_attention_mask"].dtype == torch.bfloat16
    # Qwen's encoders cut the text to the prompt's own length: nothing is padding.
    assert zoo.embeddings("qwen-image-edit", "tiny", seed=3)["prompt_embeds_mask"].all()


def test_call_kwargs_carry_geometry_steps_guidance_and_the_edit_image():
    kw = zoo.call_kwargs("qwen-image-edit", "tiny", steps=3)
    assert kw["num_inference_steps"] == 3 and kw["true_cfg_scale"] == 4.0
    assert kw["image"].size == (64, 64) and (kw["height"], kw["width"]) == (64, 64)
    assert zoo.call_kwargs("flux2", "tiny")["num_inference_steps"] == zoo.family("flux2").steps
    assert "num_frames" in zoo.call_kwargs("ltx", "tiny") and "num_frames" not in zoo.call_inputs("ltx", "tiny")


def test_half_precision_keeps_the_modules_wan_keeps_in_float32():
    wan = zoo.build_component("wan", "transformer", "tiny", device="meta", dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in wan.named_parameters()}
    assert dtypes["condition_embedder.time_embedder.linear_1.weight"] == torch.float32
    assert dtypes["scale_shift_table"] == torch.float32
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16


def test_build_component_builds_the_denoiser_and_vae_by_their_pipeline_names_only():
    sdxl = zoo.family("sdxl")
    unet = zoo.build_component("sdxl", sdxl.denoiser, "tiny", device="meta")
    vae = zoo.build_component("sdxl", "vae", "tiny", device="meta")
    assert type(unet).__name__ == sdxl.denoiser_class and type(vae).__name__ == sdxl.vae_class
    with pytest.raises(ValueError, match="'unet' and 'vae', not 'transformer'"):
        zoo.build_component("sdxl", "transformer", "tiny", device="meta")


@pytest.fixture(scope="module")
def tiny_pipes():
    return {name: zoo.build(name, "tiny", seed=1) for name in zoo.NAMES}


@pytest.mark.parametrize("name", zoo.NAMES)
def test_tiny_builds_without_text_encoders(tiny_pipes, name):
    fam, pipe = zoo.family(name), tiny_pipes[name]
    assert type(pipe).__name__ == fam.pipeline
    denoiser = getattr(pipe, fam.denoiser)
    assert type(denoiser).__name__ == fam.denoiser_class and type(pipe.vae).__name__ == fam.vae_class
    assert type(pipe.scheduler).__name__ == fam.scheduler_class
    assert sum(p.numel() for p in denoiser.parameters()) < 5e6  # tiny means tiny
    absent = zoo.absent_components(fam)
    assert any(a.startswith("text_encoder") for a in absent), absent
    for component in absent:
        assert getattr(pipe, component, None) is None, component
    # The same structure as the release: patches, block types, norms.
    full, tiny = fam.denoiser_config("full"), fam.denoiser_config("tiny")
    for key in ("patch_size", "patch_size_t", "down_block_types", "up_block_types", "norm_type", "qk_norm"):
        assert tiny.get(key) == full.get(key), key


def _count_rows(module: torch.nn.Module) -> tuple[list[int], object]:
    rows: list[int] = []

    def hook(_module, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("sample"))
        rows.append(int(x.shape[0]))

    return rows, module.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("name", [n for n in zoo.NAMES if n not in NOT_CALLED])
def test_tiny_call_runs_the_denoising_loop(tiny_pipes, name):
    fam, pipe = zoo.family(name), tiny_pipes[name]
    rows, handle = _count_rows(getattr(pipe, fam.denoiser))
    try:
        kwargs = zoo.call_kwargs(name, "tiny", seed=2, steps=2)
        out = pipe(**kwargs, output_type="latent", return_dict=False, generator=torch.Generator().manual_seed(0))[0]
    finally:
        handle.remove()
    assert torch.isfinite(out).all() and out.float().std() > 0
    # Every step computes both guidance branches (one batch of two, or two calls) exactly when
    # the family says it guides with CFG.
    assert sum(rows) == 2 * (2 if fam.cfg else 1), rows


def test_registered_pipeline_classes_exist():
    for fam in zoo.FAMILIES.values():
        for cls in (fam.pipeline, fam.denoiser_class, fam.vae_class, fam.scheduler_class):
            assert hasattr(diffusers, cls), f"{fam.name}: diffusers has no {cls}"

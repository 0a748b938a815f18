"""The LoRA files of scripts/bench_lora_switch.py: three random LoRAs for a model's denoiser,
saved as .safetensors files the way a trainer saves them."""

from __future__ import annotations

import math
from pathlib import Path

import torch

TARGETS = ("to_q", "to_k", "to_v")
# A LoRA's B drawn so that its output is about this fraction of its input's size: a visible change
# of the image that keeps bf16 activations in range.
LORA_STRENGTH = 0.05


def make_lora_files(model: str, size: str, rank: int, folder: Path, dtype: torch.dtype) -> list[Path]:
    """Three random LoRAs (A, B, C) for ``model``'s denoiser, saved as a trainer saves them.

    peft's ``LoraConfig`` is applied to the denoiser built on the meta device (every module, no
    weights), so the keys and shapes are peft's own at no memory; the values are drawn on the CPU
    (A: unit rows in expectation; B: scaled so a LoRA moves its layer's output by about
    :data:`LORA_STRENGTH`); the file is written by the pipeline's ``save_lora_weights``, with the
    config as its adapter metadata (``lora_alpha`` is read back from it).
    """
    import peft
    from peft.utils import get_peft_model_state_dict

    from pipelines.builders import build_transformer, pipeline_class

    meta = build_transformer(model, size, device="meta", dtype=dtype)
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TARGETS), init_lora_weights=False)
    meta.add_adapter(config, adapter_name="trained")
    shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(meta, adapter_name="trained").items()}
    del meta
    metadata = config.to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])  # a set: JSON needs a list
    paths = []
    for i, letter in enumerate("abc"):
        gen = torch.Generator().manual_seed(1000 + i)
        layers = {}
        for key, shape in sorted(shapes.items()):
            w = torch.randn(shape, generator=gen)
            # lora_A: (rank, in); lora_B: (out, rank).
            w /= math.sqrt(shape[1]) if ".lora_A." in key else math.sqrt(rank) / LORA_STRENGTH
            layers[key] = w.to(dtype)
        name = f"lora-{letter}.safetensors"
        pipeline_class(model).save_lora_weights(
            folder, transformer_lora_layers=layers, weight_name=name, transformer_lora_adapter_metadata=metadata
        )
        paths.append(folder / name)
    return paths

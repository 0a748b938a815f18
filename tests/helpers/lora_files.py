"""A LoRA ``.safetensors`` file made in-process for a tiny built-in model, as a trainer saves one.

peft's ``LoraConfig`` on the tiny denoiser (random A and B, so the adapter changes the image),
``get_peft_model_state_dict``, then the pipeline's own ``save_lora_weights`` with the config as
the file's adapter metadata (so ``lora_alpha`` is read back from the file, not guessed from the rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import peft
import torch
from peft.utils import get_peft_model_state_dict

from pipelines.builders import build_transformer, pipeline_class

TARGETS = ("to_q", "to_k", "to_v")


def make_lora_file(
    model: str, path: Path, *, seed: int = 1, rank: int = 4, alpha: int = 8, targets: Sequence[str] = TARGETS
) -> Path:
    """Save a LoRA for the tiny ``model`` (a built-in name) at ``path`` (a .safetensors file); returns it."""
    transformer = build_transformer(model, "tiny")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False)
    torch.manual_seed(seed)
    transformer.add_adapter(config, adapter_name="trained")
    layers = get_peft_model_state_dict(transformer, adapter_name="trained")
    metadata = config.to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])  # a set: JSON needs a list
    path.parent.mkdir(parents=True, exist_ok=True)
    pipeline_class(model).save_lora_weights(
        path.parent, transformer_lora_layers=layers, weight_name=path.name, transformer_lora_adapter_metadata=metadata
    )
    return path

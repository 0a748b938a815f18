"""ZImagePipeline's denoising loop, one step at a time, for rows that joined at different steps.

``bcg-serve --batching continuous`` runs a batch whose rows are requests at their own steps: each
row has its own latents, timesteps, step count and guidance. This module re-states the parts of
``ZImagePipeline.__call__`` (diffusers 0.42) that make one row's image, so that a row computes what
the stock call computes for it: its text (``encode_prompt``), its noise (``prepare_latents`` with
its own generator), its schedule (``calculate_shift``, the default sigmas, ``retrieve_timesteps``
on a scheduler of its own), one step of the batch's transformer call with the guidance combined
per row as the pipeline does (``pos + g * (pos - neg)``, its own ``g``), and the decode. The
scheduler's update is the scheduler's own ``step``, per row (:mod:`pipelines.stepwise`).

Not re-stated: ``cfg_normalization``, a ``cfg_truncation`` below 1 and custom ``sigmas`` (the
server passes none of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PIPELINES", "Steps"]

# The pipelines whose loop this module re-states, by class name.
PIPELINES = ("ZImagePipeline",)
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default, which the server's calls keep


class Steps:
    """One Z-Image pipeline's loop, by parts; a row's text is ``(prompt_embeds, negative_embeds)``."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    @property
    def device(self) -> torch.device:
        return self.pipe._execution_device

    def encode(self, prompts: Sequence[str], negatives: Sequence[str] | None, cfg: bool) -> list[Any]:
        """Each prompt's text, encoded in one call of ``len(prompts)`` rows as the pipeline does
        (``negatives`` None with ``cfg``: the pipeline's empty negative prompts)."""
        # A fresh list each: the pipeline applies its chat template to the list in place.
        pos, neg = self.pipe.encode_prompt(
            prompt=list(prompts),
            negative_prompt=list(negatives) if negatives is not None else None,
            do_classifier_free_guidance=cfg,
            device=self.device,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        return [(p, neg[i] if cfg else None) for i, p in enumerate(pos)]

    def noise(self, generator: torch.Generator, width: int, height: int) -> torch.Tensor:
        """One row's initial latents, ``(1, C, h, w)`` float32: the pipeline's, from ``generator``."""
        pipe = self.pipe
        return pipe.prepare_latents(1, pipe.transformer.in_channels, height, width, torch.float32, self.device,
                                    generator)  # fmt: skip

    def scheduler(self, steps: int, width: int, height: int) -> Any:
        """A scheduler of the pipeline's class and config, its timesteps set as the pipeline sets them."""
        from diffusers.pipelines.z_image.pipeline_z_image import (
            calculate_shift,
            get_default_z_image_sigmas,
            retrieve_timesteps,
        )

        pipe = self.pipe
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        h = 2 * (int(height) // (pipe.vae_scale_factor * 2))
        w = 2 * (int(width) // (pipe.vae_scale_factor * 2))
        config = scheduler.config
        mu = calculate_shift((h // 2) * (w // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))  # fmt: skip
        retrieve_timesteps(scheduler, steps, self.device, sigmas=get_default_z_image_sigmas(steps), mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def predict(self, latents: torch.Tensor, timesteps: torch.Tensor, texts: Sequence[Any],
                guidance: Sequence[float], cfg: bool, size: tuple[int, int]) -> torch.Tensor:  # fmt: skip
        """The noise prediction the pipeline hands its scheduler for ``latents`` (``(B, C, h, w)``
        float32) at ``timesteps`` (``(B,)``, each row's own ``t``), with each row's text and guidance."""
        pipe = self.pipe
        batch = latents.shape[0]
        timestep = (1000 - timesteps) / 1000
        prompt_embeds = [p for p, _ in texts]
        if cfg:
            latent_model_input = latents.to(pipe.transformer.dtype).repeat(2, 1, 1, 1)
            prompt_embeds_model_input = prompt_embeds + [n for _, n in texts]
            timestep_model_input = timestep.repeat(2)
        else:
            latent_model_input = latents.to(pipe.transformer.dtype)
            prompt_embeds_model_input = prompt_embeds
            timestep_model_input = timestep
        latent_model_input = latent_model_input.unsqueeze(2)
        model_out_list = pipe.transformer(
            list(latent_model_input.unbind(dim=0)),
            timestep_model_input,
            prompt_embeds_model_input,
            joint_attention_kwargs=None,
            return_dict=False,
        )[0]
        if cfg:
            noise_pred = []
            for j in range(batch):
                pos = model_out_list[j].float()
                neg = model_out_list[batch + j].float()
                noise_pred.append(pos + guidance[j] * (pos - neg))
            noise_pred = torch.stack(noise_pred, dim=0)
        else:
            noise_pred = torch.stack([t.float() for t in model_out_list], dim=0)
        return (-noise_pred.squeeze(2)).to(torch.float32)

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """The pipeline's ``output_type="pt"`` images of ``latents``: ``(B, 3, H, W)`` in [0, 1]."""
        pipe = self.pipe
        latents = latents.to(pipe.vae.dtype)
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pt")

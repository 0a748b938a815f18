"""QwenImagePipeline's denoising loop, one step at a time, for rows that joined at different steps.

``bcg-serve --batching continuous`` runs a batch whose rows are requests at their own steps. This
module re-states the parts of ``QwenImagePipeline.__call__`` (diffusers 0.42) that make one row's
image: its text (``encode_prompt``, the negative prompt's too for true CFG), its packed noise
(``prepare_latents`` with its own generator), its schedule (``calculate_shift`` at the image's
sequence length, the pipeline's sigmas, ``retrieve_timesteps`` on a scheduler of its own), one step
of the batch (the prompt's call under ``cache_context("cond")``, the negative's under
``("uncond")``, each row's own ``true_cfg_scale`` in the combination and the pipeline's norm
rescale over the whole batch) and the decode.

A row keeps its text at the length of the call that encoded it; a step pads the rows' texts to the
longest among them with masked zeros, as the pipeline pads a call's prompts (its mask dropped where
every row is full). Where the recipe pads text to its length buckets (graphs, up to 768x768), every
row of a batch reaches the denoiser at the bucket's length whatever its company; elsewhere a row's
text is as long as the longest of its batch, as in a pipeline call whose longest prompt is as long.

Not re-stated: guidance-distilled transformers (``guidance_embeds``), custom ``sigmas``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["PIPELINES", "Steps"]

PIPELINES = ("QwenImagePipeline",)
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default, which the server's calls keep


def _rows(embeds: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row of a call's text, its padding cut (a mask of None: every row full)."""
    if mask is None:
        return list(embeds)
    return [e[: int(n)] for e, n in zip(embeds, mask.sum(dim=1).tolist())]


def _collate(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of text padded to the longest with zeros, stacked, and their mask (None where all are
    full), as ``_get_qwen_prompt_embeds`` and ``encode_prompt`` make them."""
    longest = max(r.shape[0] for r in rows)
    embeds = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    ones = [torch.ones(r.shape[0], dtype=torch.long, device=r.device) for r in rows]
    mask = torch.stack([torch.cat([m, m.new_zeros(longest - m.shape[0])]) for m in ones])
    return embeds, None if all(r.shape[0] == longest for r in rows) else mask


class Steps:
    """One Qwen-Image pipeline's loop, by parts; a row's text is ``(prompt, negative or None)``,
    each its encoder's hidden states without padding."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        if getattr(pipe.transformer.config, "guidance_embeds", False):
            raise ValueError("a guidance-distilled Qwen-Image transformer is not stepped by rows here")

    @property
    def device(self) -> torch.device:
        return self.pipe._execution_device

    def encode(self, prompts: Sequence[str], negatives: Sequence[str] | None, cfg: bool) -> list[Any]:
        """Each prompt's text (and its negative prompt's, with ``cfg``), in one call each of
        ``len(prompts)`` rows, as the pipeline encodes them."""
        pipe = self.pipe
        pos = _rows(*pipe.encode_prompt(list(prompts), device=self.device, max_sequence_length=MAX_SEQUENCE_LENGTH))
        if not cfg or negatives is None:
            return [(p, None) for p in pos]
        neg = _rows(*pipe.encode_prompt(list(negatives), device=self.device, max_sequence_length=MAX_SEQUENCE_LENGTH))
        return list(zip(pos, neg))

    def noise(self, generator: torch.Generator, width: int, height: int) -> torch.Tensor:
        """One row's initial packed latents, ``(1, seq, C * 4)``, in the text encoder's dtype as the pipeline's."""
        pipe = self.pipe
        channels = pipe.transformer.config.in_channels // 4
        return pipe.prepare_latents(1, channels, height, width, pipe.text_encoder.dtype, self.device, generator)

    def _sequence(self, width: int, height: int) -> int:
        f = self.pipe.vae_scale_factor
        return (2 * (int(height) // (f * 2)) // 2) * (2 * (int(width) // (f * 2)) // 2)

    def scheduler(self, steps: int, width: int, height: int) -> Any:
        """A scheduler of the pipeline's class and config, its timesteps set as the pipeline sets them."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        pipe = self.pipe
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        config = scheduler.config
        mu = calculate_shift(self._sequence(width, height), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))  # fmt: skip
        sigmas = np.linspace(1.0, 1 / steps, steps)
        retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def predict(self, latents: torch.Tensor, timesteps: torch.Tensor, texts: Sequence[Any],
                guidance: Sequence[float], cfg: bool, size: tuple[int, int]) -> torch.Tensor:  # fmt: skip
        """The noise prediction the pipeline hands its scheduler for ``latents`` at ``timesteps``
        (each row's own ``t``), with each row's text and ``true_cfg_scale``."""
        pipe = self.pipe
        width, height = size
        batch = latents.shape[0]
        f = pipe.vae_scale_factor
        img_shapes = [[(1, height // f // 2, width // f // 2)]] * batch
        timestep = timesteps.to(latents.dtype)

        def branch(context: str, which: int) -> torch.Tensor:  # the pipeline's call, in its cache context
            embeds, mask = _collate([text[which] for text in texts])
            with pipe.transformer.cache_context(context):
                return pipe.transformer(hidden_states=latents, timestep=timestep / 1000, guidance=None,
                                        encoder_hidden_states_mask=mask, encoder_hidden_states=embeds,
                                        img_shapes=img_shapes, attention_kwargs={}, return_dict=False)[0]  # fmt: skip

        noise_pred = branch("cond", 0)
        if not cfg:
            return noise_pred
        neg_noise_pred = branch("uncond", 1)
        # Each row's own scale, elementwise as the pipeline's one scale; the norms over the batch as its.
        comb_pred = torch.cat([neg_noise_pred[i : i + 1] + guidance[i] * (noise_pred[i : i + 1] - neg_noise_pred[i : i + 1])
                               for i in range(batch)])  # fmt: skip
        cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
        return comb_pred * (cond_norm / noise_norm)

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """The pipeline's ``output_type="pt"`` images of ``latents``: ``(B, 3, H, W)`` in [0, 1]."""
        pipe = self.pipe
        width, height = size
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = latents.to(pipe.vae.dtype)
        z = pipe.vae.config.z_dim
        latents_mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        latents_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device,
                                                                                               latents.dtype)  # fmt: skip
        latents = latents / latents_std + latents_mean
        image = pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="pt")

"""Recipe for HunyuanVideo-1.5 denoisers (diffusers' HunyuanVideo15Transformer3DModel).

The stock forward (diffusers 0.42) cannot be captured whole: after embedding its three condition
streams (Qwen2.5-VL text, ByT5 glyph text, SigLIP image tokens) it asks the device whether the
image embeddings are all zero (``if torch.all(image_embeds == 0):``, a host sync) and then moves
each sample's valid tokens to the front with boolean-mask indexing (data-dependent shapes, one
sync each), before stacking them back to a fixed total length. That code is inline in the
top-level forward, which can never itself become a break, so no automatic break can help.

The recipe's forward is the stock one split in three, with the same arithmetic line for line:

* the embedders, which depend on shapes only (RoPE, timestep, patch, both text embedders, the
  image projection and the first two streams' type embeddings), captured;
* :func:`combine_condition_tokens`, the stock code from the ``is_t2v`` test to the two stacks,
  an eager break: it returns the reordered tokens and their mask, whose shapes are fixed
  (every call of one signature has the same total text length);
* the transformer blocks, ``norm_out``, ``proj_out`` and the unpatchify, captured.

So text-to-video (zero image embeddings) and image-to-video calls, and masks of any valid lengths,
share one graph per shape, and the output equals the stock forward bit for bit. The pipeline pads
every prompt to a fixed length (1000 Qwen tokens, 256 ByT5 tokens, 729 image tokens), so a
resolution and frame count need one graph, whatever the prompt.

What stays eager per denoiser call: the break, per sample 12 boolean-mask selections (each a
``nonzero`` and a device-to-host sync) and a few concatenations, plus the ``is_t2v`` sync and the
image stream's type embedding: about 50 small kernels and 13 syncs for one video, while the GPU
waits, roughly 0.5-1 ms a call (estimated, not measured), against seconds of transformer per
call at 480p (121 frames: about 49k image tokens through 54 blocks).

Not done: the guidance branches on two GPUs (``parallel="cfg"``: refused, see
:meth:`HunyuanVideo15Recipe.cfg_parallel_support`); Ulysses is refused by the base recipe, as
diffusers 0.42 gives the model no context-parallel plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accel import GenerationDefaults, Recipe, WarmupCase, eager_on_graph

from .models import FAMILY

logger = logging.getLogger(__name__)

BREAK_NAME = "hunyuan-video-1.5 condition tokens"
# What HunyuanVideo15Pipeline pads each stream to (tokenizer_max_length, tokenizer_2_max_length,
# vision_num_semantic_tokens in diffusers 0.42): every prompt reaches the denoiser this long.
MLLM_LENGTH = 1000
BYT5_LENGTH = 256
IMAGE_TOKENS = 729


@eager_on_graph(name=BREAK_NAME)
def combine_condition_tokens(
    self: torch.nn.Module,
    batch_size: int,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor,
    encoder_hidden_states_2: torch.Tensor,
    encoder_attention_mask_2: torch.Tensor,
    encoder_hidden_states_3: torch.Tensor,
    image_embeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The three condition streams as one, valid tokens first: ``(tokens, mask)`` of a fixed shape.

    The body is diffusers 0.42's ``HunyuanVideo15Transformer3DModel.forward`` from ``is_t2v`` to
    the two ``torch.stack`` calls, line for line (the recipe's version pin guards it), so the
    result is the stock one bit for bit. ``self`` is the model (only its ``cond_type_embed`` is
    read), so named that the body stays diffusers' text.
    """
    is_t2v = torch.all(image_embeds == 0)
    if is_t2v:
        encoder_hidden_states_3 = encoder_hidden_states_3 * 0.0
        encoder_attention_mask_3 = torch.zeros(
            (batch_size, encoder_hidden_states_3.shape[1]),
            dtype=encoder_attention_mask.dtype,
            device=encoder_attention_mask.device,
        )
    else:
        encoder_attention_mask_3 = torch.ones(
            (batch_size, encoder_hidden_states_3.shape[1]),
            dtype=encoder_attention_mask.dtype,
            device=encoder_attention_mask.device,
        )
    encoder_hidden_states_3_cond_emb = self.cond_type_embed(
        2
        * torch.ones_like(
            encoder_hidden_states_3[:, :, 0],
            dtype=torch.long,
        )
    )
    encoder_hidden_states_3 = encoder_hidden_states_3 + encoder_hidden_states_3_cond_emb

    # reorder and combine text tokens: combine valid tokens first, then padding
    encoder_attention_mask = encoder_attention_mask.bool()
    encoder_attention_mask_2 = encoder_attention_mask_2.bool()
    encoder_attention_mask_3 = encoder_attention_mask_3.bool()
    new_encoder_hidden_states = []
    new_encoder_attention_mask = []

    for text, text_mask, text_2, text_mask_2, image, image_mask in zip(
        encoder_hidden_states,
        encoder_attention_mask,
        encoder_hidden_states_2,
        encoder_attention_mask_2,
        encoder_hidden_states_3,
        encoder_attention_mask_3,
    ):
        # Concatenate: [valid_image, valid_byt5, valid_mllm, invalid_image, invalid_byt5, invalid_mllm]
        new_encoder_hidden_states.append(
            torch.cat(
                [
                    image[image_mask],  # valid image
                    text_2[text_mask_2],  # valid byt5
                    text[text_mask],  # valid mllm
                    image[~image_mask],  # invalid image
                    torch.zeros_like(text_2[~text_mask_2]),  # invalid byt5 (zeroed)
                    torch.zeros_like(text[~text_mask]),  # invalid mllm (zeroed)
                ],
                dim=0,
            )
        )

        # Apply same reordering to attention masks
        new_encoder_attention_mask.append(
            torch.cat(
                [
                    image_mask[image_mask],
                    text_mask_2[text_mask_2],
                    text_mask[text_mask],
                    image_mask[~image_mask],
                    text_mask_2[~text_mask_2],
                    text_mask[~text_mask],
                ],
                dim=0,
            )
        )

    encoder_hidden_states = torch.stack(new_encoder_hidden_states)
    encoder_attention_mask = torch.stack(new_encoder_attention_mask)
    return encoder_hidden_states, encoder_attention_mask


def split_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor,
    timestep_r: torch.LongTensor | None = None,
    encoder_hidden_states_2: torch.Tensor | None = None,
    encoder_attention_mask_2: torch.Tensor | None = None,
    image_embeds: torch.Tensor | None = None,
    attention_kwargs: dict[str, Any] | None = None,
    return_dict: bool = True,
) -> Any:
    """diffusers 0.42's ``HunyuanVideo15Transformer3DModel.forward``, line for line, with its
    condition-token reordering moved into the eager break :func:`combine_condition_tokens`.

    Unbound and undecorated: :meth:`HunyuanVideo15Recipe.wrap_forward` adds diffusers' LoRA
    scaling (``apply_lora_scale("attention_kwargs")``, as the stock forward has) and binds it.
    """
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    batch_size, num_channels, num_frames, height, width = hidden_states.shape  # noqa: RUF059 (kept verbatim)
    p_t, p_h, p_w = self.config.patch_size_t, self.config.patch_size, self.config.patch_size
    post_patch_num_frames = num_frames // p_t
    post_patch_height = height // p_h
    post_patch_width = width // p_w

    # 1. RoPE
    image_rotary_emb = self.rope(hidden_states)

    # 2. Conditional embeddings
    temb = self.time_embed(timestep, timestep_r=timestep_r)

    hidden_states = self.x_embedder(hidden_states)

    # qwen text embedding
    encoder_hidden_states = self.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)

    encoder_hidden_states_cond_emb = self.cond_type_embed(
        torch.zeros_like(encoder_hidden_states[:, :, 0], dtype=torch.long)
    )
    encoder_hidden_states = encoder_hidden_states + encoder_hidden_states_cond_emb

    # byt5 text embedding
    encoder_hidden_states_2 = self.context_embedder_2(encoder_hidden_states_2)

    encoder_hidden_states_2_cond_emb = self.cond_type_embed(
        torch.ones_like(encoder_hidden_states_2[:, :, 0], dtype=torch.long)
    )
    encoder_hidden_states_2 = encoder_hidden_states_2 + encoder_hidden_states_2_cond_emb

    # image embed
    encoder_hidden_states_3 = self.image_embedder(image_embeds)
    # The data-dependent part (a host sync, boolean-mask indexing): an eager break whose
    # outputs have fixed shapes, so what follows is captured.
    encoder_hidden_states, encoder_attention_mask = combine_condition_tokens(
        self,
        batch_size,
        encoder_hidden_states,
        encoder_attention_mask,
        encoder_hidden_states_2,
        encoder_attention_mask_2,
        encoder_hidden_states_3,
        image_embeds,
    )

    # 4. Transformer blocks
    if torch.is_grad_enabled() and self.gradient_checkpointing:
        for block in self.transformer_blocks:
            hidden_states, encoder_hidden_states = self._gradient_checkpointing_func(
                block,
                hidden_states,
                encoder_hidden_states,
                temb,
                encoder_attention_mask,
                image_rotary_emb,
            )

    else:
        for block in self.transformer_blocks:
            hidden_states, encoder_hidden_states = block(
                hidden_states,
                encoder_hidden_states,
                temb,
                encoder_attention_mask,
                image_rotary_emb,
            )

    # 5. Output projection
    hidden_states = self.norm_out(hidden_states, temb)
    hidden_states = self.proj_out(hidden_states)

    hidden_states = hidden_states.reshape(
        batch_size, post_patch_num_frames, post_patch_height, post_patch_width, -1, p_t, p_h, p_w
    )
    hidden_states = hidden_states.permute(0, 4, 1, 5, 2, 6, 3, 7)
    hidden_states = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    if not return_dict:
        return (hidden_states,)

    return Transformer2DModelOutput(sample=hidden_states)


def _stock_forward() -> Callable[..., Any] | None:
    """diffusers' own forward of the class (None where this diffusers has no such model)."""
    try:
        from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15Transformer3DModel
    except ImportError:
        return None
    return HunyuanVideo15Transformer3DModel.forward


class HunyuanVideo15Recipe(Recipe):
    """The stock forward split around an eager break at its condition-token reordering."""

    name = "hunyuan-video-1.5"
    denoiser_classes = ("HunyuanVideo15Transformer3DModel",)
    diffusers_versions = ">=0.42,<0.43"

    def install(self, module: torch.nn.Module) -> Callable[[], None]:
        # Nothing of the module is patched: the split forward lives in the graph hook only
        # (wrap_forward), so removing the hook gives the stock forward back.
        return lambda: None

    def wrap_forward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        module = getattr(fn, "__self__", None)
        stock = _stock_forward()
        if module is None or stock is None or getattr(fn, "__func__", None) is not stock:
            # A subclass's own forward, or one someone wrapped: the split is a copy of diffusers'
            # code, valid only in its place. Captured as it is, which fails and runs eagerly.
            logger.warning(
                "%s: the denoiser's forward is not diffusers' HunyuanVideo15Transformer3DModel.forward; "
                "not splitting it (the whole forward cannot be captured, so it will run eagerly)",
                self.name,
            )
            return fn
        from diffusers.utils import apply_lora_scale

        forward = apply_lora_scale("attention_kwargs")(split_forward)

        def bound(*args: Any, **kwargs: Any) -> Any:
            return forward(module, *args, **kwargs)

        return bound

    def generation_defaults(self) -> GenerationDefaults:
        return GenerationDefaults(**FAMILY.generation)  # the family's (models.py)

    def cfg_parallel_support(self, module: torch.nn.Module) -> str | None:
        return (
            "the hunyuan-video-1.5 recipe does not split guidance branches (the pipeline runs them as two calls "
            "under cache_context 'pred_cond' and 'pred_uncond', but no split is written or tested)"
        )

    # -- warm-up ---------------------------------------------------------------------------
    def default_prompt_lengths(self) -> tuple[int, ...]:
        return (MLLM_LENGTH,)

    def prompt_lengths(self, pipe: Any, prompts: list[str]) -> list[int]:
        # The pipeline pads every prompt to its tokenizer's maximum: the length never varies.
        return [getattr(pipe, "tokenizer_max_length", MLLM_LENGTH)] * len(prompts)

    def warmup_length(self, length: int, width: int, height: int) -> int:
        return MLLM_LENGTH

    def warmup_calls(self, pipe: Any, case: WarmupCase) -> Iterator[dict[str, Any]]:
        # Random embeddings in the shapes the pipeline's encoders give, masks half valid. Whether
        # guidance runs is the pipeline's guider's to say, not the call's: the negative embeddings
        # are always passed (unused when it does not guide), and both branches share a graph.
        # Embeddings the user passes in call_kwargs replace these (the warm-up merges them in).
        given, batch = case.call_kwargs, case.batch_size
        device, dtype, g = self.embedding_setup(pipe)
        config = pipe.transformer.config
        mllm = getattr(pipe, "tokenizer_max_length", MLLM_LENGTH)
        byt5 = getattr(pipe, "tokenizer_2_max_length", BYT5_LENGTH)

        def embeds(length: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
            e = torch.randn(batch, length, dim, generator=g, device=device, dtype=dtype)
            mask = (torch.arange(length, device=device) < max(1, length // 2)).to(dtype).expand(batch, -1)
            return e, mask

        kwargs = self.warmup_call(pipe, case)
        for prefix in ("", "negative_"):
            for suffix, length, dim in (("", mllm, config.text_embed_dim), ("_2", byt5, config.text_embed_2_dim)):
                if f"{prefix}prompt_embeds{suffix}" not in given:
                    kwargs[f"{prefix}prompt_embeds{suffix}"], kwargs[f"{prefix}prompt_embeds_mask{suffix}"] = embeds(
                        length, dim
                    )
        yield kwargs

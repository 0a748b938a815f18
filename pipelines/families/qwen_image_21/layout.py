"""Qwen-Image 2.1's token layout, factored out of its forward (diffusers' QwenImage21Transformer2DModel).

The stock forward (diffusers 0.42) lays the text, the condition images and the target image out as
one joint sequence, and does so on the host: ``repeat_interleave`` by a tensor of repeats, boolean
index-puts, ``nonzero``, ``tolist()`` in the RoPE table and the prefix segments,
``int((~target_token_mask).sum())``. None of it can be captured, and it sits in the forward's own
body, where no function can be marked as a break. Yet all of it is a function of the call's
shapes and masks (``img_mask``, ``encoder_hidden_states_mask``, ``img_shapes``), never of the
latents. So :func:`layout_forward` runs the forward with that preamble factored out:

* :func:`token_layout` is one *keyed* eager break: it computes the joint layout (the gather
  index that replaces the repeat, the image positions that replace the boolean index-put, the
  RoPE table, the target-token mask, the key-valid mask, ``prefix_len``, the prefix segments or
  the flex ``BlockMask``) with diffusers' own helpers. Its host values (``prefix_len``, the
  segments) are part of its output's structure, so a call with another layout replays (or
  captures) a chain of its own instead of failing. Layouts are remembered by the masks' values
  (:class:`LayoutMemo`), so a replayed step pays a lookup, not the preamble; a mask tensor's
  values are read to the host once per call (the pipeline hands every step the same masks, and
  the recipe passes their token, :data:`LAYOUT_KWARG`), so the steps do not wait on that read.
* everything after it (input projections, timestep and modulation, the block loop, the output
  norm and projection) is the stock forward's code, captured as one segment. The blocks and
  their attention processors are diffusers' own, called with the same arguments: the prefill's
  per-segment SDPA (or flex) is exactly what stock runs.

The result equals the stock forward bit for bit (the layout is pure data movement; every
arithmetic op is the stock one, in the same order).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import sys
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from accel import eager_on_graph

__all__ = [
    "LAYOUTS_KEPT",
    "LAYOUT_KWARG",
    "MODULE",
    "TOKENS_KEPT",
    "Layout",
    "LayoutMemo",
    "LayoutQuery",
    "layout_forward",
    "token_layout",
]

MODULE = "diffusers.models.transformers.transformer_qwenimage21"
# Layouts remembered per transformer (by their masks' values): the tensors of one are a few MB at
# 1024x1024 (its RoPE table), and a process sees few distinct layouts (one per prompt length and
# condition-image size).
LAYOUTS_KEPT = 16
# Mask values told apart by their layout tokens; a call whose token was forgotten gets a new one,
# a signature of its own.
TOKENS_KEPT = 1024
# The keyword the recipe adds to each call (route_call) and the forward takes out again: the
# number of the call's mask values, so that the layout break need not read them.
LAYOUT_KWARG = "_bcg_layout"


@dataclasses.dataclass
class Layout:
    """The joint token layout of one call: what the stock forward computes on the host.

    Attributes:
        gather: ``(vlm_len * ...)`` indices into ``cat([text, target slots], dim=1)`` that expand
            each vision slot to its 2x2 latent tokens (the stock ``repeat_interleave(repeats)``).
        image_positions: the joint positions of the latent tokens (the stock boolean index-put).
        rotary_emb: the RoPE table of the joint sequence.
        target_token_mask: ``True`` at the target image's tokens.
        joint_key_valid: ``(batch, joint_len)`` keys attention may see, or None without a text mask.
        prefix_len: text and condition-image tokens before the target image.
        segments: the prefill's ``(start, end, is_text)`` runs for the SDPA processor, or None.
        block_mask: the prefill's flex ``BlockMask`` for the flex processor, or None.
    """

    gather: torch.Tensor
    image_positions: torch.Tensor
    rotary_emb: torch.Tensor
    target_token_mask: torch.Tensor
    joint_key_valid: torch.Tensor | None
    prefix_len: int
    segments: list[tuple[int, int, bool]] | None
    block_mask: Any


def _host_bytes(t: torch.Tensor | None) -> Hashable:
    """A tensor's values as a hashable key (one device-to-host read)."""
    if t is None:
        return None
    return (tuple(t.shape), t.dtype, t.detach().cpu().numpy().tobytes())


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), or None where it keeps none (an
    inference tensor)."""
    try:
        return t._version
    except RuntimeError:
        return None


class LayoutMemo:
    """The layouts of one transformer, by the values of the masks and shapes they came from
    (least recently used forgotten first). The same object comes back for the same values, so
    a graph whose boundary buffer it is keeps reading what it was captured with.

    A mask's values are read once per tensor and version (:meth:`host_key`): the pipeline hands
    the same mask tensors to every step of a call, and reading them at every step would make the
    host wait there for the GPU to finish the step before, leaving the GPU idle while it launches
    the next one."""

    def __init__(self, limit: int = LAYOUTS_KEPT) -> None:
        self.limit = limit
        self._layouts: collections.OrderedDict[Hashable, Layout] = collections.OrderedDict()
        self._read: collections.OrderedDict[int, tuple[weakref.ref[torch.Tensor], int, Hashable]] = (
            collections.OrderedDict()
        )
        self._tokens: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._by_token: dict[int, Hashable] = {}
        self._numbers = itertools.count()  # never reused: a forgotten token names nothing
        self.computed = 0
        self.host_reads = 0

    def host_key(self, t: torch.Tensor | None) -> Hashable:
        """:func:`_host_bytes` of ``t``, read again only for another tensor, or after an in-place
        write to this one (a tensor that keeps no version is read every time)."""
        if t is None:
            return None
        version = _version(t)
        seen = self._read.get(id(t))
        if seen is not None and version is not None and seen[0]() is t and seen[1] == version:
            self._read.move_to_end(id(t))
            return seen[2]
        key = _host_bytes(t)
        self.host_reads += 1
        if version is not None:
            self._read[id(t)] = (weakref.ref(t), version, key)
            while len(self._read) > 2 * self.limit:
                self._read.popitem(last=False)
        return key

    def get(self, key: Hashable, compute: Callable[[], Layout]) -> Layout:
        layout = self._layouts.get(key)
        if layout is None:
            layout = compute()
            self.computed += 1
            self._layouts[key] = layout
            while len(self._layouts) > self.limit:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return layout

    def masks_token(self, img_mask: torch.Tensor | None, encoder_hidden_states_mask: torch.Tensor | None) -> int:
        """A number for the masks' values, the same for the same values (within the last
        :data:`TOKENS_KEPT` told apart): the call's :data:`LAYOUT_KWARG`."""
        key = (self.host_key(img_mask), self.host_key(encoder_hidden_states_mask))
        token = self._tokens.get(key)
        if token is None:
            token = self._tokens[key] = next(self._numbers)
            self._by_token[token] = key
            while len(self._tokens) > TOKENS_KEPT:
                self._by_token.pop(self._tokens.popitem(last=False)[1], None)
        self._tokens.move_to_end(key)
        return token

    def masks_key(self, token: int | None) -> Hashable | None:
        """The masks' key a :meth:`masks_token` stands for (None: not one of the kept)."""
        return self._by_token.get(token) if token is not None else None

    def clear(self) -> None:
        self._layouts.clear()
        self._read.clear()

    def __len__(self) -> int:
        return len(self._layouts)


@dataclasses.dataclass(frozen=True)
class LayoutQuery:
    """What a layout depends on besides the masks' values: the image blocks' ``(frame, height,
    width)`` (the first sample's: samples share a layout), the batch, the device, and which
    prefill form the attention processors read (the SDPA processor's segments, the flex one's
    BlockMask; neither for the cached steps)."""

    img_shapes: tuple[tuple[int, int, int], ...]
    batch_size: int
    device: torch.device
    segments: bool
    block_mask: bool


def _compute_layout(
    module: torch.nn.Module, img_mask: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None, q: LayoutQuery
) -> Layout:
    """The stock forward's host-side preamble, with diffusers' helpers (see the module docstring)."""
    mod = sys.modules[MODULE]
    shapes = [tuple(s) for s in q.img_shapes]
    repeats = torch.where(img_mask, mod._IMG_TOKENS_PER_SLOT, 1)[0]
    image_pad_mask = torch.repeat_interleave(img_mask[0], repeats)
    gather = torch.repeat_interleave(torch.arange(repeats.shape[0], device=repeats.device), repeats)
    image_positions = image_pad_mask.nonzero(as_tuple=True)[0]
    rotary_emb = module.pos_embed(shapes, image_pad_mask, device=q.device)
    image_ids, target_token_mask = module.build_token_metadata(image_pad_mask, shapes)
    joint_key_valid = None
    if encoder_hidden_states_mask is not None:
        joint_key_valid = torch.ones(q.batch_size, image_pad_mask.shape[0], dtype=torch.bool, device=q.device)
        text_positions = (~image_pad_mask).nonzero(as_tuple=True)[0]
        vlm_text_positions = ~img_mask[0][: encoder_hidden_states_mask.shape[1]]
        joint_key_valid[:, text_positions] = encoder_hidden_states_mask.bool()[:, vlm_text_positions]
    prefix_len = int((~target_token_mask).sum())
    return Layout(
        gather=gather.to(q.device),
        image_positions=image_positions.to(q.device),
        rotary_emb=rotary_emb,
        target_token_mask=target_token_mask,
        joint_key_valid=joint_key_valid,
        prefix_len=prefix_len,
        segments=mod._qwenimage21_prefix_segments(image_ids, prefix_len) if q.segments else None,
        block_mask=(
            mod.build_qwenimage21_block_causal_mask(image_ids, joint_key_valid, q.batch_size, q.device)
            if q.block_mask
            else None
        ),
    )


@eager_on_graph(keyed=True, name="qwen-image-2.1 token layout")
def token_layout(
    memo: LayoutMemo,
    module: torch.nn.Module,
    img_mask: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    query: LayoutQuery,
    token: int | None = None,
) -> Layout:
    """The call's :class:`Layout`: remembered by the masks' values, computed on a miss. An eager
    break keyed on its output (``prefix_len`` and the segments are host values the segments
    after it were captured for). ``token``: the masks' values as the recipe read them from the
    pipeline's own tensors before the call (:meth:`QwenImage21Recipe.route_call`); without it the
    masks handed here are read."""
    masks = memo.masks_key(token)
    if masks is None:
        masks = (memo.host_key(img_mask), memo.host_key(encoder_hidden_states_mask))
    return memo.get((*masks, query), lambda: _compute_layout(module, img_mask, encoder_hidden_states_mask, query))


def _forward(
    memo: LayoutMemo,
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    img_shapes: list[list[tuple[int, int, int]]],
    img_mask: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None = None,
    attention_kwargs: dict[str, Any] | None = None,
    kv_cache: Any = None,
    kv_cache_mode: str | None = None,
    return_dict: bool = True,
    layout_token: int | None = None,
) -> Any:
    """diffusers 0.42's ``QwenImage21Transformer2DModel.forward`` (below its LoRA-scale
    decorator), its layout taken from :func:`token_layout`; every other line as stock."""
    mod = sys.modules[MODULE]
    batch_size = hidden_states.shape[0]
    if kv_cache is not None and not self.config.causal_condition:
        raise ValueError(
            "kv_cache requires `causal_condition=True`. The cache is only valid because text and condition-image "
            "tokens modulate from t=0, which makes their activations independent of the denoising step."
        )
    if kv_cache is not None and kv_cache_mode not in ("extract", "cached"):
        raise ValueError(
            f"kv_cache_mode must be 'extract' or 'cached' when kv_cache is provided, got {kv_cache_mode!r}."
        )
    if kv_cache is None and kv_cache_mode is not None:
        raise ValueError(f"kv_cache_mode is {kv_cache_mode!r} but no kv_cache was passed to hold the prefix.")

    prefill = kv_cache_mode != "cached"
    processors = [block.attn.processor for block in self.transformer_blocks]
    flex = [isinstance(p, mod.QwenImage21FlexAttnProcessor) for p in processors]
    query = LayoutQuery(
        img_shapes=tuple(tuple(s) for s in img_shapes[0]),
        batch_size=batch_size,
        device=hidden_states.device,
        segments=prefill and not all(flex),
        block_mask=prefill and any(flex),
    )
    layout = token_layout(memo, self, img_mask, encoder_hidden_states_mask, query, layout_token)

    hidden_states = self.img_in(hidden_states)
    encoder_hidden_states = self.txt_in(encoder_hidden_states)

    target_tokens = math.prod(img_shapes[0][-1])
    joint_hidden_states = torch.cat(
        [
            encoder_hidden_states,
            encoder_hidden_states.new_zeros(batch_size, target_tokens // 4, encoder_hidden_states.shape[2]),
        ],
        dim=1,
    )
    # The stock repeat_interleave(repeats) and boolean index-put, as a gather and an index-put by
    # positions: the same values moved, with no host sync.
    joint_hidden_states = joint_hidden_states.index_select(1, layout.gather)
    joint_hidden_states[:, layout.image_positions] = hidden_states

    rotary_emb = layout.rotary_emb
    target_token_mask = layout.target_token_mask

    timestep = timestep.to(hidden_states.dtype)
    if self.config.causal_condition:
        timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        modulation_mask = target_token_mask
    else:
        modulation_mask = None
    temb = self.time_text_embed(timestep, hidden_states)
    modulation = self.modulation(temb)

    joint_key_valid = layout.joint_key_valid
    prefix_len = layout.prefix_len

    if kv_cache_mode == "cached":
        joint_hidden_states = joint_hidden_states[:, prefix_len:]
        rotary_emb = rotary_emb[prefix_len:]
        modulation_mask = modulation_mask[prefix_len:]
        attention_mask = None if joint_key_valid is None else joint_key_valid[:, None, None, :]
        cache_write_slice = None
        block_segments, block_key_valid = None, None
    else:
        attention_mask = layout.block_mask
        block_segments = layout.segments
        cache_write_slice = slice(0, prefix_len) if kv_cache_mode == "extract" else None
        block_key_valid = joint_key_valid

    for index_block, block in enumerate(self.transformer_blocks):
        layer_cache = kv_cache.get_layer(index_block) if kv_cache is not None else None
        joint_hidden_states = block(
            hidden_states=joint_hidden_states,
            modulation=modulation,
            rotary_emb=rotary_emb,
            attention_mask=attention_mask,
            target_token_mask=modulation_mask,
            layer_cache=layer_cache,
            kv_cache_mode=kv_cache_mode,
            cache_write_slice=cache_write_slice,
            segments=block_segments,
            key_valid=block_key_valid,
        )

    joint_hidden_states = self.norm_out(joint_hidden_states, temb, modulation_mask)
    output = self.proj_out(joint_hidden_states)

    if not return_dict:
        return (output,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=output)


def layout_forward(fn: Callable[..., Any], memo: LayoutMemo) -> Callable[..., Any] | None:
    """The forward of ``fn``'s module with its preamble as :func:`token_layout`, or None where
    ``fn`` is not diffusers 0.42's forward of a QwenImage21Transformer2DModel (a subclass's own,
    another wrapper): then the stock forward runs, and its capture fails into eager."""
    mod = sys.modules.get(MODULE)
    module = getattr(fn, "__self__", None)
    if mod is None or getattr(fn, "__func__", None) is not mod.QwenImage21Transformer2DModel.forward:
        return None
    from diffusers.utils.peft_utils import apply_lora_scale

    # The stock forward's decorator: PEFT's LoRA scale set around the call, as stock sets it.
    scaled = apply_lora_scale("attention_kwargs")(functools.partial(_forward, memo))

    @functools.wraps(fn)
    def forward(*args: Any, **kwargs: Any) -> Any:
        token = kwargs.pop(LAYOUT_KWARG, None)
        if torch.is_grad_enabled() and module.gradient_checkpointing:
            return fn(*args, **kwargs)  # training: the stock forward, checkpointing as it does
        return scaled(module, *args, layout_token=token, **kwargs)

    return forward

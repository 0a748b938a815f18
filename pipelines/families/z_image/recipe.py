"""Recipe for Z-Image denoisers (diffusers' ZImageTransformer2DModel).

The stock forward has no host syncs in its basic (text-to-image) mode, so it needs no eager
break. What it does need:

* Its caption handling pads every caption to a multiple of 32 by repeating the last row, then
  swaps the padded rows for a learned pad token that attention *does* see. Extra padding would
  change the image, so captions are never padded past their native multiple of 32. But the
  position of the pad rows is decided by Python ints inside the forward, so a graph captured
  for a 37-token caption would serve only 37-token captions. The recipe pads captions to their
  native multiple of 32 itself, exactly as the model would, and hands the model the pad rows as
  a mask tensor (a graph input) instead of an int: every caption length in one multiple of 32
  shares a graph, and the arithmetic is the stock model's, bit for bit.
* Its RoPE tables live on a plain object outside the module tree; the ones a graph reads are
  kept alive with the graph.
* Its omni mode (``ZImageOmniPipeline``: condition images, SigLIP features, nested captions) has
  its own call, breaks and warm-up: :mod:`pipelines.families.z_image.omni`.
* On several GPUs: diffusers ships no context-parallel plan for it; :func:`context_parallel_plan`
  is ours (Ulysses over 2 ranks: 30 heads and a 32-token multiple). Its split hooks sit on the
  main layers, inside the repeated blocks ``compile=True`` compiles, so before every call their
  argument positions are resolved eagerly (:func:`resolve_split_hooks`): left to the first
  call, diffusers would run ``inspect.signature`` inside the compiled block, which dynamo cannot
  trace. CFG-parallel is refused: the pipeline batches both guidance branches into one call.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from accel import GenerationDefaults, Recipe, WarmupCase, fuse_swiglu_inputs

from . import omni
from .models import FAMILY

logger = logging.getLogger(__name__)

SEQ_MULTIPLE = 32  # diffusers' SEQ_MULTI_OF for Z-Image
SPLIT_LAYERS = "layers"  # where context_parallel_plan puts its split hooks (repeated blocks)
MASKS_KWARG = "bcg_caption_pad_masks"
DEFAULT_MAX_SEQUENCE_LENGTH = 512

# Pad masks of the call in flight, consumed caption by caption by the patched padding helper.
_pending_masks: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "zimage_caption_pad_masks", default=None
)


def _ceil(n: int) -> int:
    return -(-n // SEQ_MULTIPLE) * SEQ_MULTIPLE


def context_parallel_plan(module: torch.nn.Module, degree: int) -> dict[str, Any]:
    """A diffusers context-parallel plan for ZImageTransformer2DModel (which ships none).

    Only the main layers are split: the unified ``[image, caption]`` sequence (and its RoPE table
    and padding mask, passed again to every layer) along its length at the first layer, gathered
    back after the final layer. The refiners (2 + 2 of 34 layers) run whole on every rank: their
    outputs are cut per sample into the unified sequence, which needs whole sequences. The caption
    pad rows are placed before the split, so pad handling is the stock model's. Every sample's
    length is a multiple of 32, so a degree dividing 32 (and the heads) always splits evenly.
    """
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    heads = getattr(module.config, "n_heads", None)
    if SEQ_MULTIPLE % degree or (isinstance(heads, int) and heads % degree):
        fits = [
            d
            for d in range(2, SEQ_MULTIPLE + 1)
            if SEQ_MULTIPLE % d == 0 and not (isinstance(heads, int) and heads % d)
        ]
        raise ValueError(
            f"z-image: Ulysses over {degree} ranks needs a degree dividing both its {heads} attention heads and "
            f"its {SEQ_MULTIPLE}-token sequence multiple; use {' or '.join(map(str, fits)) or 'one'} processes"
        )
    plan: dict[str, Any] = {
        f"{SPLIT_LAYERS}.0": {"x": ContextParallelInput(split_dim=1, expected_dims=3)},
        f"{SPLIT_LAYERS}.*": {
            "attn_mask": ContextParallelInput(split_dim=1, expected_dims=2),
            "freqs_cis": ContextParallelInput(split_dim=1, expected_dims=3),
        },
    }
    for key in getattr(module, "all_final_layer", {}):
        plan[f"all_final_layer.{key}"] = ContextParallelOutput(gather_dim=1, expected_dims=3)
    return plan


def resolve_split_hooks(module: torch.nn.Module) -> None:
    """Resolve, eagerly, where diffusers' context-parallel split hooks on the main layers find
    their inputs among the positional arguments.

    The stock forward calls every layer positionally, so on its first call each split hook looks
    the argument names up with ``inspect.signature`` of the layer's forward (diffusers'
    ``ModuleForwardMetadata``) and caches them. The hooks run inside the layer's call, so with
    the layers compiled (``compile_repeated_blocks``) dynamo traces that lookup and fails on
    ``fullgraph=True`` ("Unexpected type in sourceless builder" on torch 2.11, "Unsupported
    hasattr call" on 2.13). Filled in here, outside any compiled region, with exactly what
    diffusers would compute, the hooks that dynamo traces hold only a dict of ints. Cheap after
    the first call (one attribute per hook); a no-op without split hooks.
    """
    from diffusers.hooks.context_parallel import ContextParallelSplitHook

    for layer in getattr(module, SPLIT_LAYERS, ()):
        registry = layer.__dict__.get("_diffusers_hook")
        if registry is None:
            continue
        for hook in registry.hooks.values():
            if not isinstance(hook, ContextParallelSplitHook):
                continue
            meta = getattr(hook, "module_forward_metadata", None)
            if meta is None or meta.cached_parameter_indices is not None or meta._cls is None:
                continue
            names = list(inspect.signature(meta._cls.forward).parameters)[1:]  # as diffusers: without self
            meta.cached_parameter_indices = {name: i for i, name in enumerate(names)}


def _register_block_for_caches() -> None:
    """Let diffusers' block caches (FirstBlockCache, MagCache) find Z-Image's hidden states.

    diffusers 0.42 registers ``ZImageTransformerBlock`` for its caches with the default argument
    name ``hidden_states``, but the block calls it ``x``: FirstBlockCache asks for
    ``hidden_states`` by name and MagCache by the registered name, and both fail on the first
    call. The registered metadata is corrected in place (hooks applied earlier hold that very
    object), which only makes those caches work; nothing else reads it.
    """
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry
        from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

        meta = TransformerBlockRegistry.get(ZImageTransformerBlock)
    except (ImportError, ValueError, AttributeError):  # another diffusers: its caches say what fails
        return
    params = list(inspect.signature(ZImageTransformerBlock.forward).parameters)[1:]
    if "x" not in params:
        return
    indices = {p: i for i, p in enumerate(params)}
    indices["hidden_states"] = indices["x"]
    meta.hidden_states_argument_name = "x"
    meta._cached_parameter_indices = indices


def fuse_swiglu(module: torch.nn.Module) -> Callable[[], None]:
    """``module``'s SwiGLU feed-forwards (diffusers' Z-Image ``FeedForward``: ``w2(silu(w1(x)) *
    w3(x))``) hand a float8 down projection of the library's their factors, which its one-pass
    quantization multiplies (:func:`accel.fuse_swiglu_inputs`; ``compile=True``; Z-Image runs
    torchao's layers unless told otherwise, where this changes nothing); the returned undo takes
    them out."""
    from diffusers.models.transformers.transformer_z_image import FeedForward

    why = "z-image: a float8 down projection quantizes silu(w1) * w3 in one pass (compile=True)"
    return fuse_swiglu_inputs(module, FeedForward, gate="w1", up="w3", down="w2", why=why)


class ZImageRecipe(Recipe):
    """Captions padded to their native multiple of 32 with a mask input; RoPE tables pinned."""

    name = "z-image"
    denoiser_classes = ("ZImageTransformer2DModel",)
    diffusers_versions = ">=0.42,<0.43"
    # quantize="fp8" keeps these in bf16 from the start (every layer in float8 gives Z-Image noise):
    # the patch, caption and timestep embedders, every block's adaLN modulation, the final layer.
    fp8_keep = ("all_x_embedder.*", "cap_embedder.*", "t_embedder.*", "*adaLN_modulation*", "all_final_layer.*")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _register_block_for_caches()

    def install(self, module: torch.nn.Module) -> Callable[[], None]:
        undo_omni = omni.install(module)
        original = getattr(module, "_pad_with_ids", None)
        if original is None or not hasattr(module, "create_coordinate_grid"):
            return undo_omni

        def pad_with_ids(feat, pos_grid_size, pos_start, device, noise_mask_val=None):  # type: ignore[no-untyped-def]
            masks = _pending_masks.get()
            is_caption = tuple(pos_start) == (1, 0, 0) and tuple(pos_grid_size[1:]) == (1, 1)
            if not masks or not is_caption or noise_mask_val is not None:
                return original(feat, pos_grid_size, pos_start, device, noise_mask_val)
            # The stock helper is called with the caption's padded length as its grid, so every
            # row, pad rows included, keeps its grid position; only which rows are pad changes.
            pad_mask = masks.pop(0)
            pos_ids = module.create_coordinate_grid(size=pos_grid_size, start=pos_start, device=device).flatten(0, 2)
            return feat, pos_ids, pad_mask, len(feat), None

        module._pad_with_ids = pad_with_ids

        def undo() -> None:
            module.__dict__.pop("_pad_with_ids", None)
            undo_omni()

        return undo

    def compiled_forms(self, module: torch.nn.Module) -> Callable[[], None]:
        # With the library's float8 layers, a down projection takes the SwiGLU into its quantization.
        return fuse_swiglu(module)

    def wrap_forward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            masks = kwargs.pop(MASKS_KWARG, None)
            token = _pending_masks.set(list(masks) if masks is not None else None)
            try:
                with omni.taking_lengths(kwargs):
                    return fn(*args, **kwargs)
            finally:
                _pending_masks.reset(token)

        return forward

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if omni.is_omni_call(args, kwargs):
            return omni.prepare(args, kwargs)
        if len(args) < 3 or kwargs.get("siglip_feats") is not None:
            return args, kwargs
        x, t, captions = args[0], args[1], args[2]
        if not (
            isinstance(captions, list)
            and captions
            and all(isinstance(c, torch.Tensor) and c.dim() == 2 for c in captions)
        ):
            return args, kwargs  # omni mode (nested lists) or something new: leave it alone
        padded, masks = [], []
        for c in captions:
            n = c.shape[0]
            total = _ceil(n)
            if total > n:
                c = torch.cat([c, c[-1:].repeat(total - n, 1)], dim=0)
            padded.append(c)
            masks.append(torch.arange(total, device=c.device) >= n)
        return (x, t, padded, *args[3:]), {**kwargs, MASKS_KWARG: masks}

    @contextlib.contextmanager
    def capture_scope(self, module: torch.nn.Module) -> Iterator[list]:
        keep: list[Any] = []
        try:
            yield keep
        finally:
            rope = getattr(module, "rope_embedder", None)
            if getattr(rope, "freqs_cis", None) is not None:
                keep.append(list(rope.freqs_cis))

    def component_breaks(self) -> dict[str, tuple[str, ...]]:
        # Qwen3's causal-mask builder asks whether the padding mask is all ones (a host sync).
        # A pure function of the mask; its bool (False for any prompt shorter than the padded
        # 512 tokens) is checked at every replay, and a call where it flips runs eagerly.
        return {"text_encoder": ("transformers.masking_utils._ignore_causal_mask_sdpa",)}

    def generation_defaults(self) -> GenerationDefaults:
        return GenerationDefaults(**FAMILY.generation)  # the family's (models.py)

    # -- several GPUs ----------------------------------------------------------------------
    def cfg_parallel_support(self, module: torch.nn.Module) -> str | None:
        # Splitting the batch would change the GEMM shapes and drop the attention mask the
        # batched call uses (captions in different 32-token buckets), so no rank would compute
        # what one GPU computes; and the pipeline gives no per-call sign of the CFG batch
        # (cfg_truncation halves it mid-loop).
        return (
            "Z-Image runs both guidance branches as one batched call, which cannot be split over two GPUs "
            "bit for bit; use parallel='ulysses'"
        )

    def context_parallel_plan(self, module: torch.nn.Module, degree: int) -> dict[str, Any]:
        return context_parallel_plan(module, degree)

    def prepare_context_parallel(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], degree: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = args[0] if args else kwargs.get("x")
        if isinstance(x, list) and x and isinstance(x[0], list):
            raise ValueError(
                "z-image: parallel='ulysses' splits text-to-image calls; omni (image-conditioned) calls are not split"
            )
        # Every caption and image is padded to a multiple of 32 inside the forward (captions by
        # prepare(), exactly as the model would): with a degree dividing 32 nothing is left to do
        # to the call. The split hooks get their argument positions here, not inside a compiled
        # layer.
        resolve_split_hooks(module)
        return args, kwargs

    # -- warm-up ---------------------------------------------------------------------------
    def default_prompt_lengths(self) -> tuple[int, ...]:
        return (32, 64, 96, 128)

    def warmup_length(self, length: int, width: int, height: int) -> int:
        return _ceil(length)

    def prompt_lengths(self, pipe: Any, prompts: list[str]) -> list[int]:
        if omni.is_omni_pipeline(pipe):  # its caption of a call without condition images
            return [omni.plain_length(pipe, p, DEFAULT_MAX_SEQUENCE_LENGTH) for p in prompts]
        lengths = []
        for p in prompts:
            text = pipe.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True
            )
            lengths.append(min(len(pipe.tokenizer(text).input_ids), DEFAULT_MAX_SEQUENCE_LENGTH))
        return lengths

    def warmup_calls(self, pipe: Any, case: WarmupCase) -> Iterator[dict[str, Any]]:
        # Random captions of the measured lengths stand for the text; embeddings the user passes
        # in call_kwargs replace them (the warm-up merges those in).
        given = case.call_kwargs
        device, dtype, g = self.embedding_setup(pipe)
        dim = pipe.transformer.config.cap_feat_dim
        embeds: Callable[[int], Any]
        if omni.is_omni_pipeline(pipe):
            # ZImageOmniPipeline: nested captions at the lengths its templates give, condition
            # images (if any) as call_kwargs pass them; see omni.py.
            images = omni.condition_image_count(given)
            longest = given.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)
            lengths = omni.warmup_plains(pipe, case.prompt_length, images, longest)

            def embeds(length: int) -> list[list[torch.Tensor]]:
                return omni.warmup_embeddings(
                    pipe,
                    batch_size=case.batch_size,
                    plain=length,
                    images=images,
                    max_length=longest,
                    dim=dim,
                    device=device,
                    dtype=dtype,
                    generator=g,
                )
        else:
            lengths = [case.prompt_length]

            def embeds(length: int) -> list[torch.Tensor]:
                return [
                    torch.randn(length, dim, generator=g, device=device, dtype=dtype) for _ in range(case.batch_size)
                ]

        for length in lengths:
            kwargs = self.warmup_call(pipe, case)
            kwargs["guidance_scale"] = 4.0 if case.cfg else 0.0
            if "prompt_embeds" not in given:
                kwargs["prompt_embeds"] = embeds(length)
            if case.cfg and "negative_prompt_embeds" not in given:
                kwargs["negative_prompt_embeds"] = embeds(case.negative_prompt_length)
            yield kwargs

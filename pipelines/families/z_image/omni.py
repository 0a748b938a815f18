"""Z-Image Omni: ``ZImageTransformer2DModel`` in its omni mode, as ``ZImageOmniPipeline`` calls it.

The Z-Image recipe (:mod:`pipelines.families.z_image.recipe`) serves both modes of the one
denoiser class; this module holds what the omni mode needs (diffusers 0.42):

* **The call.** ``x`` is one list per sample (condition latents, then the target), ``cap_feats``
  one list of caption segments per sample (one segment without condition images; with N images,
  N + 2: the text between and around the vision tokens), ``siglip_feats`` one list of SigLIP
  features per sample (the target's entry None) or None, ``image_noise_mask`` ints. Every segment
  is padded to a multiple of 32 inside the forward with a learned pad token attention sees, so
  padding further would change the image.
* **Caption lengths share graphs.** The token layout (``patchify_and_embed_omni``) places every
  segment and image by Python ints taken from the exact caption lengths: a graph captured for a
  37-token caption would serve only 37-token captions. :func:`prepare` pads each segment to its
  own multiple of 32 exactly as the model does (the last row repeated) and hands the exact
  lengths over as a tensor; the layout then runs as an eager break (keyed on its output's
  structure) that cuts the segments back to those lengths and calls diffusers' layout. Its
  output's shapes depend only on the padded lengths, so every caption in one multiple of 32
  shares the graphs behind it, and the arithmetic is the stock model's, bit for bit.
* **Pageable copies.** ``_prepare_sequence`` (with a noise mask) and ``_build_unified_sequence``
  (in omni mode) turn Python lists into device tensors with ``torch.tensor(list, device=...)``: a
  copy from pageable host memory, which a CUDA capture refuses. Both run as eager breaks there;
  the standard (text-to-image) mode never reaches them.
* **Warm-up.** The pipeline takes its text as nested lists at exact lengths, so the warm-up
  builds them: one segment per sample without condition images, N + 2 with N (``image`` in
  ``call_kwargs``), the fixed segments' lengths measured with the pipeline's tokenizer as the
  pipeline would, the prompt's from the measured length.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from accel import eager_on_graph

__all__ = [
    "LENGTHS_KWARG",
    "TokenInts",
    "condition_image_count",
    "install",
    "is_omni_call",
    "is_omni_pipeline",
    "plain_length",
    "prepare",
    "segment_lengths",
    "taking_lengths",
    "token_ints",
    "warmup_embeddings",
    "warmup_plains",
]

SEQ_MULTIPLE = 32  # diffusers' SEQ_MULTI_OF for Z-Image
LENGTHS_KWARG = "bcg_omni_caption_lengths"
# Where patchify_and_embed_omni's result (a 14-tuple in diffusers 0.42) has the captions, their
# position ids, and the per-token noise masks (lists of ints, one per sample, of x, caption, SigLIP).
_CAP_OUT, _CAP_POS = 1, 5
_NOISE_MASKS = (11, 12, 13)


class TokenInts:
    """A per-token list of ints (a noise mask) as one constant: what the token layout's break
    returns in place of the list, so a replay compares it as one value (a tuple, hashed once)
    instead of walking thousands of leaves (milliseconds of host time a step at 1024x1024, while
    the GPU waits). Only this module's wrappers read it (:func:`token_ints`)."""

    __slots__ = ("_hash", "values")

    def __init__(self, values: list[int]) -> None:
        self.values = tuple(values)
        self._hash = hash(self.values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenInts) and self._hash == other._hash and self.values == other.values

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"TokenInts({len(self.values)} ints)"


def token_ints(masks: Any) -> Any:
    """Noise masks as diffusers takes them (lists of ints), whether or not the layout's break
    wrapped them (:class:`TokenInts`)."""
    if masks is None:
        return None
    return [list(m.values) if isinstance(m, TokenInts) else m for m in masks]


# The caption templates of ZImageOmniPipeline._encode_prompt (diffusers 0.42), around the prompt.
_PLAIN = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
_FIRST = "<|im_start|>user\n<|vision_start|>"
_BETWEEN = "<|vision_end|><|vision_start|>"
_PROMPT_WITH_IMAGES = ("<|vision_end|>", "<|im_end|>\n<|im_start|>assistant\n<|vision_start|>")
_LAST = "<|vision_end|><|im_end|>"

# The exact caption lengths of the call in flight, read by the patched token layout at capture.
_pending_lengths: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "zimage_omni_caption_lengths", default=None
)


def _ceil(n: int) -> int:
    return -(-n // SEQ_MULTIPLE) * SEQ_MULTIPLE


def is_omni_pipeline(pipe: Any) -> bool:
    """Whether ``pipe`` drives its Z-Image denoiser in omni mode (``ZImageOmniPipeline``: it has
    the SigLIP parts)."""
    return "siglip_processor" in getattr(pipe, "components", {})


def is_omni_call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a denoiser call is an omni-mode one (``x`` nested: one list per sample)."""
    x = args[0] if args else kwargs.get("x")
    return isinstance(x, list) and bool(x) and isinstance(x[0], list)


def _captions(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    return args[2] if len(args) >= 3 else kwargs.get("cap_feats")


def prepare(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An omni call with every caption segment padded to its multiple of 32 (the last row repeated,
    as the model pads) and the exact lengths under :data:`LENGTHS_KWARG`; left alone where the
    captions are not lists of 2-D tensors."""
    caps = _captions(args, kwargs)
    if not (
        isinstance(caps, list)
        and caps
        and all(
            isinstance(item, list) and item and all(isinstance(c, torch.Tensor) and c.dim() == 2 for c in item)
            for item in caps
        )
    ):
        return args, kwargs
    lengths: list[int] = []
    padded = []
    for item in caps:
        row = []
        for c in item:
            n = c.shape[0]
            lengths.append(n)
            total = _ceil(n)
            row.append(torch.cat([c, c[-1:].repeat(total - n, 1)], dim=0) if total > n else c)
        padded.append(row)
    exact = torch.tensor(lengths, dtype=torch.long, device=caps[0][0].device)
    if len(args) >= 3:
        return (*args[:2], padded, *args[3:]), {**kwargs, LENGTHS_KWARG: exact}
    return args, {**kwargs, "cap_feats": padded, LENGTHS_KWARG: exact}


@contextlib.contextmanager
def taking_lengths(kwargs: dict[str, Any]) -> Iterator[None]:
    """Around the wrapped forward: the lengths :func:`prepare` added, popped from ``kwargs`` and
    kept for the token layout of this call."""
    token = _pending_lengths.set(kwargs.pop(LENGTHS_KWARG, None))
    try:
        yield
    finally:
        _pending_lengths.reset(token)


def _layout_at_exact_lengths(layout: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers' token layout, fed the captions cut back to their exact lengths: an eager break
    keyed on its output's structure (the lengths are read on the host)."""

    def at_exact_lengths(
        all_x: Any,
        all_cap_feats: Any,
        all_siglip_feats: Any,
        patch_size: int,
        f_patch_size: int,
        images_noise_mask: Any,
        lengths: torch.Tensor,
    ) -> Any:
        exact = iter(lengths.tolist())
        caps = [[c[: next(exact)] for c in item] for item in all_cap_feats]
        out = list(layout(all_x, caps, all_siglip_feats, patch_size, f_patch_size, images_noise_mask))
        # A caption segment's position ids come out longer than the segment (its padded grid, then
        # one more row per pad row), so their count would follow the exact length. The forward
        # keeps only as many rows as the sample's caption has (its RoPE table is cut to the
        # longest caption, and rows past a shorter caption's end are masked keys and discarded
        # queries): cut to that here, the rows the model reads stay the same.
        out[_CAP_POS] = [p[: len(c)] for p, c in zip(out[_CAP_POS], out[_CAP_OUT])]
        for i in _NOISE_MASKS:
            out[i] = [TokenInts(m) for m in out[i]]
        return tuple(out)

    return eager_on_graph(at_exact_lengths, name="z-image omni token layout at the exact caption lengths", keyed=True)


def install(module: torch.nn.Module) -> Callable[[], None]:
    """The omni mode's breaks on ``module`` (instance attributes over diffusers' methods); the
    undo. A no-op on a diffusers without these methods (the recipe's version range says which)."""
    names = ("patchify_and_embed_omni", "_prepare_sequence", "_build_unified_sequence")
    if not all(hasattr(module, n) for n in names):
        return lambda: None
    layout = module.patchify_and_embed_omni
    exact_layout = _layout_at_exact_lengths(layout)
    prepare_sequence = module._prepare_sequence
    prepare_sequence_eager = eager_on_graph(prepare_sequence, name="z-image omni noise mask to device")
    unified = module._build_unified_sequence
    unified_eager = eager_on_graph(unified, name="z-image omni unified noise mask to device")

    def patchify_and_embed_omni(all_x, all_cap_feats, all_siglip_feats, patch_size, f_patch_size, images_noise_mask):  # type: ignore[no-untyped-def]
        lengths = _pending_lengths.get()
        if lengths is None:  # captions at their exact lengths: the layout is capturable as it is
            return layout(all_x, all_cap_feats, all_siglip_feats, patch_size, f_patch_size, images_noise_mask)
        return exact_layout(
            all_x, all_cap_feats, all_siglip_feats, patch_size, f_patch_size, images_noise_mask, lengths
        )

    def _prepare_sequence(feats, pos_ids, inner_pad_mask, pad_token, noise_mask=None, device=None):  # type: ignore[no-untyped-def]
        fn = prepare_sequence if noise_mask is None else prepare_sequence_eager
        return fn(feats, pos_ids, inner_pad_mask, pad_token, token_ints(noise_mask), device)

    def _build_unified_sequence(*args):  # type: ignore[no-untyped-def]
        # (x, x_freqs, x_seqlens, x_noise_mask, cap, cap_freqs, cap_seqlens, cap_noise_mask,
        # siglip, siglip_freqs, siglip_seqlens, siglip_noise_mask, omni_mode, device): only the
        # omni branch copies a list to the device.
        args = list(args)
        for i in (3, 7, 11):
            args[i] = token_ints(args[i])
        return (unified_eager if args[-2] else unified)(*args)

    module.patchify_and_embed_omni = patchify_and_embed_omni
    module._prepare_sequence = _prepare_sequence
    module._build_unified_sequence = _build_unified_sequence

    def undo() -> None:
        for name in names:
            module.__dict__.pop(name, None)

    return undo


# -- warm-up ---------------------------------------------------------------------------------
def condition_image_count(call_kwargs: Mapping[str, Any]) -> int:
    """How many condition images a call with ``call_kwargs`` passes (the pipeline's own rule)."""
    image = call_kwargs.get("image")
    if image is None:
        return 0
    return len(image) if isinstance(image, list) else 1


def _tokens(pipe: Any, text: str, max_length: int) -> int:
    return min(len(pipe.tokenizer(text).input_ids), max_length)


def plain_length(pipe: Any, prompt: str, max_length: int) -> int:
    """The caption length of ``prompt`` in a call without condition images, as the pipeline
    encodes it (its attention mask's ones)."""
    return _tokens(pipe, prompt.join(_PLAIN), max_length)


def segment_lengths(pipe: Any, plain: int, images: int, max_length: int) -> list[int]:
    """The caption segments' lengths of one sample whose prompt is ``plain`` tokens long without
    condition images (:func:`plain_length`), in a call with ``images`` condition images.

    The prompt sits between special tokens in both templates, so its own tokens are the same in
    both: only the templates' tokens around it differ."""
    if images == 0:
        return [plain]
    prompt = (
        plain - _tokens(pipe, "".join(_PLAIN), max_length) + _tokens(pipe, "".join(_PROMPT_WITH_IMAGES), max_length)
    )
    first = _tokens(pipe, _FIRST, max_length)
    between = _tokens(pipe, _BETWEEN, max_length)
    last = _tokens(pipe, _LAST, max_length)
    return [first, *[between] * (images - 1), min(max(prompt, 1), max_length), last]


def warmup_plains(pipe: Any, bucket: int, images: int, max_length: int) -> list[int]:
    """Plain lengths (:func:`plain_length`) whose calls capture every graph prompts measured in
    ``bucket`` (a multiple of 32: lengths in ``(bucket - 32, bucket]``) need in calls with
    ``images`` condition images. Without images that is the bucket itself; with them the prompt's
    segment is a few tokens longer or shorter than its plain length, so the range may straddle two
    of the segment's multiples of 32: its two ends are warmed up where they do."""
    if images == 0:
        return [bucket]
    ends = [p for p in (bucket, bucket - SEQ_MULTIPLE + 1) if p >= 1]
    seen: dict[int, int] = {}
    for p in ends:
        seen.setdefault(_ceil(segment_lengths(pipe, p, images, max_length)[images]), p)
    return list(seen.values())


def warmup_embeddings(
    pipe: Any,
    *,
    batch_size: int,
    plain: int,
    images: int,
    max_length: int,
    dim: int,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> list[list[torch.Tensor]]:
    """Random caption embeddings shaped as the pipeline's for ``batch_size`` prompts of
    ``plain`` tokens (:func:`segment_lengths`)."""
    lengths = segment_lengths(pipe, plain, images, max_length)
    return [
        [torch.randn(n, dim, generator=generator, device=device, dtype=dtype) for n in lengths]
        for _ in range(batch_size)
    ]

"""Recipe for Qwen-Image denoisers (diffusers' QwenImageTransformer2DModel).

What the stock forward needs (diffusers 0.42):

* ``compute_text_seq_len_from_mask`` builds a device tensor from a Python int whenever a text
  mask is passed: a pageable host-to-device copy, illegal inside a capture, and one that waits for
  the GPU. The recipe puts in the same function with that tensor filled on the device
  (:mod:`pipelines.families.qwen_image.mask_helper`), so it captures with the rest; a helper that is not diffusers'
  own becomes an eager break.
* RoPE tables come from ``QwenEmbedRope``'s LRU caches, which graphs read by address: the ones a
  capture touches are kept alive with the graph, whatever the cache evicts later.
* Text embeddings are right-padded with zeros to a length bucket and masked, so prompts of
  different lengths share a graph. Padding is exact in real arithmetic (padded keys are masked,
  real text keeps its RoPE positions) but switches attention to its masked kernel, so padded
  calls match eager to bf16 noise rather than bit for bit. ``text_buckets=None`` turns it off.
* Padding pays only where the forward is launch-bound: the masked kernel costs a few percent of a
  step, while a prompt length without a graph runs eagerly, twice the graph's step time where
  the step is launch-bound and the graph's own speed where it is compute-bound (measured:
  docs/benchmarks.md, "Measurements behind the code"). So text is padded only up to :data:`BUCKET_MAX_IMAGE_TOKENS` image
  tokens; larger images keep their exact text length (one graph per length, bit for bit, never
  slower than eager).
* On several GPUs (``parallel=``): true CFG's two calls run under ``cache_context("cond")`` and
  ``("uncond")``, one per rank, exact; Ulysses uses diffusers' own ``_cp_plan``, with the text
  right-padded (masked) to a multiple of the number of ranks where its length does not split.
* The two calls join into one batch-2 call (``cfg_batch``) where each GPU's share of the image is
  at most :data:`BUCKET_MAX_IMAGE_TOKENS`: up to 768x768 on one GPU, up to 1024x1024 on two
  Ulysses ranks (measured faster than apart there: docs/benchmarks.md). The calls themselves,
  joined or stood in for, are :mod:`pipelines.families.qwen_image.guidance`.
* Qwen-Image Layered (``QwenImageLayeredPipeline``, the same denoiser with a layer-indexed RoPE)
  is called by image and ``resolution``, not by size: :mod:`pipelines.families.qwen_image.layered`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from accel import GenerationDefaults, Recipe, WarmupCase

from . import layered
from .forms import QWEN_MODULE, qwen_rope_in_real_arithmetic
from .fused_norms import fuse_norm_quantization
from .guidance import CFG_BRANCHES, join_calls, output_like
from .mask_helper import mask_helper_on_device
from .models import FAMILY
from .modulation import ROLE_KWARG, ModulationOnce, modulation_once

logger = logging.getLogger(__name__)

DEFAULT_TEXT_BUCKETS = (64, 128, 256, 512, 1024)
# 768x768 (48 x 48 patches): the largest measured size still launch-bound (docs/benchmarks.md).
BUCKET_MAX_IMAGE_TOKENS = 48 * 48
PATCH_PIXELS = 16  # VAE factor 8 times patch size 2
# The pipeline drops its system-prompt template (34 tokens) and truncates to this by default.
DEFAULT_MAX_SEQUENCE_LENGTH = 512
# What a warm-up call of a pipeline that must be given a prompt says (the text reaches the
# denoiser as random embeddings of the case's length).
WARMUP_PROMPT = "a photograph"
# The RoPE helpers whose cached tables a graph reads (QwenEmbedRope: the first; the Layered
# model's QwenEmbedLayer3DRope: both).
_ROPE_CACHES = ("_compute_video_freqs", "_compute_condition_freqs")


def _pad_text(kwargs: dict[str, Any], length: int) -> dict[str, Any]:
    """``kwargs`` with the text right-padded with masked zeros to ``length`` tokens (a mask of
    ones is made where the call had none)."""
    text = kwargs["encoder_hidden_states"]
    batch, have, width = text.shape
    mask = kwargs.get("encoder_hidden_states_mask")
    if mask is None:
        mask = torch.ones(batch, have, dtype=torch.long, device=text.device)
    if length > have:
        text = torch.cat([text, text.new_zeros(batch, length - have, width)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(batch, length - have)], dim=1)
    return {**kwargs, "encoder_hidden_states": text, "encoder_hidden_states_mask": mask}


class QwenImageRecipe(Recipe):
    """Eager break at the text-mask helper, RoPE caches pinned, text padded to buckets."""

    name = "qwen-image"
    denoiser_classes = ("QwenImageTransformer2DModel",)
    diffusers_versions = ">=0.42,<0.43"
    # quantize="fp8" keeps these in bf16 from the start, as the peers' float8 presets do: the image
    # and text inputs, the timestep embedder, the output norm and projection, and the text
    # stream's projections: they run on a few dozen text tokens, where float8 saves nothing (and
    # on an H200 cuBLASLt once refused the per-row float8 product of the 12288-wide one). The
    # blocks' modulation (one row each, bound by its weight's bytes, which float8 halves) is left
    # to the measured budget.
    fp8_keep = (
        "img_in",
        "txt_in",
        "time_text_embed.*",
        "norm_out.linear",
        "proj_out",
        "*.txt_mlp.*",
        "*.attn.add_q_proj",
        "*.attn.add_k_proj",
        "*.attn.add_v_proj",
        "*.attn.to_add_out",
    )

    # The library's own float8 layers: their one-pass quantization (with the feed-forward's GELU
    # inside it) measured faster than torchao's here. Z-Image keeps torchao's: there inductor fuses
    # the quantization into the SiLU-gated product and the RMS norm (both: docs/benchmarks.md).
    fp8_layers = "scaled-mm"
    # Off until its gain in a full step is measured: with compile=True and the library's float8
    # layers, the second modulated LayerNorm writing its feed-forward's float8 input in one Triton
    # pass (fused_norms.py). Its kernel failed its tolerance on an H100 once (the modulation's
    # product and shift contracted into one rounding); launched without contraction, it passes
    # tests/cuda/test_fused_quant.py there (samples/gpu-run-2026-12-06f/). Set it on the class
    # (``QwenImageRecipe.fused_norm_fp8 = True``) before accelerate_pipeline to try it.
    fused_norm_fp8 = False

    pads_text = True
    # The processors build the joint attention mask from it (QwenDoubleStreamAttnProcessor2_0).
    pad_mask_kwarg = "encoder_hidden_states_mask"

    def __init__(self, text_buckets: tuple[int, ...] | None = DEFAULT_TEXT_BUCKETS) -> None:
        if text_buckets is not None and any(b < 1 for b in text_buckets):
            raise ValueError(f"text buckets must be positive, got {text_buckets}")
        self.buckets: tuple[int, ...] = tuple(sorted(set(text_buckets or ())))
        self._too_long_said = False
        self._per_sample_shapes = False
        self._layered = False
        self.modulation: ModulationOnce | None = None

    def install(self, module: torch.nn.Module) -> Callable[[], None]:
        self._per_sample_shapes = bool(getattr(module.config, "zero_cond_t", False))
        self._layered = layered.is_layered(module)
        undo: list[Callable[[], None]] = []
        # Both guidance calls of a step read one computation of the blocks' modulation (modulation.py).
        self.modulation = modulation_once(module)
        if self.modulation is not None:
            undo.append(self.modulation.install())
        modname = type(module).__module__
        if hasattr(sys.modules.get(modname), "compute_text_seq_len_from_mask"):
            undo.append(mask_helper_on_device(modname))

        def uninstall() -> None:
            for u in reversed(undo):
                u()
            self.modulation = None

        return uninstall

    def wrap_forward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.modulation.wrap(fn) if self.modulation is not None else fn

    def route_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        role = self.modulation.role(kwargs) if self.modulation is not None and not args else None
        return (args, {**kwargs, ROLE_KWARG: role}) if role is not None else (args, kwargs)

    def compiled_forms(self, module: torch.nn.Module) -> Callable[[], None]:
        # The complex rotary product is an ATen kernel inductor cannot fuse (pipelines/families/qwen_image/forms.py);
        # opted in (fused_norm_fp8), the second modulated LayerNorm writes the feed-forward's float8 input itself.
        if type(module).__module__ != QWEN_MODULE:
            return lambda: None
        undo = [qwen_rope_in_real_arithmetic()]
        if self.fused_norm_fp8:
            undo.append(fuse_norm_quantization(module))
        return lambda: [u() for u in reversed(undo)] and None

    def inexact(self) -> tuple[str, str] | None:
        if not self.buckets or self.padding_refused is not None or self._layered:
            return None
        side = math.isqrt(BUCKET_MAX_IMAGE_TOKENS) * PATCH_PIXELS
        return (
            f"up to {side}x{side} the text is padded to buckets: attention runs its masked kernel (and, with "
            "cfg_batch, the guidance branches one call of batch 2), within bf16 noise of the stock pipeline's image",
            "text_buckets=None",
        )

    def bucket(self, length: int) -> int | None:
        """The bucket a text of ``length`` tokens is padded to (None: longer than all)."""
        return next((b for b in self.buckets if b >= length), None)

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        shapes = kwargs.get("img_shapes")
        if (
            not self._per_sample_shapes
            and isinstance(shapes, list)
            and len(shapes) > 1
            and shapes.count(shapes[0]) == len(shapes)
        ):
            # RoPE reads only the first entry; the pipeline sizes the list by prompts, not
            # images, so N prompts and one prompt times N images would otherwise not share.
            kwargs = {**kwargs, "img_shapes": shapes[:1]}
        text = kwargs.get("encoder_hidden_states")
        if not self.buckets or self._layered or args or not isinstance(text, torch.Tensor) or text.dim() != 3:
            return args, kwargs  # the Layered model's calls are far past where padding pays: exact
        image = kwargs.get("hidden_states")
        if isinstance(image, torch.Tensor) and image.dim() == 3 and image.shape[1] > BUCKET_MAX_IMAGE_TOKENS:
            return args, kwargs  # compute-bound: the masked kernel would cost more than it saves
        length = text.shape[1]
        bucket = self.bucket(length)
        if bucket is None:
            if not self._too_long_said:
                self._too_long_said = True
                logger.info(
                    "qwen-image: a %d-token text is longer than the largest bucket %d; not padded",
                    length,
                    self.buckets[-1],
                )
            return args, kwargs
        return args, _pad_text(kwargs, bucket)

    @contextlib.contextmanager
    def capture_scope(self, module: torch.nn.Module) -> Iterator[list]:
        keep: list[Any] = []
        rope = getattr(module, "pos_embed", None)
        cached = {name: getattr(rope, name) for name in _ROPE_CACHES if getattr(rope, name, None) is not None}
        if not cached:
            yield keep
            return

        def recording(fn: Callable[..., Any]) -> Callable[..., Any]:
            def record(*a: Any, **k: Any) -> Any:
                out = fn(*a, **k)
                keep.append(out)
                return out

            return record

        for name, fn in cached.items():
            setattr(rope, name, recording(fn))
        try:
            yield keep
        finally:
            for name in cached:
                rope.__dict__.pop(name, None)
            device_freqs = getattr(rope, "_get_device_freqs", None)
            if device_freqs is not None:
                for p in module.parameters():
                    keep.append(device_freqs(p.device))
                    break

    def component_breaks(self) -> dict[str, tuple[str, ...]]:
        # Qwen2.5-VL's causal-mask builder asks whether the padding mask is all ones (a host
        # sync) to choose between SDPA's is_causal and an explicit mask. It is a pure function
        # of the mask; its bool is checked at every replay (copy-back of constants).
        return {"text_encoder": ("transformers.masking_utils._ignore_causal_mask_sdpa",)}

    def generation_defaults(self) -> GenerationDefaults:
        return GenerationDefaults(**FAMILY.generation)  # the family's (models.py)

    # -- several GPUs ----------------------------------------------------------------------
    def cfg_parallel_support(self, module: torch.nn.Module) -> str | None:
        # The pipeline runs true CFG as two calls, under cache_context("cond") and ("uncond"),
        # and combines them only after the second: each can run whole on its own rank.
        return None

    def cfg_branch(self, context: str | None) -> int | None:
        return CFG_BRANCHES.get(context) if context is not None else None

    def cfg_output_like(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return output_like(module, args, kwargs)

    def batch_cfg(
        self, module: torch.nn.Module, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], *, degree: int = 1
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        # Only where each rank's share of the image is launch-bound (one GPU: where text is padded
        # anyway, within bf16 noise of eager already; Ulysses: where it is split, never bit for
        # bit). Both texts go to the larger of their two buckets, exact in real arithmetic.
        if len(calls) != 2 or not self.buckets or self._per_sample_shapes or self._layered or any(a for a, _ in calls):
            return None
        (_, first), (_, second) = calls
        if set(first) != set(second):
            return None
        buckets = []
        for kwargs in (first, second):
            text, image = kwargs.get("encoder_hidden_states"), kwargs.get("hidden_states")
            if not (isinstance(text, torch.Tensor) and text.dim() == 3 and isinstance(image, torch.Tensor)):
                return None
            bucket = self.bucket(text.shape[1])
            if image.dim() != 3 or image.shape[1] > BUCKET_MAX_IMAGE_TOKENS * degree or bucket is None:
                return None  # one GPU keeps exact text lengths here: output promised bit for bit
            buckets.append(bucket)
        first, second = (_pad_text(k, max(buckets)) for k in (first, second))
        joined = join_calls(first, second)  # guidance.py
        return ((), joined) if joined is not None else None

    def prepare_context_parallel(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], degree: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        image = kwargs.get("hidden_states")
        if isinstance(image, torch.Tensor) and image.dim() == 3 and image.shape[1] % degree:
            raise ValueError(
                f"qwen-image: {image.shape[1]} image tokens do not split over {degree} Ulysses ranks; use a "
                f"resolution whose (width/16) x (height/16) is a multiple of {degree}"
            )
        text = kwargs.get("encoder_hidden_states")
        if args or not isinstance(text, torch.Tensor) or text.dim() != 3 or text.shape[1] % degree == 0:
            return args, kwargs
        # The text is split along its length too: right-pad it with masked zeros to a multiple of
        # the degree (exact in real arithmetic, as the buckets are).
        length = text.shape[1]
        if self.padding_refused is not None:
            raise ValueError(
                f"qwen-image: a {length}-token text does not split over {degree} Ulysses ranks and cannot be "
                f"padded: {self.padding_refused}"
            )
        return args, _pad_text(kwargs, length + -length % degree)

    # -- warm-up ---------------------------------------------------------------------------
    def default_prompt_lengths(self) -> tuple[int, ...]:
        return tuple(b for b in self.buckets if b <= 128)

    def warmup_length(self, length: int, width: int, height: int) -> int:
        if self._layered:  # several frames at 640 or 1024: never padded (see layered.py)
            return length
        if (width // PATCH_PIXELS) * (height // PATCH_PIXELS) > BUCKET_MAX_IMAGE_TOKENS:
            return length
        return self.bucket(length) or length

    def check_warmup(self, pipe: Any, *, cfg: tuple[bool, ...], call_kwargs: Mapping[str, Any]) -> None:
        if layered.is_layered_pipeline(pipe):
            layered.check_warmup(pipe, call_kwargs)

    def prompt_lengths(self, pipe: Any, prompts: list[str]) -> list[int]:
        if getattr(pipe, "tokenizer", None) is None:  # built without text encoders: embeddings are given
            raise NotImplementedError("the pipeline has no tokenizer to measure prompts with")
        template = pipe.prompt_template_encode
        drop = pipe.prompt_template_encode_start_idx
        ids = pipe.tokenizer([template.format(p) for p in prompts]).input_ids
        return [max(1, min(len(i) - drop, DEFAULT_MAX_SEQUENCE_LENGTH)) for i in ids]

    def warmup_calls(self, pipe: Any, case: WarmupCase) -> Iterator[dict[str, Any]]:
        # Random embeddings of the measured lengths stand for the text; embeddings the user
        # passes in call_kwargs replace them (the warm-up merges those in).
        given, batch = case.call_kwargs, case.batch_size
        device, dtype, g = self.embedding_setup(pipe)
        dim = pipe.transformer.config.joint_attention_dim

        def embeds(length: int) -> tuple[torch.Tensor, torch.Tensor]:
            e = torch.randn(batch, length, dim, generator=g, device=device, dtype=dtype)
            return e, torch.ones(batch, length, dtype=torch.long, device=device)

        kwargs: dict[str, Any]
        if layered.is_layered_pipeline(pipe):
            # Called by image and resolution, with a prompt, decoded: see layered.py.
            kwargs = dict(num_inference_steps=case.num_inference_steps)
            kwargs.update(
                layered.warmup_call(
                    pipe,
                    width=case.width,
                    height=case.height,
                    batch_size=batch,
                    prompt=WARMUP_PROMPT,
                    call_kwargs=given,
                )
            )
        else:
            kwargs = self.warmup_call(pipe, case)  # with an edit pipeline's image (it cannot run without one)
        if "prompt_embeds" not in given:
            kwargs["prompt_embeds"], kwargs["prompt_embeds_mask"] = embeds(case.prompt_length)
        if case.cfg:
            if "negative_prompt_embeds" not in given:
                negative = embeds(case.negative_prompt_length)
                kwargs["negative_prompt_embeds"], kwargs["negative_prompt_embeds_mask"] = negative
            kwargs["true_cfg_scale"] = 4.0
        else:
            kwargs["true_cfg_scale"] = 1.0
        yield kwargs

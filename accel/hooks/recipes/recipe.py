"""Recipes: what one family of denoisers needs to be captured, looked up by the denoiser's class.

A recipe says which functions must run as eager breaks, how to normalise a call so that more
calls share a graph (text padding), which caches a graph reads by address and must stay alive,
and how to drive the pipeline during warm-up so that exactly the signatures real calls will hit
get captured; for one image on several GPUs, which denoiser calls are guidance branches and how
the model's sequence splits over Ulysses ranks. Model-specific recipes live in the ``pipelines``
package and are found through the ``bcg_diffusers.recipes`` entry-point group (or
:func:`~accel.hooks.recipes.registry.register_recipe`); this module holds only the interface. The
recipe for denoisers nobody wrote one for is :mod:`accel.hooks.recipes.generic`; the registry that
finds a denoiser's recipe is :mod:`accel.hooks.recipes.registry`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

from ...graphs.errors import BCGError
from ..call_shape import read_call_shape, warmup_image

__all__ = [
    "DEFAULT_WARMUP_PROMPT",
    "WARMUP_ARGUMENTS",
    "GenerationDefaults",
    "Recipe",
    "RecipeError",
    "WarmupCase",
    "check_heads_divisible",
]

# What a warm-up call says where no prompt was named (its text, not its length, reaches the pipeline).
DEFAULT_WARMUP_PROMPT = "a photograph"
# Pipeline arguments the warm-up sets itself, from its own parameters (resolutions, num_frames,
# num_inference_steps, prompts, negative_prompt, batch_sizes, cfg): not taken from call_kwargs.
WARMUP_ARGUMENTS = frozenset(
    {
        "width",
        "height",
        "num_frames",
        "num_inference_steps",
        "generator",
        "output_type",
        "prompt",
        "negative_prompt",
        "num_images_per_prompt",
        "num_videos_per_prompt",
        "guidance_scale",
        "true_cfg_scale",
    }
)


class RecipeError(BCGError):
    """What a recipe said of its model does not match what the model did (say the structure of
    an output it described for a guidance branch)."""


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """How a model family is usually run, as its recipe states it for front ends (the CLI, the benchmark).

    Attributes:
        steps: denoising steps.
        guidance: the guidance scale (None: leave the pipeline's own default).
        guidance_kwarg: the pipeline argument that takes it (``"guidance_scale"``,
            ``"true_cfg_scale"``) or None when the pipeline takes none.
        cfg_above: classifier-free guidance runs when the guidance is above this.
        default_negative: the negative prompt used when guidance is on and none is given (true
            CFG needs one to run at all), or None.
    """

    steps: int = 30
    guidance: float | None = None
    guidance_kwarg: str | None = None
    cfg_above: float = 1.0
    default_negative: str | None = None


@dataclasses.dataclass(frozen=True)
class WarmupCase:
    """One warm-up case: the pipeline calls of one size, frame count, batch size, guidance setting
    and text (:meth:`Recipe.warmup_calls` makes them), with what every case of a warm-up shares.

    Attributes:
        width, height: the calls' size in pixels.
        batch_size: images per call.
        cfg: whether guidance runs.
        text: the prompt's length in tokens or, for a recipe that cannot measure prompts
            (:meth:`Recipe.prompt_lengths` raises NotImplementedError), a prompt warmed up as given
            (:attr:`prompt_length`, :attr:`prompt`).
        num_inference_steps: steps of each call.
        num_frames: frames of a video pipeline's calls (None for images).
        negative_prompt_length: the negative prompt's length (None where the recipe cannot measure it).
        negative_prompt: the negative prompt real calls use, if the user named one.
        call_kwargs: the user's extra arguments; the warm-up passes them with every call, merged
            over what the recipe yields, so a recipe yields nothing they replace.
    """

    width: int
    height: int
    batch_size: int
    cfg: bool
    text: int | str
    num_inference_steps: int
    num_frames: int | None = None
    negative_prompt_length: int | None = None
    negative_prompt: str | None = None
    call_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def prompt_length(self) -> int | None:
        """The text length in tokens (None where the case warms up a prompt as given)."""
        return self.text if isinstance(self.text, int) else None

    @property
    def prompt(self) -> str | None:
        """The prompt warmed up as given (None where the case is a text length)."""
        return self.text if isinstance(self.text, str) else None

    @property
    def size(self) -> tuple[int, int, int | None]:
        """What a report row is per: (width, height, frames)."""
        return self.width, self.height, self.num_frames


class Recipe:
    """What the library knows of one family of denoisers, behind one interface: subclass it and
    override what the model needs; every method has a default.

    A new model's recipe must set :attr:`name`, :attr:`denoiser_classes` and
    :attr:`diffusers_versions`, and return its family's :meth:`generation_defaults`. With that
    alone the whole forward is captured and the warm-up makes the calls the pipeline's signature
    says real calls make (as :class:`~accel.hooks.recipes.generic.GenericRecipe` does). The rest is
    overridden by concern, where the model needs it:

    ============  ==================================================  ===============================
    concern       methods and attributes                              override where
    ============  ==================================================  ===============================
    install       :meth:`install`, :meth:`component_breaks`,          a function cannot be captured;
                  :meth:`compiled_forms`, :meth:`wrap_forward`,       ``compile=True`` has a faster
                  :attr:`fp8_keep`, :attr:`fp8_layers`                form; float8 needs bf16 layers
    per call      :meth:`prepare`, :meth:`route_call`,                text padded to buckets; a call
                  :meth:`inexact`, :meth:`capture_scope`,             picked by more than its inputs;
                  :attr:`pads_text`, :attr:`pad_mask_kwarg`,          caches a graph reads by address;
                  :attr:`state_types`                                 state a call makes per request
    several GPUs  :meth:`cfg_parallel_support`, :meth:`cfg_branch`,   ``parallel="cfg"`` and
                  :meth:`cfg_output_like`, :meth:`batch_cfg`,         ``"ulysses"``; joined guidance
                  :meth:`context_parallel_plan`,                      branches
                  :meth:`prepare_context_parallel`
    warm-up       :meth:`warmup_calls` (one :class:`WarmupCase`),     the pipeline's call needs more
                  :meth:`warmup_call`, :meth:`prompt_lengths`,        than a prompt (embeddings of
                  :meth:`default_prompt_lengths`,                     measured lengths, an image);
                  :meth:`warmup_length`, :meth:`warmup_cfg`,          guidance on and off make the
                  :meth:`check_warmup`, :meth:`embedding_setup`       same calls
    ============  ==================================================  ===============================

    Attributes:
        name: short name used in logs and reports.
        denoiser_classes: class names (matched along the MRO) this recipe serves.
        diffusers_versions: the diffusers range (PEP 440 specifier) the recipe was tested with;
            outside it the denoiser runs eagerly with a warning.
        pads_text: the recipe takes a ``text_buckets`` argument (``None`` for no padding).
        pad_mask_kwarg: the keyword of the mask the recipe's padding hands the model's attention
            (None: it pads nothing attention must ignore). Padding runs only while every
            attention processor in the module names it and every attention backend in use
            applies a mask (:mod:`accel.hooks.recipes.padding_gate`).
        padding_refused: set by the graph hook: why padding must not run now (a processor does
            not take ``pad_mask_kwarg``, a backend refuses masks), or None. While it is set :meth:`prepare` and
            :meth:`batch_cfg` are not called, and :meth:`prepare_context_parallel` must not pad.
        fp8_keep: ``quantize="fp8"``: fnmatch patterns of the Linear layers and attention
            modules (qualified names in the denoiser) kept in bf16 before anything is measured:
            those its float8 images are known to need in bf16, or that are measured slower in
            float8 (:mod:`accel.hooks.fp8.layer_select`).
        fp8_layers: ``quantize="fp8"``: the kind of float8 layer the model measured fastest with,
            a key of :data:`accel.hooks.fp8.layer_kinds.FP8_LAYERS` (``"scaled-mm"``: the library's
            own layers, whose activations are quantized in one pass); None: torchao's.
        state_types: the classes of the request-scoped state the denoiser is called with (a K/V
            cache its pipeline makes per call: Qwen-Image 2.1's ``QwenImage21KVCache``, FLUX.2
            klein KV's ``Flux2KVCache``). Its objects, and the plain objects they hold (the
            per-layer caches), are matched by structure, not identity, and what a call stores
            into them is put back by every replay (:mod:`accel.graphs.stores`).
    """

    name: ClassVar[str] = "generic"
    denoiser_classes: ClassVar[tuple[str, ...]] = ()
    diffusers_versions: ClassVar[str] = ""
    # Whether the recipe pads text to buckets: only then is it built with ``text_buckets=``.
    pads_text: ClassVar[bool] = False
    pad_mask_kwarg: ClassVar[str | None] = None
    padding_refused: str | None = None
    fp8_keep: ClassVar[tuple[str, ...]] = ()
    fp8_layers: ClassVar[str | None] = None
    state_types: ClassVar[tuple[type, ...]] = ()

    # -- what every model states ------------------------------------------------------------
    def generation_defaults(self) -> GenerationDefaults | None:
        """How the model is usually run, for front ends; None where the recipe does not know."""
        return None

    # -- install -----------------------------------------------------------------------------
    def install(self, module: torch.nn.Module) -> Callable[[], None]:
        """Mark this module's uncapturable functions as eager breaks; return the undo."""
        return lambda: None

    def component_breaks(self) -> dict[str, tuple[str, ...]]:
        """Functions the pipeline's other components must run as eager breaks, by component
        name (``"text_encoder"``, ``"vae.decoder"``): ``module.qualname`` of pure functions
        known to break their captures (found with ``auto_breaks``, pinned here once verified)."""
        return {}

    def compiled_forms(self, module: torch.nn.Module) -> Callable[[], None]:
        """With ``compile=True`` only, before the blocks compile: swap in forms of the model's
        functions that compile to fewer kernels (equal in real arithmetic, not promised bit for
        bit to eager: compiled graphs are held to the same compiled model without graphs);
        return the undo."""
        return lambda: None

    def wrap_forward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap the module's original forward (e.g. to accept what :meth:`prepare` adds)."""
        return fn

    # -- per call ----------------------------------------------------------------------------
    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Normalise a call before it reaches the runner (e.g. pad text to a bucket); called only
        where graphs run, and not while :attr:`padding_refused` is set."""
        return args, kwargs

    def route_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Add to a call what picks its graph beyond its inputs: a constant keyword that
        :meth:`wrap_forward` takes out again (Qwen-Image's modulation role). Called at every call
        where graphs run, after :meth:`prepare`, whether the call was padded or not."""
        return args, kwargs

    def inexact(self) -> tuple[str, str] | None:
        """Where this recipe's calls are not the stock pipeline's bit for bit: what differs (a
        phrase for ``report()``) and the options that give the stock image; None where they are."""
        return None

    def capture_scope(self, module: torch.nn.Module) -> AbstractContextManager[list]:
        """Entered around warm-up and capture; objects put in the yielded list stay alive
        as long as the graph does (caches the graph reads by address)."""
        return contextlib.nullcontext([])

    # -- several GPUs (accelerate_pipeline(parallel=...), accel/parallel) --------------------
    def cfg_parallel_support(self, module: torch.nn.Module) -> str | None:
        """None where the model's pipelines run the two guidance branches as separate denoiser
        calls that :meth:`cfg_branch` tells apart (so each can run on its own GPU, bit for bit);
        otherwise why not, in one line."""
        return f"no recipe says how pipelines call {type(module).__name__} for guidance"

    def cfg_branch(self, context: str | None) -> int | None:
        """The guidance branch (0 or 1) a denoiser call computes, from the name of the diffusers
        ``cache_context`` it runs under (None outside one); None for a call that is not one
        branch of a pair (every rank computes it)."""
        return None

    def cfg_output_like(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What this call returns, uncomputed (``torch.empty``), with its exact structure, shapes
        and dtypes: the rank that does not compute the branch returns it, and the exchange at the
        end of the pair fills it in place."""
        raise NotImplementedError(f"the {self.name} recipe cannot describe its model's output for parallel='cfg'")

    def batch_cfg(
        self, module: torch.nn.Module, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], *, degree: int = 1
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The two guidance branches' calls ``[(args, kwargs), ...]`` joined into one call whose
        output is theirs stacked along the batch dimension (accel/hooks/cfg_batch.py); None to run
        them one after the other. ``degree`` is the number of Ulysses ranks the joined call's
        sequence will be split over (1 on one GPU): each rank computes ``1/degree`` of it. Join
        only calls already normalised to within bf16 noise of eager: a batch changes which
        kernels run, so never where output is promised bit for bit."""
        return None

    def context_parallel_plan(self, module: torch.nn.Module, degree: int) -> dict[str, Any]:
        """diffusers' context-parallel plan (``_cp_plan``) for Ulysses over ``degree`` ranks;
        ValueError, in one line, where the model cannot be split so."""
        plan = getattr(module, "_cp_plan", None)
        if plan is None:
            raise ValueError(
                f"{type(module).__name__} has no context-parallel plan (_cp_plan) and the {self.name} recipe gives "
                "none, so parallel='ulysses' cannot split it"
            )
        check_heads_divisible(module, degree)
        return plan

    def prepare_context_parallel(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], degree: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Make a call splittable over ``degree`` ranks (sequence lengths divisible by it), on
        every device; ValueError, in one line, where it cannot be."""
        return args, kwargs

    # -- warm-up -----------------------------------------------------------------------------
    def default_prompt_lengths(self) -> tuple[int, ...]:
        """Text lengths to capture when the user names neither prompts nor lengths."""
        return (64,)

    def prompt_lengths(self, pipe: Any, prompts: list[str]) -> list[int]:
        """Encoded lengths of real prompts, as the denoiser will see them."""
        raise NotImplementedError(f"the {self.name} recipe cannot measure prompt lengths; pass prompt_lengths")

    def warmup_length(self, length: int, width: int, height: int) -> int:
        """The text length a call of ``length`` tokens at ``width`` x ``height`` reaches the
        runner with."""
        return length

    @staticmethod
    def embedding_setup(pipe: Any) -> tuple[torch.device, torch.dtype, torch.Generator]:
        """Device, dtype and a seeded generator for random text embeddings that look like the
        pipeline's own (its text encoder's dtype, on its execution device)."""
        device = pipe._execution_device
        encoder = getattr(pipe, "text_encoder", None)
        dtype = encoder.dtype if encoder is not None else pipe.transformer.dtype
        return device, dtype, torch.Generator(device).manual_seed(0)

    def warmup_cfg(self, pipe: Any, cfg: tuple[bool, ...]) -> tuple[bool, ...]:
        """The guidance settings that need warm-up cases of their own, of those asked for
        (``cfg``, True first): fewer where guidance on and off make the same calls."""
        return cfg

    def check_warmup(self, pipe: Any, *, cfg: tuple[bool, ...], call_kwargs: Mapping[str, Any]) -> None:
        """ValueError, in one line, where this recipe cannot warm ``pipe`` up with these guidance
        settings and extra arguments; checked before anything runs."""

    def warmup_call(self, pipe: Any, case: WarmupCase) -> dict[str, Any]:
        """What every warm-up call of ``case`` passes besides text and guidance: its size and
        steps, latents out (nothing is decoded), the case's ``num_frames`` for a video pipeline,
        and a random image of the case's size as ``image`` where the pipeline needs one and
        ``call_kwargs`` gives none (see :mod:`accel.hooks.call_shape`)."""
        out: dict[str, Any] = dict(
            height=case.height, width=case.width, num_inference_steps=case.num_inference_steps, output_type="latent"
        )
        if case.num_frames is not None:
            out["num_frames"] = case.num_frames
        if "image" not in case.call_kwargs and read_call_shape(pipe).needs_image:
            out["image"] = warmup_image(case.width, case.height)
        return out

    def warmup_calls(self, pipe: Any, case: WarmupCase) -> Iterator[dict[str, Any]]:
        """The pipeline's keyword arguments for each call that hits the signatures of ``case``
        (``case.call_kwargs`` are merged over each by the warm-up)."""
        yield dict(prompt=[case.prompt or DEFAULT_WARMUP_PROMPT] * case.batch_size, **self.warmup_call(pipe, case))


def check_heads_divisible(module: torch.nn.Module, degree: int) -> None:
    """ValueError unless the model's attention heads split evenly over ``degree`` Ulysses ranks."""
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", None)
    if isinstance(heads, int) and heads % degree:
        raise ValueError(
            f"{type(module).__name__} has {heads} attention heads, which do not split over {degree} Ulysses ranks; "
            f"use a number of processes that divides {heads}"
        )

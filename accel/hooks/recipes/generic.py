"""The recipe of denoisers nobody wrote one for: the whole forward captured, the warm-up read off the pipeline.

:func:`~accel.hooks.recipes.registry.recipe_for` gives it to a denoiser no registered recipe serves,
and every component (text encoders, the VAE decoder) gets it. Its warm-up makes the calls that the
pipeline's own ``__call__`` signature and components say real calls make
(:mod:`accel.hooks.call_shape`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..call_shape import CFG, TRUE_CFG, call_parameters, read_call_shape
from .recipe import DEFAULT_WARMUP_PROMPT, WARMUP_ARGUMENTS, Recipe, WarmupCase

__all__ = ["GenericRecipe"]


class GenericRecipe(Recipe):
    """For any denoiser without a recipe: capture the whole forward, no breaks, no padding.

    A forward that cannot be captured whole fails its capture and runs eagerly, with the reason
    in the report. The warm-up makes the calls the pipeline's own signature and components say
    real calls make (:mod:`accel.hooks.call_shape`): its guidance style on and off, its frame
    count, an image where it needs one, and prompts as given (or the embeddings in
    ``call_kwargs``, for a pipeline without text encoders).
    """

    name = "generic"

    def warmup_cfg(self, pipe: Any, cfg: tuple[bool, ...]) -> tuple[bool, ...]:
        return cfg if read_call_shape(pipe).cfg_changes_calls else cfg[:1]

    def check_warmup(self, pipe: Any, *, cfg: tuple[bool, ...], call_kwargs: Mapping[str, Any]) -> None:
        shape = read_call_shape(pipe)
        made = WARMUP_ARGUMENTS | ({"image"} if shape.needs_image else set())
        missing = [p for p in shape.required_params if p not in call_kwargs and p not in made]
        if missing:
            raise ValueError(
                f"{shape.pipeline}'s call needs {', '.join(missing)}, which the warm-up cannot make: "
                f"pass them in call_kwargs"
            )
        if not shape.takes_prompt or shape.has_text_encoders:
            return
        if not shape.gives_text(call_kwargs):
            guided = True in cfg and shape.cfg_changes_calls
            wanted = [p for p in shape.embedding_params if guided or not p.startswith("negative_")]
            raise ValueError(
                f"{shape.pipeline} has no text encoder, so the warm-up cannot encode prompts: pass "
                f"call_kwargs=dict({', '.join(f'{p}=...' for p in wanted)})"
            )
        if True in cfg and shape.cfg_changes_calls and not shape.gives_negative(call_kwargs):
            raise ValueError(
                f"{shape.pipeline} has no text encoder and cfg=True runs a negative prompt: add "
                f"{', '.join(f'{p}=...' for p in shape.negative_embedding_params)} to call_kwargs (or pass cfg=False)"
            )

    def warmup_calls(self, pipe: Any, case: WarmupCase) -> Iterator[dict[str, Any]]:
        given, batch_size = case.call_kwargs, case.batch_size
        shape = read_call_shape(pipe)
        kwargs = self.warmup_call(pipe, case)
        embedded = shape.gives_text(given)
        if embedded and shape.batch_param is not None:
            kwargs[shape.batch_param] = batch_size  # one prompt's embeddings, repeated per image
        elif not embedded and shape.takes_prompt:
            kwargs["prompt"] = [case.prompt or DEFAULT_WARMUP_PROMPT] * batch_size

        def per_image(text: str) -> str | list[str]:
            # A negative prompt goes as the prompt does: one per image beside a list of prompts.
            return [text] * batch_size if "prompt" in kwargs else text

        if shape.guidance in (TRUE_CFG, CFG):
            kwargs["true_cfg_scale" if shape.guidance == TRUE_CFG else "guidance_scale"] = (
                shape.cfg_on if case.cfg else shape.cfg_off
            )
        if shape.takes_negative_prompt and shape.gives_negative(given):
            # Negative embeddings given: some pipelines (Sana, PixArt) default negative_prompt to
            # "" and refuse both, so it is passed as None, as their callers must.
            if call_parameters(pipe)["negative_prompt"].default is not None:
                kwargs["negative_prompt"] = None
        elif case.cfg and shape.takes_negative_prompt:
            if shape.guidance == TRUE_CFG:
                # True CFG runs only with a negative prompt: " ", as real calls that name none pass.
                negative = case.negative_prompt
                kwargs["negative_prompt"] = per_image(negative if negative is not None else " ")
            elif shape.guidance == CFG and case.negative_prompt is not None:
                # Without one the pipeline encodes its own default (""), as real calls naming none do.
                kwargs["negative_prompt"] = per_image(case.negative_prompt)
        yield kwargs

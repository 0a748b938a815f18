"""The parts of a pipeline swapped in before it is accelerated, each from its flag: a scheduler
(``--scheduler``), a single-file denoiser (``--transformer``) and LoRA adapters (``--lora``). Bad
input is an :class:`InputError`, a failure a :class:`RunError`, each one line."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..lora import LoraError, LoraSpec, load_loras
from .constants import LORA_SCALE_WARNING
from .errors import InputError, RunError, one_line

logger = logging.getLogger(__name__)


def _compatible_schedulers(scheduler: Any) -> set[str]:
    """The scheduler classes ``scheduler``'s config suits: those it lists (``compatibles``), and a
    flow-matching scheduler's fellow flow-matching ones, which its list leaves out (diffusers lists
    only FlowMatchEulerDiscreteScheduler for itself)."""
    import diffusers

    own = type(scheduler).__name__
    names = {c.__name__ for c in getattr(scheduler, "compatibles", ())} | {own}
    if own.startswith("FlowMatch"):
        names |= {n for n in dir(diffusers) if n.startswith("FlowMatch") and n.endswith("Scheduler")}
    return names


def set_scheduler(pipe: Any, name: str) -> None:
    """``pipe``'s scheduler replaced by the diffusers class ``name``, made from its config; InputError
    naming the compatible ones where it is not one (:func:`_compatible_schedulers`). A compatible
    class whose steps this pipeline cannot call (FlowMatchHeun lacks Z-Image's ``mu``) fails the
    first call in one line."""
    scheduler = getattr(pipe, "scheduler", None)
    compatible = sorted(_compatible_schedulers(scheduler))
    if name not in compatible:
        raise InputError(f"--scheduler {name}: {type(pipe).__name__}'s {type(scheduler).__name__} lists as compatible "
                       f"{', '.join(compatible)}")  # fmt: skip
    import diffusers

    cls = getattr(diffusers, name)
    if not isinstance(scheduler, cls):
        pipe.scheduler = cls.from_config(scheduler.config)
    logger.info("scheduler: %s", name)


def load_single_file_denoiser(pipe: Any, file: Any, device: Any, dtype: Any) -> None:
    """``pipe``'s denoiser replaced by the single-file checkpoint ``file`` (diffusers'
    ``from_single_file``, which converts a checkpoint in its original layout), configured as the
    one it replaces; InputError where diffusers loads no single file of that class or the file does
    not fit it, RunError where the file cannot be read."""
    import tempfile

    from accel import DENOISER_NAMES

    name = next((n for n in DENOISER_NAMES if getattr(pipe, n, None) is not None), None)
    if name is None:
        raise InputError(f"--transformer: {type(pipe).__name__} has no denoiser to replace")
    current = getattr(pipe, name)
    cls = type(current)
    if not hasattr(cls, "from_single_file"):
        raise InputError(f"--transformer: diffusers loads no single-file checkpoint of {cls.__name__}")
    try:
        with tempfile.TemporaryDirectory() as config:
            current.save_config(config)
            loaded = cls.from_single_file(str(file), config=config, torch_dtype=dtype)
    except (ValueError, KeyError, RuntimeError) as e:  # keys or shapes another model's
        raise InputError(f"--transformer {file.name}: not a {cls.__name__} checkpoint of this configuration "
                       f"({type(e).__name__}: {one_line(e)[:200]})") from None  # fmt: skip
    except Exception as e:  # an unreadable file, say
        raise RunError(f"--transformer {file.name}: {type(e).__name__}: {one_line(e)[:200]}") from None
    pipe.register_modules(**{name: loaded.to(device)})
    logger.info("%s: %s from %s", name, cls.__name__, file.name)


def load_loras_checked(pipe: Any, specs: Sequence[LoraSpec]) -> tuple[LoraSpec, ...]:
    """``--lora``'s adapters loaded and active: InputError for a LoRA the model cannot take (another
    model's, say), RunError for a load that fails otherwise."""
    if not specs:
        return ()
    import torch

    try:
        return tuple(load_loras(pipe, specs))
    except LoraError as e:
        raise InputError(f"--lora {e}") from None
    except torch.OutOfMemoryError:
        raise RunError("out of memory loading --lora's adapters") from None
    except Exception as e:  # diffusers and peft raise many kinds; each ends as one line
        raise RunError(f"could not load --lora: {type(e).__name__}: {one_line(e)[:300]}") from None


def warn_lora_scales(specs: Sequence[LoraSpec]) -> None:
    """One warning line for each adapter whose scale is far outside the usual range: such a
    scale is allowed (a finite number), but is more likely a typo than a wish for noise."""
    for spec in specs:
        if abs(spec.scale) > LORA_SCALE_WARNING:
            logger.warning("--lora %s: a scale of %g is far outside the usual range (-%g to %g); the adapter will "
                           "likely swamp the model", spec.path.name, spec.scale, LORA_SCALE_WARNING,
                           LORA_SCALE_WARNING)  # fmt: skip

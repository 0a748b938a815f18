"""The install plan: what :func:`~accel.hooks.accelerator.accelerate_pipeline` will put into a
pipeline, decided in one pass before anything is put in.

:func:`plan_install` reads the pipeline and the options and refuses, in one line, what cannot be
done (a quantization that cannot run, no denoiser, a module another pipeline accelerated with
other options); nothing is installed by then. The :class:`InstallPlan` it returns names, in the
order :class:`~accel.hooks.install.Installation` enters them:

1. ``quantization``: what ``quantize=`` will do (it changes nothing before the first warm-up);
   ``attention``: the attention backend ``attention=`` sets on the denoisers' processors, or why
   it cannot (:mod:`accel.hooks.attention.selection`), set before the graph hooks see them;
2. ``modules``: every module that gets a graph hook, denoisers first, each with its recipe (the
   one in use where another pipeline accelerated the module already), the breaks its pipeline's
   recipe names for it, the component whose offload hooks move it, and the device whose graph
   pool it captures into (one pool per pipeline on a device);
3. ``guard``: whether the pipeline's scheduler gets a call guard;
4. ``parallel``: the several-process layout asked for, if any;
5. ``cfg_batch``: the denoisers whose guidance branches may run as one call;
6. ``postprocess_refused``: why the image processor keeps diffusers' own post-processing, or None
   where its ``output_type="pil"`` gets its pixels made on the device
   (:mod:`accel.hooks.images.postprocess`, the same pixels bit for bit).

``describe()`` says it in the report's words.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .attention.selection import AttentionChoice, plan_attention
from .components import DENOISER_NAMES, component, components, module_device
from .fp8.quantize import Quantization, plan_quantization
from .graph_hook import check_joinable
from .images.postprocess import why_not_hooked
from .options import AcceleratorOptions
from .recipes.recipe import Recipe
from .recipes.registry import new_recipe
from .state.guard import CallGuard

__all__ = ["InstallPlan", "ModulePlan", "plan_install"]


@dataclasses.dataclass(frozen=True)
class ModulePlan:
    """One module that gets a graph hook.

    Attributes:
        name: its component name (``"transformer"``, ``"vae.decoder"``).
        module: the module.
        recipe: the recipe its hook uses.
        device: where its weights are: its graphs capture into this pipeline's pool there.
        component: a text encoder or the VAE decoder (generic recipe, checked against eager,
            never compiled), not a denoiser.
        breaks: functions (``module.qualname``) it runs as eager breaks, named by the first
            denoiser's recipe.
        offload_root: the top-level component whose offload hooks move its weights, where it is
            a submodule (the VAE of its decoder).
        shared: another pipeline accelerated it already: its hook (and recipe) is joined.
    """

    name: str
    module: torch.nn.Module
    recipe: Recipe
    device: torch.device
    component: bool = False
    breaks: tuple[str, ...] = ()
    offload_root: torch.nn.Module | None = None
    shared: bool = False


@dataclasses.dataclass(frozen=True)
class InstallPlan:
    """What one :func:`~accel.hooks.accelerator.accelerate_pipeline` installs (see the module docstring)."""

    options: AcceleratorOptions
    quantization: Quantization | None
    attention: AttentionChoice | None
    modules: tuple[ModulePlan, ...]
    guard: bool
    parallel: str | None
    cfg_batch: tuple[str, ...]
    postprocess_refused: str | None

    @property
    def denoisers(self) -> list[str]:
        """The names of the denoisers among ``modules``, in their order."""
        return [m.name for m in self.modules if not m.component]

    def describe(self) -> list[str]:
        """The report's lines."""

        def module(m: ModulePlan) -> str:
            how = [f"recipe {m.recipe.name}"]
            how += [f"{len(m.breaks)} known break(s)"] if m.breaks else []
            how += ["shared with another pipeline"] if m.shared else []
            return f"{m.name} ({', '.join(how)})"

        pools = sorted({str(m.device) for m in self.modules if m.device.type == "cuda"})
        quantize = self.quantization.value if self.quantization is not None else None
        attention = [self.attention.describe()] if self.attention is not None else []
        return [
            f"  install plan: {', '.join(module(m) for m in self.modules)}",
            f"    graph pool {', '.join(pools) or 'none (nothing on CUDA)'}; "
            f"call guard {'on the scheduler' if self.guard else 'none (no scheduler to hook)'}; "
            f"quantize {quantize}; parallel {self.parallel}; "
            f"guidance branches joined: {', '.join(self.cfg_batch) or 'none'}; "
            + (
                "PIL images made on the device"
                if self.postprocess_refused is None
                else f"post-processing stock ({self.postprocess_refused})"
            ),
            *attention,
        ]


def _module(name: str, module: torch.nn.Module, options: AcceleratorOptions, **how: Any) -> ModulePlan:
    """``module``'s entry: the recipe of the hook it has (refused if made with other options), else a new one."""
    hook = check_joinable(module, options, name)
    recipe = hook.recipe if hook is not None else new_recipe(module, options, component=how.get("component", False))
    return ModulePlan(name, module, recipe, module_device(module), shared=hook is not None, **how)


def _joins_guidance(entry: ModulePlan, options: AcceleratorOptions, guard: bool) -> bool:
    """Whether ``entry``'s guidance branches may run as one call (:mod:`accel.hooks.cfg_batch`)."""
    # Only where graphs run (CUDA, not eager mode, a call guard telling where calls begin):
    # elsewhere the pipeline stays unchanged.
    if not options.cfg_batch or not guard or options.mode == "eager" or not torch.cuda.is_available():
        return False
    # Under the "cfg" layouts each rank computes one branch whole: nothing to join.
    if options.parallel is not None and "cfg" in options.parallel.split("+"):
        return False
    # A recipe that cannot tell the branches apart: the pipeline batches them itself, or the
    # recipe does not know how it calls them.
    return entry.device.type == "cuda" and entry.recipe.cfg_parallel_support(entry.module) is None


def plan_install(pipe: Any, options: AcceleratorOptions) -> InstallPlan:
    """Everything :func:`~accel.hooks.accelerator.accelerate_pipeline` will install in ``pipe``
    under ``options``, or the one-line refusal (QuantizeError, ValueError) of what cannot be."""
    denoisers = [
        _module(name, module, options)
        for name in DENOISER_NAMES
        if isinstance(module := getattr(pipe, name, None), torch.nn.Module)
    ]
    if not denoisers:
        raise ValueError(
            f"{type(pipe).__name__} has no denoiser to accelerate (looked for components named "
            f"{', '.join(DENOISER_NAMES)})"
        )
    # Refused (one line) before anything is installed; quantizes nothing until the warm-up.
    quantization = plan_quantization(pipe, options, DENOISER_NAMES, denoisers[0].recipe.fp8_layers)
    attention = plan_attention(options, {d.name: d.module for d in denoisers})
    known = denoisers[0].recipe.component_breaks()
    parts = []
    for name in components(pipe, options):
        module = component(pipe, name)
        assert module is not None
        root = component(pipe, name.split(".")[0])
        parts.append(
            _module(
                name,
                module,
                options,
                component=True,
                breaks=tuple(known.get(name, ())),
                offload_root=root if root is not module else None,
            )
        )
    guard = CallGuard.can_attach(pipe)
    return InstallPlan(
        options=options,
        quantization=quantization,
        attention=attention,
        modules=(*denoisers, *parts),
        guard=guard,
        parallel=options.parallel,
        cfg_batch=tuple(d.name for d in denoisers if _joins_guidance(d, options, guard)),
        # In every mode: it changes no pixel, and takes the host's float work off every call.
        postprocess_refused=why_not_hooked(getattr(pipe, "image_processor", None)),
    )

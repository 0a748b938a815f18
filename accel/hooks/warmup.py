"""Warm-up: drive a pipeline so that exactly the signatures real calls will hit get captured.

:func:`plan_warmup` turns what the user said (resolutions, batch sizes, CFG, prompts or lengths)
into a validated :class:`WarmupPlan`; :func:`run_warmup` runs the recipe's warm-up calls for
every case, largest resolution first (smaller captures then reuse the pool blocks the largest
one reserved), with the runners in capturing mode, and reports what each resolution cost.
With compiled blocks, one uncaptured call per resolution compiles first, so compile seconds are
reported apart from capture seconds. Components (text encoders, the VAE decoder) are captured
last, by real pipeline calls with text prompts that decode an image: one per resolution (the
VAE's latent shapes) and one per further prompt (the text encoder's token lengths).

A case is a resolution, a frame count (video pipelines), a batch size, a guidance setting and a
text: a length in tokens, or, for a recipe that cannot measure prompts (the generic one), a
prompt warmed up as given. ``call_kwargs`` are passed with every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, NamedTuple

import torch

from ..graphs.capture import capture_session
from ..graphs.pool import GraphPool
from ..graphs.runner import GraphRunner
from .call_shape import call_parameters, read_call_shape
from .compile import compiled_graph_count
from .options import check_resolution
from .recipe import WARMUP_ARGUMENTS, Recipe

__all__ = [
    "WarmupCase",
    "WarmupPlan",
    "WarmupReport",
    "WarmupRow",
    "case_calls",
    "normalise_resolutions",
    "plan_warmup",
    "run_warmup",
    "uncaptured",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WarmupRow:
    """What warming up one resolution (and frame count, for video) cost. ``seconds`` is capture
    time; ``compile_seconds`` the first compiled call's (0 without compile); ``frames`` None
    for images."""

    width: int
    height: int
    seconds: float
    captures: int
    resident_bytes: int
    compile_seconds: float = 0.0
    frames: int | None = None

    @property
    def size(self) -> str:
        """``WxH``, with ``xF frames`` for video."""
        return f"{self.width}x{self.height}" + (f", {self.frames} frames" if self.frames is not None else "")


@dataclasses.dataclass
class WarmupReport:
    """Per-resolution warm-up cost, largest resolution first.

    ``compiled_graphs`` counts the graphs inductor compiled during the warm-up (recompiles
    included; 0 without compile); ``capture_passes`` is 2 where inductor compiled again during
    the first capture pass and every case was captured once more (rows count the graphs kept,
    their seconds both passes); ``skipped`` says why nothing was captured, if so.
    """

    rows: list[WarmupRow]
    compiled_graphs: int = 0
    skipped: str | None = None
    capture_passes: int = 1

    @property
    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def total_compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.rows)

    @property
    def total_captures(self) -> int:
        return sum(r.captures for r in self.rows)

    @property
    def total_resident_bytes(self) -> int:
        return sum(r.resident_bytes for r in self.rows)

    def __str__(self) -> str:
        if self.skipped:
            return f"nothing captured: {self.skipped}"
        compiled = any(r.compile_seconds for r in self.rows)
        video = any(r.frames is not None for r in self.rows)
        head = f"{'resolution':>12}" + (f" {'frames':>6}" if video else "")
        head += f" {'capture s':>9} {'graphs':>6} {'graph MiB':>10}"
        lines = [head + (f" {'compile s':>9}" if compiled else "")]
        for r in self.rows:
            line = f"{r.width:>5}x{r.height:<6}"
            if video:
                line += f" {r.frames if r.frames is not None else '-':>6}"
            line += f" {r.seconds:9.2f} {r.captures:6d} {r.resident_bytes / 2**20:10.1f}"
            lines.append(line + (f" {r.compile_seconds:9.2f}" if compiled else ""))
        total = f"{'total':>12}" + (" " * 7 if video else "")
        total += f" {self.total_seconds:9.2f} {self.total_captures:6d} {self.total_resident_bytes / 2**20:10.1f}"
        lines.append(total + (f" {self.total_compile_seconds:9.2f}" if compiled else ""))
        if compiled:
            lines.append(f"inductor compiled {self.compiled_graphs} graph(s)")
        if self.capture_passes > 1:
            lines.append(
                f"every case captured {self.capture_passes} times: inductor compiled again during capture "
                "(the earlier graphs were dropped; capture s counts every pass)"
            )
        return "\n".join(lines)


class WarmupCase(NamedTuple):
    """One warm-up case. ``text`` is a text length in tokens or, for a recipe that cannot measure
    prompts, a prompt warmed up as given; ``frames`` the frame count of a video pipeline's calls
    (None for images)."""

    width: int
    height: int
    batch_size: int
    cfg: bool
    text: int | str
    frames: int | None = None

    @property
    def size(self) -> tuple[int, int, int | None]:
        """What a report row is per: (width, height, frames)."""
        return self.width, self.height, self.frames


@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    """Every case to capture, largest first, and what every call of them shares.

    ``negative_length`` is None where the recipe cannot measure prompts; ``call_kwargs`` (left
    out of the repr, which ranks compare) are passed with every call.
    """

    resolutions: tuple[tuple[int, int], ...]
    cases: tuple[WarmupCase, ...]
    negative_length: int | None
    num_inference_steps: int
    negative_prompt: str | None = None
    call_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def sizes(self) -> list[tuple[int, int, int | None]]:
        """(width, height, frames) of the cases, largest first, each once."""
        return list(dict.fromkeys(c.size for c in self.cases))


def normalise_resolutions(resolutions: Any) -> list[tuple[int, int]]:
    """One ``(width, height)`` or an iterable of them -> unique pairs, largest area first."""
    if isinstance(resolutions, tuple) and len(resolutions) == 2 and all(isinstance(v, int) for v in resolutions):
        resolutions = [resolutions]
    if isinstance(resolutions, (str, bytes)) or not isinstance(resolutions, Iterable):
        raise ValueError(f"resolutions must be (width, height) pairs, got {resolutions!r}")
    out: list[tuple[int, int]] = []
    for r in resolutions:
        if isinstance(r, (str, bytes)) or not isinstance(r, Sequence) or len(r) != 2:
            raise ValueError(f"a resolution is a (width, height) pair of integers, got {r!r}")
        out.append(check_resolution(*r))
    if not out:
        raise ValueError("no resolutions given")
    return sorted(dict.fromkeys(out), key=lambda wh: wh[0] * wh[1], reverse=True)


def _bools(name: str, value: Any) -> tuple[bool, ...]:
    values = (value,) if isinstance(value, bool) else value
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be True, False or a list of them, got {value!r}")
    values = tuple(values)
    if not values or any(not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be True, False or a list of them, got {value!r}")
    return tuple(sorted(set(values), reverse=True))


def _positive_ints(name: str, values: Any) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list of positive integers, got {values!r}")
    values = list(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must be a list of positive integers, got {values!r}")
    return values


def _frames(pipe: Any, num_frames: Any) -> tuple[int | None, ...]:
    """The frame counts to capture: those asked for, else the pipeline's default (None: images)."""
    params = call_parameters(pipe)
    if num_frames is None:
        default = params["num_frames"].default if "num_frames" in params else None
        return (default if isinstance(default, int) and not isinstance(default, bool) and default > 0 else None,)
    values = [num_frames] if isinstance(num_frames, int) and not isinstance(num_frames, bool) else num_frames
    try:
        frames = sorted(set(_positive_ints("num_frames", values)), reverse=True)
    except ValueError:
        raise ValueError(f"num_frames must be a positive integer or a list of them, got {num_frames!r}") from None
    if "num_frames" not in params:
        raise ValueError(f"num_frames={num_frames!r}: {type(pipe).__name__} makes images, its call takes no num_frames")
    return tuple(frames)


def _call_kwargs(pipe: Any, call_kwargs: Any) -> dict[str, Any]:
    """``call_kwargs`` as a dict, or ValueError naming the keys the pipeline's call does not take
    (or the warm-up sets itself)."""
    if call_kwargs is None:
        return {}
    if not isinstance(call_kwargs, Mapping) or any(not isinstance(k, str) for k in call_kwargs):
        raise ValueError(f"call_kwargs must be a mapping of pipeline argument names, got {type(call_kwargs).__name__}")
    params = call_parameters(pipe)
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = [k for k in call_kwargs if k not in params]
        if unknown:
            raise ValueError(f"call_kwargs: {type(pipe).__name__}'s call takes no {', '.join(unknown)}")
    owned = [k for k in call_kwargs if k in WARMUP_ARGUMENTS]
    if owned:
        raise ValueError(
            f"call_kwargs: the warm-up sets {', '.join(owned)} itself (from resolutions, num_frames, "
            "num_inference_steps, prompts, negative_prompt, batch_sizes and cfg)"
        )
    return dict(call_kwargs)


def plan_warmup(
    recipe: Recipe,
    pipe: Any,
    resolutions: Any,
    *,
    batch_sizes: Sequence[int],
    cfg: bool | Sequence[bool],
    prompt_lengths: Sequence[int] | None,
    prompts: Sequence[str] | None,
    negative_prompt: str | None,
    num_inference_steps: int,
    num_frames: int | Sequence[int] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
) -> WarmupPlan:
    """Validate the user's warm-up request and resolve text lengths through the recipe (for a
    recipe that cannot measure prompts, each prompt is a case of its own, as given)."""
    res = normalise_resolutions(resolutions)
    cfgs = _bools("cfg", cfg)
    sizes = sorted(set(_positive_ints("batch_sizes", batch_sizes)), reverse=True)
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 2:
        raise ValueError(
            f"num_inference_steps must be an integer of at least 2 (one-step schedules can be degenerate), "
            f"got {num_inference_steps!r}"
        )
    if prompts is not None and prompt_lengths is not None:
        raise ValueError("pass prompts or prompt_lengths, not both")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise ValueError(f"negative_prompt must be a string, got {type(negative_prompt).__name__}")
    frames = _frames(pipe, num_frames)
    extra = _call_kwargs(pipe, call_kwargs)
    try:
        negative_length: int | None = recipe.prompt_lengths(pipe, [negative_prompt or ""])[0]
        measures = True
    except NotImplementedError:
        negative_length, measures = None, False
    lengths: list[int] = []
    as_given: list[str] | None = None
    if prompts is not None:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts or any(not isinstance(p, str) for p in prompts):
            raise ValueError(f"prompts must be a list of strings, got {prompts!r}")
        if measures:
            lengths = recipe.prompt_lengths(pipe, list(prompts))
        else:
            as_given = list(dict.fromkeys(prompts))
    elif prompt_lengths is not None:
        lengths = _positive_ints("prompt_lengths", prompt_lengths)
    else:
        lengths = list(recipe.default_prompt_lengths())
    if negative_length is None and lengths:
        negative_length = min(lengths)
    cfgs = recipe.warmup_cfg(pipe, cfgs)
    recipe.check_warmup(pipe, cfg=cfgs, call_kwargs=extra)

    def texts(w: int, h: int) -> list[int | str]:
        if as_given is not None:
            return list(as_given)
        return sorted({recipe.warmup_length(n, w, h) for n in lengths}, reverse=True)

    # Largest first, frames counted: smaller captures reuse the blocks the largest reserved.
    shapes = sorted(
        ((w, h, f) for (w, h) in res for f in frames), key=lambda s: s[0] * s[1] * (s[2] or 1), reverse=True
    )
    cases = tuple(
        WarmupCase(w, h, b, c, n, f) for (w, h, f) in shapes for b in sizes for c in cfgs for n in texts(w, h)
    )
    return WarmupPlan(tuple(res), cases, negative_length, num_inference_steps, negative_prompt, extra)


def _calls(recipe: Recipe, pipe: Any, plan: WarmupPlan, case: WarmupCase) -> Iterator[dict[str, Any]]:
    """The recipe's calls of ``case``, each with the user's ``call_kwargs`` merged over it."""
    text = case.text
    for kwargs in recipe.warmup_calls(
        pipe,
        width=case.width,
        height=case.height,
        batch_size=case.batch_size,
        cfg=case.cfg,
        prompt_length=text if isinstance(text, int) else None,
        negative_prompt_length=plan.negative_length,
        num_inference_steps=plan.num_inference_steps,
        num_frames=case.frames,
        prompt=text if isinstance(text, str) else None,
        negative_prompt=plan.negative_prompt,
        call_kwargs=plan.call_kwargs,
    ):
        yield {**kwargs, **plan.call_kwargs}


# The calls of one case, for what runs them outside run_warmup (the measurement of quantize=).
case_calls = _calls


@contextlib.contextmanager
def uncaptured(runners: Iterable[GraphRunner]) -> Iterator[None]:
    """Calls run the (recipe-prepared) forward eagerly: no capture, no miss counted."""
    runners = list(runners)
    was = [r.enabled for r in runners]
    for r in runners:
        r.enabled = False
    try:
        yield
    finally:
        for r, enabled in zip(runners, was):
            r.enabled = enabled


def _progress(total: int, enabled: bool, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="case", disable=not enabled, leave=False)


# What a component warm-up encodes when the user named no prompt. Z-Image-style encoders pad
# every prompt to one length, so this one prompt covers them; encoders that do not pad capture
# each new length on first use only with capture_on_miss.
WARMUP_PROMPT = "a photograph of a red fox in the snow"


def _with_prompt(kwargs: dict[str, Any], prompt: str, negative_prompt: str | None, batch: int) -> dict[str, Any]:
    """A recipe's warm-up call (made of random embeddings) with text prompts instead."""
    out = {k: v for k, v in kwargs.items() if "prompt_embeds" not in k}
    out["prompt"] = [prompt] * batch
    if "negative_prompt_embeds" in kwargs or "negative_prompt" in kwargs:
        out["negative_prompt"] = [negative_prompt if negative_prompt is not None else " "] * batch
    return out


def _component_calls(
    recipe: Recipe, pipe: Any, plan: WarmupPlan, prompts: list[str], negative_prompt: str | None
) -> Iterator[tuple[tuple[int, int, int | None], dict[str, Any]]]:
    """(size, kwargs) of the calls that capture the components: each size's first case
    decoding an image, then every further prompt at the smallest size. Calls keep their
    embeddings where the pipeline has no text encoder or ``call_kwargs`` carry the text (real
    calls then never run a text encoder)."""
    shape = read_call_shape(pipe)
    text = shape.has_text_encoders and not shape.gives_text(plan.call_kwargs)

    def prompted(kwargs: dict[str, Any], prompt: str, batch: int) -> dict[str, Any]:
        return _with_prompt(kwargs, prompt, negative_prompt, batch) if text else dict(kwargs)

    seen: set[tuple[int, int, int | None]] = set()
    for case in plan.cases:
        if case.size in seen:
            continue
        seen.add(case.size)
        for kwargs in _calls(recipe, pipe, plan, case):
            yield case.size, {**prompted(kwargs, prompts[0], case.batch_size), "output_type": "pil"}
    smallest = plan.cases[-1]
    if not text or isinstance(smallest.text, str):  # embeddings only, or every prompt was a case already
        return
    for prompt in prompts[1:]:
        for kwargs in _calls(recipe, pipe, plan, smallest):
            yield smallest.size, {**prompted(kwargs, prompt, smallest.batch_size), "output_type": "latent"}


def _run_capturing(
    pipe: Any,
    device: torch.device,
    row: WarmupRow,
    runners: list[GraphRunner],
    pool: GraphPool,
    calls: Iterable[dict[str, Any]],
) -> None:
    """Run these pipeline calls (the runners capturing) and add their cost to ``row``."""
    captures0 = sum(r.stats(memory=False).captures for r in runners)
    resident0 = pool.resident_bytes()
    t0 = time.perf_counter()
    for kwargs in calls:
        pipe(**kwargs, generator=torch.Generator(device).manual_seed(0))
    torch.cuda.synchronize(device)
    row.seconds += time.perf_counter() - t0
    row.captures += sum(r.stats(memory=False).captures for r in runners) - captures0
    row.resident_bytes += pool.resident_bytes() - resident0


def _row(case: WarmupCase) -> WarmupRow:
    return WarmupRow(case.width, case.height, 0.0, 0, 0, frames=case.frames)


def run_warmup(
    pipe: Any,
    recipe: Recipe,
    plan: WarmupPlan,
    runners: list[GraphRunner],
    device: torch.device,
    *,
    compiled: bool,
    progress: bool,
    prompts: list[str] | None = None,
    negative_prompt: str | None = None,
    components: Sequence[GraphRunner] = (),
    components_compiled: bool = False,
) -> WarmupReport:
    """Run ``plan``'s warm-up calls through ``pipe`` with ``runners`` capturing; then, when
    ``components`` (runners among ``runners``) are given, the calls that capture them. With
    ``compiled``, every call runs uncaptured first (the components' too where
    ``components_compiled``), so nothing is captured over kernels a later shape recompiles."""
    pool = runners[0].pool
    assert pool is not None
    rows: dict[tuple[int, int, int | None], WarmupRow] = {}
    graphs0 = compiled_graph_count() if compiled else 0
    passes = 1
    progress_config = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)
    try:
        component_calls = (
            list(_component_calls(recipe, pipe, plan, prompts or [WARMUP_PROMPT], negative_prompt))
            if components
            else []
        )
        if compiled:
            # Every case runs once uncaptured first: dynamo compiles (and recompiles, on new
            # shapes) here, so that the capture below times capture alone and no graph is
            # captured over kernels a later recompile replaces (see GraphHook.follow_weights).
            bar = _progress(len(plan.cases), progress, "compiling")
            with uncaptured(runners):
                for case in plan.cases:
                    row = rows.setdefault(case.size, _row(case))
                    t0 = time.perf_counter()
                    for kwargs in _calls(recipe, pipe, plan, case):
                        pipe(**kwargs, generator=torch.Generator(device).manual_seed(0))
                    torch.cuda.synchronize(device)
                    row.compile_seconds += time.perf_counter() - t0
                    bar.update()
                # And, where a component has compiled kernels too (a VAE decoder's GroupNorms),
                # the calls that capture the components: their sizes compile before any capture.
                for size, kwargs in component_calls if components_compiled else ():
                    t0 = time.perf_counter()
                    pipe(**kwargs, generator=torch.Generator(device).manual_seed(0))
                    torch.cuda.synchronize(device)
                    rows[size].compile_seconds += time.perf_counter() - t0
            bar.close()
        with capture_session(), ExitStack() as stack:
            for r in runners:
                stack.enter_context(r.capturing())
            # A recompile during capture drops the graphs (at the next call's weight check):
            # those cases are captured once more, over the newest kernels.
            for attempt in range(2 if compiled else 1):
                if attempt:
                    for row in rows.values():
                        row.captures = 0  # the first pass's graphs are dropped: count those kept
                passes = attempt + 1
                graphs = compiled_graph_count() if compiled else 0
                bar = _progress(len(plan.cases), progress, "capturing graphs")
                for case in plan.cases:
                    row = rows.setdefault(case.size, _row(case))
                    _run_capturing(pipe, device, row, runners, pool, _calls(recipe, pipe, plan, case))
                    text = f"text {case.text}" if isinstance(case.text, int) else f"prompt {case.text[:20]!r}"
                    bar.set_postfix_str(f"{row.size} batch {case.batch_size} cfg {case.cfg} {text}")
                    bar.update()
                bar.close()
                if not compiled or compiled_graph_count() == graphs:
                    break
                logger.info("warmup: inductor compiled again during capture; capturing every case once more")
            if components:
                bar = _progress(len(component_calls), progress, "capturing text encoder and VAE")
                for size, kwargs in component_calls:
                    _run_capturing(pipe, device, rows[size], runners, pool, [kwargs])
                    bar.update()
                bar.close()
    finally:
        pipe._progress_bar_config = progress_config
    graphs = compiled_graph_count() - graphs0 if compiled else 0
    return WarmupReport(list(rows.values()), compiled_graphs=graphs, capture_passes=passes)

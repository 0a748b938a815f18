"""Warm-up: drive a pipeline so that exactly the signatures real calls will hit get captured.

:func:`plan_warmup` turns what the user said (resolutions, batch sizes, CFG, prompts or lengths)
into a validated :class:`WarmupPlan`; :func:`run_warmup` runs the recipe's warm-up calls for
every case, largest resolution first (smaller captures then reuse the pool blocks the largest
one reserved), with the runners in capturing mode, and reports what each resolution cost.
With compiled blocks, one uncaptured call per resolution compiles first, so compile seconds are
reported apart from capture seconds. Components (text encoders, the VAE decoder) are captured
last, by real pipeline calls with text prompts that decode an image: one per resolution (the
VAE's latent shapes) and one per further prompt (the text encoder's token lengths).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from ..graphs.capture import capture_session
from ..graphs.pool import GraphPool
from ..graphs.runner import GraphRunner
from .compile import compiled_graph_count
from .options import check_resolution
from .recipe import Recipe

__all__ = ["WarmupPlan", "WarmupReport", "WarmupRow", "normalise_resolutions", "plan_warmup", "run_warmup"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WarmupRow:
    """What warming up one resolution cost. ``seconds`` is capture time; ``compile_seconds``
    the first compiled call's (0 without compile)."""

    width: int
    height: int
    seconds: float
    captures: int
    resident_bytes: int
    compile_seconds: float = 0.0


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
        head = f"{'resolution':>12} {'capture s':>9} {'graphs':>6} {'graph MiB':>10}"
        lines = [head + (f" {'compile s':>9}" if compiled else "")]
        for r in self.rows:
            line = f"{r.width:>5}x{r.height:<6} {r.seconds:9.2f} {r.captures:6d} {r.resident_bytes / 2**20:10.1f}"
            lines.append(line + (f" {r.compile_seconds:9.2f}" if compiled else ""))
        total = f"{'total':>12} {self.total_seconds:9.2f} {self.total_captures:6d} {self.total_resident_bytes / 2**20:10.1f}"
        lines.append(total + (f" {self.total_compile_seconds:9.2f}" if compiled else ""))
        if compiled:
            lines.append(f"inductor compiled {self.compiled_graphs} graph(s)")
        if self.capture_passes > 1:
            lines.append(
                f"every case captured {self.capture_passes} times: inductor compiled again during capture "
                "(the earlier graphs were dropped; capture s counts every pass)"
            )
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    """Every case to capture as (width, height, batch, cfg, text length), largest first."""

    resolutions: tuple[tuple[int, int], ...]
    cases: tuple[tuple[int, int, int, bool, int], ...]
    negative_length: int
    num_inference_steps: int


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
) -> WarmupPlan:
    """Validate the user's warm-up request and resolve text lengths through the recipe."""
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
    if prompts is not None:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts or any(not isinstance(p, str) for p in prompts):
            raise ValueError(f"prompts must be a list of strings, got {prompts!r}")
        lengths = recipe.prompt_lengths(pipe, list(prompts))
    elif prompt_lengths is not None:
        lengths = _positive_ints("prompt_lengths", prompt_lengths)
    else:
        lengths = list(recipe.default_prompt_lengths())
    try:
        negative_length = recipe.prompt_lengths(pipe, [negative_prompt or ""])[0]
    except NotImplementedError:
        negative_length = min(lengths)
    cases = tuple(
        (w, h, b, c, n)
        for (w, h) in res
        for b in sizes
        for c in cfgs
        for n in sorted({recipe.warmup_length(n, w, h) for n in lengths}, reverse=True)
    )
    return WarmupPlan(tuple(res), cases, negative_length, num_inference_steps)


def _calls(recipe: Recipe, pipe: Any, plan: WarmupPlan, case: tuple[int, int, int, bool, int]) -> Iterable[dict]:
    w, h, b, c, n = case
    return recipe.warmup_calls(
        pipe,
        width=w,
        height=h,
        batch_size=b,
        cfg=c,
        prompt_length=n,
        negative_prompt_length=plan.negative_length,
        num_inference_steps=plan.num_inference_steps,
    )


@contextlib.contextmanager
def _uncaptured(runners: list[GraphRunner]) -> Iterator[None]:
    """Calls run the (recipe-prepared) forward eagerly: no capture, no miss counted."""
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
    if "negative_prompt_embeds" in kwargs:
        out["negative_prompt"] = [negative_prompt if negative_prompt is not None else " "] * batch
    return out


def _component_calls(
    recipe: Recipe, pipe: Any, plan: WarmupPlan, prompts: list[str], negative_prompt: str | None
) -> Iterator[tuple[tuple[int, int], dict[str, Any]]]:
    """((width, height), kwargs) of the calls that capture the components: each resolution's
    first case decoding an image, then every further prompt at the smallest resolution."""
    seen: set[tuple[int, int]] = set()
    for case in plan.cases:
        if case[:2] in seen:
            continue
        seen.add(case[:2])
        for kwargs in _calls(recipe, pipe, plan, case):
            yield case[:2], {**_with_prompt(kwargs, prompts[0], negative_prompt, case[2]), "output_type": "pil"}
    smallest = plan.cases[-1]
    for prompt in prompts[1:]:
        for kwargs in _calls(recipe, pipe, plan, smallest):
            yield smallest[:2], {**_with_prompt(kwargs, prompt, negative_prompt, smallest[2]), "output_type": "latent"}


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
) -> WarmupReport:
    """Run ``plan``'s warm-up calls through ``pipe`` with ``runners`` capturing; then, when
    ``components`` (runners among ``runners``) are given, the calls that capture them."""
    pool = runners[0].pool
    assert pool is not None
    rows: dict[tuple[int, int], WarmupRow] = {}
    graphs0 = compiled_graph_count() if compiled else 0
    passes = 1
    progress_config = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)
    try:
        if compiled:
            # Every case runs once uncaptured first: dynamo compiles (and recompiles, on new
            # shapes) here, so that the capture below times capture alone and no graph is
            # captured over kernels a later recompile replaces (see GraphHook.follow_weights).
            bar = _progress(len(plan.cases), progress, "compiling")
            with _uncaptured(runners):
                for case in plan.cases:
                    row = rows.setdefault(case[:2], WarmupRow(*case[:2], 0.0, 0, 0))
                    t0 = time.perf_counter()
                    for kwargs in _calls(recipe, pipe, plan, case):
                        pipe(**kwargs, generator=torch.Generator(device).manual_seed(0))
                    torch.cuda.synchronize(device)
                    row.compile_seconds += time.perf_counter() - t0
                    bar.update()
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
                    w, h, b, c, n = case
                    row = rows.setdefault((w, h), WarmupRow(w, h, 0.0, 0, 0))
                    _run_capturing(pipe, device, row, runners, pool, _calls(recipe, pipe, plan, case))
                    bar.set_postfix_str(f"{w}x{h} batch {b} cfg {c} text {n}")
                    bar.update()
                bar.close()
                if not compiled or compiled_graph_count() == graphs:
                    break
                logger.info("warmup: inductor compiled again during capture; capturing every case once more")
            if components:
                calls = list(_component_calls(recipe, pipe, plan, prompts or [WARMUP_PROMPT], negative_prompt))
                bar = _progress(len(calls), progress, "capturing text encoder and VAE")
                for wh, kwargs in calls:
                    _run_capturing(pipe, device, rows[wh], runners, pool, [kwargs])
                    bar.update()
                bar.close()
    finally:
        pipe._progress_bar_config = progress_config
    graphs = compiled_graph_count() - graphs0 if compiled else 0
    return WarmupReport(list(rows.values()), compiled_graphs=graphs, capture_passes=passes)

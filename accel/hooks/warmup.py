"""Warm-up: run a :class:`~accel.hooks.warmup_plan.WarmupPlan`'s calls so that exactly the signatures real calls will hit get captured.

:func:`run_warmup` runs the recipe's warm-up calls for every case (:mod:`accel.hooks.warmup_plan`
plans them, largest resolution first) with the runners in capturing mode, and reports what each
resolution cost (:class:`~accel.hooks.report.WarmupReport`). With compiled blocks, one uncaptured call per case
compiles first, so compile seconds are reported apart from capture seconds. Components (text
encoders, the VAE decoder) are captured last, by real pipeline calls with text prompts that decode
an image: one per resolution (the VAE's latent shapes) and one per further prompt (the text
encoder's token lengths). The decoder keeps graphs only at the sizes where they pay, in time or in
the peak memory they leave (:mod:`accel.hooks.images.decoder_trial`,
:mod:`accel.hooks.images.decoder_verdict`).

Memory, per resolution: the graph memory it added (the pool's growth, static inputs, boundary
buffers) beside the eager peak it replaces (the most a capture's eager warm-up runs allocated
above what was allocated before them: the transient of the call the graphs stand for). During a
warm-up the allocator's cache is given back before every capture and once at the end, so the eager
warm-up runs' transients do not stay beside the pool.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from ..graphs.capture import capture_session
from ..graphs.pool import GraphPool, peak_memory
from ..graphs.runner import GraphRunner
from .call_shape import read_call_shape
from .compiled.compile import compiled_graph_count
from .images import decoder_trial
from .images.decoder_trial import DecoderTrial, Timing
from .recipes.recipe import Recipe
from .report import WarmupReport, WarmupRow
from .warmup_plan import WarmupCase, WarmupPlan, case_calls

__all__ = ["run_warmup", "uncaptured"]

logger = logging.getLogger(__name__)


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
    """(size, kwargs) of the calls that capture the components: the first case of each size and
    batch size decoding an image (the text encoder's and the decoder's shapes follow both: with
    one call per size, a server's smaller buckets encoded and decoded eagerly), then every
    further prompt at the smallest size. Calls keep their
    embeddings where the pipeline has no text encoder or ``call_kwargs`` carry the text (real
    calls then never run a text encoder)."""
    shape = read_call_shape(pipe)
    text = shape.has_text_encoders and not shape.gives_text(plan.call_kwargs)

    def prompted(kwargs: dict[str, Any], prompt: str, batch: int) -> dict[str, Any]:
        return _with_prompt(kwargs, prompt, negative_prompt, batch) if text else dict(kwargs)

    seen: set[tuple[tuple[int, int, int | None], int]] = set()
    for case in plan.cases:
        if (case.size, case.batch_size) in seen:
            continue
        seen.add((case.size, case.batch_size))
        for kwargs in case_calls(recipe, pipe, case):
            yield case.size, {**prompted(kwargs, prompts[0], case.batch_size), "output_type": "pil"}
    smallest = plan.cases[-1]
    if not text or isinstance(smallest.text, str):  # embeddings only, or every prompt was a case already
        return
    for prompt in prompts[1:]:
        for kwargs in case_calls(recipe, pipe, smallest):
            # The recipe's own output type (latents, where the pipeline can return them): only
            # the text encoder has anything left to capture.
            yield smallest.size, {"output_type": "latent", **prompted(kwargs, prompt, smallest.batch_size)}


def _run_capturing(
    pipe: Any,
    device: torch.device,
    row: WarmupRow,
    runners: list[GraphRunner],
    pool: GraphPool,
    calls: Iterable[dict[str, Any]],
    on_trial: GraphRunner | None = None,
) -> None:
    """Run these pipeline calls (the runners capturing) and add their cost to ``row``; the
    memory of ``on_trial``'s graphs is counted where they are kept, not here."""
    captures0 = sum(r.stats(memory=False).captures for r in runners)
    held_by = [r for r in runners if r is not on_trial]
    held0 = _held_bytes(held_by)
    resident0 = pool.resident_bytes()
    t0 = time.perf_counter()
    for kwargs in calls:
        pipe(**kwargs, generator=torch.Generator(device).manual_seed(0))
    torch.cuda.synchronize(device)
    row.seconds += time.perf_counter() - t0
    row.captures += sum(r.stats(memory=False).captures for r in runners) - captures0
    row.resident_bytes += pool.resident_bytes() - resident0 + _held_bytes(held_by) - held0
    pools = {id(r.pool): r.pool for r in runners if r.pool is not None}
    row.eager_peak_bytes = max(row.eager_peak_bytes, *(p.take_eager_peak() for p in pools.values()))


def _held_bytes(runners: list[GraphRunner]) -> int:
    """Static inputs and boundary buffers of the runners' graphs (outside the pool)."""
    stats = [r.stats(memory=True, pool=False) for r in runners]
    return sum(s.static_bytes + s.boundary_bytes for s in stats)


def _row(case: WarmupCase) -> WarmupRow:
    return WarmupRow(case.width, case.height, 0.0, 0, 0, frames=case.num_frames)


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
    decoder: tuple[str, GraphRunner] | None = None,
    decided: Sequence[Timing] = (),
    earlier: Sequence[WarmupPlan] = (),
) -> WarmupReport:
    """Run ``plan``'s warm-up calls through ``pipe`` with ``runners`` capturing; then, when
    ``components`` (runners among ``runners``) are given, the calls that capture them. With
    ``compiled``, every call runs uncaptured first, the components' too, so nothing is captured
    over kernels a later shape recompiles; and where those calls compiled anything, the denoiser
    cases of ``earlier`` (the plans of earlier warm-ups, whose graphs that drops) are captured
    again after ``plan``'s, so that no call after the warm-up captures.
    ``decoder``: the VAE decoder's name and runner (one of ``components``), whose graphs are
    kept only where they pay (:class:`~accel.hooks.images.decoder_trial.DecoderTrial`);
    ``decided``: its sizes earlier warm-ups decided, weighed in as they are."""
    pool = runners[0].pool
    assert pool is not None
    rows: dict[tuple[int, int, int | None], WarmupRow] = {}
    graphs0 = compiled_graph_count() if compiled else 0
    passes = 1
    progress_config = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)
    pool.give_back_before_capture = True
    try:

        def component_calls() -> list[tuple[tuple[int, int, int | None], dict[str, Any]]]:
            # Made afresh for every pass: a pipeline may rewrite the prompt list it is given in
            # place (Z-Image's encode_prompt applies its chat template to each item), and a list
            # used twice reached the text encoder templated twice, a longer caption than real calls'.
            if not components:
                return []
            return list(_component_calls(recipe, pipe, plan, prompts or [WARMUP_PROMPT], negative_prompt))

        if compiled:
            # Every case runs once uncaptured first: dynamo compiles (and recompiles, on new
            # shapes) here, so that the capture below times capture alone and no graph is
            # captured over kernels a later recompile replaces (see GraphHook.follow_weights).
            bar = _progress(len(plan.cases), progress, "compiling")
            with uncaptured(runners):
                for case in plan.cases:
                    row = rows.setdefault(case.size, _row(case))
                    t0 = time.perf_counter()
                    for kwargs in case_calls(recipe, pipe, case):
                        pipe(**kwargs, generator=torch.Generator(device).manual_seed(0))
                    torch.cuda.synchronize(device)
                    row.compile_seconds += time.perf_counter() - t0
                    bar.update()
                # And the calls that capture the components: they run the compiled denoiser on
                # real text embeddings, whose layout the cases' random ones do not have (Z-Image's
                # rotary table, a view of a longer one: dynamo guards on its stride), and a
                # component's own compiled kernels (a VAE decoder's GroupNorms). Compiled there,
                # after the captures, they dropped every graph captured so far.
                for size, kwargs in component_calls():
                    t0 = time.perf_counter()
                    pipe(**kwargs, generator=torch.Generator(device).manual_seed(0))
                    torch.cuda.synchronize(device)
                    rows[size].compile_seconds += time.perf_counter() - t0
            bar.close()
        # Dynamo runs its newest kernels for every shape: the compiles above dropped the graphs
        # of earlier warm-ups (at the next call's weight check), captured again with this plan's.
        again = [c for p in earlier for c in p.cases] if compiled and compiled_graph_count() != graphs0 else []
        if again:
            logger.info(
                "warmup: inductor compiled new shapes; capturing %d cases of earlier warm-ups again", len(again)
            )
        cases = [*plan.cases, *again]
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
                bar = _progress(len(cases), progress, "capturing graphs")
                for case in cases:
                    row = rows.setdefault(case.size, _row(case))
                    _run_capturing(pipe, device, row, runners, pool, case_calls(recipe, pipe, case))
                    text = f"text {case.text}" if isinstance(case.text, int) else f"prompt {case.text[:20]!r}"
                    bar.set_postfix_str(f"{row.size} batch {case.batch_size} cfg {case.cfg} {text}")
                    bar.update()
                bar.close()
                if not compiled or compiled_graph_count() == graphs:
                    break
                logger.info("warmup: inductor compiled again during capture; capturing every case once more")
            if components:
                _capture_components(pipe, device, rows, runners, pool, component_calls(), decoder, decided, progress)
    finally:
        pool.give_back_before_capture = False
        pipe._progress_bar_config = progress_config
        # What the eager runs left cached (their transient, on the capture stream too) is given
        # back: the graphs replace it.
        torch.cuda.synchronize(device)
        pool.release_cached()
    graphs = compiled_graph_count() - graphs0 if compiled else 0
    peak = peak_memory(device)[1] if device.type == "cuda" else 0
    return WarmupReport(list(rows.values()), compiled_graphs=graphs, capture_passes=passes, peak_reserved_bytes=peak)


def _capture_components(
    pipe: Any,
    device: torch.device,
    rows: dict[tuple[int, int, int | None], WarmupRow],
    runners: list[GraphRunner],
    pool: GraphPool,
    calls: list[tuple[tuple[int, int, int | None], dict[str, Any]]],
    decoder: tuple[str, GraphRunner] | None,
    decided: Sequence[Timing],
    progress: bool,
) -> None:
    """The component calls (see :func:`_component_calls`), the decoder on trial where given."""
    trying = decoder is not None and decoder[1].enabled and decoder_trial.timed_on(pool.device)
    trial = DecoderTrial(decoder[1], decoder[0], decided) if trying else None
    bar = _progress(len(calls), progress, "capturing text encoder and VAE")
    for size, kwargs in calls:
        row = rows[size]
        if trial is not None:
            trial.before_call()
        _run_capturing(pipe, device, row, runners, pool, [kwargs], decoder[1] if trial is not None else None)
        if trial is not None:
            t0 = time.perf_counter()
            for timing in trial.after_call(size):
                row.captures -= 1  # the trial's graph: counted where it is captured again, if kept
                row.decoder = timing  # its verdict comes at trial.finish
            row.seconds += time.perf_counter() - t0
        bar.update()
    bar.close()
    if trial is not None:

        def added(size: tuple[int, int, int | None], graphs: int, grown: int, seconds: float) -> None:
            row = rows[size]
            row.captures += graphs
            row.resident_bytes += grown
            row.seconds += seconds

        trial.finish(added)

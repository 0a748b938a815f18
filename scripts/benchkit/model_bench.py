"""One model: for each resolution every variant on the same recorded denoiser call (a case), end to end,
and the memory-vs-captured-resolutions series."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .calls import accelerate, denoiser_name, describe_call, record_step_calls, text_tokens
from .measure import Clock, free_memory, max_abs_diff
from .phases import measure_breakdown
from .rows import CaseRow, SeriesPoint, err_text, rnd, summary
from .settings import NEGATIVE, PROMPT, SEED, MiB, calls_per_step, pipe_kwargs, res_name, say, steps_of, uses_cfg


@dataclasses.dataclass
class Case:
    """One (model, resolution): the benchmarked call and what variants leave for the later ones."""

    wh: tuple[int, int]
    args: tuple
    kwargs: dict
    e2e: bool  # end to end at this resolution
    ref: Any = None  # eager's output (tensors, cloned)
    e2e_latents: torch.Tensor | None = None  # eager's final latents end to end
    regional_out: Any = None  # compile-regional's output (tensors, cloned)


Variant = Callable[["ModelBench", CaseRow, Case], None]


@dataclasses.dataclass(eq=False)
class ModelBench:
    pipe: Any
    model: str
    args: argparse.Namespace
    device: torch.device
    variants: Mapping[str, Variant]
    clock: Clock = dataclasses.field(init=False)
    cfg: bool = dataclasses.field(init=False)
    activation_mb: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict, init=False)
    calls: dict[tuple[int, int], tuple[tuple, dict]] = dataclasses.field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.clock = Clock(self.device)
        self.cfg = uses_cfg(self.model)

    # -- one case ------------------------------------------------------------------------------
    def run_case(self, wh: tuple[int, int]) -> list[CaseRow]:
        rows = {v: CaseRow.new(self.model, wh, v) for v in self.args.variants}
        try:
            calls = record_step_calls(self.pipe, self.model, wh, self.args, self.device)
        except Exception as exc:
            traceback.print_exc()
            for r in rows.values():
                r.fail("error", f"recording the denoiser call failed: {err_text(exc)}")
            return list(rows.values())
        args, kwargs = calls[0]
        self.calls[wh] = (args, kwargs)
        call = describe_call(args, kwargs)
        say(f"{self.model} {res_name(wh)}: step 0 makes {len(calls)} call(s); benchmarking the first: {call}")
        case = Case(wh=wh, args=args, kwargs=kwargs, e2e=wh in self.args.e2e_resolutions)
        for variant in self.args.variants:
            row = rows[variant]
            row.set(call=call, calls_per_step=len(calls), text_tokens=[text_tokens(self.model, a, k) for a, k in calls])
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    self.variants[variant](self, row, case)
            except Exception as exc:
                traceback.print_exc()
                row.fail("error", err_text(exc))
            finally:
                try:
                    if "accel" in self.pipe.__dict__:
                        self.pipe.accel.restore()
                    free_memory(self.clock)
                except Exception as exc:
                    traceback.print_exc()
                    row.notes.append(f"cleanup failed: {err_text(exc)}")
            row.variant_wall_s = rnd(time.perf_counter() - t0, 2)
            say(f"{self.model} {res_name(wh)} {variant:<10} {summary(row)}")
        eager = rows["eager"]
        for r in rows.values():
            if r.ok and eager.ok:
                if r.step_ms:
                    r.speedup_vs_eager = rnd(eager.step_ms / r.step_ms, 3)
                if r.e2e_s and eager.e2e_s:
                    r.e2e_speedup_vs_eager = rnd(eager.e2e_s / r.e2e_s, 3)
        return list(rows.values())

    # -- helpers of the variants ---------------------------------------------------------------
    def stock(self, case: Case) -> Callable[[], Any]:
        """``pipe.transformer(...)`` on the recorded call (through whatever is installed on it)."""
        a, k = case.args, case.kwargs
        transformer = self.pipe.transformer
        return lambda: transformer(*a, **k)

    def ok(self, row: CaseRow, t: tuple[float, float, float]) -> None:
        row.set(status="ok", reason=None, step_ms=rnd(t[0]), host_ms=rnd(t[1]), step_min_ms=rnd(t[2]))

    def diff(self, row: CaseRow, case: Case, out: Any) -> None:
        if case.ref is not None:
            row.out_max_abs_diff = rnd(max_abs_diff(out, case.ref), 6)

    def busy(self, row: CaseRow, fn: Callable[[], Any]) -> None:
        seq_ms, busy, why = self.clock.back_to_back(fn, self.args.seq_calls, busy=not self.args.no_busy)
        row.seq_ms = rnd(seq_ms)
        row.gpu_busy = rnd(busy, 3)
        if why and not self.args.no_busy and self.clock.cuda:
            row.notes.append(f"gpu_busy: {why}")

    # -- end to end ----------------------------------------------------------------------------
    def e2e(self, row: CaseRow, case: Case) -> None:
        """Full pipeline call (output decoded to PIL), median of runs after one warm-up run."""
        steps = steps_of(self.model, self.args)
        final: dict[str, torch.Tensor] = {}
        accel = self.pipe.__dict__.get("accel")

        def keep(pipe_: Any, i: int, t: Any, cb_kwargs: dict) -> dict:
            final["latents"] = cb_kwargs["latents"]
            return {}

        def call(g: torch.Generator) -> Any:
            kwargs = pipe_kwargs(self.model, case.wh, self.args)
            return self.pipe(**kwargs, generator=g, output_type="pil", callback_on_step_end=keep)

        def once() -> float:
            g = torch.Generator(self.device).manual_seed(SEED)
            self.clock.sync()
            t0 = time.perf_counter()
            call(g)
            self.clock.sync()
            return time.perf_counter() - t0

        try:
            stats0 = accel.stats()[denoiser_name(accel)] if accel is not None else None
            if self.clock.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            row.e2e_first_s = rnd(once(), 3)
            times = [once() for _ in range(self.args.e2e_runs)]
            e2e_s = statistics.median(times)
            row.set(
                e2e_s=rnd(e2e_s, 4),
                e2e_steps=steps,
                e2e_calls_per_step=calls_per_step(self.model),
                e2e_per_step_ms=rnd(e2e_s / steps * 1e3, 2),
                e2e_runs=len(times),
            )
            if self.clock.cuda:
                row.e2e_peak_mb = rnd(torch.cuda.max_memory_allocated(self.device) / MiB, 1)
            latents = final["latents"].detach().clone()
            if accel is None:
                case.e2e_latents = latents
            else:
                stats1 = accel.stats()[denoiser_name(accel)]
                row.e2e_graph_misses = stats1.misses - stats0.misses
                row.e2e_eager_calls = stats1.eager_calls - stats0.eager_calls
                ref = case.e2e_latents
                if ref is not None:
                    row.e2e_bit_equal = bool(torch.equal(latents, ref))
                    row.e2e_max_abs_diff = rnd(float((latents.float() - ref.float()).abs().max()), 6)
        except Exception as exc:  # the step numbers stand; say why end to end is missing
            traceback.print_exc()
            row.e2e_error = err_text(exc)
            row.notes.append(f"end to end failed: {row.e2e_error}")
            return
        if getattr(self.args, "breakdown", False):
            self.breakdown(row, case, call)

    def breakdown(self, row: CaseRow, case: Case, call: Callable[[torch.Generator], Any]) -> None:
        """One more end-to-end call, split into phases (:mod:`benchkit.phases`)."""
        try:
            g = torch.Generator(self.device).manual_seed(SEED)
            row.e2e_breakdown = measure_breakdown(self.pipe, lambda: call(g), self.device)
            say(f"{self.model} {res_name(case.wh)} {row.variant} breakdown: {row.e2e_breakdown.line()}")
        except Exception as exc:  # end to end stands; say why its breakdown is missing
            traceback.print_exc()
            row.notes.append(f"end-to-end breakdown failed: {err_text(exc)}")

    # -- memory vs number of captured resolutions ----------------------------------------------
    def call_footprint_mb(self, wh: tuple[int, int]) -> float | None:
        """Device memory torch holds at the peak of one decoded call, above what it held before
        (the weights, and graph pools if accelerated): reserved, not allocated, since graph pools
        are reserved memory the eager phases cannot use."""
        if not self.clock.cuda:
            return None
        free_memory(self.clock)
        base = torch.cuda.memory_reserved(self.device)
        accel = self.pipe.__dict__.get("accel")
        if accel is not None:  # the pool is part of what an accelerated call costs
            base -= accel.pool.resident_bytes() if accel.pool is not None else 0
        torch.cuda.reset_peak_memory_stats(self.device)
        self.pipe(**pipe_kwargs(self.model, wh, self.args), generator=torch.Generator(self.device).manual_seed(SEED))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_reserved(self.device) - base
        free_memory(self.clock)
        return rnd(peak / MiB, 1)

    def memory_series(self) -> list[SeriesPoint]:
        n = self.args.series_count
        if n <= 0 or "bcg" not in self.args.variants:
            return []
        res = sorted(self.calls, key=lambda wh: wh[0] * wh[1], reverse=True)[:n]
        if not res:
            return []
        out: list[SeriesPoint] = []
        free_memory(self.clock)
        try:
            with torch.no_grad():
                eager_mb = self.call_footprint_mb(res[0])
                accelerate(self.pipe)
                accel = self.pipe.accel
                total_peaks: float | None = 0.0
                done: list[str] = []
                for i, wh in enumerate(res, 1):
                    self.clock.sync()
                    t0 = time.perf_counter()
                    report = accel.warmup(
                        [wh],
                        prompts=[PROMPT],
                        negative_prompt=NEGATIVE if self.cfg else None,
                        cfg=self.cfg,
                        progress=False,
                    )
                    self.clock.sync()
                    done.append(res_name(wh))
                    peak = self.activation_mb.get(wh)
                    total_peaks = None if peak is None or total_peaks is None else total_peaks + peak
                    point = SeriesPoint(
                        model=self.model,
                        n_resolutions=i,
                        added=res_name(wh),
                        resolutions=list(done),
                        warmup_s=rnd(time.perf_counter() - t0, 3),
                        captures=report.total_captures,
                        graph_mb=rnd(accel.graph_memory_bytes() / MiB, 1),
                        pool_mb=rnd((accel.pool.resident_bytes() if accel.pool else 0) / MiB, 1),
                        eager_activation_mb=peak,
                        sum_eager_activation_mb=rnd(total_peaks, 1),
                    )
                    out.append(point)
                    say(
                        f"{self.model} memory series: +{res_name(wh)} -> graph {point.graph_mb} MiB "
                        f"(sum of eager activation peaks {point.sum_eager_activation_mb} MiB)"
                    )
                if out and eager_mb is not None:
                    out[-1].call_eager_mb = eager_mb
                    out[-1].call_accelerated_mb = self.call_footprint_mb(res[0])
                    say(
                        f"{self.model} {res_name(res[0])} call footprint over the weights: eager {eager_mb} MiB, "
                        f"accelerated with {len(res)} resolutions warmed {out[-1].call_accelerated_mb} MiB"
                    )
        except Exception as exc:
            traceback.print_exc()
            out.append(SeriesPoint(model=self.model, n_resolutions=len(out) + 1, error=err_text(exc)))
        finally:
            if "accel" in self.pipe.__dict__:
                self.pipe.accel.restore()
            free_memory(self.clock)
        return out

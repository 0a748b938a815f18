"""results.md: the tables of a run (or of merged runs), written from results.json's content."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .breakdown_table import breakdown_table
from .registry import COMPILED
from .rows import CACHE_ORDER, CaseRow, SeriesPoint, cache_state, split_cases

METHOD = (
    "Method: see the docstring of scripts/bench.py. Host ms = wall time until the call returns; step ms = "
    "CUDA-event time of the call from an idle GPU; back-to-back ms = wall time per call in a sequence; "
    "GPU busy = union of the profiler's GPU activity over that sequence's wall time (profiler overhead "
    "included, so eager's figure is a lower bound). Graph MiB for bcg = shared pool + static inputs + "
    "boundary buffers; for graph = its private pool."
)
CACHE_TEXT = {
    "cold": "cold: inductor's and triton's on-disk caches started empty",
    "warm": "warm: the --compile-cache folder held an earlier run's caches",
    "disabled": "disabled (--no-compile-cache)",
    "mixed": "the runs differ (below); where a cold and a warm run measured the same cases, the tables show "
    "the cold run's numbers and the setup-cost table both",
}


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _header(results: dict, paired: bool) -> list[str]:
    env, cfg = results["env"], results["config"]
    L: list[str] = ["# bcg-diffusers benchmark", ""]
    L.append(
        f"**Device:** {env['device_name']} ({env['device']}"
        + (f", driver {env['driver']}, CUDA {env['cuda']}" if env["device"] == "cuda" else "")
        + ")  "
    )
    L.append(
        f"**Versions:** torch {env['torch']}, diffusers {env['diffusers']}, transformers {env['transformers']}, "
        f"python {env['python']}; bcg-diffusers {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}  "
    )
    when = "merged runs (below)" if results.get("runs") else env["date"]
    e2e = (
        f", end to end: median of {cfg['e2e_runs']} runs after 1 warm-up"
        if cfg.get("e2e_resolutions")
        else ", no end-to-end runs"
    )
    run = (
        f"**Run:** {when}; size {cfg['size']}, dtype {cfg['dtype']}, {cfg['repeats']} timed calls after "
        f"{cfg['warmup_calls']} warm-up{e2e}{' (smoke)' if cfg['smoke'] else ''}; "
        f"total {results.get('elapsed_s', '-')} s"
    )
    state = cfg.get("compile_cache_state")
    if state in CACHE_TEXT and any(v in cfg["variants"] for v in COMPILED):
        L += [run + "  ", f"**Compile cache:** {CACHE_TEXT[state]}"]
    else:
        L.append(run)
    if results.get("runs"):
        L.append("")
        same = (
            "resolution in a table come from the same run (the cold one where a cold and a warm run measured "
            "the same cases):"
            if paired
            else "resolution come from the same run:"
        )
        L.append(f"Merged from {len(results['runs'])} runs, one process each; all variants of one model and {same}")
        L.append("")
        for i, r in enumerate(results["runs"]):
            cache = f", compile cache {r['compile_cache']}" if r.get("compile_cache") else ""
            L.append(
                f"- run {i}: {r['date']}, {' '.join(r['models'])} at {' '.join(r['resolutions'])}, "
                f"variants {' '.join(r['variants'])}, {r.get('elapsed_s', '-')} s{cache}"
            )
    L.append("")
    L.append(
        "Step = one denoiser forward of step 0's first call, median; x = speed-up vs eager measured in the same "
        "process. Z-Image runs as Turbo (guidance 0, 9 steps); Qwen-Image with true CFG (2 calls per step, "
        f"{cfg['steps_e2e']} steps end to end, negative prompt), and bcg pads its text to a length bucket with a "
        "mask, so its output differs from the unpadded stock call by bf16 noise. Where it pads, bcg's end-to-end "
        "calls also join the two guidance branches into one call at batch 2 (cfg_batch); its step is still one "
        "branch's forward at batch 1."
    )
    L.append("")
    return L


class ModelRows:
    """One model's rows: ``by`` the main rows per (resolution, variant), ``others`` the rows of
    further runs of the same cases (a warm run beside a cold one), each with its run's cache state."""

    def __init__(self, results: dict, rows: list[CaseRow], others: list[CaseRow]) -> None:
        self.results = results
        self.rows = rows
        self.variants: list[str] = results["config"]["variants"]
        self.resolutions = list(dict.fromkeys(r.resolution for r in rows))
        self.by = {(r.resolution, r.variant): r for r in rows}
        self.all = [(cache_state(results, r.run), r) for r in rows + others]

    def get(self, res: str, variant: str) -> CaseRow | None:
        return self.by.get((res, variant))

    def value(self, res: str, variant: str, field: str) -> Any:
        r = self.by.get((res, variant))
        return None if r is None else getattr(r, field)

    def states(self, variant: str, field: str) -> list[str | None]:
        """The cache states of the runs that measured ``field`` of ``variant``, cold first."""
        found = {s for s, r in self.all if r.variant == variant and getattr(r, field) is not None}
        return sorted(found, key=lambda s: CACHE_ORDER.index(s) if s in CACHE_ORDER else len(CACHE_ORDER))

    def in_state(self, res: str, variant: str, field: str, state: str | None) -> Any:
        for s, r in self.all:
            if s == state and r.resolution == res and r.variant == variant:
                return getattr(r, field)
        return None


def _step_table(m: ModelRows) -> list[str]:
    L = ["### Denoiser step, ms (speed-up vs eager)", ""]
    L.append("| resolution | " + " | ".join(m.variants) + " | GPU busy eager | GPU busy bcg |")
    L.append("|---|" + "---|" * (len(m.variants) + 2))
    for res in m.resolutions:
        cells = []
        for v in m.variants:
            r = m.get(res, v)
            if r is None:
                cells.append("-")
            elif not r.ok:
                cells.append(r.status)
            elif v == "eager":
                cells.append(f"{r.step_ms:.2f}")
            else:
                cells.append(f"{r.step_ms:.2f} ({_f(r.speedup_vs_eager)}x)")
        busy = [m.value(res, v, "gpu_busy") for v in ("eager", "bcg")]
        L.append(f"| {res} | " + " | ".join(cells) + " | " + " | ".join(_f(b, "{:.0%}") for b in busy) + " |")
    return [*L, ""]


def _host_table(m: ModelRows) -> list[str]:
    L = ["### Host time per call (ms), setup cost (s), memory (MiB)", ""]
    L.append(
        "| resolution | variant | host ms | back-to-back ms | capture / compile s | graph MiB | peak over weights MiB | "
        "eager activation MiB | out max diff vs eager |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for res in m.resolutions:
        for v in m.variants:
            r = m.get(res, v)
            if r is None or not r.ok:
                continue
            if r.capture_s is not None and r.compile_s is not None:  # bcg+compile: both, apart
                setup = f"{r.compile_s:.2f} + {r.capture_s:.2f}"
            else:
                setup = _f(r.capture_s if r.capture_s is not None else r.compile_s)
            L.append(
                f"| {res} | {v} | {_f(r.host_ms)} | {_f(r.seq_ms)} | {setup} | {_f(r.graph_mb, '{:.1f}')} | "
                f"{_f(r.peak_over_base_mb, '{:.1f}')} | {_f(r.activation_mb, '{:.1f}')} | "
                f"{_f(r.out_max_abs_diff, '{:.3g}')} |"
            )
    return [*L, ""]


Column = tuple[str, Callable[[str], str]]


def _by_state(m: ModelRows, variant: str, field: str, label: str, fmt: str) -> list[Column]:
    """One column of ``field``, or one per cache state when cold and warm runs measured it."""
    states = m.states(variant, field)
    if len(states) < 2:
        return [(label, lambda res: _f(m.value(res, variant, field), fmt))]
    return [(f"{label}, {s}", lambda res, s=s: _f(m.in_state(res, variant, field, s), fmt)) for s in states]


def _ratio(m: ModelRows, variant: str) -> Column:
    def cell(res: str) -> str:
        r, cap = m.get(res, variant), m.value(res, "bcg", "capture_s")
        setup = r.setup_s() if r is not None else None
        return f"{setup / cap:.0f}x" if setup and cap else "-"

    return f"{variant} / capture", cell


def _setup_table(m: ModelRows) -> list[str]:
    first_calls = [
        v
        for v in ("compile", "compile-ro", "compile-regional")
        if any(m.value(res, v, "compile_s") for res in m.resolutions)
    ]
    with_graphs = any(m.value(res, "bcg+compile", "capture_s") is not None for res in m.resolutions)
    if not (first_calls or with_graphs) or not ("bcg" in m.variants or with_graphs):
        return []
    columns: list[Column] = [("bcg capture", lambda res: _f(m.value(res, "bcg", "capture_s")))]
    for v in first_calls:
        columns += [*_by_state(m, v, "compile_s", f"{v} first call", "{:.1f}"), _ratio(m, v)]
    if with_graphs:
        columns += [
            *_by_state(m, "bcg+compile", "compile_s", "bcg+compile compile", "{:.1f}"),
            ("bcg+compile capture", lambda res: _f(m.value(res, "bcg+compile", "capture_s"))),
            _ratio(m, "bcg+compile"),
        ]
    L = ["### Setup cost: bcg capture vs torch.compile's first call, s", ""]
    L.append("| resolution | " + " | ".join(h for h, _ in columns) + " |")
    L.append("|---|" + "---|" * len(columns))
    for res in m.resolutions:
        L.append(f"| {res} | " + " | ".join(cell(res) for _, cell in columns) + " |")
    L.append("")
    if {"compile", "compile-ro"} & set(first_calls):
        text = (
            "compile-ro runs right after compile at the same resolution in the same process and reuses the "
            "kernels built there, and later resolutions of a run reuse kernels of earlier ones, so these first "
            "calls, compile-ro's above all, are lower bounds of cold ones. bcg capture likewise follows "
            "earlier captures of the run."
        )
    else:
        text = (
            "Later compiles of a run reuse kernels of earlier ones, so they are lower bounds of cold ones. "
            "bcg capture likewise follows earlier captures of the run."
        )
    if with_graphs:
        text += (
            " bcg+compile's warm-up compiles the repeated blocks (inductor, dynamic shapes) and captures the "
            "graphs over the compiled kernels; the two are timed apart, and its ratio is both over bcg's capture."
        )
        if "compile-regional" in first_calls:
            text += (
                " It runs after compile-regional in the same process and reuses its kernels: a run without "
                "compile-regional gives its own compile cost."
            )
    if any(len(m.states(v, "compile_s")) > 1 for v in COMPILED):
        text += (
            " Cold and warm columns come from separate runs (processes) with the same --compile-cache folder, "
            "empty at the start of the cold one; every ratio is taken inside the cold run."
        )
    return [*L, text, ""]


def _compiled_table(m: ModelRows) -> list[str]:
    rows = [
        (res, r)
        for res in m.resolutions
        for v in ("compile-regional", "bcg+compile")
        if (r := m.get(res, v)) is not None and r.ok
    ]
    if not rows:
        return []
    L = ["### Regional compile, without and with graphs", ""]
    L.append(
        "| resolution | variant | compile s | capture s | step ms | speed-up | compiled graphs | out max diff vs eager | "
        "vs compile-regional |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for res, r in rows:
        L.append(
            f"| {res} | {r.variant} | {_f(r.compile_s)} | {_f(r.capture_s)} | {r.step_ms:.2f} | "
            f"{_f(r.speedup_vs_eager)}x | {_f(r.compiled_graphs, '{}')} | {_f(r.out_max_abs_diff, '{:.3g}')} | "
            f"{_f(r.out_max_abs_diff_vs_regional, '{:.3g}')} |"
        )
    L.append("")
    L.append(
        "compile-regional = diffusers' transformer.compile_repeated_blocks(fullgraph=True, dynamic=True), no "
        "graphs; bcg+compile = accelerate_pipeline(pipe, compile=True). Both differences are to outputs of the "
        "same process."
    )
    return [*L, ""]


def _e2e_table(m: ModelRows) -> list[str]:
    e2e_rows = [r for r in m.rows if r.e2e_s is not None or r.e2e_error]
    if not e2e_rows:
        return []
    L = ["### End to end (full pipeline call, decoded image)", ""]
    L.append(
        "| resolution | variant | steps x calls | e2e s | per step ms | speed-up | first run s | output vs eager |"
    )
    L.append("|---|---|---|---|---|---|---|---|")
    for r in e2e_rows:
        if r.e2e_s is None:
            L.append(f"| {r.resolution} | {r.variant} | - | error | - | - | - | {r.e2e_error} |")
            continue
        if r.variant == "eager":
            match = "reference"
        elif r.e2e_bit_equal:
            match = "bit-equal"
        elif r.e2e_max_abs_diff is not None:
            match = f"max abs diff {r.e2e_max_abs_diff:.3g}"
        else:
            match = "-"
        L.append(
            f"| {r.resolution} | {r.variant} | {r.e2e_steps} x {r.e2e_calls_per_step} | "
            f"{r.e2e_s:.3f} | {_f(r.e2e_per_step_ms)} | {_f(r.e2e_speedup_vs_eager)}x | "
            f"{_f(r.e2e_first_s, '{:.3f}')} | {match} |"
        )
    return [*L, ""]


def _series_table(results: dict, model: str) -> list[str]:
    series = [SeriesPoint.from_dict(s) for s in results.get("memory_series", []) if s["model"] == model]
    if not series:
        return []
    L = ["### Graph memory vs number of captured resolutions (one accelerated pipeline)", ""]
    L.append("| captured | added | warm-up s | graph MiB | sum of eager activation peaks MiB |")
    L.append("|---|---|---|---|---|")
    for s in series:
        if s.error is not None:
            L.append(f"| {s.n_resolutions} | error | - | - | {s.error} |")
        else:
            L.append(
                f"| {s.n_resolutions} | {s.added} | {_f(s.warmup_s)} | {_f(s.graph_mb, '{:.1f}')} | "
                f"{_f(s.sum_eager_activation_mb, '{:.1f}')} |"
            )
    last = series[-1]
    if last.error is None and last.call_eager_mb and last.call_accelerated_mb is not None:
        L += [
            "",
            f"One decoded call at {series[0].added} with these {last.n_resolutions} resolutions warmed: device memory "
            f"torch holds at its peak above the weights (graph pools included), eager {last.call_eager_mb:.1f} MiB, "
            f"accelerated {last.call_accelerated_mb:.1f} MiB "
            f"({last.call_accelerated_mb / last.call_eager_mb:.2f}x eager).",
        ]
    return [*L, ""]


def _notes(m: ModelRows) -> list[str]:
    main = {id(r) for r in m.rows}

    def said(r: CaseRow) -> tuple[str, str | None, list[str]]:
        return r.status, r.reason, r.notes

    # A further run's row is listed only where it says something its main row does not.
    noted = [
        (s, r)
        for s, r in m.all
        if (not r.ok or r.notes)
        and (id(r) in main or (main_row := m.get(r.resolution, r.variant)) is None or said(main_row) != said(r))
    ]
    if not noted:
        return []
    L = ["### Notes, skips and errors", ""]
    for state, r in noted:
        text = r.reason if not r.ok else "; ".join(r.notes)
        run = "" if id(r) in main else f", {state or 'other'} run {r.run}"
        L.append(f"- {r.resolution} {r.variant}{run} ({r.status}): {text}")
    return [*L, ""]


def write_markdown(results: dict, path: Path) -> None:
    """results.md from results (their JSON form: measured or merged)."""
    main, others = split_cases(results)
    L = _header(results, paired=bool(others))
    for model in results["config"]["models"]:
        rows = [r for r in main if r.model == model]
        if not rows:
            continue
        info = results.get("models", {}).get(model, {})
        L.append(f"## {model}" + (f" — {info['describe']}" if info.get("describe") else ""))
        L.append("")
        m = ModelRows(results, rows, [r for r in others if r.model == model])
        for section in (
            _step_table(m),
            _host_table(m),
            _setup_table(m),
            _compiled_table(m),
            _e2e_table(m),
            breakdown_table(m.rows),
            _series_table(results, model),
            _notes(m),
        ):
            L += section
    plots = results.get("plots", {})
    if plots:
        L.append("## Plots")
        L.append("")
        for name, status in plots.items():
            L.append(f"![{name}]({name})" if status == "ok" else f"- {name}: {status}")
        L.append("")
    L.append(METHOD)
    path.write_text("\n".join(L) + "\n")

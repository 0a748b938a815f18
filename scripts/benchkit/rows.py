"""Typed result rows and their JSON form.

results.json keeps the format of the dict rows these classes replaced: a :class:`CaseRow`'s
first 26 fields are always written, in this order; the fields after them appear only once a
variant measured them (a field left at None is not written), as the keys the old code added.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from typing import Any, ClassVar

from .breakdown import Breakdown
from .settings import res_name


def rnd(x: float | None, n: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), n)


def err_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    root = exc.__cause__ or exc.__context__
    if root is not None and root is not exc:  # e.g. capture_end failing after the real error
        text += f" (after {type(root).__name__}: {str(root).strip()})".replace("\n", " ")
    return text if len(text) < 400 else text[:397] + "..."


def failed(row: dict[str, Any], exc: BaseException) -> None:
    """``row`` marked failed by ``exc`` (its traceback printed, its reason one line): one row's
    failure must not cost the others."""
    traceback.print_exc()
    row.update(status="error", reason=err_text(exc))


@dataclasses.dataclass
class CaseRow:
    """One (model, resolution, variant) of a run."""

    model: str
    resolution: str
    width: int
    height: int
    variant: str
    status: str = "skipped"  # ok, skipped, error
    reason: str | None = "not run"
    step_ms: float | None = None  # median of the timed calls, each from an idle GPU
    step_min_ms: float | None = None
    host_ms: float | None = None  # wall time until the call returns
    seq_ms: float | None = None  # wall time per call, back to back
    speedup_vs_eager: float | None = None  # eager's step_ms of the same process over this one's
    gpu_busy: float | None = None
    capture_s: float | None = None  # bcg: the warm-up; graph: warm-up runs + capture
    compile_s: float | None = None  # torch.compile variants: the first call; bcg+compile: compiling
    peak_mb: float | None = None
    peak_over_base_mb: float | None = None
    reserved_growth_mb: float | None = None
    graph_mb: float | None = None
    activation_mb: float | None = None
    out_max_abs_diff: float | None = None  # vs eager's output of the same process
    e2e_s: float | None = None
    e2e_per_step_ms: float | None = None
    e2e_speedup_vs_eager: float | None = None
    variant_wall_s: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    # Written only when measured (None: left out of results.json).
    call: str | None = None
    calls_per_step: int | None = None
    text_tokens: list[int | None] | None = None
    captures: int | None = None
    capture_only_s: float | None = None
    segments_per_graph: list[int] | None = None
    replays: int | None = None
    eager_fallbacks: int | None = None
    compiled_graphs: int | None = None  # compile-regional, bcg+compile: graphs dynamo compiled (recompiles too)
    out_max_abs_diff_vs_regional: float | None = None  # bcg+compile vs compile-regional, same process
    e2e_first_s: float | None = None
    e2e_steps: int | None = None
    e2e_calls_per_step: int | None = None
    e2e_runs: int | None = None
    e2e_peak_mb: float | None = None
    e2e_graph_misses: int | None = None
    e2e_eager_calls: int | None = None
    e2e_bit_equal: bool | None = None
    e2e_max_abs_diff: float | None = None
    e2e_error: str | None = None
    e2e_breakdown: Breakdown | None = None  # one more end-to-end run, split into phases
    run: int | None = None  # merged results: the index of the run that measured it

    ALWAYS: ClassVar[int] = 26  # the leading fields written even when None

    @classmethod
    def new(cls, model: str, wh: tuple[int, int], variant: str) -> CaseRow:
        return cls(model=model, resolution=res_name(wh), width=wh[0], height=wh[1], variant=variant)

    def set(self, **values: Any) -> None:
        for key, value in values.items():
            if key not in _CASE_FIELDS:
                raise AttributeError(f"CaseRow has no field {key!r}")
            setattr(self, key, value)

    def fail(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def setup_s(self) -> float | None:
        """Seconds before the first fast call: capture, the first compiled call, or both."""
        parts = [x for x in (self.compile_s, self.capture_s) if x is not None]
        return sum(parts) if parts else None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {k: v for i, (k, v) in enumerate(data.items()) if i < self.ALWAYS or v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaseRow:
        """A row of a results.json (keys this version does not know are ignored)."""
        values = {k: v for k, v in data.items() if k in _CASE_FIELDS}
        if isinstance(values.get("e2e_breakdown"), dict):
            values["e2e_breakdown"] = Breakdown.from_dict(values["e2e_breakdown"])
        return cls(**values)


_CASE_FIELDS = frozenset(f.name for f in dataclasses.fields(CaseRow))
assert [f.name for f in dataclasses.fields(CaseRow)][CaseRow.ALWAYS - 1] == "notes"


@dataclasses.dataclass
class SeriesPoint:
    """One step of the memory series: one more resolution warmed up on the same accelerated pipeline.

    The last point also has the footprint of one decoded call at the largest resolution: device
    memory reserved at its peak above the weights, eager (the stock pipeline, before accelerating)
    and accelerated (graph pools included: everything torch holds), and their ratio.
    """

    model: str
    n_resolutions: int
    added: str | None = None
    resolutions: list[str] = dataclasses.field(default_factory=list)
    warmup_s: float | None = None
    captures: int | None = None
    graph_mb: float | None = None
    pool_mb: float | None = None
    eager_activation_mb: float | None = None
    sum_eager_activation_mb: float | None = None
    call_eager_mb: float | None = None
    call_accelerated_mb: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.error is not None:
            return {"model": self.model, "n_resolutions": self.n_resolutions, "error": self.error}
        data = dataclasses.asdict(self)
        del data["error"]
        for key in ("call_eager_mb", "call_accelerated_mb"):  # only the last point has them
            if data[key] is None:
                del data[key]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SeriesPoint:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def jsonable(obj: Any) -> Any:
    """``json.dumps`` default: rows as their dicts, anything else as text."""
    if isinstance(obj, (CaseRow, SeriesPoint)):
        return obj.to_dict()
    return str(obj)


def summary(row: CaseRow) -> str:
    """The progress line of one variant."""
    if not row.ok:
        return f"{row.status}: {row.reason}"
    parts = [f"step {row.step_ms:.2f} ms", f"host {row.host_ms:.2f} ms"]
    for key, label, unit in (
        ("capture_s", "capture", "s"),
        ("compile_s", "compile", "s"),
        ("graph_mb", "graph", "MiB"),
        ("peak_over_base_mb", "peak+", "MiB"),
        ("gpu_busy", "busy", ""),
        ("e2e_s", "e2e", "s"),
        ("out_max_abs_diff", "diff", ""),
        ("out_max_abs_diff_vs_regional", "diff vs regional", ""),
    ):
        value = getattr(row, key)
        if value is not None:
            parts.append(f"{label} {value}{(' ' + unit) if unit else ''}")
    if row.e2e_bit_equal is not None:
        parts.append("e2e bit-equal" if row.e2e_bit_equal else f"e2e max diff {row.e2e_max_abs_diff}")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------------
# Reading results: which rows the tables show, and each run's compile-cache state
# ------------------------------------------------------------------------------------------------
CACHE_ORDER = ("cold", "disabled", "warm")  # the first one present is a case's main run


def run_rank(state: str | None, run: int | None) -> tuple[int, int]:
    """Sort key of the runs that measured one case: the first is its main run (cold before warm)."""
    return (CACHE_ORDER.index(state) if state in CACHE_ORDER else len(CACHE_ORDER), -1 if run is None else run)


def cache_state(results: dict[str, Any], run: int | None) -> str | None:
    """ "cold", "warm" or "disabled" for the run that measured a row; None for results from before
    the state was recorded."""
    runs = results.get("runs")
    if runs and run is not None and 0 <= run < len(runs):
        return runs[run].get("compile_cache")
    return results.get("config", {}).get("compile_cache_state")


def split_cases(results: dict[str, Any]) -> tuple[list[CaseRow], list[CaseRow]]:
    """(main rows, rows of further runs of the same case).

    A merge keeps a (model, resolution) measured in two runs only when the runs differ in
    compile-cache state (cold vs warm); the tables show the cold run's rows (every ratio from one
    process) and put the other run's setup seconds beside them.
    """
    rows = [CaseRow.from_dict(c) for c in results["cases"]]
    runs_of: dict[tuple[str, str], set[int | None]] = {}
    for r in rows:
        runs_of.setdefault((r.model, r.resolution), set()).add(r.run)

    main_run = {
        key: min(runs, key=lambda run: run_rank(cache_state(results, run), run)) for key, runs in runs_of.items()
    }
    main = [r for r in rows if r.run == main_run[(r.model, r.resolution)]]
    others = [r for r in rows if r.run != main_run[(r.model, r.resolution)]]
    return main, others

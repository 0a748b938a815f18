"""``pipe.accel.report()``: what an accelerated pipeline did, in lines a person reads.

First the install plan (:meth:`~accel.hooks.plan.InstallPlan.describe`: the modules and their
recipes, the pool, the guard, quantization, parallel, joined guidance); then per accelerated
module: its state (graphs, or eager and why), counters, capture failures and the breaks found,
step caches and their decision paths, guidance batches; then what ``quantize=`` did, the parallel
session, graph memory, and the patches the library has in place in the process.

And what a warm-up cost, per resolution (:class:`WarmupRow`) and in all (:class:`WarmupReport`,
which :meth:`~accel.hooks.accelerator.PipelineAccelerator.warmup` returns and prints as a table).
"""

from __future__ import annotations

import dataclasses

from ..graphs import patches
from .attention.backends import FA3
from .components import component, module_device
from .graph_hook import GraphHook
from .images.decoder_trial import NOT_KEPT, Timing
from .install import Installation
from .recipes.mask_backends import backends_in_use

__all__ = ["WarmupReport", "WarmupRow", "graph_memory_bytes", "image_line", "report"]

NOTHING_WARMED_UP = "nothing warmed up yet: call pipe.accel.warmup(...) or pass capture_on_miss=True"


def graph_memory_bytes(hooks: dict[str, GraphHook]) -> int:
    """Device memory held for graphs: the graph pool(s), static inputs and boundary buffers."""
    # One snapshot of the allocator per pool, not one per runner (they share the pipeline's pool).
    stats = [h.runner.stats(pool=False) for h in hooks.values()]
    pools = {id(h.runner.pool): h.runner.pool for h in hooks.values() if h.runner.pool is not None}
    return sum(p.resident_bytes() for p in pools.values()) + sum(s.static_bytes + s.boundary_bytes for s in stats)


def image_line(installed: Installation, h: GraphHook) -> str:
    """Whether a denoiser's calls give the stock pipeline's image bit for bit, and if not, why
    and with which options they would (the report's promise, checked by the GPU tests)."""
    differs: list[str] = []
    exact_with: list[str] = []
    # A recipe normalises calls only where graphs run on CUDA (elsewhere the stock call runs).
    module = h.module()
    on_cuda = module is not None and module_device(module).type == "cuda"
    inexact = h.recipe.inexact() if h.active and on_cuda else None
    if inexact is not None:
        differs.append(inexact[0])
        exact_with.append(inexact[1])
    if module is not None and FA3 in backends_in_use(module):
        differs.append("its attention runs FlashAttention-3 (exact, not bit for bit cuDNN's attention)")
        exact_with.append("attention=None" if installed.plan.attention is not None else "diffusers' default attention")
    if h.compiled:
        differs.append("its blocks are compiled (graphs give the compiled model's image bit for bit)")
        exact_with.append("compile=False")
    if installed.quantization is not None and installed.quantization.quantizer is not None:
        differs.append(f"its weights are quantized ({installed.quantization.value})")
        exact_with.append("quantize=None")
    if not differs:
        return "    image: the stock pipeline's, bit for bit"
    return (
        f"    image: not the stock pipeline's bit for bit: {'; '.join(differs)}; "
        f"bit for bit with {', '.join(exact_with)}"
    )


def _module_lines(installed: Installation, name: str, h: GraphHook, why_no_graphs: str | None) -> list[str]:
    s = h.runner.stats()
    state = "graphs" if h.active else f"eager ({h.inactive_reason})"
    extra = (", compiled GroupNorms" if h.component else ", compiled blocks") if h.compiled else ""
    if h.recompile_drops:
        extra += f", graphs dropped by {h.recompile_drops} recompiles"
    lines = [
        f"  {name} ({type(component(installed.pipe, name)).__name__}, recipe {h.recipe.name}, {state}{extra}): "
        f"{s.entries} graphs, {s.captures} captures in {s.capture_seconds:.2f}s, {s.replays} replays, "
        f"{s.misses} misses, {s.eager_calls} eager calls, {s.capture_failures} capture failures, "
        f"{s.evictions} evictions, segments per graph {s.segments_per_entry or '-'}"
    ]
    if not h.component:
        lines.append(image_line(installed, h))
    if h.recipe.padding_refused is not None:
        lines.append(f"    text not padded: {h.recipe.padding_refused}")
    events = h.follower.events
    lines.append(f"    guard, last call: {'; '.join(events) if events else 'nothing changed'}")
    reasons = sorted(set(h.runner.blocked.values()))
    lines += [f"    capture failed: {reason}" for reason in reasons if not reason.startswith(NOT_KEPT)]
    lines += [
        f"    decoded eagerly: {reason[len(NOT_KEPT) :].lstrip()}" for reason in reasons if reason.startswith(NOT_KEPT)
    ]
    lines += [f"    capture broke at: {site}" for site in h.runner.found_breaks]
    if h.caches is not None and h.caches.active:
        lines += [f"    step cache, last call: {line}" for line in h.caches.describe()]
        paths = [p for entry in s.paths_per_entry for p in entry]
        lines.append(
            f"    decision paths with graphs: {', '.join(sorted(set(paths))) or 'none yet'}; "
            f"{s.path_captures} captured on the way, {s.path_misses} taken without a graph, "
            f"{s.path_switches} chain switches"
        )
    batch = installed.cfg_batch.get(name)
    if batch is not None:
        lines.append(f"    guidance branches: {batch.joined} pairs run as one batch, {batch.alone} calls alone")
    if not s.entries and h.active:
        lines.append(f"    no graphs: {why_no_graphs or NOTHING_WARMED_UP}")
    return lines


def _memory_lines(installed: Installation) -> list[str]:
    """Graph memory now, and per resolution of the last warm-up beside the eager peak it replaces."""
    lines = [f"  graph memory: {graph_memory_bytes(installed.hooks) / 2**20:.1f} MiB"]
    warmed = next((w for w in reversed(installed.warmups) if not w.skipped and w.rows), None)
    if warmed is None:
        return lines
    per = ", ".join(f"{r.size} {r.resident_bytes / 2**20:.1f} / {r.eager_peak_bytes / 2**20:.1f}" for r in warmed.rows)
    lines.append(f"    last warm-up, graph MiB added / eager peak MiB it replaces: {per}")
    decoded = [r.decoder for r in warmed.rows if r.decoder is not None]
    if decoded:
        said = ", ".join(
            f"{t.label} {'graphs' if t.kept else 'eager'} ({t.graph_ms:.1f} ms graphs, {t.eager_ms:.1f} eager; "
            f"{(t.graph_bytes + t.held_bytes) / 2**20:.0f} MiB graphs, {t.eager_bytes / 2**20:.0f} MiB eager decode)"
            for t in decoded
        )
        lines.append(f"    VAE decoder, timed at that warm-up: {said}")
    return lines


def report(installed: Installation | None, pipeline: str, mode: str) -> str:
    """The report of one accelerator (``installed`` None once it was restored)."""
    head = f"bcg-diffusers: {pipeline}, mode {mode}"
    if installed is None:
        return head + ": restored (not accelerated any more)"
    why = installed.why_no_graphs(module_device(installed.primary))
    if mode == "bcg" and why is not None:  # what was asked is not what runs: the head says both
        head += f" asked, eager here: {why}"
    lines = [head, *installed.plan.describe()]
    for name, h in installed.hooks.items():
        lines += _module_lines(installed, name, h, why)
    if installed.quantization is not None:
        lines += installed.quantization.describe()
    if installed.parallel is not None:
        lines.append(f"  {installed.parallel.describe()}")
    lines += _memory_lines(installed)
    in_place = patches.active()
    lines.append("  patches in place (process-wide): " + ("none" if not in_place else str(len(in_place))))
    lines += [f"    {line}" for line in in_place]
    return "\n".join(lines)


@dataclasses.dataclass
class WarmupRow:
    """What warming up one resolution (and frame count, for video) cost. ``seconds`` is capture
    time; ``compile_seconds`` the first compiled call's (0 without compile); ``frames`` None
    for images. ``resident_bytes``: the graph memory it added (pool growth, static inputs,
    boundary buffers); ``eager_peak_bytes``: the largest eager transient its captures replace (0
    where nothing was captured); ``decoder``: the VAE decoder's trial at this size (replay and
    eager times and memory, whether its graphs were kept and why not), None where it was not tried."""

    width: int
    height: int
    seconds: float
    captures: int
    resident_bytes: int
    compile_seconds: float = 0.0
    frames: int | None = None
    eager_peak_bytes: int = 0
    decoder: Timing | None = None

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
    their seconds both passes); ``skipped`` says why nothing was captured, if so;
    ``peak_reserved_bytes``: the device's peak reserved memory when the warm-up ended (since the
    process began or :func:`accel.graphs.pool.reset_peak_memory`).
    """

    rows: list[WarmupRow]
    compiled_graphs: int = 0
    skipped: str | None = None
    capture_passes: int = 1
    peak_reserved_bytes: int = 0

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

    @property
    def largest_eager_peak_bytes(self) -> int:
        """The largest eager transient the graphs replace: what graph memory is held to."""
        return max((r.eager_peak_bytes for r in self.rows), default=0)

    def __str__(self) -> str:
        if self.skipped:
            return f"nothing captured: {self.skipped}"
        compiled = any(r.compile_seconds for r in self.rows)
        video = any(r.frames is not None for r in self.rows)
        decoder = any(r.decoder is not None for r in self.rows)
        head = f"{'resolution':>12}" + (f" {'frames':>6}" if video else "")
        head += f" {'capture s':>9} {'graphs':>6} {'graph MiB':>10} {'eager peak MiB':>14}"
        head += f" {'decode ms graph/eager':>31}" if decoder else ""
        lines = [head + (f" {'compile s':>9}" if compiled else "")]
        for r in self.rows:
            line = f"{r.width:>5}x{r.height:<6}"
            if video:
                line += f" {r.frames if r.frames is not None else '-':>6}"
            line += (
                f" {r.seconds:9.2f} {r.captures:6d} {r.resident_bytes / 2**20:10.1f} {r.eager_peak_bytes / 2**20:14.1f}"
            )
            if decoder:
                d = r.decoder
                line += f" {'-':>31}" if d is None else f" {_decode(d):>31}"
            lines.append(line + (f" {r.compile_seconds:9.2f}" if compiled else ""))
        total = f"{'total':>12}" + (" " * 7 if video else "")
        total += f" {self.total_seconds:9.2f} {self.total_captures:6d} {self.total_resident_bytes / 2**20:10.1f}"
        total += f" {self.largest_eager_peak_bytes / 2**20:14.1f}" + (" " * 32 if decoder else "")
        lines.append(total + (f" {self.total_compile_seconds:9.2f}" if compiled else ""))
        lines.append(
            "(eager peak: the most a resolution's eager calls allocate above the weights, which its graphs replace)"
        )
        if decoder:
            lines.append(
                "(decode: the VAE decoder's graphs kept where faster than eager beyond noise without raising the "
                "peak memory, or no slower and lowering it ('peak'))"
            )
        if compiled:
            lines.append(f"inductor compiled {self.compiled_graphs} graph(s)")
        if self.capture_passes > 1:
            lines.append(
                f"every case captured {self.capture_passes} times: inductor compiled again during capture "
                "(the earlier graphs were dropped; capture s counts every pass)"
            )
        return "\n".join(lines)


def _decode(t: Timing) -> str:
    return f"{t.graph_ms:.1f} / {t.eager_ms:.1f} {t.verdict}"

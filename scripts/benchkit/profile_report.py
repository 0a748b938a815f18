"""profile.md of scripts/profile_step.py: the header (device, versions, commit), the step's time by
kernel kind (the bf16 step beside a float8 one), the top kernels, the step's products by shape,
the floor they imply, and the call outside the denoiser."""

from __future__ import annotations

from typing import Any

from .breakdown import PHASES
from .kernels import DESCRIPTIONS, KINDS

__all__ = ["markdown"]


def _cell(text: str, limit: int = 160) -> str:
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _section(title: str, intro: str, columns: str, align: str) -> list[str]:
    """A section up to its table's rows: the title, a paragraph saying how to read the table, its head."""
    return ["", f"## {title}", "", intro, "", columns, align]


def _by_kind(f: dict[str, Any]) -> list[str]:
    """A floor's rows, kind by kind: measured, floor, and what is left above it."""
    return [
        f"| {r['kind']} | {r['measured_ms']:.3f} | {r['floor_ms']:.3f} | {r['excess_ms']:.3f} |" for r in f["by_kind"]
    ]


_BY_KIND = ("| kind | measured ms | floor ms | excess ms |", "|---|--:|--:|--:|")


def _peaks(f: dict[str, Any]) -> str:
    return ", ".join(f"{d} {p[0]:g}-{p[1]:g}" for d, p in f["peaks_tflops"].items())


def _header(result: dict[str, Any]) -> list[str]:
    env, cfg, setup_ = result["env"], result["config"], result["setup"]
    compiled = "compiled" if setup_["compiled_blocks"] else "not compiled"
    if not cfg["graphs"]:
        graphs = "graphs off (kernel by kernel)"
    elif setup_["captures"]:
        graphs = "CUDA graphs"
    else:
        graphs = f"no graphs ({setup_['warmup_skipped'] or 'nothing captured'})"
    quant = f", {cfg['quantize']}" if cfg.get("quantize") else ""
    cuda, batch = env["device"] == "cuda", cfg.get("batch", 1)
    images = f", batch {batch}" if batch > 1 else ""
    L = [f"# Per-kernel profile: {cfg['model']} {cfg['resolution']}{images}, {compiled}, {graphs}{quant}", ""]
    L.append(
        f"**Device:** {env['device_name']} ({env['device']}"
        + (f", driver {env['driver']}, CUDA {env['cuda']}" if cuda else "")
        + ")  "
    )
    L.append(
        f"**Versions:** torch {env['torch']}, diffusers {env['diffusers']}, transformers {env['transformers']}, "
        f"python {env['python']}; bcg-diffusers {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}  "
    )
    L.append(
        f"**Run:** {env['date']}; {setup_['describe']}; size {cfg['size']}, {cfg['dtype']}; "
        f"batch {batch} (images per pipeline call, the warm-up's batch size); "
        f"{cfg['steps']} profiled steps after {cfg['warmup_calls']} warm-up and {cfg['steps']} timed ones; "
        f"a step = {cfg['calls_per_step']} denoiser call(s) ({'; '.join(cfg['calls'])})  "
    )
    L.append(
        f"**Setup:** warm-up {setup_['warmup_s']} s (compile {setup_['compile_s']} s, "
        f"{setup_['compiled_blocks']} compiled blocks), {setup_['captures']} graph(s), {setup_['graph_mb']} MiB of graphs"
        + (f"; {setup_['quantization']}" if setup_.get("quantization") else "")
    )
    return [*L, ""]


def _kinds(result: dict[str, Any], beside: dict[str, Any] | None) -> list[str]:
    timing, prof, cuda = result["timing"], result["profile"], result["env"]["device"] == "cuda"
    clock, batch = "CUDA events" if cuda else "wall clock", result["config"].get("batch", 1)
    per_step = (
        f"**ms per denoiser step:** {timing['step_ms']:.2f} unprofiled (median, {clock}; "
        f"{timing['step_ms'] / batch:.2f} per image at batch {batch}); {prof['step_ms']:.2f} "
        "profiled (mean window: first launch to the end of the step's synchronisation)"
    )
    if prof["events"]:
        per_step += (
            f", of which device busy {prof['busy_ms']:.2f}, idle {prof['idle_ms']:.2f} ({prof['idle_share']:.1%}; "
            f"{prof['gaps_ms']:.2f} between the first and the last kernel)"
        )
    L = [per_step + "."]
    if beside is not None:
        ms = beside["timing"]["step_ms"]
        L.append(f"The bf16 step beside it (same pipeline, compiled graphs): {ms:.2f} ms ({ms / batch:.2f} per image).")
    L.append("")
    L += [f"> {note}\n" for note in result["notes"]]
    head = "| kind | group | kernels/step | ms/step | share of step |" + (" bf16 ms/step |" if beside else "")
    L += [head + " what |", "|---|---|--:|--:|--:|" + ("--:|" if beside else "") + "---|"]
    other = beside["profile"]["kinds"] if beside else {}
    for k in KINDS:
        row = prof["kinds"][k]
        extra = f" {other[k]['ms_per_step']:.3f} |" if beside else ""
        L.append(
            f"| {k} | {row['group']} | {row['count_per_step']:g} | {row['ms_per_step']:.3f} | "
            f"{row['share']:.1%} |{extra} {DESCRIPTIONS[k]} |"
        )
    idle = (f"{prof['idle_ms']:.3f}", f"{prof['idle_share']:.1%}") if prof["events"] else ("-", "-")
    extra = f" {beside['profile']['idle_ms']:.3f} |" if beside else ""
    L.append(f"| idle | | | {idle[0]} | {idle[1]} |{extra} step window minus the union of busy intervals |")
    if prof["overlap_ms"] > 0:
        L += ["", f"Kernels overlapped on several streams for {prof['overlap_ms']:.3f} ms per step (counted in each)."]
    return L


def _top(prof: dict[str, Any], top: int) -> list[str]:
    L = ["", f"## Top {top} kernels", ""]
    kernels = list(prof["kernels"].items())[:top]
    if not kernels:
        return [*L, "No CUDA kernel recorded."]
    L += ["| # | kind | calls/step | ms/step | share | kernel |", "|--:|---|--:|--:|--:|---|"]
    for i, (kname, k) in enumerate(kernels, 1):
        L.append(
            f"| {i} | {k['kind']} | {k['count'] / prof['steps']:g} | {k['ms_per_step']:.3f} | "
            f"{k['share']:.1%} | {_cell(kname)} |"
        )
    return L


def _gemms(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    L = _section(
        "The step's matrix products by shape",
        "M rows (tokens x batch), K in, N out; TFLOP/s measured alone (float8: `torch._scaled_mm` rowwise, "
        "fast accumulation, quantization left out; bf16: `F.linear`).",
        "| dtype | M | K | N | calls/step | GFLOP/step | TFLOP/s alone | ms/step alone | layers | e.g. |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    )
    for r in rows:
        rate = "-" if r["tflops_alone"] is None else f"{r['tflops_alone']:g}"
        ms = "-" if r["ms_per_step_alone"] is None else f"{r['ms_per_step_alone']:.3f}"
        L.append(
            f"| {r['dtype']} | {r['m']} | {r['k']} | {r['n']} | {r['calls_per_step']} | {r['gflop_per_step']:.1f} | "
            f"{rate} | {ms} | {r['layers']} | {_cell(r['example'], 60)} |"
        )
    return L


def _floor(name: str, f: dict[str, Any]) -> list[str]:
    lo, hi = f["floor_ms"]
    achieved = ", ".join(f"{d} {v:g}" for d, v in f["achieved_tflops"].items() if v)
    L = _section(
        f"Floor: {name}",
        f"GEMMs at the measured peak ({_peaks(f)} TFLOP/s"
        + (
            f"; or their bytes at the memory's {f['bandwidth_tbs']:g} TB/s where longer"
            if f.get("bandwidth_tbs")
            else ""
        )
        + "), every other kernel as measured, no idle time: "
        f"**{lo:.2f}-{hi:.2f} ms** per step; measured {f['step_ms']:.2f} ms, "
        f"{f['ratio'][1]:.2f}x-{f['ratio'][0]:.2f}x the floor"
        + (f"; each shape at its own rate alone: {f['at_shapes_ms']:.2f} ms" if f["at_shapes_ms"] else "")
        + f". Achieved in the step: {achieved or '-'} TFLOP/s.",
        *_BY_KIND,
    )
    L += _by_kind(f)
    if f["holder"]:
        L += ["", f"What is left is held mostly by **{f['holder']}**."]
    return L


def _attention(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    L = _section(
        "The step's attention by shape",
        "TFLOP/s measured alone: cuDNN's SDPA, FlashAttention-3 in bf16 and on float8 operands (quantization "
        "left out); - where not measured (no CUDA, no fa3-fwd wheel).",
        "| dtype | batch | queries | keys | heads | dim | calls/step | GFLOP/step | SDPA | FA3 | FA3 float8 | layers |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    )
    for r in rows:
        rate = {k: "-" if v is None else f"{v:g}" for k, v in r["tflops_alone"].items()}
        L.append(
            f"| {r['dtype']} | {r['batch']} | {r['query_tokens']} | {r['key_tokens']} | {r['heads']} | {r['head_dim']} "
            f"| {r['calls_per_step']} | {r['flop_per_step'] / 1e9:.1f} | {rate['sdpa']} | {rate['fa3']} | "
            f"{rate['fa3_fp8']} | {r['layers']} |"
        )
    return L


def _work_floor(name: str, f: dict[str, Any]) -> list[str]:
    lo, hi = f["floor_ms"]
    roof = f"; or their bytes at {f['bandwidth_tbs']:g} TB/s where longer" if f.get("bandwidth_tbs") else ""
    fp8 = len(f["attention_layers_fp8"])
    return _section(
        f"Floor from the work: {name}",
        f"Products at the measured peak ({_peaks(f)} TFLOP/s{roof}), attention at the rate measured alone "
        f"({f['attention_rates']}; {fp8} attention layers in float8), nothing else: **{lo:.2f}-{hi:.2f} ms** per "
        f"step; measured {f['step_ms']:.2f} ms, {f['ratio'][1]:.2f}x-{f['ratio'][0]:.2f}x the floor. With every "
        f"attention call in bf16: {f['floor_all_bf16_attention_ms'][0]:.2f}-{f['floor_all_bf16_attention_ms'][1]:.2f} "
        f"ms; in float8: {f['floor_all_fp8_attention_ms'][0]:.2f}-{f['floor_all_fp8_attention_ms'][1]:.2f} ms.",
        *_BY_KIND,
    ) + _by_kind(f)


def _outside(out: dict[str, Any]) -> list[str]:
    L = ["", "## The call outside the denoiser", ""]
    images = f"{out.get('batch', 1)} image(s), "
    L.append(
        f"One end-to-end call ({images}{out['steps']} steps, decoded), {out['graphs']['clock']}; ms (share of the call):"
    )
    L += ["", "| phase | decoder graphs | decoder eager |", "|---|--:|--:|"]
    for key, label, _ in PHASES:
        a, b = out["graphs"]["phases"][key], out["eager_decoder"]["phases"][key]
        L.append(f"| {label} | {a['ms']:.1f} ({a['share']:.0%}) | {b['ms']:.1f} ({b['share']:.0%}) |")
    a, b = out["graphs"], out["eager_decoder"]
    L.append(f"| **call** | {a['call_ms']:.1f} | {b['call_ms']:.1f} |")
    L += ["", f"Decoder replays in the graphs call: {out['decoder_replays']}; the rest of the loop is the scheduler "
          "and guidance."]  # fmt: skip
    return L


def markdown(result: dict[str, Any], top: int) -> str:
    """profile.md of ``result`` (the dict profile.json holds)."""
    beside = result.get("beside")
    L = _header(result) + _kinds(result, beside) + _top(result["profile"], top)
    L += _gemms(result.get("gemms", []))
    L += _attention(result.get("attention", []))
    for name, f in result.get("floor", {}).items():
        L += _floor(name, f)
    for name, f in result.get("work_floor", {}).items():
        L += _work_floor(name, f)
    if result.get("outside"):
        L += _outside(result["outside"])
    L += [
        "",
        "Method: see the docstring of scripts/profile_step.py. Shares are of the profiled step's wall time; "
        "kinds from scripts/benchkit/kernels.py (a fused Triton kernel takes the kind of its dominant op).",
        "",
    ]
    return "\n".join(L)

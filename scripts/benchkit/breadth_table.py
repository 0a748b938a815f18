"""breadth.md of scripts/bench_breadth.py: the device and versions, then one row per family, from
breadth.json's content."""

from __future__ import annotations

from typing import Any

__all__ = ["table"]


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else "-"


def _setting(row: dict[str, Any]) -> str:
    g = row.get("geometry") or {}
    if not g:
        return "-"
    frames = f"x{g['frames']}f" if g.get("frames") else ""
    return f"{g['width']}x{g['height']}{frames}, {row.get('usual_steps')} steps{', CFG' if row.get('cfg') else ''}"


def _ok(v: dict[str, Any] | None) -> bool:
    return bool(v) and v.get("status", "ok") == "ok"


def _cell(v: dict[str, Any] | None, key: str, fmt: str) -> str:
    if not v:
        return "-"
    return _f(v.get(key), fmt) if _ok(v) else v.get("status", "-")


def _misses(g: dict[str, Any] | None) -> str:
    if not _ok(g):
        return "-"
    w = g.get("warmup") or {}
    if "error" in w:
        return "warm-up failed"
    if "captures" not in w:
        return "no warm-up"
    c = g["timed_calls"]
    return f"{c['misses']} misses, {c['eager_calls']} eager" if c["misses"] or c["eager_calls"] else "0"


def _equal(v: dict[str, Any] | None, key: str = "equal") -> str:
    if not _ok(v):
        return (v or {}).get("status", "-")
    if v.get(key):
        return "yes"
    return f"NO ({v.get('max_abs_diff', v.get('max_abs_diff_to_compiled_eager'))})"


def table(results: dict[str, Any]) -> str:
    """breadth.md: the device and versions, then a row per family."""
    rows = list(results["results"].values())
    env = next((r["env"] for r in rows if r.get("env")), {})
    cfg = results["config"]
    lines = [
        "# Breadth: diffusers pipelines at their released denoiser configs",
        "",
        f"**Device:** {env.get('device_name', '?')} ({env.get('device', cfg['device'])}"
        + (f", driver {env.get('driver')}, CUDA {env.get('cuda')}" if env.get("device") == "cuda" else "")
        + f"), {cfg['dtype']}, size {cfg['size']}  ",
        f"**Versions:** torch {env.get('torch')}, diffusers {env.get('diffusers')}, transformers "
        f"{env.get('transformers')}, Python {env.get('python')}  ",
        f"**Project:** commit {env.get('git_commit')}{' (uncommitted changes)' if env.get('git_dirty') else ''}, "
        f"{results['date']}  ",
        f"**Command:** `python scripts/bench_breadth.py {' '.join(cfg['argv'])}`",
        "",
        "Random weights, random prompt embeddings of the released shapes, "
        + (
            '`output_type="pt"` (the VAE decode included, the images compared)'
            if cfg.get("decode")
            else '`output_type="latent"`'
        )
        + ". Per step: the "
        f"slope of wall time over calls at {' and '.join(map(str, cfg['steps']))} steps; end to end: its intercept "
        "plus the usual step count times per step (a measured call where that count is among them, else derived). Graphs: "
        "`accelerate_pipeline(pipe)` with default options and a warm-up at the geometry; equal: the latents "
        "bit for bit against eager (compiled: against the same compiled model with graphs off). Ratios: eager "
        "over the variant, per step (end to end).",
        "",
        "| pipeline | setting | graphs by default | why not | equal | eager ms/step | graphs ms/step "
        "| compiled ms/step | eager s | graphs s | compiled s | graphs x | compiled x | compiled equal "
        "| warm-up misses |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        v = r.get("variants") or {}
        e, g, c = v.get("eager"), v.get("graphs"), v.get("compiled")
        why = (g or {}).get("why_not") or (g or {}).get("reason") or ""
        if r.get("status") != "ok":
            why = f"{r.get('status')}: {r.get('reason', '')}"
        ratios = []
        for other in (g, c):
            if _ok(other) and _ok(e):
                ratios.append(
                    f"{_ratio(e['per_step_ms'], other['per_step_ms'])} ({_ratio(e['e2e_s'], other['e2e_s'])})"
                )
            else:
                ratios.append("-")
        cells = [
            f"{r['name']} ({r.get('pipeline', '?')})",
            _setting(r),
            g.get("graphs_used", "-") if _ok(g) else "-",
            why.replace("|", "/")[:240],
            _equal(g),
            _cell(e, "per_step_ms", "{:.1f}"),
            _cell(g, "per_step_ms", "{:.1f}"),
            _cell(c, "per_step_ms", "{:.1f}"),
            _cell(e, "e2e_s", "{:.2f}"),
            _cell(g, "e2e_s", "{:.2f}"),
            _cell(c, "e2e_s", "{:.2f}"),
            *ratios,
            _equal(c, "equal_to_compiled_eager"),
            _misses(g),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    skipped: dict[str, list[str]] = {}  # reason -> families
    for r in rows:
        c = (r.get("variants") or {}).get("compiled") or {}
        if c.get("status") == "skipped":
            skipped.setdefault(c["reason"], []).append(r["name"])
    if skipped:
        why = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in skipped.items())
        lines += ["", f"Compiled variant skipped: {why}."]
    return "\n".join(lines) + "\n"

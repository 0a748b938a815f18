"""The checks and tables of scripts/bench_lora_switch.py: the bars and equalities of a model's
rows, and lora.md."""

from __future__ import annotations

import math
from typing import Any

HOT_SWAP_BAR = 0.1  # a hot-swap's cost over the floor, as a fraction of a recapture's


def checks(rows: list[dict[str, Any]], graphs: bool) -> list[dict[str, Any]]:
    """The bars and the equalities, each ``{"what", "ok", "asserted"}`` (``ok`` None: not checked);
    only ``asserted`` ones set the exit status. Without graphs (a CPU) no bar means anything."""
    by = {r["variant"]: r for r in rows}
    out: list[dict[str, Any]] = []

    def add(what: str, ok: bool | None, asserted: bool = True) -> None:
        out.append({"what": what, "ok": ok, "asserted": asserted})

    for r in rows:
        if r["status"] != "ok":
            add(f"{r['variant']} ran ({r.get('reason', '')})", False)
    if not graphs:
        add("the bars: not checked, nothing was captured (no graphs)", None, asserted=False)
    else:
        for variant, want in (("hot-swap", "0"), ("switch-back", "0"), ("recapture", ">0")):
            r = by.get(variant)
            if r is None or r["status"] != "ok":
                continue
            caps = r["captures"] + r.get("switch_to_b_captures", [])
            ok = all(c > 0 for c in caps) if want == ">0" else all(c == 0 for c in caps)
            add(f"{variant}: captures {caps} (bar: {want} on every call)", ok)
        r = by.get("switch-back")
        if r is not None and r["status"] == "ok":
            add(
                f"switch-back: b's state captured in the prelude ({r['prelude_captures']})",
                r["prelude_captures"][1] > 0,
            )
    swap, again = by.get("hot-swap", {}), by.get("recapture", {})
    if graphs and "cost_s" in swap and "cost_s" in again:
        ratio = swap["cost_s"] / again["cost_s"] if again["cost_s"] > 0 else math.inf
        add(
            f"hot-swap cost {swap['cost_s']:.3f} s = {ratio:.3f} of recapture's {again['cost_s']:.3f} s "
            f"(bar < {HOT_SWAP_BAR}; totals {swap['total_s']:.3f} s and {again['total_s']:.3f} s)",
            ratio < HOT_SWAP_BAR,
            asserted=False,
        )
    if "differs_from_plain" in swap:
        add("hot-swap: the swapped LoRA changes the image", swap["differs_from_plain"])
    for r in rows:
        c = r.get("check")
        if c is None:
            continue
        shown = "equal" if c["equal"] else f"max abs {c['max_abs']}"
        add(f"{r['variant']}: image vs {c['reference']}: {shown}", c["equal"], asserted=c["exact_expected"])
    return out


def header(env: dict[str, Any]) -> str:
    dirty = " (dirty)" if env.get("git_dirty") else ""
    return (
        f"{env['device_name']} ({env['device']}), torch {env['torch']}, diffusers {env['diffusers']}, "
        f"peft {env.get('peft')}, transformers {env['transformers']}, commit {env['git_commit']}{dirty}, {env['date']}"
    )


def setup_line(setup: dict[str, Any]) -> str:
    if not setup:
        return "Setup: not finished (see the rows)"
    line = (
        f"Setup (accelerate + warm-up): {setup['setup_s']} s, {setup['warmup_captures']} captures in "
        f"{setup['warmup_capture_s']} s"
    )
    return line if setup["graphs"] else f"{line}; no graphs: {setup['no_graphs_why']}"


def markdown(env: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [header(env), ""]
    for res in results:
        s = res["settings"]
        lines += [
            f"### {res['model']} ({s['size']}), {s['resolution']}, {s['steps']} steps, LoRA rank {s['rank']}, "
            f"{s['repeats']} repeats, reference {s['reference']}{', exact text' if s['exact_text'] else ''}",
            "",
            setup_line(res["setup"]),
            "",
            "| variant | change s | next call s | total s | cost over floor s | captures | capture s | vs reference | status |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            c = r.get("check")
            ref = "" if c is None else ("equal" if c["equal"] else f"max abs {c['max_abs']}")
            lines.append(
                f"| {r['variant']} | {r.get('change_s', '')} | {r.get('call_s', '')} | {r.get('total_s', '')} | "
                f"{r.get('cost_s', '')} | {r.get('captures', '')} | {r.get('capture_s', '')} | {ref} | "
                f"{r['status']} {r.get('reason', '')} |"
            )
        lines += ["", "Checks:"]
        for c in res["checks"]:
            mark = "skipped" if c["ok"] is None else "ok" if c["ok"] else "FAILED" if c["asserted"] else "missed"
            lines.append(f"- {mark}: {c['what']}{'' if c['asserted'] else ' (reported, not asserted)'}")
        lines.append("")
    return "\n".join(lines)

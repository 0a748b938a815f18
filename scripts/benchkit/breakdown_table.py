"""The table of the rows' breakdowns in results.md (``### Where a pipeline call spends its time``).

Reads :class:`benchkit.rows.CaseRow` and :mod:`benchkit.breakdown`; :mod:`benchkit.report` places it.
"""

from __future__ import annotations

from .breakdown import CLOCKS, PHASE_KEYS, PHASES, Breakdown
from .rows import CaseRow

TITLE = "### Where a pipeline call spends its time"


def _cell(b: Breakdown, key: str) -> str:
    phase = b.phases.get(key)
    return "-" if phase is None else f"{phase.ms:.1f} ({phase.share:.0%})"


def _calls(b: Breakdown) -> str:
    text, denoiser = b.phases.get("text_encoder"), b.phases.get("denoiser")
    return f"{text.calls if text else '-'} / {denoiser.calls if denoiser else '-'}"


def breakdown_table(rows: list[CaseRow]) -> list[str]:
    """The rows' breakdowns, one table line each; nothing when none has one."""
    rows = [r for r in rows if r.e2e_breakdown is not None]
    if not rows:
        return []
    heads = [label for _, label, _ in PHASES]
    L = [TITLE, ""]
    L.append(
        "| resolution | variant | call ms | "
        + " | ".join(f"{h} ms" for h in heads)
        + " | outside the denoiser ms | calls (text / denoiser) |"
    )
    L.append("|---|---|---|" + "---|" * (len(heads) + 2))
    for r in rows:
        b = r.e2e_breakdown
        L.append(
            f"| {r.resolution} | {r.variant} | {b.call_ms:.1f} | "
            + " | ".join(_cell(b, key) for key in PHASE_KEYS)
            + f" | {b.outside_denoiser_ms:.1f} ({b.outside_denoiser_share:.0%}) | {_calls(b)} |"
        )
    L.append("")
    clocks = sorted({r.e2e_breakdown.clock for r in rows})
    how = (
        "CUDA events recorded on the current stream at each phase's start and end, one synchronize after the call"
        if clocks == [CLOCKS["cuda"]]
        else "host clocks (no GPU)"
        if clocks == [CLOCKS["host"]]
        else "per row: " + ", ".join(clocks)
    )
    L.append(
        "One more end-to-end call per variant after the timed ones, split by hooks removed afterwards (forward "
        "pre/post hooks on the text encoder and the denoiser; wrappers on encode_prompt, the loop's progress bar, "
        f"vae.decode and image_processor.postprocess), timed with {how}. Each cell: ms (share of the call); the "
        "phases do not overlap and sum to the call. "
        + "; ".join(f"{label}: {what}" for _, label, what in PHASES)
        + ". Outside the denoiser = call minus the denoiser's calls."
    )
    notes = [f"{r.resolution} {r.variant}: {'; '.join(r.e2e_breakdown.notes)}" for r in rows if r.e2e_breakdown.notes]
    if notes:
        L += ["", *(f"- {n}" for n in notes)]
    return [*L, ""]

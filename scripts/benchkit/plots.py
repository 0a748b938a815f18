"""step_time.png (step time per variant and resolution) and graph_memory.png (the memory series)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .rows import CaseRow, SeriesPoint, err_text, split_cases
from .settings import PLOTS


def _step_time(plt: Any, results: dict, models: list[str], rows: list[CaseRow], out: Path) -> None:
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mrows = [r for r in rows if r.model == model]
        ress = sorted(dict.fromkeys((r.width, r.height) for r in mrows), key=lambda wh: wh[0] * wh[1])
        for v in results["config"]["variants"]:
            pts = sorted(
                ((r.width * r.height / 1e6, r.step_ms) for r in mrows if r.variant == v and r.ok), key=lambda p: p[0]
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
        ax.set_xticks([w * h / 1e6 for w, h in ress])
        ax.set_xticklabels([f"{w}x{h}" for w, h in ress], rotation=30, fontsize=8)
        ax.set_xlabel("resolution (x: megapixels)")
        ax.set_ylabel("denoiser step, ms (median)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    env = results["env"]
    fig.suptitle(f"step time per variant - {env['device_name']}, torch {env['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)


def _graph_memory(plt: Any, results: dict, models: list[str], out: Path) -> None:
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    points = [SeriesPoint.from_dict(s) for s in results.get("memory_series", [])]
    for ax, model in zip(axes[0], models):
        series = [s for s in points if s.model == model and s.error is None]
        if series:
            x = [s.n_resolutions for s in series]
            ax.plot(x, [s.graph_mb for s in series], marker="o", label="bcg graph memory (one shared pool)")
            sums = [s.sum_eager_activation_mb for s in series]
            if all(v is not None for v in sums):
                ax.plot(x, sums, marker="s", linestyle="--", label="sum of eager activation peaks")
            ax.set_xticks(x)
            ax.set_xticklabels([f"{s.n_resolutions}\n+{s.added}" for s in series], fontsize=8)
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no series", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("captured resolutions (cumulative)")
        ax.set_ylabel("MiB")
        ax.set_title(model)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "graph_memory.png", dpi=110)
    plt.close(fig)


def write_plots(results: dict, out: Path) -> dict[str, str]:
    """Draw both plots from results (their JSON form); returns each plot's status."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return {name: f"skipped: matplotlib unavailable ({err_text(exc)})" for name in PLOTS}
    status: dict[str, str] = {}
    rows, _ = split_cases(results)  # a cold/warm pair of runs: the cold run's rows
    models = [m for m in results["config"]["models"] if any(r.model == m for r in rows)] or ["-"]
    try:
        _step_time(plt, results, models, rows, out)
        status["step_time.png"] = "ok"
    except Exception as exc:
        status["step_time.png"] = f"error: {err_text(exc)}"
    if not results.get("memory_series"):
        status["graph_memory.png"] = "skipped: no memory series in these results (--series-count 0)"
        return status
    try:
        _graph_memory(plt, results, models, out)
        status["graph_memory.png"] = "ok"
    except Exception as exc:
        status["graph_memory.png"] = f"error: {err_text(exc)}"
    return status

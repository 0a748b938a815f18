"""scripts/bench_serve.py's report: the median of the repeats, the ratios the bars are stated in
(each within one run), and serve.md.

The variant table adds, for the server runs, the split of a request's mean latency into queue
wait, device, encoding and the rest (:func:`benchkit.serve_runs.split`). The ratios: the server's
images/s over the pipeline's own single-call rate (``pipeline``), batched over unbatched at the
same number of clients, the one-client p50 over one pipeline call's p50, and continuous over
batched: images/s at the same clients, and p50/p95/p99 and images/s at the same open-loop
arrival rate. Speed is reported, never asserted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["SPLIT", "markdown", "median_rows", "ratios", "warmup_rows"]

# The server runs' split of a request's mean latency (serve_runs.split), by column.
SPLIT = {"mean ms": "mean_ms", "queue ms": "queue_ms", "device ms": "device_ms", "encode ms": "encode_ms",
         "rest ms": "rest_ms"}  # fmt: skip
SHAPE_NOTE = (
    "rows / bucket: the mean rows of requests and the mean bucket of the device's runs, pipeline calls "
    "(batched) or steps (continuous), from /metrics (bcg_serve_batch_size, bcg_serve_padded_rows)."
)
SPLIT_NOTE = (
    "The server runs' mean latency per request, split from /metrics scraped around the run: queue (arrival "
    "to its batch taken by the device worker), device (its batch's pipeline calls, Engine.make's host work "
    "included), encode (its files and base64, on the server's encoding threads), rest (the mean less those: HTTP, "
    "JSON, the client, the hand-offs between threads; serve.json's server_ms is arrival to files encoded)."
)


def median_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (variant, clients, batch), the repeat with the median images/s, and every repeat's."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["clients"], r.get("batch"), r.get("arrival_rate")), []).append(r)
    out = []
    for runs in groups.values():
        runs = sorted(runs, key=lambda r: r["images_per_s"])
        out.append(dict(runs[len(runs) // 2], repeats=len(runs), images_per_s_all=[r["images_per_s"] for r in runs]))
    return out


def _find(rows: Sequence[dict[str, Any]], variant: str, clients: int | None = None,
          rate: float | None = None) -> dict[str, Any] | None:  # fmt: skip
    return next((r for r in rows if r["variant"] == variant and (clients is None or r["clients"] == clients)
                 and r.get("arrival_rate") == rate), None)  # fmt: skip


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The ratios of the median rows, by name (only those whose two rows ran)."""
    out: dict[str, float] = {}
    pipe = _find(rows, "pipeline")
    for r in rows:
        rate = r.get("arrival_rate")
        if r["variant"] == "continuous":
            batched = _find(rows, "batched", r["clients"], rate)
            if batched is None:
                continue
            if rate is None:
                out[f"continuous_over_batched_{r['clients']}_clients"] = round(
                    r["images_per_s"] / batched["images_per_s"], 3
                )
            else:
                for q in ("p50", "p95", "p99"):
                    out[f"continuous_over_batched_{q}_at_{rate:g}_per_s"] = round(r[f"{q}_ms"] / batched[f"{q}_ms"], 3)
                out[f"continuous_over_batched_images_per_s_at_{rate:g}_per_s"] = round(
                    r["images_per_s"] / batched["images_per_s"], 3
                )
            continue
        if r["variant"] not in ("batched", "unbatched") or rate is not None:
            continue
        c = r["clients"]
        if pipe is not None:
            out[f"{r['variant']}_{c}_over_pipeline_images_per_s"] = round(r["images_per_s"] / pipe["images_per_s"], 3)
        unbatched = _find(rows, "unbatched", c)
        if r["variant"] == "batched" and unbatched is not None:
            out[f"batched_over_unbatched_{c}_clients"] = round(r["images_per_s"] / unbatched["images_per_s"], 3)
        if c == 1 and pipe is not None:
            out[f"{r['variant']}_1_p50_over_pipeline_p50"] = round(r["p50_ms"] / pipe["p50_ms"], 3)
    return out


def warmup_rows(engine: Any) -> list[dict[str, Any]]:
    """What warming up each bucket cost (:class:`pipelines.serve.warmup.BucketCost`), largest first."""
    return [dict(batch=b, seconds=round(c.seconds, 3), calls=c.calls, compiled_graphs=c.compiled,
                 graph_mib=round(c.graph_bytes / 2**20, 1), peak_mib=round(c.peak_bytes / 2**20, 1))
            for b, c in sorted(engine.warmup_costs.items(), reverse=True)]  # fmt: skip


def markdown(rows: Sequence[dict[str, Any]], warm: Sequence[dict[str, Any]], result: dict[str, Any]) -> str:
    """serve.md: the settings, the warm-up per bucket, the runs, the ratios, the device."""
    lines = [f"# bcg-serve: {result['settings']['argv']}", "",
             f"build {result['build_seconds']:.1f} s, warm-up {result['warmup_seconds']:.1f} s", ""]  # fmt: skip
    if warm:
        lines += [
            "| warm-up of batch | seconds | calls | graphs compiled | graph MiB | peak MiB |",
            "|---|---|---|---|---|---|",
        ]
        lines += [f"| {w['batch']} | {w['seconds']:.2f} | {w['calls']} | {w['compiled_graphs']} | {w['graph_mib']} | "
                  f"{w['peak_mib']} |" for w in warm]  # fmt: skip
        lines.append("")
    lines += [
        "| variant | clients | batch | images/s | p50 ms | p95 ms | p99 ms | requests a call | rows / bucket | "
        + " | ".join(SPLIT)
        + " |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(SPLIT),
    ]
    for r in rows:
        batch = r.get("batch") or r.get("max_batch") or ""
        split = " | ".join("" if r.get(k) is None else f"{r[k]:.1f}" for k in SPLIT.values())
        who = r["clients"] if r.get("arrival_rate") is None else f"open, {r['arrival_rate']:g}/s"
        p99 = f"{r['p99_ms']:.0f}" if r.get("p99_ms") is not None else ""
        shape = f"{r['rows_mean']:.2f} / {r['bucket_mean']:.2f}" if r.get("runs") else ""
        lines.append(f"| {r['variant']} | {who} | {batch} | {r['images_per_s']:.2f} | {r['p50_ms']:.0f} | "
                     f"{r['p95_ms']:.0f} | {p99} | {r['requests_per_call'] or ''} | {shape} | {split} |")  # fmt: skip
    lines += ["", SPLIT_NOTE, "", SHAPE_NOTE]
    calls = [f"{r['variant']} at {r['clients']} client(s): {' '.join(map(str, r['call_images']))}" for r in rows
             if r.get("call_images")]  # fmt: skip
    if calls:
        lines += ["", "Images of each pipeline call, in order (each call runs at its bucket; the rest is padding): "
                  + "; ".join(calls) + "."]  # fmt: skip
    lines += ["", "ratios (one run): " + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()), ""]
    lines += [f"settings: {json.dumps(result['settings'])}", f"env: {json.dumps(result['env'])}", ""]
    return "\n".join(lines)

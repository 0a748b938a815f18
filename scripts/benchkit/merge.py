"""``--merge``: one report from runs made in separate processes on one machine setup."""

from __future__ import annotations

from typing import Any

from .registry import VARIANTS
from .rows import rnd, run_rank
from .settings import by_area, parse_resolution

MERGE_SAME_ENV = ("device", "device_name", "driver", "torch", "diffusers", "transformers")
MERGE_SAME_CONFIG = ("size", "dtype")


def _check_same_setup(parts: list[dict]) -> None:
    first = parts[0]
    for i, part in enumerate(parts[1:], 1):
        for key in MERGE_SAME_ENV:
            if part["env"].get(key) != first["env"].get(key):
                raise ValueError(f"run {i} differs in env {key}: {part['env'].get(key)!r} vs {first['env'].get(key)!r}")
        for key in MERGE_SAME_CONFIG:
            if part["config"].get(key) != first["config"].get(key):
                raise ValueError(
                    f"run {i} differs in config {key}: {part['config'].get(key)!r} vs {first['config'].get(key)!r}"
                )


def _owners(parts: list[dict], states: list[str | None]) -> dict[tuple[str, str], list[int]]:
    """The runs that measured each (model, resolution); several only when they differ in cache state."""
    owners: dict[tuple[str, str], list[int]] = {}
    for i, part in enumerate(parts):
        for key in dict.fromkeys((c["model"], c["resolution"]) for c in part["cases"]):
            runs = owners.setdefault(key, [])
            for j in runs:
                if states[i] is None or states[j] is None or states[i] == states[j]:
                    why = f", both with a {states[i]} compile cache" if states[i] else ""
                    raise ValueError(
                        f"{key[0]} {key[1]} was measured in run {j} and in run {i}{why}; only runs that "
                        "differ in compile-cache state (cold and warm) may measure the same case"
                    )
            runs.append(i)
    return owners


def merge_results(parts: list[dict]) -> dict:
    """One report from runs made in separate processes on one machine setup.

    Refuses runs from different devices or versions, and a (model, resolution) measured in two runs:
    its variants would then be compared across processes, and every ratio here is meant to be one
    measured inside a single process. The exception: runs that differ in compile-cache state (a cold
    and a warm run of the same cases) are both kept; the report takes its tables from the cold one
    and puts the warm run's setup seconds beside them.
    """
    if not parts:
        raise ValueError("nothing to merge")
    _check_same_setup(parts)
    states = [p["config"].get("compile_cache_state") for p in parts]
    owners = _owners(parts, states)
    # A warm repeat of a model's cases adds setup seconds, not a second memory series.
    main_runs: dict[str, set[int]] = {}
    other_runs: dict[str, set[int]] = {}
    for (model, _), runs in owners.items():
        ranked = sorted(runs, key=lambda i: run_rank(states[i], i))
        main_runs.setdefault(model, set()).add(ranked[0])
        other_runs.setdefault(model, set()).update(ranked[1:])

    first = parts[0]
    models = list(dict.fromkeys(m for p in parts for m in p["config"]["models"]))
    cases = [dict(c, run=i) for i, p in enumerate(parts) for c in p["cases"]]
    cases.sort(
        key=lambda c: (models.index(c["model"]), by_area((c["width"], c["height"])), VARIANTS.index(c["variant"]))
    )
    config = dict(first["config"])
    config.update(
        models=models,
        resolutions=sorted(
            dict.fromkeys(r for p in parts for r in p["config"]["resolutions"]),
            key=lambda r: by_area(parse_resolution(r)),
        ),
        variants=[v for v in VARIANTS if any(v in p["config"]["variants"] for p in parts)],
        e2e_resolutions=list(dict.fromkeys(r for p in parts for r in p["config"].get("e2e_resolutions", []))),
    )
    if any(s is not None for s in states):
        config["compile_cache_state"] = states[0] if len(set(states)) == 1 else "mixed"
    runs: list[dict[str, Any]] = []
    for p, state in zip(parts, states):
        run = {
            "date": p["env"]["date"],
            "elapsed_s": p.get("elapsed_s"),
            "models": p["config"]["models"],
            "resolutions": p["config"]["resolutions"],
            "variants": p["config"]["variants"],
        }
        if state is not None:
            run["compile_cache"] = state
        runs.append(run)
    info: dict[str, Any] = {}
    for p in parts:
        for model, m in p.get("models", {}).items():
            info.setdefault(model, {k: v for k, v in m.items() if k == "describe"})
    series = [
        s
        for i, p in enumerate(parts)
        for s in p.get("memory_series", [])
        if i in main_runs.get(s["model"], ()) or i not in other_runs.get(s["model"], ())
    ]
    elapsed = [p.get("elapsed_s") for p in parts]
    return {
        "env": dict(first["env"]),
        "config": config,
        "models": info,
        "cases": cases,
        "memory_series": series,
        "runs": runs,
        "elapsed_s": rnd(sum(elapsed), 1) if all(e is not None for e in elapsed) else None,
    }

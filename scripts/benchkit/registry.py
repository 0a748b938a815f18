"""Every variant, by name, in the order a case runs them (eager first: the reference of the rest;
compile-regional before bcg+compile: its second reference)."""

from __future__ import annotations

from .compiled import bcg_compile, bcg_compile_stock, bcg_compile_tuned, compile_regional, compile_ro, compile_whole
from .model_bench import Variant
from .variants import bcg, bcg_exact, eager, graph

REGISTRY: dict[str, Variant] = {
    "eager": eager,
    "bcg": bcg,
    "bcg-exact": bcg_exact,
    "graph": graph,
    "compile": compile_whole,
    "compile-ro": compile_ro,
    "compile-regional": compile_regional,
    "bcg+compile": bcg_compile,
    "bcg+compile-tuned": bcg_compile_tuned,
    "bcg+compile-stock": bcg_compile_stock,
}
VARIANTS: tuple[str, ...] = tuple(REGISTRY)
COMPILED = (
    "compile",
    "compile-ro",
    "compile-regional",
    "bcg+compile",
    "bcg+compile-tuned",
)  # read the compile-cache folder
DEFAULT_CUDA = ("eager", "bcg", "graph")  # compile variants take minutes per resolution: opt-in
DEFAULT_CPU = ("eager", "bcg")

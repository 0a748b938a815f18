#!/usr/bin/env python
"""LoRA changes on an accelerated pipeline: a hot-swap and a switch back to an adapter captured
before, each beside a recapture of the same pipeline, and a plain call as the floor.

    python scripts/bench_lora_switch.py --models z-image --out out/lora                # GPU: 1024x1024, 9 steps
    python scripts/bench_lora_switch.py --models qwen-image --exact-text --out out/lora  # 512x512, 20 steps, true CFG
    python scripts/bench_lora_switch.py --size tiny --resolution 64 --steps 2 --out /tmp/lora   # CPU smoke

Per model, in one process: the pipeline is built (full size, random weights, bf16 on CUDA; tiny
and float32 on a CPU), three random LoRAs of ``--rank`` for its denoiser are made (peft's
``LoraConfig`` on ``to_q``, ``to_k``, ``to_v``, saved as .safetensors files the way a trainer
saves them), ``pipe.enable_lora_hotswap(target_rank=--rank)`` is called before the first load,
LoRA A is loaded as adapter ``a``, the pipeline is accelerated with the library's defaults and
warmed up at the resolution. Then each variant, ``--repeats`` times (medians):

* ``plain``: a call with nothing changed: the floor;
* ``hot-swap``: ``load_lora_weights(B or A, adapter_name="a", hotswap=True)`` (B, A, B...), then a
  call; it must capture nothing;
* ``switch-back``: LoRA C loaded the ordinary way as adapter ``b`` (new weights: captured again),
  a call under ``a`` and one under ``b`` (each state's graphs captured); then ``set_adapters("a")``
  and a call, which must capture nothing (``a``'s graphs replayed), and ``set_adapters("b")`` and
  an untimed call (nothing captured either);
* ``recapture``: a fresh adapter loaded the ordinary way (B or C under a new name) and made the
  only active one, then a call, which captures the denoiser's graphs again; the fresh adapter is
  deleted afterwards, untimed.

Each timed sample is the wall time from the start of the change to the end of the next call (CUDA
synchronised before and after), split into the change and the call; ``cost`` is that time less the
floor (what the change cost, compared with not changing anything). ``captures`` and ``capture s``
are the counters of every runner of the pipeline (``pipe.accel.stats()``) over the change and the
call. The bars: a hot-swap and a switch back capture nothing, and a hot-swap costs under a tenth of
a recapture.

Correctness, on the first sample of each variant: the images (the call's decoded output, floats)
against ``--reference``: ``stock`` (default) is a second pipeline built alike, never accelerated,
to which every change is made too; ``no-graphs`` is the same pipeline with every runner switched
off (what the model computes now, through the same hooks; no second pipeline's memory); ``none``.
Asserted equal bit for bit where the library promises it: always against ``no-graphs``; against
``stock``, except for Qwen-Image with its text padded (its default at 768x768 and below; the
distance is printed, ``--exact-text`` turns padding off). The hot-swapped image must also differ
from the floor's (else the swap proved nothing). A failed assertion or bar on captures makes the
exit status 1 (after the files are written); the speed bar is reported, never asserted.

Writes ``lora.json`` and ``lora.md`` to ``--out`` after every model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from benchkit.calls import register_recipes  # noqa: E402
from benchkit.environment import collect_env  # noqa: E402
from benchkit.settings import NEGATIVE, PROMPT, QWEN_TRUE_CFG, SEED, ZIMAGE_STEPS, res_name, say  # noqa: E402

MODELS = ("z-image", "qwen-image")
VARIANTS = ("plain", "hot-swap", "switch-back", "recapture")
REFERENCES = ("stock", "no-graphs", "none")
TARGETS = ("to_q", "to_k", "to_v")
# The settings: Z-Image Turbo at 1024x1024, 9 steps; Qwen-Image at 512x512, 20 steps, true CFG.
DEFAULT_RESOLUTION = {"z-image": (1024, 1024), "qwen-image": (512, 512)}
DEFAULT_STEPS = {"z-image": ZIMAGE_STEPS, "qwen-image": 20}
# A LoRA's B drawn so that its output is about this fraction of its input's size: a visible change
# of the image that keeps bf16 activations in range.
LORA_STRENGTH = 0.05
HOT_SWAP_BAR = 0.1  # a hot-swap's cost over the floor, as a fraction of a recapture's


# ------------------------------------------------------------------------------------------------
# LoRA files
# ------------------------------------------------------------------------------------------------
def make_lora_files(model: str, size: str, rank: int, folder: Path, dtype: torch.dtype) -> list[Path]:
    """Three random LoRAs (A, B, C) for ``model``'s denoiser, saved as a trainer saves them.

    peft's ``LoraConfig`` is applied to the denoiser built on the meta device (every module, no
    weights), so the keys and shapes are peft's own at no memory; the values are drawn on the CPU
    (A: unit rows in expectation; B: scaled so a LoRA moves its layer's output by about
    :data:`LORA_STRENGTH`); the file is written by the pipeline's ``save_lora_weights``, with the
    config as its adapter metadata (``lora_alpha`` is read back from it).
    """
    import peft
    from peft.utils import get_peft_model_state_dict

    from pipelines.builders import build_transformer, pipeline_class

    meta = build_transformer(model, size, device="meta", dtype=dtype)
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TARGETS), init_lora_weights=False)
    meta.add_adapter(config, adapter_name="trained")
    shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(meta, adapter_name="trained").items()}
    del meta
    metadata = config.to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])  # a set: JSON needs a list
    paths = []
    for i, letter in enumerate("abc"):
        gen = torch.Generator().manual_seed(1000 + i)
        layers = {}
        for key, shape in sorted(shapes.items()):
            w = torch.randn(shape, generator=gen)
            # lora_A: (rank, in); lora_B: (out, rank).
            w /= math.sqrt(shape[1]) if ".lora_A." in key else math.sqrt(rank) / LORA_STRENGTH
            layers[key] = w.to(dtype)
        name = f"lora-{letter}.safetensors"
        pipeline_class(model).save_lora_weights(
            folder, transformer_lora_layers=layers, weight_name=name, transformer_lora_adapter_metadata=metadata
        )
        paths.append(folder / name)
    return paths


# ------------------------------------------------------------------------------------------------
# Samples
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Sample:
    """One timed change and the call after it."""

    change_s: float
    call_s: float
    captures: int
    capture_s: float
    captures_by_module: dict[str, int]

    @property
    def total_s(self) -> float:
        return self.change_s + self.call_s


def median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 4)


def exact_expected(model: str, reference: str, exact_text: bool, wh: tuple[int, int]) -> bool:
    """Whether the library promises the reference's image bit for bit (README's table): always
    the same model without graphs; stock, except where Qwen-Image's recipe pads the text."""
    from pipelines.qwen_image import BUCKET_MAX_IMAGE_TOKENS, PATCH_PIXELS

    if reference == "no-graphs" or model != "qwen-image" or exact_text:
        return True
    return (wh[0] // PATCH_PIXELS) * (wh[1] // PATCH_PIXELS) > BUCKET_MAX_IMAGE_TOKENS


def distance(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    if a.shape != b.shape:
        return {"equal": False, "max_abs": None, "why": f"shapes {tuple(a.shape)} and {tuple(b.shape)}"}
    equal = torch.equal(a, b)
    return {"equal": equal, "max_abs": 0.0 if equal else float(f"{(a - b).abs().max().item():.3g}")}


class LoraBench:
    """One model: the accelerated pipeline, its reference, the LoRA files, and the variants."""

    def __init__(self, args: argparse.Namespace, model: str, wh: tuple[int, int], steps: int, folder: Path) -> None:
        self.args, self.model, self.wh, self.steps = args, model, wh, steps
        self.cuda = args.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.qwen = model == "qwen-image"
        say(f"{model} ({args.size}) on {args.device}: {res_name(self.wh)}, {self.steps} steps, rank {args.rank}")
        self.files = make_lora_files(model, args.size, args.rank, folder, self.dtype)
        self.pipe = self._build()
        self.stock = self._build() if args.reference == "stock" else None
        self.floor_s: float | None = None
        self.floor_images: torch.Tensor | None = None
        # A variant that ends on a change of weights no call followed would leave its captures to
        # the next variant's first call: one untimed call first settles them.
        self.unsettled = False

    def _build(self) -> Any:
        from pipelines.builders import build_pipeline

        pipe = build_pipeline(self.model, self.args.size, device=self.args.device, dtype=self.dtype, seed=SEED)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # -- the pipeline side --------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.args.device)

    def call(self, pipe: Any) -> torch.Tensor:
        kw: dict[str, Any] = dict(prompt=PROMPT, width=self.wh[0], height=self.wh[1], num_inference_steps=self.steps)
        if self.qwen:
            kw.update(negative_prompt=NEGATIVE, true_cfg_scale=QWEN_TRUE_CFG)
        else:
            kw.update(guidance_scale=0.0)
        gen = torch.Generator(self.args.device).manual_seed(SEED)
        return torch.from_numpy(pipe(**kw, generator=gen, output_type="np").images)

    def change(self, fn: Callable[[Any], Any]) -> None:
        """``fn`` made to the reference too (untimed), so that it stays the same pipeline."""
        if self.stock is not None:
            fn(self.stock)

    def both(self, fn: Callable[[Any], Any]) -> None:
        fn(self.pipe)
        self.change(fn)

    def counters(self) -> tuple[int, float, dict[str, int]]:
        stats = self.pipe.accel.stats()
        by = {name: s.captures for name, s in stats.items()}
        return sum(by.values()), sum(s.capture_seconds for s in stats.values()), by

    def timed(self, fn: Callable[[Any], Any] | None) -> tuple[Sample, torch.Tensor]:
        """``fn`` (None: nothing changed) and the next call, timed on the accelerated pipeline."""
        n0, s0, by0 = self.counters()
        self.sync()
        t0 = time.perf_counter()
        if fn is not None:
            fn(self.pipe)
        self.sync()
        t1 = time.perf_counter()
        images = self.call(self.pipe)
        self.sync()
        t2 = time.perf_counter()
        n1, s1, by1 = self.counters()
        if fn is not None:
            self.change(fn)
        by = {k: v - by0.get(k, 0) for k, v in by1.items() if v != by0.get(k, 0)}
        return Sample(t1 - t0, t2 - t1, n1 - n0, round(s1 - s0, 4), by), images

    def reference(self, images: torch.Tensor) -> dict[str, Any] | None:
        """The images against the reference's, in the state the pipeline is in now."""
        ref = self.args.reference
        if ref == "none":
            return None
        if ref == "stock":
            want = self.call(self.stock)
        else:
            runners = list(self.pipe.accel.runners.values())
            was = [r.enabled for r in runners]
            for r in runners:
                r.enabled = False
            try:
                want = self.call(self.pipe)
            finally:
                for r, enabled in zip(runners, was):
                    r.enabled = enabled
        out = {"reference": ref, "exact_expected": exact_expected(self.model, ref, self.args.exact_text, self.wh)}
        return out | distance(images, want)

    # -- setup and variants ---------------------------------------------------------------------
    def setup(self) -> dict[str, Any]:
        from accel import accelerate_pipeline

        rank, first = self.args.rank, str(self.files[0])
        self.both(lambda p: p.enable_lora_hotswap(target_rank=rank))
        self.both(lambda p: p.load_lora_weights(first, adapter_name="a"))
        options: dict[str, Any] = {"text_buckets": None} if self.args.exact_text else {}
        self.sync()
        t0 = time.perf_counter()
        accelerate_pipeline(self.pipe, **options)
        report = self.pipe.accel.warmup(
            [self.wh],
            prompts=[PROMPT],
            negative_prompt=NEGATIVE if self.qwen else None,
            cfg=self.qwen,
            num_inference_steps=2,
            progress=False,
        )
        self.call(self.pipe)  # untimed: captures what the warm-up left, if anything
        self.sync()
        captures, seconds, _ = self.counters()
        return {
            "setup_s": round(time.perf_counter() - t0, 3),
            "warmup_captures": captures,
            "warmup_capture_s": round(seconds, 3),
            "graphs": captures > 0,
            "no_graphs_why": report.skipped,
        }

    def run(self, variant: str) -> dict[str, Any]:
        row: dict[str, Any] = {"model": self.model, "variant": variant}
        try:
            if self.unsettled:
                row["settle_captures"] = self.timed(None)[0].captures
                self.unsettled = False
            fn = {
                "plain": self.plain,
                "hot-swap": self.hot_swap,
                "switch-back": self.switch_back,
                "recapture": self.recapture,
            }[variant]
            samples, check, extra = fn()
            row.update(summarise(samples, None if variant == "plain" else self.floor_s))
            row.update(extra)
            if check is not None:
                row["check"] = check
            row["status"] = "ok"
        except Exception as exc:  # one variant's failure must not cost the others
            import traceback

            traceback.print_exc()
            row = error_row(self.model, variant, exc) | {k: v for k, v in row.items() if k == "settle_captures"}
        shown = {k: v for k, v in row.items() if k not in ("model", "variant")}
        say(f"{self.model} {variant}: {json.dumps(shown, default=str)}")
        return row

    def repeat(
        self, change: Callable[[int], Callable[[Any], Any] | None], after: Callable[[int], None] | None = None
    ) -> tuple[list[Sample], dict[str, Any] | None, torch.Tensor]:
        """``--repeats`` samples of ``change(i)``; the first one's images checked; ``after(i)``
        (untimed) after each."""
        samples, check, first = [], None, None
        for i in range(self.args.repeats):
            sample, images = self.timed(change(i))
            samples.append(sample)
            if i == 0:
                first = images
                check = self.reference(images)
            if after is not None:
                after(i)
        assert first is not None
        return samples, check, first

    def plain(self) -> tuple[list[Sample], dict[str, Any] | None, dict[str, Any]]:
        samples, check, images = self.repeat(lambda i: None)
        self.floor_s = median([s.total_s for s in samples])
        self.floor_images = images
        return samples, check, {}

    def hot_swap(self) -> tuple[list[Sample], dict[str, Any] | None, dict[str, Any]]:
        files = [str(self.files[1]), str(self.files[0])]  # B, then A, then B...

        def change(i: int) -> Callable[[Any], Any]:
            return lambda p: p.load_lora_weights(files[i % 2], adapter_name="a", hotswap=True)

        samples, check, images = self.repeat(change)
        extra: dict[str, Any] = {}
        if self.floor_images is not None:
            extra["differs_from_plain"] = not torch.equal(images, self.floor_images)
        if self.args.repeats % 2:  # adapter a holds B: give it A back (in place: nothing to capture)
            self.both(lambda p: p.load_lora_weights(files[1], adapter_name="a", hotswap=True))
        return samples, check, extra

    def switch_back(self) -> tuple[list[Sample], dict[str, Any] | None, dict[str, Any]]:
        c = str(self.files[2])
        self.both(lambda p: p.load_lora_weights(c, adapter_name="b"))
        prelude = []
        for name in ("a", "b"):  # a's graphs again (the weights changed), then b's state
            sample, _ = self.timed(lambda p, name=name: p.set_adapters(name))
            prelude.append(sample)
        others: list[int] = []

        def back_to_b(i: int) -> None:
            sample, _ = self.timed(lambda p: p.set_adapters("b"))
            others.append(sample.captures)

        samples, check, _ = self.repeat(lambda i: lambda p: p.set_adapters("a"), back_to_b)
        self.both(lambda p: p.set_adapters("a"))  # a state whose graphs are kept: nothing to capture
        extra = {
            "prelude_captures": [s.captures for s in prelude],
            "prelude_s": [round(s.total_s, 4) for s in prelude],
            "switch_to_b_captures": others,
        }
        return samples, check, extra

    def recapture(self) -> tuple[list[Sample], dict[str, Any] | None, dict[str, Any]]:
        files = [str(self.files[1]), str(self.files[2])]

        def change(i: int) -> Callable[[Any], Any]:
            def load(p: Any) -> None:
                p.load_lora_weights(files[i % 2], adapter_name=f"fresh{i}")
                p.set_adapters(f"fresh{i}")

            return load

        def drop(i: int) -> None:
            self.both(lambda p: p.set_adapters("a"))
            self.both(lambda p: p.delete_adapters(f"fresh{i}"))

        samples, check, _ = self.repeat(change, drop)
        self.unsettled = True
        return samples, check, {}

    def close(self) -> None:
        if "accel" in vars(self.pipe):
            self.pipe.accel.restore()
        self.pipe = self.stock = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def error_row(model: str, variant: str, exc: BaseException) -> dict[str, Any]:
    return {"model": model, "variant": variant, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:500]}


def summarise(samples: list[Sample], floor_s: float | None) -> dict[str, Any]:
    totals = [s.total_s for s in samples]
    out: dict[str, Any] = {
        "repeats": len(samples),
        "change_s": median([s.change_s for s in samples]),
        "call_s": median([s.call_s for s in samples]),
        "total_s": median(totals),
        "captures": [s.captures for s in samples],
        "capture_s": median([s.capture_s for s in samples]),
        "captures_by_module": samples[0].captures_by_module,
        "samples_s": [round(t, 4) for t in totals],
    }
    if floor_s is not None:
        out["cost_s"] = round(out["total_s"] - floor_s, 4)
    return out


# ------------------------------------------------------------------------------------------------
# Checks and tables
# ------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def _resolution(text: str) -> tuple[int, int]:
    from benchkit.settings import parse_resolution

    return parse_resolution(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _names(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(bad) or repr(text)}; choose from {', '.join(choices)}"
            )
        return names

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", type=_names(MODELS, "model"), default=list(MODELS), help="comma-separated: z-image, qwen-image"
    )
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on a CPU")
    p.add_argument(
        "--resolution", type=_resolution, default=None, help="N or WxH; default 1024 (Z-Image), 512 (Qwen-Image)"
    )
    p.add_argument("--steps", type=_positive, default=None, help="default 9 (Z-Image), 20 (Qwen-Image, true CFG)")
    p.add_argument("--rank", type=_positive, default=16, help="rank of every LoRA (and enable_lora_hotswap's target)")
    p.add_argument(
        "--variants",
        type=_names(VARIANTS, "variant"),
        default=list(VARIANTS),
        help="comma-separated, run in this order (plain, the floor, always first)",
    )
    p.add_argument("--repeats", type=_positive, default=2, help="timed samples per variant (medians)")
    p.add_argument(
        "--reference",
        choices=REFERENCES,
        default="stock",
        help="what each variant's image is compared with: a stock pipeline given the same changes (default), the "
        "same pipeline with its graphs off, or nothing",
    )
    p.add_argument(
        "--exact-text",
        action="store_true",
        help="text_buckets=None: Qwen-Image's text unpadded, bit for bit with stock",
    )
    p.add_argument("--out", required=True, help="folder for lora.json and lora.md")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda for --size full, else cpu")
    args = p.parse_args(argv)
    args.size = args.size or ("full" if torch.cuda.is_available() else "tiny")
    args.device = torch.device(args.device or ("cuda" if args.size == "full" else "cpu"))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here: use --size tiny on a CPU")
    if args.size == "full" and args.device.type != "cuda":
        p.error("--size full needs a CUDA device (use --size tiny on a CPU)")
    if "plain" in args.variants:  # the floor first: every other variant's cost is read against it
        args.variants = ["plain", *[v for v in args.variants if v != "plain"]]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    register_recipes()
    env = collect_env(args.device)
    with contextlib.suppress(Exception):
        import importlib.metadata

        env["peft"] = importlib.metadata.version("peft")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say(header(env))
    results: list[dict[str, Any]] = []

    def save() -> None:
        # After every variant: a run cut off by a time limit keeps what it measured.
        (out / "lora.json").write_text(json.dumps({"env": env, "results": results}, indent=1, default=str))
        (out / "lora.md").write_text(markdown(env, results))

    for model in args.models:
        wh, steps = args.resolution or DEFAULT_RESOLUTION[model], args.steps or DEFAULT_STEPS[model]
        settings = {
            "size": args.size,
            "resolution": res_name(wh),
            "steps": steps,
            "rank": args.rank,
            "repeats": args.repeats,
            "reference": args.reference,
            "exact_text": args.exact_text,
            "targets": list(TARGETS),
            "prompt": PROMPT,
            "seed": SEED,
        }
        result: dict[str, Any] = {"model": model, "settings": settings, "setup": {}, "rows": [], "checks": []}
        results.append(result)
        with tempfile.TemporaryDirectory(prefix="bcg-lora-") as folder, warnings.catch_warnings():
            # peft's note that a model gets a second adapter: several are what this asks for.
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            bench = None
            try:
                bench = LoraBench(args, model, wh, steps, Path(folder))
                result["setup"] = bench.setup()
                for variant in args.variants:
                    result["rows"].append(bench.run(variant))
                    save()
            except Exception as exc:  # one model's failure must not cost the others
                import traceback

                traceback.print_exc()
                result["rows"].append(error_row(model, "setup", exc))
            finally:
                if bench is not None:
                    bench.close()
        result["checks"] = checks(result["rows"], bool(result["setup"].get("graphs")))
        save()
    print(markdown(env, results))
    failed = any(c["asserted"] and not c["ok"] for r in results for c in r["checks"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

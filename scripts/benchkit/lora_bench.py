"""One model of scripts/bench_lora_switch.py: the accelerated pipeline, its reference, the LoRA
files, and the variants (plain, hot-swap, switch-back, recapture), each a list of timed samples."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .calls import warm_up
from .lora_files import make_lora_files
from .settings import NEGATIVE, PROMPT, QWEN_TRUE_CFG, SEED, res_name, say


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
    from pipelines.families.qwen_image.recipe import BUCKET_MAX_IMAGE_TOKENS, PATCH_PIXELS

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
        report = warm_up(self.pipe, [self.wh], self.qwen, steps=2)
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

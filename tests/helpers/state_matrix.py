"""What a user does to a loaded pipeline after a capture, as one matrix the CPU and the GPU run.

Each row is a change made to the accelerated pipeline and to a stock pipeline built the same way
(same weights, seeded LoRA weights); after it, one call of each. tests/hooks/state/test_state_matrix.py
runs the matrix on emulated graphs, tests/cuda/test_state_matrix.py on CUDA's. What a row must
give is what ``report()`` promises: where it says the image is the stock pipeline's bit for bit,
equal to the stock call; where it names a difference (Qwen-Image's text buckets), equal to the same
accelerated pipeline run eagerly, so that a recapture is exactly as exact as the first capture.

The rows reach LoRA (pipeline and model level, PEFT merges), attention processors (wrapped, edited
in place, taking only ``*args, **kwargs``), attention backends (one that refuses masks), fused projections, train/eval,
weights given other memory or edited in place through ``.data``, and components and the
scheduler replaced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from diffusers.models.attention_processor import Attention

from pipelines.builders import build_text_encoder, build_transformer, build_vae

EXACT_LINE = "image: the stock pipeline's, bit for bit"


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where the matrix runs: the model, the device and dtype of its pipelines."""

    name: str
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @functools.cache  # noqa: B019 (one setup per test; the files are its)
    def lora(self, seed: int) -> dict[str, torch.Tensor]:
        """A seeded LoRA as a file holds it (random A and B, so it changes the image)."""
        from peft.utils import get_peft_model_state_dict

        t = build_transformer(self.name, "tiny")
        torch.manual_seed(seed)
        t.add_adapter(_lora_config(), adapter_name="x")
        sd = get_peft_model_state_dict(t, adapter_name="x")
        return {f"transformer.{k}": v.to(self.device, self.dtype) for k, v in sd.items()}


def _lora_config() -> Any:
    import peft

    # init_lora_weights=False draws A and B from the global RNG: every caller seeds it first.
    return peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)


def _add_model_adapter(pipe: Any, s: Setup) -> None:
    torch.manual_seed(11)
    pipe.transformer.add_adapter(_lora_config(), adapter_name="m")
    pipe.transformer.to(s.device, s.dtype)


def _tuner_layers(pipe: Any) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in pipe.transformer.modules() if isinstance(m, BaseTunerLayer)]


def _merge(pipe: Any, s: Setup) -> None:
    for layer in _tuner_layers(pipe):
        layer.merge(adapter_names=["m"])


def _unmerge(pipe: Any, s: Setup) -> None:
    for layer in _tuner_layers(pipe):
        layer.unmerge()


def _attention(pipe: Any) -> list[Any]:
    return [m for m in pipe.transformer.modules() if callable(getattr(m, "set_processor", None))]


def _stock_processors(pipe: Any) -> list[Any]:
    return [type(m.processor) for m in _attention(pipe)]


@functools.cache
def _wrapped(base: type) -> type:
    """A processor as IP-Adapter or attention-map tools write one: the stock one called through,
    its signature kept (``functools.wraps``), its output scaled by an attribute."""

    class Wrapped(base):  # type: ignore[misc, valid-type]
        scale = 1.25

        @functools.wraps(base.__call__)
        def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
            out = super().__call__(attn, *args, **kwargs)
            return tuple(o * self.scale for o in out) if isinstance(out, tuple) else out * self.scale

    return Wrapped


@functools.cache
def _args_kwargs(base: type) -> type:
    """A processor that takes only ``*args, **kwargs``: diffusers hands it no keyword its
    ``__call__`` does not name (Qwen-Image's text mask among them)."""

    class ArgsKwargs(base):  # type: ignore[misc, valid-type]
        def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(attn, *args, **kwargs)

    return ArgsKwargs


def _set_each(pipe: Any, make: Callable[[type], type]) -> None:
    """Every attention module gets a processor of ``make(its stock processor's class)``."""
    for m, stock in zip(_attention(pipe), pipe._matrix_stock_processors):
        m.set_processor(make(stock)())


def _stock_back(pipe: Any, s: Setup) -> None:
    for m, stock in zip(_attention(pipe), pipe._matrix_stock_processors):
        m.set_processor(stock())


def _edit_attribute(pipe: Any, s: Setup) -> None:
    for m in _attention(pipe):
        m.processor.scale = 0.5


def _reset_backend(pipe: Any, s: Setup) -> None:
    # diffusers resets the processors' backend but leaves its process-wide one as set.
    pipe.transformer.reset_attention_backend()
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def _fuse_projections(pipe: Any, s: Setup) -> None:
    # New weights (to_qkv) the stock processors do not read: captured again, the same image.
    for m in pipe.transformer.modules():
        if isinstance(m, Attention):
            m.fuse_projections()


def _a_weight(pipe: Any) -> torch.nn.Parameter:
    return next(p for n, p in pipe.transformer.named_parameters() if p.dim() == 2 and "lora" not in n)


def _other_memory(pipe: Any, s: Setup) -> None:
    w = _a_weight(pipe)
    pipe._matrix_old_memory = w.data  # kept alive: a graph that still read it would read these values
    w.data = w.data * 0.9


def _edit_through_data(pipe: Any, s: Setup) -> None:
    _a_weight(pipe).data.mul_(1.1)  # no version counter moves: only the address tells


def _other_scheduler(pipe: Any, s: Setup) -> None:
    config = dict(pipe.scheduler.config)
    config["shift"] = 2.0
    if config.get("use_dynamic_shifting"):
        config["max_shift"] = 0.8 * config.get("max_shift", 1.15)
    pipe.scheduler = type(pipe.scheduler).from_config(config)


# (label, change); the changes run in this order, each on top of the ones before.
ROWS: list[tuple[str, Callable[[Any, Setup], None]]] = [
    ("a LoRA loaded (pipeline level)", lambda p, s: p.load_lora_weights(s.lora(1), adapter_name="a")),
    ("a second LoRA loaded", lambda p, s: p.load_lora_weights(s.lora(2), adapter_name="b")),
    ("both LoRAs at other weights", lambda p, s: p.set_adapters(["a", "b"], [0.7, 0.4])),
    ("fuse_lora", lambda p, s: p.fuse_lora()),
    ("unfuse_lora", lambda p, s: p.unfuse_lora()),
    ("disable_lora", lambda p, s: p.disable_lora()),
    ("enable_lora", lambda p, s: p.enable_lora()),
    ("a LoRA deleted", lambda p, s: p.delete_adapters("a")),
    ("an adapter added to the model (seeded)", _add_model_adapter),
    ("a PEFT merge of it", _merge),
    ("a PEFT unmerge", _unmerge),
    ("every adapter deleted", lambda p, s: p.transformer.delete_adapters(["b", "m"])),
    ("the user's processors (the stock ones wrapped)", lambda p, s: _set_each(p, _wrapped)),
    ("a processor attribute edited in place", _edit_attribute),
    ("processors taking only *args, **kwargs", lambda p, s: _set_each(p, _args_kwargs)),
    ("the stock processors back", _stock_back),
    ("set_attention_backend", lambda p, s: p.transformer.set_attention_backend("_native_math")),
    # A backend that refuses masks: padded text would raise in it, so none is padded (stock exact).
    ("a backend that refuses masks (_native_flash)", lambda p, s: p.transformer.set_attention_backend("_native_flash")),
    ("reset_attention_backend", _reset_backend),
    ("fused projections", _fuse_projections),
    ("train mode", lambda p, s: p.transformer.train()),
    ("eval mode", lambda p, s: p.transformer.eval()),
    ("a weight given other memory (.data = ...)", _other_memory),
    ("a weight edited in place through .data", _edit_through_data),
    ("the VAE replaced (same config, other weights)", lambda p, s: _replace(p, s, "vae", build_vae)),
    ("the text encoder replaced (other weights)", lambda p, s: _replace(p, s, "text_encoder", build_text_encoder)),
    ("a scheduler with another shift", _other_scheduler),
    ("the user's processors after the new scheduler", lambda p, s: _set_each(p, _wrapped)),
]


def _replace(pipe: Any, s: Setup, component: str, build: Callable[..., torch.nn.Module]) -> None:
    new = build(s.name, "tiny", device=s.device, dtype=s.dtype, seed=5)
    setattr(pipe, component, new)


@dataclasses.dataclass
class Result:
    """One row: what report() promised, how far the call was from what it must equal."""

    label: str
    claim: str
    diff: float
    eager_calls: int
    captures: int
    to_stock: float

    @property
    def off(self) -> bool:
        return self.diff != 0.0 or self.eager_calls != 0


def run(
    pipe: Any, stock: Any, s: Setup, call: Callable[[Any], torch.Tensor], eager: Callable[[Any], torch.Tensor]
) -> list[Result]:
    """Every row on ``pipe`` (accelerated, captured) and ``stock``; ``eager`` is ``pipe``'s call
    with its graphs off. Returns a result per row (the caller asserts none is off)."""
    for p in (pipe, stock):
        p._matrix_stock_processors = _stock_processors(p)
    results = []
    for label, change in ROWS:
        change(pipe, s)
        change(stock, s)
        before = pipe.accel.stats()["transformer"]
        got = call(pipe)
        after = pipe.accel.stats()["transformer"]
        exact = EXACT_LINE in pipe.accel.report()
        stock_out = call(stock)
        want = stock_out if exact else eager(pipe)
        results.append(
            Result(
                label,
                "stock, bit for bit" if exact else "its own eager run",
                max_diff(got, want),
                after.eager_calls - before.eager_calls,
                after.captures - before.captures,
                max_diff(got, stock_out),
            )
        )
    return results


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def table(results: list[Result]) -> str:
    """The results as a plain table, one row per line (``to stock``: the call's distance to the
    stock pipeline's, whatever it is held to)."""
    head = f"{'change':<52} {'held to':<20} {'max diff':>9} {'to stock':>9} {'captures':>8} {'eager':>5}"
    lines = [head]
    lines += [
        f"{r.label:<52} {r.claim:<20} {r.diff:>9.3g} {r.to_stock:>9.3g} {r.captures:>8} {r.eager_calls:>5}"
        for r in results
    ]
    off = [r.label for r in results if r.off]
    lines.append(f"{len(results)} rows, {len(off)} off" + (f": {', '.join(off)}" if off else ""))
    return "\n".join(lines)

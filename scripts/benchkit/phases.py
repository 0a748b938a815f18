"""Measuring where one pipeline call spends its time (:class:`benchkit.breakdown.Breakdown`).

For the length of one call (:func:`measure_breakdown`) the pipeline gets

* forward pre/post hooks on ``pipe.text_encoder`` and ``pipe.transformer`` (every call: Qwen-Image
  with true CFG encodes twice and makes two denoiser calls per step),
* instance-attribute wrappers around ``pipe.encode_prompt``, ``pipe.progress_bar`` (the denoising
  loop runs inside ``with self.progress_bar(total=...)`` in QwenImagePipeline and ZImagePipeline, so
  its ``__enter__`` and ``__exit__`` bracket the loop), ``pipe.vae.decode`` and
  ``pipe.image_processor.postprocess``,

each marking its start and end. On a GPU a mark is a CUDA event recorded on the current stream
(no host clock around asynchronous work, no synchronize inside the call: the call is synchronized
once at its end, then the event pairs are read); on a CPU it is the host clock. Every hook and
wrapper is removed afterwards, even when the call fails: the pipeline's methods and its modules'
forwards and hook dicts are back as they were (:func:`hook_state` tells).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from .breakdown import CLOCKS, PHASE_KEYS, Breakdown, Phase

Mark = Any  # a recorded torch.cuda.Event, or a perf_counter() value
# (owner, attribute) wrapped as instance attributes; "" is the pipeline itself
WRAPPED = (("", "encode_prompt"), ("", "progress_bar"), ("vae", "decode"), ("image_processor", "postprocess"))


class Marks:
    """Start and end marks per phase; on CUDA, events on the current stream (recording one does not
    synchronize), read only after the caller's one synchronize."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list[list[Mark]]] = {}
        self.depth: dict[str, int] = {}
        self.notes: list[str] = []

    def mark(self) -> Mark:
        if self.cuda:
            if torch.cuda.is_current_stream_capturing():  # a capture in the call: no event inside it
                self.notes.append("a phase hook fired during a CUDA graph capture; its mark is missing")
                return None
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))  # enqueued, no host sync
            return event
        return time.perf_counter()

    def ms(self, start: Mark, end: Mark) -> float:
        if start is None or end is None:
            return 0.0
        return float(start.elapsed_time(end)) if self.cuda else (end - start) * 1e3

    def open(self, phase: str, within: str | None = None) -> None:
        """Start a span of ``phase`` unless one is open already (a nested call). A span opened while
        a span of ``within`` is open is also listed as ``phase@within``."""
        depth = self.depth.get(phase, 0)
        self.depth[phase] = depth + 1
        if depth:
            return
        span = [self.mark(), None]
        self.spans.setdefault(phase, []).append(span)
        if within is not None and self.depth.get(within, 0):
            self.spans.setdefault(f"{phase}@{within}", []).append(span)

    def close(self, phase: str) -> None:
        depth = self.depth.get(phase, 0)
        if depth <= 0:
            return
        self.depth[phase] = depth - 1
        if depth == 1:
            self.spans[phase][-1][1] = self.mark()

    def total(self, phase: str) -> float:
        return sum(self.ms(s, e) for s, e in self.spans.get(phase, []))

    def count(self, phase: str) -> int:
        return len(self.spans.get(phase, []))


# -- installing and removing -----------------------------------------------------------------------
def _module_hooks(stack: ExitStack, module: Any, marks: Marks, phase: str, within: str) -> None:
    def pre(mod: Any, args: tuple) -> None:
        marks.open(phase, within)

    def post(mod: Any, args: tuple, out: Any) -> None:
        marks.close(phase)

    stack.callback(module.register_forward_pre_hook(pre).remove)
    stack.callback(module.register_forward_hook(post, always_call=True).remove)


def _wrap(stack: ExitStack, owner: Any, name: str, wrapper_of: Callable[[Callable], Callable]) -> None:
    """``owner.name = wrapper_of(owner.name)`` as an instance attribute; undone on the stack's exit
    (the attribute deleted, or the instance attribute that was there put back)."""
    had = name in owner.__dict__
    before = owner.__dict__.get(name)
    setattr(owner, name, wrapper_of(getattr(owner, name)))

    def restore() -> None:
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)

    stack.callback(restore)


def _timed(marks: Marks, phase: str, within: str | None = None) -> Callable[[Callable], Callable]:
    def wrapper_of(fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            marks.open(phase, within)
            try:
                return fn(*args, **kwargs)
            finally:
                marks.close(phase)

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    return wrapper_of


class _Loop:
    """The progress bar's context manager, marking the loop between its enter and its exit."""

    def __init__(self, bar: Any, marks: Marks) -> None:
        self.bar, self.marks = bar, marks

    def __enter__(self) -> Any:
        inner = self.bar.__enter__()
        self.marks.open("loop")
        return inner

    def __exit__(self, *exc: Any) -> Any:
        self.marks.close("loop")
        return self.bar.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bar, name)


def _loop_bracket(marks: Marks) -> Callable[[Callable], Callable]:
    def wrapper_of(fn: Callable) -> Callable:
        def progress_bar(*args: Any, **kwargs: Any) -> Any:
            bar = fn(*args, **kwargs)
            if args or kwargs.get("iterable") is not None:  # a loop over an iterable: not bracketed
                return bar
            return _Loop(bar, marks)

        progress_bar.__wrapped__ = fn  # type: ignore[attr-defined]
        return progress_bar

    return wrapper_of


@contextmanager
def phase_hooks(pipe: Any, marks: Marks) -> Iterator[None]:
    """The hooks and wrappers on ``pipe`` for the block's length, then gone."""
    with ExitStack() as stack:
        if getattr(pipe, "text_encoder", None) is not None:
            _module_hooks(stack, pipe.text_encoder, marks, "text_encoder", within="encode_prompt")
        _module_hooks(stack, pipe.transformer, marks, "denoiser", within="loop")
        if hasattr(pipe, "encode_prompt"):
            _wrap(stack, pipe, "encode_prompt", _timed(marks, "encode_prompt"))
        if hasattr(pipe, "progress_bar"):
            _wrap(stack, pipe, "progress_bar", _loop_bracket(marks))
        if getattr(pipe, "vae", None) is not None:
            _wrap(stack, pipe.vae, "decode", _timed(marks, "vae_decode"))
        if getattr(pipe, "image_processor", None) is not None:
            _wrap(stack, pipe.image_processor, "postprocess", _timed(marks, "postprocess"))
        yield


def hook_state(pipe: Any) -> dict[str, Any]:
    """What :func:`phase_hooks` touches, comparable before and after: the hook dicts of the text
    encoder and the denoiser, and which of the wrapped names are instance attributes (and which)."""
    state: dict[str, Any] = {}
    for name in ("text_encoder", "transformer"):
        module = getattr(pipe, name, None)
        if module is not None:
            state[name] = (
                dict(module._forward_pre_hooks),
                dict(module._forward_hooks),
                module.__dict__.get("forward"),
            )
    for owner_name, attr in WRAPPED:
        owner = getattr(pipe, owner_name, None) if owner_name else pipe
        if owner is not None:
            state[f"{owner_name or 'pipe'}.{attr}"] = owner.__dict__.get(attr)
    return state


# -- one measured call -------------------------------------------------------------------------------
def _phase(ms: float, calls: int | None, call_ms: float) -> Phase:
    return Phase(ms=round(ms, 3), share=round(ms / call_ms, 4) if call_ms > 0 else 0.0, calls=calls)


def measure_breakdown(pipe: Any, call: Callable[[], Any], device: torch.device) -> Breakdown:
    """``call()`` (one pipeline call) once, with the phase hooks on ``pipe``; its :class:`Breakdown`."""
    marks = Marks(device)
    before = hook_state(pipe)

    def sync() -> None:
        if marks.cuda:
            torch.cuda.synchronize(device)

    sync()
    with phase_hooks(pipe, marks):
        t0 = time.perf_counter()
        start = marks.mark()
        call()
        end = marks.mark()
        sync()  # the one synchronize: every event of the call has completed
        wall_ms = (time.perf_counter() - t0) * 1e3
    if hook_state(pipe) != before:
        raise RuntimeError("the phase hooks were not all removed")

    call_ms = marks.ms(start, end)
    text, denoiser = marks.total("text_encoder"), marks.total("denoiser")
    prompt_rest = marks.total("encode_prompt") - marks.total("text_encoder@encode_prompt")
    loop_how = "progress bar"
    if marks.count("loop") == 1:
        loop_rest = marks.total("loop") - marks.total("denoiser@loop")
    else:  # no bracket: from the first denoiser call's start to the last one's end
        spans = marks.spans.get("denoiser", [])
        loop_rest = marks.ms(spans[0][0], spans[-1][1]) - denoiser if spans else 0.0
        loop_how = f"first to last denoiser call (the progress bar bracketed {marks.count('loop')} loops)"
    measured = {
        "text_encoder": (text, marks.count("text_encoder")),
        "prompt_rest": (prompt_rest, None),
        "denoiser": (denoiser, marks.count("denoiser")),
        "loop_rest": (loop_rest, None),
        "vae_decode": (marks.total("vae_decode"), marks.count("vae_decode")),
        "postprocess": (marks.total("postprocess"), marks.count("postprocess")),
    }
    measured["other"] = (call_ms - sum(ms for ms, _ in measured.values()), None)
    phases = {key: _phase(*measured[key], call_ms) for key in PHASE_KEYS}
    outside = call_ms - denoiser
    return Breakdown(
        clock=CLOCKS["cuda" if marks.cuda else "host"],
        call_ms=round(call_ms, 3),
        wall_ms=round(wall_ms, 3),
        phases=phases,
        denoiser_ms=round(denoiser, 3),
        outside_denoiser_ms=round(outside, 3),
        outside_denoiser_share=round(outside / call_ms, 4) if call_ms > 0 else 0.0,
        loop=loop_how,
        notes=sorted(set(marks.notes)),
    )

"""Locating the operation that broke a capture, and marking its enclosing function, without CUDA.

A CUDA capture failure is simulated by patching a tensor method (``__bool__``, ``.item``,
``.tolist``) with :func:`discover_toys.raising_op`, which raises CUDA's capture error. For the
marked runs, it raises only while a fake capture (``tests.helpers.fakes.fake_capture``: a real
``bcg._Capture`` with dummy segments) records a segment, i.e. not while a break runs.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from accel.graphs import bcg, marks
from accel.graphs.discover import BreakSite, discover, mark_as_break, mark_by_name
from accel.graphs.sites import is_capture_error, locate, locate_by_sync_debug, resolve
from tests.helpers import discover_toys
from tests.helpers.discover_toys import CAPTURE_ERROR, raising_op
from tests.helpers.fakes import fake_capture


def _always() -> bool:
    return True


def _recording_a_segment() -> bool:
    # bcg has no public "inside a segment, not inside a break" predicate; is_capturing() is also
    # True while a break runs, so read the capture's own flag.
    cap = marks.ACTIVE.get()
    return cap is not None and not cap.in_break


_ORIGINAL = {name: getattr(torch.Tensor, name) for name in ("__bool__", "item", "tolist")}


def _patch(monkeypatch: pytest.MonkeyPatch, method: str, when: Callable[[], bool]) -> None:
    monkeypatch.setattr(torch.Tensor, method, raising_op(_ORIGINAL[method], when, CAPTURE_ERROR))


def _raised(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException:
    with pytest.raises(RuntimeError, match="stream is capturing") as info:
        fn(*args, **kwargs)
    return info.value


def _line_of(fn: Callable[..., Any], text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


# --------------------------------------------------------------------------------------------
# Errors and sites
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        CAPTURE_ERROR,
        "CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors might be ...",
        "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing",
        "CUDA error: cudaErrorStreamCaptureInvalidated",
        "CUDA error: operation failed due to a previous error during capture",
        "Capture was invalidated by a prior error",
        "called a synchronizing CUDA operation",
        "Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture.",
    ],
)
def test_is_capture_error_positive(message: str) -> None:
    assert is_capture_error(RuntimeError(message))


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
        RuntimeError("Expected all tensors to be on the same device"),
        ValueError("capture group 1 is missing"),
        bcg.CopyBackError("break 'x': output[1]: constant changed from 3 to 5"),
        KeyError("hidden_states"),
    ],
)
def test_is_capture_error_negative(exc: BaseException) -> None:
    assert not is_capture_error(exc)


def test_is_capture_error_walks_causes_and_contexts() -> None:
    def raise_from() -> None:
        try:
            raise RuntimeError(CAPTURE_ERROR)
        except RuntimeError as e:
            raise bcg.BreakError("capture failed") from e

    def raise_during() -> None:
        try:
            raise RuntimeError("CUDA error: cudaErrorStreamCaptureInvalidated")
        except RuntimeError:
            raise ValueError("cleanup failed") from None

    def unrelated_chain() -> None:
        try:
            raise KeyError("scale")
        except KeyError as e:
            raise RuntimeError("CUDA out of memory") from e

    # "from None" only hides the context from the printout; the error still carries it
    for fn, want in ((raise_from, True), (raise_during, True), (unrelated_chain, False)):
        with pytest.raises(Exception) as info:
            fn()
        assert is_capture_error(info.value) is want, fn.__name__


def test_break_site_str_is_one_line() -> None:
    site = BreakSite(
        function="transformers.masking_utils._ignore_causal_mask_sdpa",
        filename="/venv/lib/python3.11/site-packages/transformers/masking_utils.py",
        lineno=123,
        line="if padding_mask.all():",
        error=f"RuntimeError: {CAPTURE_ERROR}",
        _module="transformers.masking_utils",
    )
    assert str(site) == (
        "_ignore_causal_mask_sdpa (transformers/masking_utils.py:123: `if padding_mask.all():`): "
        f"RuntimeError: {CAPTURE_ERROR}"
    )
    other = BreakSite("pkg.mod.Class.method", "/home/me/src/pkg/mod.py", 7, "x.item()", "RuntimeError: x")
    assert str(other) == "pkg.mod.Class.method (src/pkg/mod.py:7: `x.item()`): RuntimeError: x"
    assert "\n" not in str(site) and "\n" not in str(other)


# --------------------------------------------------------------------------------------------
# A module-level function
# --------------------------------------------------------------------------------------------


def test_module_function_located_marked_in_every_module_and_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    original = discover_toys.positive_gate
    user = types.ModuleType("discover_toys_user")
    exec("from tests.helpers.discover_toys import positive_gate as gate", user.__dict__)
    monkeypatch.setitem(sys.modules, user.__name__, user)
    x = torch.rand(2, 3) + 0.5

    _patch(monkeypatch, "__bool__", _always)
    exc = _raised(discover_toys.model_step, x)
    assert is_capture_error(exc)
    site = locate(exc)
    assert site is not None
    assert site.function == "tests.helpers.discover_toys.positive_gate"
    assert site.filename == discover_toys.__file__
    assert site.lineno == _line_of(original, "if (x > 0).all():")
    assert site.line == "if (x > 0).all():"
    assert site.error == f"RuntimeError: {CAPTURE_ERROR}"
    assert str(site).startswith(f"positive_gate ({'/'.join(Path(discover_toys.__file__).parts[-3:])}:")
    assert discover(exc, discover_toys.model_step, (x,), {}) == site

    res = resolve(site)
    assert res is not None and res.function is original
    assert {(getattr(ns, "__name__", None), name) for ns, name, _ in res.bindings} >= {
        ("tests.helpers.discover_toys", "positive_gate"),
        ("discover_toys_user", "gate"),
    }

    # the top-level call's code is refused, and nothing is rebound
    with pytest.raises(
        ValueError, match=r"refusing to mark tests.helpers.discover_toys.positive_gate: it is the top-level"
    ):
        mark_as_break(site, refuse={original.__code__})
    assert discover_toys.positive_gate is original and user.gate is original

    undo = mark_as_break(site)
    marked = discover_toys.positive_gate
    assert marked is not original and marked.__bcg_eager__ and marked.__wrapped__ is original
    assert user.gate is marked
    with pytest.raises(ValueError, match=r"tests.helpers.discover_toys.positive_gate is already marked"):
        mark_as_break(site)

    _patch(monkeypatch, "__bool__", _recording_a_segment)
    with fake_capture(monkeypatch) as fake:
        out = discover_toys.model_step(x)
    assert fake.graph.break_names == ["tests.helpers.discover_toys.positive_gate"]
    assert len(fake.graph.segments) == 2
    assert torch.equal(out, (x + 1) * 6)
    x.sub_(10.0)  # the segment before the break would rewrite its input; the break takes the other branch
    fake.graph.breaks[0].args[0].copy_(x + 1)
    fake.graph.replay()
    assert torch.equal(fake.graph.breaks[0].buffer, -(x + 1))

    undo()
    assert discover_toys.positive_gate is original and user.gate is original
    undo()  # idempotent
    assert discover_toys.positive_gate is original and user.gate is original


def test_locate_reads_the_capture_error_behind_a_wrapping_one(monkeypatch: pytest.MonkeyPatch) -> None:
    _patch(monkeypatch, "__bool__", _always)
    with pytest.raises(bcg.BreakError) as info:
        try:
            discover_toys.model_step(torch.rand(3))
        except RuntimeError as e:
            raise bcg.BreakError("capture failed") from e
    site = locate(info.value)
    assert site is not None and site.function == "tests.helpers.discover_toys.positive_gate"
    assert site.error == f"RuntimeError: {CAPTURE_ERROR}"


def test_mark_by_name_for_functions_and_methods() -> None:
    Toy = discover_toys.Toy
    gate, scale = discover_toys.positive_gate, Toy.__dict__["scale"]
    undo_gate = mark_by_name("tests.helpers.discover_toys.positive_gate")
    undo_scale = mark_by_name("tests.helpers.discover_toys.Toy.scale", refuse={Toy.forward.__code__})
    assert discover_toys.positive_gate.__wrapped__ is gate and Toy.__dict__["scale"].__wrapped__ is scale
    # Marks by name are counted: a second user shares the mark, which stays until both let go.
    marked = discover_toys.positive_gate
    undo_again = mark_by_name("tests.helpers.discover_toys.positive_gate")
    assert discover_toys.positive_gate is marked
    undo_gate()
    undo_gate()  # idempotent: one user lets go once
    assert discover_toys.positive_gate is marked
    undo_again()
    undo_scale()
    assert discover_toys.positive_gate is gate and Toy.__dict__["scale"] is scale
    with pytest.raises(ValueError, match="top-level"):
        mark_by_name("tests.helpers.discover_toys.Toy.forward", refuse={Toy.forward.__code__})
    with pytest.raises(
        ValueError,
        match=r"cannot mark tests.helpers.discover_toys.no_such: tests.helpers.discover_toys has no Python function",
    ):
        mark_by_name("tests.helpers.discover_toys.no_such")
    with pytest.raises(ValueError, match=r"cannot mark no_such_package.f: no module"):
        mark_by_name("no_such_package.f")


def test_generators_closures_and_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(2, 3) + 0.5
    _patch(monkeypatch, "__bool__", _always)

    gen = locate(_raised(list, discover_toys.positive_rows(x)))
    assert gen is not None and gen.function == "tests.helpers.discover_toys.positive_rows"
    with pytest.raises(ValueError, match=r"cannot mark tests.helpers.discover_toys.positive_rows: a generator"):
        mark_as_break(gen)

    closure = locate(_raised(discover_toys.make_closure(), x))
    assert closure is not None and closure.function == "tests.helpers.discover_toys.make_closure.<locals>.inner"
    assert resolve(closure) is None
    with pytest.raises(
        ValueError, match=r"cannot mark tests.helpers.discover_toys.make_closure.<locals>.inner: no module"
    ):
        mark_as_break(closure)

    res = resolve(discover_toys.current_frame())
    assert res is not None and res.function is discover_toys.current_frame


def test_discover_ignores_other_errors_and_errors_outside_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(3)
    assert discover(RuntimeError("CUDA out of memory"), discover_toys.model_step, (x,), {}) is None
    # raised by "torch" straight into this test, as when a capture ends: no frame inside the call,
    # and without CUDA there is no sync-debug re-run either
    op = raising_op(lambda self: None, _always, CAPTURE_ERROR)
    exc = _raised(op, x)
    assert discover(exc, discover_toys.model_step, (x,), {}) is None
    calls: list[int] = []
    assert locate_by_sync_debug(lambda: calls.append(1), (), {}) is None
    assert calls == [] or torch.cuda.is_available()


# --------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------


def test_method_resolved_on_its_class_marked_and_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    Toy = discover_toys.Toy
    original = Toy.__dict__["scale"]
    model = Toy().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        ref = model(x)

    _patch(monkeypatch, "item", _always)
    site = locate(_raised(model, x))
    assert site is not None
    assert site.function == "tests.helpers.discover_toys.Toy.scale"
    assert site.line == "peak = x.abs().max().item()"
    assert site.lineno == _line_of(original, ".item()")
    res = resolve(site)
    assert res is not None and res.function is original
    assert res.bindings == ((Toy, "scale", original),)
    with pytest.raises(ValueError, match="top-level"):
        mark_as_break(site, refuse={Toy.forward.__code__, original.__code__})

    undo = mark_as_break(site)
    assert Toy.__dict__["scale"].__bcg_eager__
    _patch(monkeypatch, "item", _recording_a_segment)
    with fake_capture(monkeypatch) as fake, torch.no_grad():
        out = model(x)
    assert fake.graph.break_names == ["tests.helpers.discover_toys.Toy.scale"]
    assert torch.allclose(out, ref)
    undo()
    assert Toy.__dict__["scale"] is original


def test_staticmethod_resolved_through_its_qualified_name(monkeypatch: pytest.MonkeyPatch) -> None:
    Toy = discover_toys.Toy
    original = Toy.__dict__["normalise"]
    x = torch.randn(3)
    _patch(monkeypatch, "item", _always)
    site = locate(_raised(Toy.normalise, x))
    assert site is not None and site.function == "tests.helpers.discover_toys.Toy.normalise"
    undo = mark_as_break(site)
    assert isinstance(Toy.__dict__["normalise"], staticmethod) and Toy.normalise.__bcg_eager__
    _patch(monkeypatch, "item", _recording_a_segment)
    with fake_capture(monkeypatch) as fake:
        Toy.normalise(x)
    assert fake.graph.break_names == ["tests.helpers.discover_toys.Toy.normalise"]
    undo()
    assert Toy.__dict__["normalise"] is original


# --------------------------------------------------------------------------------------------
# A real diffusers transformer, without a recipe
# --------------------------------------------------------------------------------------------


def _tiny_lumina2() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(0)
    model = Lumina2Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=1,
        num_refiner_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),  # sums to the head dim, 32 / 2
        axes_lens=(32, 16, 16),
        cap_feat_dim=16,
    ).eval()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False  # a shorter second caption
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "timestep": torch.rand(2),
        "encoder_hidden_states": torch.randn(2, 6, 16),
        "encoder_attention_mask": mask,
    }
    return model, inputs


def test_lumina2_rope_tolist_located_marked_captured_and_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers.models.transformers import transformer_lumina2 as lumina2

    Rope = lumina2.Lumina2RotaryPosEmbed
    original = Rope.__dict__["forward"]
    model, inputs = _tiny_lumina2()
    with torch.no_grad():
        ref = model(**inputs).sample

    _patch(monkeypatch, "tolist", _recording_a_segment)
    with torch.no_grad():
        with fake_capture(monkeypatch):
            exc = _raised(model, **inputs)
        site = discover(exc, model, (), inputs)
    assert site is not None
    assert site.function == "diffusers.models.transformers.transformer_lumina2.Lumina2RotaryPosEmbed.forward"
    assert site.filename == lumina2.__file__
    assert ".tolist()" in site.line and site.line == "l_effective_cap_len = attention_mask.sum(dim=1).tolist()"
    assert site.lineno == _line_of(original, ".tolist()")
    assert str(site).startswith("Lumina2RotaryPosEmbed.forward (diffusers/models/transformers/transformer_lumina2.py:")

    undo = mark_as_break(site, refuse=set(_codes_along(type(model).forward)))
    try:
        assert Rope.__dict__["forward"].__bcg_eager__
        with torch.no_grad(), fake_capture(monkeypatch) as fake:
            out = model(**inputs).sample
        assert fake.graph.break_names == [site.function]
        assert len(fake.graph.segments) == 2
        assert torch.allclose(out, ref, atol=1e-5)
        fake.graph.replay()  # the break re-runs; its lists of lengths pass copy-back unchanged
    finally:
        undo()
    assert Rope.__dict__["forward"] is original and Rope.forward.__code__ is original.__code__
    with torch.no_grad(), fake_capture(monkeypatch):
        _raised(model, **inputs)


def _codes_along(fn: Any) -> list[Any]:
    """Every code object along ``fn``'s ``__wrapped__`` chain (what the runner would refuse)."""
    out = []
    while fn is not None:
        if hasattr(fn, "__code__"):
            out.append(fn.__code__)
        fn = getattr(fn, "__wrapped__", None)
    return out

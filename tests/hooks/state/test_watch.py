"""accel.hooks.state.watch on small modules: every kind of change is seen and named, nothing else is.

Each case makes one change to a watched module and asserts the fast check (``unchanged``) sees it,
the look names it, and (for Python-state changes) the record of the state differs; then that the
look after it finds nothing, and that undoing a Python change gives a record equal to the first.
"""

from __future__ import annotations

import functools

import pytest
import torch
from diffusers.models.attention_dispatch import attention_backend

from accel import eager_on_graph
from accel.hooks.state.states import StateKeys
from accel.hooks.state.watch import Watch


class Processor:
    """An attention processor as users write them: plain attributes, lists of scales."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.scales = [1.0, 1.0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class SlotProcessor:
    __slots__ = ("scale",)

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = torch.nn.Linear(4, 4)
        self.processor = Processor()
        self.fused_projections = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.processor(self.to_q(x))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()
        self.norm = torch.nn.LayerNorm(4)
        self.act = torch.nn.GELU()
        self.scaling = {"default": 1.0}
        self.magnitudes = torch.nn.ModuleDict()  # empty, as PEFT's DoRA vectors without DoRA
        self.register_buffer("pos", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.attn(x))) + self.pos


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(Block(), Block())


def _watched(m: torch.nn.Module) -> tuple[Watch, object]:
    w = Watch(m)
    look = w.look()
    assert look.first and w.unchanged()
    return w, look.record


def _hook(module, args, output):
    return output


# name -> (change, what the look says, Python state (True) or weights (False))
CASES = {
    "processor swapped": (lambda m: setattr(m[0].attn, "processor", Processor()), "0.attn.processor changed", True),
    "processor attribute": (lambda m: setattr(m[1].attn.processor, "scale", 0.5), "1.attn.processor.scale", True),
    "processor list in place": (lambda m: m[0].attn.processor.scales.__setitem__(0, 2.0), "processor.scales", True),
    "processor attribute added": (lambda m: setattr(m[0].attn.processor, "_attention_backend", "x"), "set ('x')", True),
    "module flag": (lambda m: setattr(m[0].attn, "fused_projections", True), "fused_projections changed", True),
    "eval": (lambda m: m.eval(), "training changed (True -> False)", True),
    "dict in place (PEFT's scaling)": (lambda m: m[1].scaling.update(default=0.5), "1.scaling changed", True),
    "forward set on a submodule": (lambda m: setattr(m[0].norm, "forward", lambda x: x), "0.norm.forward set", True),
    "method set on a submodule": (
        lambda m: setattr(m[0].attn, "forward", functools.partial(Attn.forward, m[0].attn)),
        "0.attn.forward set",
        True,
    ),
    "forward hook": (lambda m: m[1].norm.register_forward_hook(_hook), "1.norm: forward hooks changed (0 -> 1)", True),
    "forward hook on a container": (
        lambda m: m[0].magnitudes.register_forward_pre_hook(lambda mod, args: None),
        "0.magnitudes: forward pre hooks changed (0 -> 1)",
        True,
    ),
    "first entry of an empty ModuleDict": (
        lambda m: m[0].magnitudes.__setitem__("d", torch.nn.Identity()),
        "0.magnitudes.d added (Identity)",
        True,
    ),
    "submodule replaced": (lambda m: setattr(m[0], "act", torch.nn.SiLU()), "0.act replaced (GELU -> SiLU)", True),
    "parameter replaced": (
        lambda m: setattr(m[0].norm, "weight", torch.nn.Parameter(torch.ones(4))),
        None,
        False,
    ),
    "in-place write": (lambda m: m[0].attn.to_q.weight.add_(0), None, False),
    "storage swapped": (lambda m: setattr(m[1].attn.to_q.weight, "data", torch.randn(4, 4)), None, False),
    "cast": (lambda m: m.double(), None, False),
    "buffer written": (lambda m: m[1].pos.add_(1), None, False),
}


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_each_change_is_seen_once_and_named(case: str) -> None:
    change, said, python_state = CASES[case]
    m = _model()
    w, first = _watched(m)
    change(m)
    assert not w.unchanged()
    look = w.look()
    assert look.weights is (not python_state)
    if said is not None:
        assert any(said in c for c in look.changes), look.changes
    if python_state:
        assert look.record != first
    assert w.unchanged() and not w.look().changes  # once, not at every call


@torch.no_grad()
def test_one_element_tensor_replaced_by_an_equal_one_is_seen() -> None:
    """PEFT's hot-swap keeps scales as one-element tensors that graphs read by address: a new
    tensor of the same value is another address, and ``==`` alone would call them equal."""
    m = _model()
    m[0].scaling = {"default": torch.tensor(1.0)}
    m[0].gate = torch.tensor(2.0)
    w, _ = _watched(m)
    m[0].scaling["default"].fill_(0.5)  # in place: the same tensor, read by replays as it is now
    assert w.unchanged()
    m[0].scaling["default"] = torch.tensor(0.5)
    assert not w.unchanged()
    assert w.look().changes
    m[0].gate = torch.tensor(2.0)
    assert not w.unchanged()
    assert any("0.gate changed" in c for c in w.look().changes)


def test_equal_values_and_unwatched_entries_are_no_change() -> None:
    m = _model()
    w, _ = _watched(m)
    m[0].attn.processor.scale = 1.0  # the same value again
    m[0]._cached_steps = [1, 2]  # cache-dit's statistics of the last call
    assert not w.look().changes
    m[0]._cached_steps = [3]
    m[0].norm._non_persistent_buffers_set.add("x")  # only state_dict() reads it
    assert w.unchanged()


def test_what_a_linear_forward_never_reads_is_not_compared_per_call_and_the_rest_is() -> None:
    m = _model()
    w, _ = _watched(m)
    q = m[0].attn.to_q
    q.in_features, q.out_features = 5, 6  # F.linear reads the weight, not these
    q.training = not q.training
    assert w.unchanged()
    m[0].norm.training = not m[0].norm.training  # LayerNorm is not on the list: compared
    assert not w.unchanged()
    w.look()
    q.weight = torch.nn.Parameter(torch.randn(4, 4))  # the one key a Linear's forward reads
    assert not w.unchanged()
    w.look()
    q.forward = lambda x: x  # a forward of its own, a new key: the dictionary's length
    assert not w.unchanged()


def test_the_watched_modules_own_forward_hooks_are_no_change_but_its_childrens_are() -> None:
    """Torch runs a module's own forward hooks around its forward, where the graphs replay: a
    timing hook on the denoiser changes nothing a graph holds; one on a block runs inside."""
    m = _model()
    w, _ = _watched(m)
    handles = [m.register_forward_pre_hook(lambda mod, args: None), m.register_forward_hook(_hook)]
    assert w.unchanged() and not w.look().changes
    for h in handles:
        h.remove()
    assert w.unchanged()
    m[0].register_forward_pre_hook(lambda mod, args: None)
    assert not w.unchanged()
    assert any("0: forward pre hooks changed" in c for c in w.look().changes)


def _scaled_hook(scale: float):
    return lambda module, args, output: output * scale


def test_a_hook_registered_again_around_every_call_is_the_same_state_and_other_hooks_are_not() -> None:
    """A pipeline that registers ``lambda module, args, output: args[0]`` on a submodule around
    every encode and removes it after (QwenImage21Pipeline on its text encoder's final norm) makes
    a new function and handle each time: the same hook, so the same state, seen by the fast check
    alone. A hook of other code or other closure values, one more hook, one left out: changes."""
    m = _model()
    w = Watch(m)
    keys = StateKeys(limit=8)

    def encode_hook() -> torch.utils.hooks.RemovableHandle:
        return m[1].norm.register_forward_hook(lambda module, args, output: args[0])

    handle = encode_hook()
    with_hook, _ = keys.number(w.look().record)
    for _ in range(3):
        handle.remove()
        handle = encode_hook()
        assert w.unchanged()  # the per-call check, no look
        assert keys.number(w.look().record) == (with_hook, True)
    handle.remove()
    assert not w.unchanged()  # left out: seen
    without, seen = keys.number(w.look().record)
    assert without != with_hook and not seen
    handle = encode_hook()
    assert not w.unchanged()
    assert keys.number(w.look().record) == (with_hook, True)  # back to the hooked state

    other = m[1].norm.register_forward_hook(lambda module, args, output: args[0])
    assert not w.unchanged()  # one more hook (a hook that stays): seen, even of the same code
    assert any("1.norm: forward hooks changed (1 -> 2)" in c for c in w.look().changes)
    other.remove()
    assert not w.unchanged()
    assert keys.number(w.look().record) == (with_hook, True)
    handle.remove()
    handle = m[1].norm.register_forward_hook(lambda module, args, output: output)  # other code
    assert not w.unchanged()
    look = w.look()
    assert any("1.norm: forward hooks changed (1 -> 1)" in c for c in look.changes)
    assert keys.number(look.record)[0] not in (with_hook, without)
    handle.remove()
    w.look()
    handle = m[1].norm.register_forward_hook(_scaled_hook(1.0))
    first, _ = keys.number(w.look().record)
    handle.remove()
    handle = m[1].norm.register_forward_hook(_scaled_hook(1.0))  # same code, same closure values
    assert w.unchanged()
    handle.remove()
    handle = m[1].norm.register_forward_hook(_scaled_hook(2.0))  # same code, another value
    assert not w.unchanged()
    look = w.look()
    assert look.changes and keys.number(look.record)[0] != first


def _vl_model(marked: bool) -> torch.nn.Module:
    """A module named as transformers' Qwen3-VL model, which keeps the M-RoPE deltas of its last
    call with an image in ``rope_deltas`` and reads them only in ``compute_3d_position_ids``."""

    class Qwen3VLModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.rope_deltas = None

        def compute_3d_position_ids(self, n: int) -> torch.Tensor:
            self.rope_deltas = torch.zeros(1, 1, dtype=torch.long) + n
            return torch.arange(n)

    if marked:
        Qwen3VLModel.compute_3d_position_ids = eager_on_graph(Qwen3VLModel.compute_3d_position_ids)
    return torch.nn.Sequential(Qwen3VLModel())


@pytest.mark.parametrize("marked", [True, False])
def test_an_attribute_only_an_eager_break_reads_is_not_watched_while_it_is_one(marked: bool) -> None:
    """Each call with an image sets a new ``rope_deltas`` tensor: while the one method that reads
    it runs as an eager break (a recipe's known break, run at every replay) no graph holds it, so
    it is no change; otherwise it is watched as any other attribute."""
    m = _vl_model(marked)
    w, first = _watched(m)
    for n in (3, 5):
        m[0].compute_3d_position_ids(n)
        assert w.unchanged() is marked
        look = w.look()
        assert (look.record == first) is marked
        assert any("0.rope_deltas" in c for c in look.changes) is not marked
        first = look.record
    m[0].proj.flag = True  # anything else on the module is still watched
    assert not w.unchanged()


def test_attention_backends_global_hooks_and_kernel_switches_are_seen() -> None:
    m = _model()
    w, _ = _watched(m)
    with attention_backend("_native_math"):
        assert not w.unchanged()
        assert any("active attention backend changed" in c for c in w.look().changes)
    assert not w.unchanged()
    w.look()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not w.unchanged()
        assert any("autocast on the CPU changed (False -> True)" in c for c in w.look().changes)
    w.look()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        assert not w.unchanged()
        assert any("flash SDPA switch changed" in c for c in w.look().changes)
    w.look()
    handle = torch.nn.modules.module.register_module_forward_hook(_hook)
    try:
        assert not w.unchanged()
        assert any("global forward hooks" in c for c in w.look().changes)
    finally:
        handle.remove()
    assert not w.unchanged()


def test_undoing_a_change_gives_the_first_state_back() -> None:
    m = _model()
    w = Watch(m)
    keys = StateKeys(limit=4)
    first, seen = keys.number(w.look().record)
    assert not seen
    proc = m[0].attn.processor
    m[0].attn.processor = Processor(0.5)
    m.eval()
    second, seen = keys.number(w.look().record)
    assert second != first and not seen
    m[0].attn.processor = proc
    m.train()
    back, seen = keys.number(w.look().record)
    assert back == first and seen


class BackendProcessor(Processor):
    """A processor whose attention backend is a class attribute until one is set, as diffusers' are."""

    _attention_backend = None


def test_an_attribute_of_its_own_holding_what_its_class_gives_is_the_same_state() -> None:
    """diffusers' set_attention_backend then reset_attention_backend leave each processor an
    ``_attention_backend = None`` of its own where there was only the class's: the state it had."""
    m = _model()
    for block in m:
        block.attn.processor = BackendProcessor()
    w = Watch(m)
    keys = StateKeys(limit=4)
    first, _ = keys.number(w.look().record)
    for block in m:
        block.attn.processor._attention_backend = "_native_flash"
    assert not w.unchanged()
    look = w.look()
    assert any("0.attn.processor._attention_backend set ('_native_flash')" in c for c in look.changes), look.changes
    flash, seen = keys.number(look.record)
    assert flash != first and not seen
    for block in m:
        block.attn.processor._attention_backend = None  # reset: an attribute of its own now
    assert not w.unchanged()  # the dictionaries changed: looked at again
    look = w.look()
    assert any("_attention_backend changed ('_native_flash' -> None)" in c for c in look.changes)
    assert keys.number(look.record) == (first, True)
    # Set to what the class gives, from nothing: no change to name, the same state.
    fresh = _model()
    fresh[0].attn.processor = BackendProcessor()
    w = Watch(fresh)
    before = w.look().record
    fresh[0].attn.processor._attention_backend = None
    look = w.look()
    assert look.changes == [] and look.record == before
    # Not so a value the class does not give, nor an attribute shadowing a method or a property.
    fresh[0].attn.processor._attention_backend = "native"
    assert w.look().record != before
    fresh[0].attn.processor._attention_backend = None
    fresh[0].attn.processor.__call__ = None
    look = w.look()
    assert look.record != before and any("processor.__call__ set (None)" in c for c in look.changes)


def test_state_numbers_are_never_reused_for_another_state() -> None:
    keys = StateKeys(limit=2)
    numbers = [keys.number(("state", i))[0] for i in range(4)]
    assert numbers == [0, 1, 2, 3]
    assert keys.number(("state", 0)) == (4, False)  # forgotten beyond the limit: a new number
    assert keys.number(("state", 3)) == (3, True)


def test_state_outside_a_dict_is_named_unwatchable() -> None:
    m = _model()
    m[1].attn.processor = SlotProcessor()
    look = Watch(m).look()
    assert look.unwatchable and "1.attn.processor (SlotProcessor" in look.unwatchable[0]
    assert "__slots__" in look.unwatchable[0]


def test_a_module_with_slots_is_named_unwatchable() -> None:
    class Gate(torch.nn.Module):
        __slots__ = ("open",)

    m = _model()
    m[0].gate = Gate()
    look = Watch(m).look()
    assert any("0.gate (Gate: it keeps state in __slots__ (open))" in u for u in look.unwatchable), look.unwatchable


def test_forget_lets_go_of_the_module() -> None:
    import gc
    import weakref

    m = _model()
    w = Watch(m)
    w.look()
    ref = weakref.ref(m)
    w.forget()
    del m
    gc.collect()
    assert ref() is None

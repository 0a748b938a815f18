"""LoRA adapters in a replica's fixed slots: loading one is a hot-swap of a slot's weights, never a
new adapter in the denoiser.

A replica holds at most ``K`` adapters (``--max-models-per-replica``) of a catalog (``--lora
NAME=FILE[:SCALE]``). At start it loads ``K`` slots (peft adapters ``slot0`` ... ``slotK-1``)
with the catalog's adapter that adapts the most modules, turns every slot's scaling into a
tensor and pads every slot to the catalog's largest rank (peft's
``prepare_model_for_compiled_hotswap``), then hot-swaps each catalog adapter once into ``slot0``,
so an adapter that cannot be swapped in (other modules, a larger rank) stops the start in one
line. The warm-up then captures one adapter state per slot, as bcg-serve captures one per
``--lora``. Loading an adapter afterwards is ``load_lora_weights(..., hotswap=True)`` into a free
slot: peft writes the new weights through ``.data`` and fills the scaling tensors in place, so
the modules, their dictionaries and every tensor's address stay as captured, and the next call
replays the slot's graphs (docs/design.md: writes through ``.data`` bump nothing).

The scale: a request's image must equal ``bcg-serve --lora NAME=FILE:SCALE``'s, whose adapter
runs at ``SCALE * alpha / r`` (peft's ``set_scale``). The swap computes ``alpha / r`` from the
file's config; it is handed a copy of that config with ``alpha * SCALE``, so the slot's scaling
is the same number. Adapters of a lower rank than the largest are zero-padded: the same sums
with zeros added, which a CPU's or GPU's matrix kernels may round otherwise (bit for bit only
where the ranks are equal).

A slot is taken by the adapter that Ray Serve's multiplexing loads (:meth:`AdapterSlots.load`),
given back when Ray evicts it (:meth:`AdapterSlots.release`), and pinned while requests for its
adapter wait or run (:meth:`AdapterSlots.pin`): a released slot is reused only once no request
needs it. The engine's interface is that of :class:`pipelines.serve.engine.Adapters`
(``names``, ``specs``, ``select``). The swap itself is made by ``select``, on the device
worker's thread, before the first call (or step) that runs the adapter: never during a pipeline
call, whichever worker (batched or continuous) makes them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from pipelines.lora import LoraError, LoraSpec

__all__ = ["AdapterSlots", "NoSlot", "largest_rank", "seed_adapter", "slot_specs"]

logger = logging.getLogger("bcg-serve")

SLOT = "slot{}"


class NoSlot(Exception):
    """No slot came free in time: every slot holds an adapter that queued requests still need."""


def _lora_shapes(spec: LoraSpec) -> dict[str, list[int]]:
    """The file's LoRA tensors' shapes by key, read from its header (no tensor is loaded)."""
    from safetensors import safe_open

    with safe_open(str(spec.path), framework="numpy") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys() if "lora" in k.lower()}  # noqa: SIM118 (safe_open is no dict)


def _is_down(key: str) -> bool:
    k = key.lower()
    return "lora_a" in k or "lora_down" in k or "lora.down" in k


def largest_rank(specs: Sequence[LoraSpec]) -> int | None:
    """The largest rank of ``specs``' adapters (a down projection's rows); None where none is read."""
    ranks = [shape[0] for s in specs for k, shape in _lora_shapes(s).items() if _is_down(k) and len(shape) >= 2]
    return max(ranks) if ranks else None


def seed_adapter(specs: Sequence[LoraSpec]) -> LoraSpec:
    """The adapter the slots are made with: the one with the most LoRA tensors, so the slots adapt
    every module any catalog adapter does where one adapter covers them all (checked at start)."""
    return max(specs, key=lambda s: len(_lora_shapes(s)))


def slot_specs(catalog: Sequence[LoraSpec], slots: int) -> tuple[LoraSpec, ...]:
    """What the start loads (before the accelerator): ``slots`` copies of the seed adapter, named
    ``slot0`` ...; none for an empty catalog."""
    if not catalog:
        return ()
    seed = seed_adapter(catalog)
    return tuple(LoraSpec(seed.path, 1.0, SLOT.format(i)) for i in range(slots))


@contextlib.contextmanager
def _scaled_swap(scale: float) -> Iterator[None]:
    """peft's hot-swap given the file's LoRA config with every alpha times ``scale``: the scaling it
    writes, ``(alpha * scale) / r``, is the number ``set_scale`` gives a loaded adapter
    (``scale * alpha / r``; the product is the same in either order)."""
    import peft.utils.hotswap as hotswap

    original = hotswap.hotswap_adapter_from_state_dict

    def scaled(model: Any, state_dict: Any, adapter_name: str, config: Any, *args: Any, **kwargs: Any) -> Any:
        config = copy.copy(config)
        config.lora_alpha = config.lora_alpha * scale
        config.alpha_pattern = {k: v * scale for k, v in (config.alpha_pattern or {}).items()}
        return original(model, state_dict, adapter_name, config, *args, **kwargs)

    hotswap.hotswap_adapter_from_state_dict = scaled  # diffusers imports it from the module at each load
    try:
        yield
    finally:
        hotswap.hotswap_adapter_from_state_dict = original


@dataclasses.dataclass
class Slot:
    """One peft adapter of the denoiser: the catalog adapter it holds (None: none yet), whether Ray's
    multiplexing holds it (``held``), the requests for it waiting or running (``pins``), and the
    adapter to swap in before it next runs (``pending``)."""

    name: str
    holds: str | None = None
    held: bool = False
    pins: int = 0
    pending: LoraSpec | None = None


class AdapterSlots:
    """A replica's adapters: ``catalog`` (by name) swapped into the pipeline's slots.

    Made once the pipeline exists, its slots loaded (``slot_specs``) and before the warm-up; call
    :meth:`prepare` first.
    """

    def __init__(self, pipe: Any, catalog: Sequence[LoraSpec], slots: Sequence[LoraSpec]) -> None:
        self.pipe = pipe
        self._catalog = {s.name: s for s in catalog}
        self._slots = [Slot(s.name or "") for s in slots]
        self._slot_specs = {s.name: s for s in slots}
        self.loads: dict[str, int] = {}  # hot-swaps per adapter since the start (the start's own not counted)
        self.swap_seconds: list[float] = []
        self._changed = threading.Condition()
        self.active: str | None = ""  # forces the first select

    # -- the start ------------------------------------------------------------------------------

    def prepare(self, target_rank: int | None) -> None:
        """Every slot's scaling a tensor and its rank padded to ``target_rank`` (before any capture;
        the denoiser itself must not be compiled yet), then each catalog adapter swapped into the
        first slot once: LoraError in one line for one that cannot be."""
        from peft.utils.hotswap import prepare_model_for_compiled_hotswap

        if not self._slots:
            return
        denoiser = self._denoiser()
        prepare_model_for_compiled_hotswap(denoiser, target_rank=target_rank, check_compiled="error")
        first = self._slots[0]
        for spec in self._catalog.values():
            self._swap(first, spec)
        first.holds = None  # what it holds is no request's yet
        self.select(None)

    def _denoiser(self) -> Any:
        for name in ("transformer", "unet"):
            module = getattr(self.pipe, name, None)
            if module is not None:
                return module
        raise LoraError(f"{type(self.pipe).__name__} has no denoiser to load adapters into")

    # -- the engine's interface (the device worker's thread) -----------------------------------

    def names(self) -> list[str]:
        """The adapter states the warm-up captures: one per slot."""
        return [s.name for s in self._slots]

    def specs(self, name: str | None) -> list[LoraSpec]:
        """What an image made with ``name`` records: the catalog's spec (its file and scale)."""
        if name is None:
            return []
        if name in self._catalog:
            return [self._catalog[name]]
        return [self._slot_specs[name]]

    def _slot_of(self, name: str) -> Slot:
        for s in self._slots:
            if s.name == name or s.holds == name:
                return s
        raise LoraError(f"adapter {name!r} is in no slot of this replica")

    def select(self, name: str | None) -> None:
        """Run adapter ``name`` (a catalog name, or a slot's during the warm-up) alone; None: none.
        An adapter loaded into its slot since is swapped in first (on this, the device worker's, thread)."""
        slot = None
        if name is not None:
            held = self._slot_of(name)
            with self._changed:
                spec, held.pending = held.pending, None
                if spec is not None:  # counted with the hand-over, so :meth:`loads_of` never misses it
                    self.loads[name] = self.loads.get(name, 0) + 1
            if spec is not None:
                self._swap(held, spec)
            slot = held.name
        if slot == self.active:
            return
        if slot is None:
            # The same Python state whichever slot ran last: peft keeps its active adapter while
            # disabled, and graphs are captured per state (another would capture at its first call).
            self._denoiser().set_adapter(self._slots[0].name)
            self.pipe.disable_lora()
        else:
            self.pipe.enable_lora()
            self._denoiser().set_adapter(slot)  # peft's active adapter only: the scalings stay the swap's
        self.active = slot

    # -- the replica's interface ---------------------------------------------------------------

    def load(self, name: str, timeout: float) -> tuple[str, bool]:
        """Put adapter ``name`` in a slot, held: a slot that holds it already, else a free one
        (released by Ray and needed by no request), its swap due at its first ``select``. Returns
        (slot, whether a swap is due). Blocks up to ``timeout`` seconds for a slot to come free
        (:class:`NoSlot`)."""
        spec = self._catalog[name]
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                slot = next((s for s in self._slots if s.holds == name), None)
                if slot is not None:
                    slot.held = True
                    return slot.name, False
                free = [s for s in self._slots if not s.held and s.pins == 0]
                if free:
                    slot = min(free, key=lambda s: s.holds is not None)  # an empty slot first
                    slot.held, slot.holds, slot.pending = True, name, spec
                    return slot.name, True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoSlot(f"no adapter slot of this replica came free within {timeout:g} s "
                                 f"(--max-models-per-replica {len(self._slots)})")  # fmt: skip
                self._changed.wait(left)

    def _swap(self, slot: Slot, spec: LoraSpec) -> None:
        t0 = time.perf_counter()
        with _scaled_swap(float(spec.scale)):
            try:
                self.pipe.load_lora_weights(str(spec.path), adapter_name=slot.name, hotswap=True)
            except (RuntimeError, ValueError) as e:
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                raise LoraError(f"{str(spec.path)!r} cannot be hot-swapped into the adapter slots made from "
                                f"{self._slot_specs[slot.name].path.name!r}: {first}") from None  # fmt: skip
        self.swap_seconds.append(time.perf_counter() - t0)
        logger.info("adapter %r hot-swapped into %s in %.3f s", spec.name, slot.name, self.swap_seconds[-1])

    def release(self, name: str) -> None:
        """Ray evicted ``name``: its slot may be reused once no request needs it."""
        with self._changed:
            for s in self._slots:
                if s.holds == name:
                    s.held = False
            self._changed.notify_all()

    def pin(self, name: str) -> None:
        """A request for ``name`` waits or runs: its slot keeps it."""
        with self._changed:
            self._slot_of(name).pins += 1

    def unpin(self, name: str) -> None:
        with self._changed:
            slot = self._slot_of(name)
            slot.pins -= 1
            self._changed.notify_all()

    def loads_of(self, name: str) -> int:
        """Hot-swaps of ``name`` since the start, one that is due (loaded, not yet swapped in)
        counted: what a request for it that was just queued will have cost."""
        with self._changed:
            due = any(s.holds == name and s.pending is not None for s in self._slots)
            return self.loads.get(name, 0) + due

    def holding(self) -> dict[str, str]:
        """Slot -> the adapter it holds for Ray (held ones only)."""
        with self._changed:
            return {s.name: s.holds for s in self._slots if s.held and s.holds is not None}

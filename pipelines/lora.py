"""LoRA adapters from ``.safetensors`` files, loaded into a diffusers pipeline by diffusers itself.

Loading is diffusers' own: ``pipe.load_lora_weights(path, adapter_name=name)`` for each file,
then ``pipe.set_adapters(names, scales)``. What this module adds is the checks around it, each a
:class:`LoraError` of one line, so that a front end refuses bad input before it generates:

* a scale that is not a finite number (:func:`parse_lora`, :class:`LoraSpec`: no file read);
* a file that is missing, a folder, unreadable or not a safetensors file
  (:func:`check_lora_file`: the header only, no tensor read, no torch);
* a LoRA for another model (:func:`load_loras`, with the pipeline built): none of the modules
  the file adapts is a module of the pipeline's denoiser, after diffusers' own key conversion
  (``lora_state_dict``), or its shapes do not fit the denoiser's. Some modules missing (a LoRA
  for a variant with more blocks, say) is a warning, as in diffusers, in one line.

Every file is checked before the first is loaded, and a load that fails removes the adapters
this call had loaded, so a refused request leaves the pipeline as it was.

Two forms of the text of one adapter, both read by :func:`parse_lora`:

* ``FILE[:SCALE]`` (the CLI's ``--lora``): the adapter is named after the file;
* ``NAME=FILE[:SCALE]`` (a server's ``--lora``, whose requests pick adapters by name).

A CLI loads its adapters and runs them all; a server loads every adapter once at start and
picks one per request with :func:`activate`::

    specs = load_loras(pipe, [parse_lora("style=style.safetensors"), parse_lora("ink=ink.safetensors:0.8")])
    activate(pipe, [s for s in specs if s.name == "ink"])  # this request: ink at 0.8
    activate(pipe, [])  # no adapter: exactly the pipeline without LoRA

The accelerator needs nothing from this: its guards see adapters added, switched or rescaled
after a capture (loading before ``accelerate_pipeline`` only saves the first captures).

Importing this module imports neither torch nor diffusers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "LoraError",
    "LoraSpec",
    "activate",
    "check_lora_file",
    "describe_loras",
    "load_loras",
    "parse_lora",
]

SUFFIX = ".safetensors"
# An adapter's name: peft keeps adapters in ModuleDicts, whose keys cannot hold a '.'.
_NAME = re.compile(r"[A-Za-z0-9_-]+")
# A LoRA key after diffusers' conversion to peft's format: the adapted module, then its part
# (LoRA's A and B, DoRA's magnitude, LoKr's factors, an alpha).
_KEY = re.compile(r"^(?P<module>.+?)\.(?:lora_[AB]|lora_magnitude_vector|lora_embedding_[AB]|lokr_\w+|alpha)(?:\.|$)")
# The pipeline components that are denoisers, in diffusers' LoRA loaders' names.
_DENOISERS = ("transformer", "unet")


class LoraError(ValueError):
    """A LoRA that cannot be used: one line that names the file and why."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """One adapter: its file, its scale and its name (None: made from the file's name by
    :func:`load_loras`, which returns the specs with their names)."""

    path: Path
    scale: float = 1.0
    name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale):
            raise LoraError(f"{str(self.path)!r}: the scale {self.scale!r} is not a finite number")
        if self.name is not None and not _NAME.fullmatch(self.name):
            raise LoraError(f"adapter name {self.name!r}: use letters, digits, '-' and '_' only")

    def describe(self) -> str:
        """``file.safetensors:SCALE``: the file's name without its folder, and the scale."""
        return f"{self.path.name}:{self.scale:g}"


def parse_lora(text: str) -> LoraSpec:
    """``[NAME=]FILE[:SCALE]`` as a :class:`LoraSpec` (scale 1.0 if none); LoraError for a
    scale that is not a finite number. The file is not looked at (:func:`check_lora_file`).

    ``NAME=`` is read as a name only if NAME is made of letters, digits, '-' and '_'. ``:SCALE``
    is read as a scale only if it holds no path separator and does not end in ``.safetensors``,
    so that ``C:\\x.safetensors`` and ``a:b.safetensors`` are files.
    """
    name: str | None = None
    head, eq, rest = text.partition("=")
    if eq and _NAME.fullmatch(head):
        name, text = head, rest
    path_text, scale = text, 1.0
    before, colon, after = text.rpartition(":")
    if colon and "/" not in after and "\\" not in after and not after.lower().endswith(SUFFIX):
        path_text = before
        try:
            scale = float(after)
        except ValueError:
            raise LoraError(
                f"{text!r}: the scale {after!r} is not a number (FILE:SCALE, e.g. x.safetensors:0.8)"
            ) from None
        if not math.isfinite(scale):
            raise LoraError(f"{text!r}: the scale {after!r} is not a finite number")
    if not path_text.strip():
        raise LoraError(f"{text!r} names no file ([NAME=]FILE[:SCALE])")
    return LoraSpec(Path(os.path.expanduser(path_text)), scale, name)


def check_lora_file(spec: LoraSpec) -> None:
    """LoraError unless ``spec.path`` is a readable safetensors file holding tensors.

    Reads its header only (safetensors' own reader; neither torch nor a tensor is loaded).
    Pickled checkpoints (``.bin``, ``.pt``) are refused: loading one runs code from the file.
    """
    from safetensors import SafetensorError, safe_open

    path = spec.path
    shown = repr(str(path))
    if not path.exists():
        raise LoraError(f"{shown} does not exist")
    if path.is_dir():
        raise LoraError(f"{shown} is a folder; a LoRA is one {SUFFIX} file")
    if path.suffix.lower() in (".bin", ".pt", ".pth", ".ckpt"):
        raise LoraError(f"{shown} is a pickled checkpoint; only {SUFFIX} files are loaded (they run no code)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            keys = list(f.keys())
    except OSError as e:
        raise LoraError(f"{shown} cannot be read: {e.strerror or e}") from None
    except (SafetensorError, ValueError) as e:
        raise LoraError(f"{shown} is not a safetensors file ({str(e).strip().splitlines()[0][:120]})") from None
    if not keys:
        raise LoraError(f"{shown} holds no tensors")


def describe_loras(specs: Iterable[LoraSpec]) -> str:
    """The adapters as image metadata records them: ``a.safetensors:1, b.safetensors:0.5``."""
    return ", ".join(s.describe() for s in specs)


def _denoiser(pipe: Any) -> tuple[str, Any]:
    """The pipeline's denoiser as its LoRA loader names it, and the module."""
    loadable = getattr(pipe, "_lora_loadable_modules", None)
    if not callable(getattr(pipe, "load_lora_weights", None)) or not loadable:
        raise LoraError(f"{type(pipe).__name__} cannot load LoRAs (diffusers gives it no LoRA loader)")
    for name in _DENOISERS:
        module = getattr(pipe, name, None)
        if name in loadable and module is not None:
            return name, module
    raise LoraError(f"{type(pipe).__name__} loads LoRAs only into {', '.join(loadable)}, not into a denoiser")


def _adapted_modules(pipe: Any, spec: LoraSpec, prefix: str) -> tuple[set[str], list[str]]:
    """The denoiser modules ``spec``'s file adapts, read as diffusers reads them: the pipeline's
    own ``lora_state_dict`` (which converts other trainers' formats), the keys under ``prefix.``
    (all ``load_lora_weights`` passes to the denoiser), converted to peft's names. Also the
    file's keys, for a message."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    try:
        state = pipe.lora_state_dict(str(spec.path))
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # a format diffusers' converters refuse
        raise LoraError(f"{str(spec.path)!r}: diffusers cannot read it as a LoRA ({_first_line(e)[:160]})") from None
    if isinstance(state, tuple):  # some loaders return (state dict, network alphas[, metadata])
        state = state[0]
    keys = list(state)
    mine = {k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + ".")}
    if mine and not any("lora_A" in k for k in mine):  # older diffusers names (lora.down...): as load_lora_adapter does
        mine = convert_unet_state_dict_to_peft(mine)
    modules = {m.group("module") for k in mine if (m := _KEY.match(k))}
    return modules, keys


def _check_matches(pipe: Any, spec: LoraSpec) -> list[str]:
    """LoraError where ``spec`` adapts no module of the denoiser; else the modules it adapts
    that the denoiser lacks (a warning says how many)."""
    prefix, denoiser = _denoiser(pipe)
    adapted, keys = _adapted_modules(pipe, spec, prefix)
    model = type(denoiser).__name__
    shown = repr(str(spec.path))
    if not adapted:
        if any(k.startswith(prefix + ".") for k in keys):
            raise LoraError(f"{shown} holds weights for {model} but no LoRA's (lora_A, lora_B...): a model's own "
                            "weights, not a LoRA?")  # fmt: skip
        starts = ", ".join(repr(s) for s in sorted({k.split(".")[0] + "." for k in keys})[:3])
        raise LoraError(f"{shown} holds no weights for {model}: diffusers reads a LoRA's under {prefix + '.'!r}, and "
                        f"its keys start with {starts}; a LoRA for another model?")  # fmt: skip
    names = {name for name, _ in denoiser.named_modules()}
    missing = sorted(adapted - names)
    if len(missing) == len(adapted):
        raise LoraError(f"{shown} is a LoRA for another model: none of the {len(adapted)} modules it adapts "
                        f"(e.g. {missing[0]}) is in {model}")  # fmt: skip
    if missing:
        logger.warning("%s: %d of the %d modules it adapts are not in %s and are left out (e.g. %s)",
                       shown, len(missing), len(adapted), model, missing[0])  # fmt: skip
    return missing


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _fit_error(e: BaseException, adapter: str) -> str:
    """A shape mismatch from torch's ``load_state_dict``, in one line: the first weight that does not fit."""
    match = re.search(r"size mismatch for (\S+?): copying a param with shape torch\.Size\((\[[^]]*\])\) from "
                      r"checkpoint, the shape in current model is torch\.Size\((\[[^]]*\])\)", str(e))  # fmt: skip
    if match is None:
        return _first_line(e)[:200]
    key, theirs, ours = match.groups()
    return f"{key.replace(f'.{adapter}.', '.')}: {theirs} in the file, {ours} in the model"


@contextlib.contextmanager
def _held_back(skip_unhandled_keys: bool, denoiser: str) -> Iterator[None]:
    """diffusers' logs and peft's warnings held back while a file loads, and shown only if it
    loads: a failure is told in one line, not in their words too. Left out even then: peft's note
    that a model gets a second adapter (several are what was asked for), diffusers' note that a
    text encoder (any module but the ``denoiser`` class) found no keys of its own in a LoRA for
    the denoiser, and, with ``skip_unhandled_keys``, diffusers' list of the keys no module took
    (:func:`_check_matches` said it in one line)."""
    records: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    lg = logging.getLogger("diffusers")
    saved = lg.handlers[:], lg.propagate
    lg.handlers, lg.propagate = [Hold(logging.WARNING)], False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield
    finally:
        lg.handlers, lg.propagate = saved
    # Reached only when the load succeeded.
    for record in records:
        message = record.getMessage()
        if skip_unhandled_keys and record.name == "diffusers.utils.peft_utils":
            continue
        if message.startswith("No LoRA keys associated to ") and f" {denoiser} " not in message:
            continue
        logging.getLogger(record.name).handle(record)
    for w in caught:
        if "Already found a `peft_config`" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _unique_names(specs: Sequence[LoraSpec], taken: set[str]) -> list[str]:
    names: list[str] = []
    for spec in specs:
        if spec.name is not None:
            if spec.name in taken or spec.name in names:
                raise LoraError(f"adapter name {spec.name!r} is already loaded: give each adapter its own NAME=")
            names.append(spec.name)
            continue
        base = re.sub(r"[^A-Za-z0-9_-]+", "_", spec.path.name.removesuffix(SUFFIX).removesuffix(SUFFIX.upper()))
        base = base.strip("_") or "lora"
        name, n = base, 1
        while name in taken or name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


def load_loras(pipe: Any, specs: Sequence[LoraSpec], *, activate_all: bool = True) -> list[LoraSpec]:
    """Load each of ``specs`` into ``pipe`` with diffusers' ``load_lora_weights``; returns the
    specs with their adapter names (those not named take the file's name, made unique).

    With ``activate_all`` the adapters then run together at their scales (:func:`activate`);
    otherwise the pipeline's active adapters are left to the caller. LoraError (one line) for a
    file that cannot be used, a LoRA for another model, or a pipeline without a LoRA loader;
    every file is checked before the first is loaded, and on any failure the adapters this call
    loaded are deleted again. Call it before ``accelerate_pipeline`` where you can: after, the
    graphs are captured again (the guards see the change), which costs time, never correctness.
    """
    if not specs:
        return []
    prefix, denoiser = _denoiser(pipe)
    for spec in specs:
        check_lora_file(spec)
    taken = {name for names in pipe.get_list_adapters().values() for name in names}
    named = [dataclasses.replace(s, name=n) for s, n in zip(specs, _unique_names(specs, taken))]
    missing = {spec.name or "": _check_matches(pipe, spec) for spec in named}
    loaded: list[str] = []
    try:
        for spec in named:
            name = spec.name or ""  # always set: named above
            try:
                with _held_back(bool(missing[name]), type(denoiser).__name__):
                    pipe.load_lora_weights(str(spec.path), adapter_name=name)
            except RuntimeError as e:
                if "size mismatch" in str(e):
                    raise LoraError(f"{str(spec.path)!r} does not fit {type(denoiser).__name__}'s shapes "
                                    f"({_fit_error(e, name)}): a LoRA for another size of this model?") from None  # fmt: skip
                raise
            except ValueError as e:
                # What the checks above do not foresee: peft's "Target modules ... not found", say.
                raise LoraError(f"{str(spec.path)!r}: {_first_line(e)[:200]}") from None
            if name not in pipe.get_list_adapters().get(prefix, []):  # diffusers skipped it with only a warning
                raise LoraError(f"{str(spec.path)!r}: diffusers loaded nothing of it into {type(denoiser).__name__}")
            loaded.append(name)
        if activate_all:
            activate(pipe, named)
    except BaseException:
        if loaded:
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # peft's notes on deleting the active adapter
                pipe.delete_adapters(loaded)
        raise
    for spec in named:
        logger.info("LoRA %s: adapter %r at scale %g", spec.path.name, spec.name, spec.scale)
    return named


def activate(pipe: Any, specs: Sequence[LoraSpec]) -> None:
    """Run exactly the adapters ``specs`` (loaded by :func:`load_loras`, so named) at their
    scales; none: LoRA off (``disable_lora``), the pipeline's own forward, bit for bit."""
    if not specs:
        pipe.disable_lora()
        return
    names = [s.name for s in specs]
    if None in names:
        raise LoraError("activate() takes the specs load_loras returned (each has its adapter name)")
    pipe.enable_lora()
    pipe.set_adapters(names, [float(s.scale) for s in specs])

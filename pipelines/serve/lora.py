"""LoRA adapters: loaded once at start, picked per pipeline call by name.

``--lora NAME=FILE`` loads FILE with diffusers' ``load_lora_weights(FILE, adapter_name=NAME)``
(which needs peft, in the ``[serve]`` extra); no adapter is active until a request names one.
A call with an adapter activates it alone (``set_adapters([NAME])``); a call without one
disables them (``disable_lora``), which gives the base model's images back exactly. Requests
with different adapters never share a call (the adapter is part of the batch key).

The adapters are loaded before the server's warm-up, which then captures every adapter state
(none, and each adapter) so each keeps graphs of its own: an adapter switch replays, it does
not capture. That relies on the library keeping graphs per adapter state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipelines.cli import RunError

from .config import UsageError
from .errors import one_line

__all__ = ["Adapters", "check_files"]

logger = logging.getLogger("bcg-serve")


def check_files(adapters: Sequence[tuple[str, str]]) -> None:
    """UsageError for an adapter file that is not there (checked before anything is built)."""
    for name, file in adapters:
        if not Path(file).expanduser().exists():
            raise UsageError(f"--lora {name}={file}: no such file")


class Adapters:
    """The adapters loaded into ``pipe``, and the one active (None: none)."""

    def __init__(self, pipe: Any, adapters: Sequence[tuple[str, str]] = ()) -> None:
        self.pipe = pipe
        self.names = tuple(name for name, _ in adapters)
        self.active: str | None = None
        if not adapters:
            return
        if not hasattr(pipe, "load_lora_weights"):
            raise RunError(f"--lora: {type(pipe).__name__} cannot load LoRA adapters (it has no load_lora_weights)")
        for name, file in adapters:
            try:
                pipe.load_lora_weights(str(Path(file).expanduser()), adapter_name=name)
            except Exception as e:  # a wrong file, a LoRA for another model, peft missing: one line each
                raise RunError(
                    f"--lora {name}={file}: cannot load it: {type(e).__name__}: {one_line(e)[:300]}"
                ) from None
            logger.info("loaded LoRA adapter %r from %s", name, file)
        pipe.disable_lora()

    def select(self, name: str | None) -> None:
        """Make ``name`` the only active adapter (None: none) for the calls that follow."""
        if name == self.active:
            return
        if name is None:
            self.pipe.disable_lora()
        else:
            if self.active is None:
                self.pipe.enable_lora()
            self.pipe.set_adapters([name])
        self.active = name

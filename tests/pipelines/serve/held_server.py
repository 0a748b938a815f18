"""``bcg-serve`` with the tiny pipeline's call wrapped, so tests can time what the device does.

A prompt containing ``hold:PATH`` makes its pipeline call wait (running, the device busy) until
the file PATH exists; one containing ``boom`` makes the call fail. Everything else is the real
server: started as ``python -m tests.pipelines.serve.held_server [bcg-serve flags]``.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any

from diffusers import ZImagePipeline

_call = ZImagePipeline.__call__


@functools.wraps(_call)  # keeps the signature the server reads its parameters from
def _held_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    prompts = kwargs.get("prompt")
    for prompt in [prompts] if isinstance(prompts, str) else list(prompts or ()):
        if "boom" in prompt:
            raise RuntimeError("injected failure\nsecond line")
        if "hold:" in prompt:
            path = Path(prompt.split("hold:", 1)[1].split()[0])
            deadline = time.monotonic() + 120
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
    return _call(self, *args, **kwargs)


ZImagePipeline.__call__ = _held_call

if __name__ == "__main__":
    from pipelines.serve import main

    sys.exit(main())

"""The run's progress: every denoising step of every call, and the images made.

On a terminal it is one tqdm bar counting steps, the images made beside it (``generating:
40%|####  | 36/90 [00:41<01:02, 1.1 step/s, image 4/10]``), log lines written above it
(:mod:`pipelines.cli.terminal`). Anywhere else (a file, a CI log, a pipe) no bar is drawn: carriage
returns would pile a bar's redraws and the log lines into one line. There it is a log line now and
then (at most every ``interval`` seconds) and one at the end of every call, each a line of its own
in the same stream as the other logs.

The steps come from the pipeline's ``callback_on_step_end`` (:class:`~pipelines.generation.steps.StepWatch`):
the host's view, so on a GPU a step counts once launched (the images are made whole at the call's
end). A pipeline without the callback advances by whole calls.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO, Any

__all__ = ["Progress"]

logger = logging.getLogger("bcg-generate")

# Seconds between two progress lines where no bar is drawn: a long run says where it is, a short
# one writes only its calls' lines.
LINE_INTERVAL = 10.0
# Seconds between two redraws of a bar (tqdm's default): a step of a few milliseconds is not a redraw.
BAR_INTERVAL = 0.1


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Progress:
    """Steps and images of a run of ``calls`` pipeline calls of ``steps`` steps each, making
    ``images`` images (``unit``: "image" or "video").

    ``enabled`` False: silent (``--quiet``); ``stream``: where a bar goes (a terminal: a bar; else
    log lines, at most one every ``interval`` seconds, default :data:`LINE_INTERVAL`); ``tag``: a
    process's prefix under accelerate; ``position``: its bar's row.
    """

    def __init__(self, images: int, calls: int, steps: int, *, enabled: bool = True, stream: IO[str] | None = None,
                 tag: str = "", position: int | None = None, unit: str = "image",
                 interval: float | None = None) -> None:  # fmt: skip
        self.images, self.calls, self.steps = images, calls, max(steps, 1)
        self.unit, self.tag = unit, tag
        self.interval = LINE_INTERVAL if interval is None else interval
        self.enabled = enabled
        stream = stream if stream is not None else sys.stderr
        self.tty = enabled and bool(getattr(stream, "isatty", lambda: False)())
        self.made = 0
        self.calls_done = 0
        self.step_in_call = 0
        self.started = time.monotonic()
        self._said = self.started
        self.bar: Any = None
        if self.tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=calls * self.steps, unit="step", desc=f"{tag}generating".strip(), file=stream,
                            position=position, dynamic_ncols=True, mininterval=BAR_INTERVAL)  # fmt: skip
            self._postfix()

    @property
    def done_steps(self) -> int:
        return self.calls_done * self.steps + min(self.step_in_call, self.steps)

    def _postfix(self) -> None:
        self.bar.set_postfix_str(f"{self.unit} {self.made}/{self.images}", refresh=False)

    def step(self, n: int) -> None:
        """Step ``n`` (from 1) of the current call ended."""
        if not self.enabled:
            return
        before = self.done_steps
        self.step_in_call = n
        if self.bar is not None:
            self.bar.update(self.done_steps - before)
        elif time.monotonic() - self._said >= self.interval:
            self._line(f"step {min(n, self.steps)}/{self.steps} of call {self.calls_done + 1}/{self.calls}")

    def call_done(self, images: int) -> None:
        """The current call ended, making ``images`` images (its step count completed, for a call
        that ran fewer steps than asked: an image-to-image call runs ``strength`` of them)."""
        if not self.enabled:
            return
        before = self.done_steps
        self.calls_done += 1
        self.step_in_call = 0
        self.made += images
        if self.bar is not None:
            self._postfix()
            self.bar.update(self.done_steps - before)
        else:
            self._line(f"call {self.calls_done}/{self.calls} done")

    def _line(self, where: str) -> None:
        now = time.monotonic()
        self._said = now
        elapsed = now - self.started
        done = self.done_steps
        left = ""
        if done:
            rate = elapsed / done
            left = f", {rate:.2f} s/step"
            if done < self.calls * self.steps:
                left += f", about {_clock(rate * (self.calls * self.steps - done))} left"
        logger.info("%sgenerating: %s, %s %d/%d made, %s elapsed%s", self.tag, where, self.unit, self.made,
                    self.images, _clock(elapsed), left)  # fmt: skip

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

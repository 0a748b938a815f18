"""Progress bars and log lines on one terminal.

While a tqdm bar is drawn, a log line written straight to the terminal lands on the bar's line and
the next redraw writes over it. tqdm's own :func:`~tqdm.contrib.logging.logging_redirect_tqdm`
makes console handlers write through ``tqdm.write``, which clears the bar, writes the line and
draws the bar again below it. By default it redirects the root logger's handlers only; diffusers
and transformers log through console handlers of their own that do not propagate to the root, so
:func:`bars_and_logs` hands it those too.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

__all__ = ["bars_and_logs", "console_loggers"]


def _writes_to_console(handler: logging.Handler) -> bool:
    # The handlers tqdm replaces: a stream handler on the process's stdout or stderr.
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


def console_loggers() -> list[logging.Logger]:
    """Every logger, the root included, that has a console handler of its own.

    Only those: tqdm gives each logger it is handed a console handler, even one that had none,
    and a root logger without one (an embedding program's, a test's) would then start printing.
    """
    loggers = [logging.root, *list(logging.Logger.manager.loggerDict.values())]  # a copy: imports add loggers
    return [lg for lg in loggers if isinstance(lg, logging.Logger) and any(map(_writes_to_console, lg.handlers))]


@contextlib.contextmanager
def bars_and_logs() -> Iterator[None]:
    """Log lines are written above the progress bars while this is open, whichever library logs
    them; the handlers are as they were once it closes."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=console_loggers()):
        yield

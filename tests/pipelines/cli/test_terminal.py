"""Progress bars and log lines share the terminal: while bars_and_logs is open, a library's own
console handler (diffusers' and transformers' do not propagate to the root logger) writes above
the bar through tqdm, instead of onto the bar's line; the handlers are as they were after."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator

import pytest
from tqdm import tqdm

from pipelines.cli.terminal import bars_and_logs, console_loggers


@pytest.fixture
def library_logger() -> Iterator[Callable[[], logging.Logger]]:
    """Makes a logger set up as diffusers sets up its own: a stderr handler, no propagation. Made
    in the test's body, after the process's stderr exists, as a library's is: pytest (9.2) gives
    capsys a new stderr in each phase of a test and closes the old one, so a handler made in a
    fixture's setup would hold a closed stream that is not sys.stderr."""
    logger = logging.getLogger("tests.a_library")
    made: list[logging.Handler] = []

    def make() -> logging.Logger:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[a library] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        made.append(handler)
        return logger

    yield make
    for handler in made:
        logger.removeHandler(handler)
    logger.propagate = True


def _bar_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "%|" in line]


def test_a_library_line_is_written_above_the_bar(library_logger: Callable[[], logging.Logger],
                                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    logger = library_logger()
    with bars_and_logs(), tqdm(total=2, file=sys.stderr, mininterval=0, ncols=60) as bar:
        bar.update()
        logger.warning("the prompt was cut")
        bar.update()
    # Each write of tqdm begins with a carriage return; the line logged must be one of its own.
    pieces = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert "[a library] the prompt was cut" in pieces
    assert not any("the prompt was cut" in piece for piece in _bar_lines(pieces))


def test_without_it_the_line_lands_on_the_bar(library_logger: Callable[[], logging.Logger],
                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """What the test above guards against, shown: the bar's text and the line on one line."""
    logger = library_logger()
    with tqdm(total=2, file=sys.stderr, mininterval=0, ncols=60) as bar:
        bar.update()
        logger.warning("the prompt was cut")
        bar.update()
    pieces = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert any("the prompt was cut" in piece for piece in _bar_lines(pieces))


def test_only_loggers_that_write_to_the_console_are_redirected(library_logger: Callable[[], logging.Logger]) -> None:
    logger = library_logger()
    quiet = logging.getLogger("tests.a_quiet_library")  # propagates, no handler: tqdm must not give it one
    handlers = {lg.name: list(lg.handlers) for lg in (logger, quiet, logging.root)}
    found = console_loggers()
    assert logger in found and quiet not in found
    with bars_and_logs():
        assert [type(h).__name__ for h in logger.handlers] == ["_TqdmLoggingHandler"]
        assert quiet.handlers == []
    assert {lg.name: list(lg.handlers) for lg in (logger, quiet, logging.root)} == handlers

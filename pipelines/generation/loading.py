"""Loading a model: library warnings held back, errors in one line."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import InputError, RunError, one_line

T = TypeVar("T")

_LIBRARY_LOGGERS = ("diffusers", "transformers", "huggingface_hub")


def _load_quietly(load: Callable[[], T]) -> T:
    """Run ``load`` with the libraries' warnings held back; they are shown only if it succeeds.

    A failed hub load first warns "Couldn't connect to the Hub ... Will try to load from local
    cache", then raises: the warnings only repeat the error, which is reported in one line.
    """
    records: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    hold = Hold(logging.WARNING)
    saved = []
    for name in _LIBRARY_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.handlers[:], lg.propagate))
        lg.handlers, lg.propagate = [hold], False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            result = load()
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers, lg.propagate = handlers, propagate
    # Each once: diffusers says its float16-on-CPU warning for every component it moves.
    said: set[tuple[str, int, str]] = set()
    for record in records:
        key = (record.name, record.levelno, record.getMessage())
        if key not in said:
            said.add(key)
            logging.getLogger(record.name).handle(record)
    shown: set[tuple[type, str]] = set()
    for w in caught:
        if (w.category, str(w.message)) not in shown:
            shown.add((w.category, str(w.message)))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result


def _load_error_message(model: str, error: BaseException) -> str:
    """What went wrong loading ``model``, in one line: the cause, not diffusers' whole story."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    names: set[str] = set()
    for x in chain:
        names.update(k.__name__ for k in type(x).__mro__)
    head = f"could not load model {model!r}"
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if "GatedRepoError" in names:
        return f"{head}: the repository is gated; accept its terms on the hub and log in (hf auth login)"
    if "RepositoryNotFoundError" in names:
        return f"{head}: no such model on the hub (check the name; a private one needs hf auth login)"
    if "OfflineModeIsEnabled" in names or (offline and "LocalEntryNotFoundError" in names):
        return f"{head}: not found in the local cache, and HF_HUB_OFFLINE is set (unset it to download)"
    network = {"ConnectError", "ConnectionError", "NetworkError", "TimeoutException", "ConnectTimeout"}
    if names & network or "not fully cached locally" in str(error):
        return f"{head}: not found in the local cache, and the hub is unreachable (no network?)"
    if os.path.isdir(model):
        return f"{head}: the folder is not a diffusers pipeline ({one_line(error)[:200]})"
    return f"{head}: {one_line(error)[:300]}"


def build_model(model: str, size: str, device: Any, dtype: Any) -> Any:
    """The pipeline: embedded models from the offline builders, anything else from_pretrained."""
    from ..builders import build_pipeline

    try:
        return _load_quietly(lambda: build_pipeline(model, size=size, device=device, dtype=dtype, seed=0))
    except ValueError as e:
        if "unknown model" in str(e) or "unknown size" in str(e):
            raise InputError(one_line(e)) from None
        raise RunError(_load_error_message(model, e)) from None
    except Exception as e:  # from_pretrained raises many kinds; each ends as one line
        raise RunError(_load_error_message(model, e)) from None

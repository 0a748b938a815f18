"""The running batch: rows in the slots of a fixed batch size, one step for all of them.

Every step calls the family's ``predict`` with ``bucket`` rows, so the denoiser's shapes are the
bucket's whatever the number of rows: an empty slot is filled with a copy of the last row, whose
result nobody reads. Each row is then updated by its own scheduler and moves on one step; a row
whose steps are done leaves its slot. Text is encoded and latents decoded at a batch size too
(:func:`encode_padded`, :func:`decode_padded`): the text encoder's and the decoder's kernels are
chosen by the batch's shape as the denoiser's are. All of it runs without autograd, as a
pipeline call does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .schedule import Schedule

__all__ = ["Preview", "Row", "RunningBatch", "decode_padded", "encode_padded", "padded"]


def padded(items: Sequence[Any], size: int) -> list[Any]:
    """``items`` and copies of its last to ``size`` in all."""
    if not items or len(items) > size:
        raise ValueError(f"{len(items)} items do not pad to {size}")
    return [*items, *[items[-1]] * (size - len(items))]


@dataclasses.dataclass(eq=False)
class Row:
    """One image: its text (the family's), latents, schedule, guidance, the steps after which a
    preview is made (0-based indices of steps done), and ``owner``, what the caller knows it by."""

    text: Any
    latents: torch.Tensor
    schedule: Schedule
    guidance: float = 0.0
    previews: frozenset[int] = frozenset()
    owner: Any = None


@dataclasses.dataclass(frozen=True)
class Preview:
    """The model's estimate of a row's clean latents (``x0``) at step ``step`` (0-based)."""

    row: Row
    step: int
    x0: torch.Tensor


class RunningBatch:
    """``bucket`` slots of rows at ``size`` (width, height), with or without guidance (``cfg``:
    the denoiser's call then has both branches for every row), stepped by ``family``."""

    def __init__(self, family: Any, bucket: int, size: tuple[int, int], cfg: bool) -> None:
        self.family = family
        self.bucket = bucket
        self.size = size
        self.cfg = cfg
        self.slots: list[Row | None] = [None] * bucket

    @property
    def rows(self) -> list[Row]:
        return [r for r in self.slots if r is not None]

    @property
    def free(self) -> int:
        return self.slots.count(None)

    def add(self, row: Row) -> None:
        """``row`` into a free slot (ValueError if none is)."""
        try:
            self.slots[self.slots.index(None)] = row
        except ValueError:
            raise ValueError(f"no free slot in a batch of {self.bucket}") from None

    def remove(self, row: Row) -> None:
        """``row`` out of its slot (a request gone); nothing if it is not here."""
        self.slots = [None if r is row else r for r in self.slots]

    @torch.no_grad()
    def step(self) -> tuple[list[Preview], list[Row]]:
        """One step of every row; returns the previews made (where a row asked for one at this
        step) and the rows whose steps are done, out of their slots now."""
        rows = self.rows
        if not rows:
            return [], []
        full = [r if r is not None else rows[-1] for r in self.slots]
        latents = torch.cat([r.latents for r in full])
        timesteps = torch.stack([r.schedule.timestep for r in full])
        out = self.family.predict(latents, timesteps, [r.text for r in full], [r.guidance for r in full], self.cfg,
                                  self.size)  # fmt: skip
        previews, done = [], []
        for i, r in enumerate(self.slots):
            if r is None:
                continue
            step = r.schedule.index
            if step in r.previews:
                previews.append(Preview(r, step, r.schedule.x0(out[i : i + 1], r.latents)))
            r.latents = r.schedule.step(out[i : i + 1], r.latents)
            if r.schedule.done:
                done.append(r)
        for r in done:
            self.remove(r)
        return previews, done


@torch.no_grad()
def encode_padded(family: Any, prompts: Sequence[str], negatives: Sequence[str] | None, cfg: bool,
                  batch: int) -> list[Any]:  # fmt: skip
    """The texts of ``prompts`` (and ``negatives``), encoded in calls of ``batch`` rows, the last
    call padded with copies of its last prompt: one text per prompt."""
    texts: list[Any] = []
    for start in range(0, len(prompts), batch):
        part = list(prompts[start : start + batch])
        neg = padded(list(negatives[start : start + batch]), batch) if negatives is not None else None
        texts += family.encode(padded(part, batch), neg, cfg)[: len(part)]
    return texts


@torch.no_grad()
def decode_padded(family: Any, latents: Sequence[torch.Tensor], size: tuple[int, int], batch: int) -> torch.Tensor:
    """The images of ``latents`` (rows of one size), decoded in calls of ``batch`` rows, the last
    padded with copies of its last row: ``(len(latents), 3, H, W)``."""
    images = []
    for start in range(0, len(latents), batch):
        part = list(latents[start : start + batch])
        images.append(family.decode(torch.cat(padded(part, batch)), size)[: len(part)])
    return torch.cat(images)

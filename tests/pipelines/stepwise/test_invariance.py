"""decode_is_batch_invariant: a decoder that computes each row alone is found to give the same bits
at every bucket; one whose rows depend on the batch's size, in one value of one row, is not."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.stepwise.invariance import decode_is_batch_invariant


class Family:
    """A stand-in loop: ``noise`` as a family's (one row from the generator), ``decode`` per row, or
    with the batch's size leaking into one value of its first row (``leak``)."""

    def __init__(self, leak: bool = False) -> None:
        self.leak = leak
        self.decoded: list[int] = []

    def noise(self, generator: torch.Generator, width: int, height: int) -> torch.Tensor:
        return torch.randn(1, 4, height // 8, width // 8, generator=generator)

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        self.decoded.append(len(latents))
        images = torch.nn.functional.interpolate(latents[:, :3].tanh(), size=size[::-1])
        if self.leak and len(latents) > 2:
            images[0, 0, 0, 0] += 2.0**-20
        return images


def test_a_decoder_of_rows_alone_gives_the_same_bits_at_every_bucket() -> None:
    family = Family()
    assert decode_is_batch_invariant(family, (64, 32), [4, 1, 2], "cpu")
    assert family.decoded == [4, 1, 2]  # the largest, then each smaller bucket once


def test_one_value_that_depends_on_the_batch_is_found() -> None:
    assert not decode_is_batch_invariant(Family(leak=True), (64, 32), [1, 2, 4], "cpu")
    assert decode_is_batch_invariant(Family(leak=True), (64, 32), [1, 2], "cpu")  # no bucket above 2 served


def test_one_bucket_needs_no_decode() -> None:
    family: Any = Family()
    assert decode_is_batch_invariant(family, (32, 32), [4, 4], "cpu") and family.decoded == []

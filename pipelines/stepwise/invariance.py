"""Whether a family's decode gives each row the same bits at every batch size it may run at.

A running batch's rows leave when their own steps are done, a few at a time. Decoded at the
batch's bucket, each such group pays the whole bucket's decode (the rows beyond its own are
copies). Decoded at the smallest bucket that holds it, the group pays for its rows only, but
its images are then the same as at the batch's bucket only where the decoder's kernels compute
each row alone, in the same order at every batch size. That depends on the device, the decoder,
its compiled forms and the size, not on the latents' values (a kernel is chosen by shapes), so it
is found out once per size, on the device, by decoding the same random latents at every bucket:
:func:`decode_is_batch_invariant`. One differing bit anywhere and the answer is no.

What it does not do: prove it for every input. Kernels chosen by shapes give every input the
same order of arithmetic, and two orders give random latents the same bits in every one of
their values with a vanishing chance, so a yes is taken as a property of the shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["decode_is_batch_invariant"]


@torch.no_grad()
def decode_is_batch_invariant(family: Any, size: tuple[int, int], buckets: Sequence[int], device: Any) -> bool:
    """Whether ``family.decode`` (a :mod:`pipelines.stepwise` loop) gives the rows of random
    latents at ``size`` (width, height) the same bits at each of ``buckets`` as at the largest."""
    buckets = sorted(set(buckets))
    if len(buckets) < 2:
        return True
    generator = torch.Generator(device).manual_seed(0)
    latents = torch.cat([family.noise(generator, *size) for _ in range(buckets[-1])])
    largest = family.decode(latents, size)
    return all(torch.equal(family.decode(latents[:b], size), largest[:b]) for b in buckets[:-1])

"""Attention backends: FlashAttention-3 in diffusers' dispatch, and ``attention=``.

Owns the wheel's forward as diffusers' backends call it (``fa3``: bf16, and float8 with per-head
scales; key-padding masks in FA3's seqused form), their registration in diffusers' attention
dispatch under the library's own names (``backends``), and what ``attention="fa3"`` sets on the
denoisers, or why it cannot (``selection``).

May import: :mod:`accel.graphs` and the base modules (``options``, ``components``); nothing of
the other subpackages.
"""

from . import fa3

__all__ = ["fa3"]

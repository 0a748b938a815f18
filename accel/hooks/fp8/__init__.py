"""Float8: ``quantize="fp8"``, its backends and which layers it may take.

Owns the quantizers (torchao's float8 and the library's own ``torch._scaled_mm`` path), the
per-layer selection measured on a calibration call under ``fp8_budget``, and the quantization an
installation applies at its first warm-up.

May import: :mod:`accel.graphs` and the base modules (``options``, ``components``); nothing of
the other subpackages.
"""

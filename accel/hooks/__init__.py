"""The diffusers integration: hooks that put graph runners into a pipeline's modules.

It builds on :mod:`accel.graphs` and never imports :mod:`accel.parallel` (which registers
itself with :mod:`accel.hooks.accelerator`).
"""

"""The torch-only core: breakable CUDA graphs, their runner, and what they walk.

Nothing here imports diffusers or the rest of ``accel``: :mod:`accel.graphs.bcg` (segments,
breaks, replay), :mod:`accel.graphs.branches` (one chain per decision path),
:mod:`accel.graphs.runner` (capture and replay per call signature, with its settings, entries,
capture policy and single capture), :mod:`accel.graphs.pool`, :mod:`accel.graphs.signature`,
:mod:`accel.graphs.tree`, and :mod:`accel.graphs.discover` (with :mod:`accel.graphs.sites` and
:mod:`accel.graphs.bindings`: where a capture broke, and the function to mark there).
"""

"""Watching Python state: what decides which code a captured forward runs, checked once per call.

Owns the scheduler's call guard (calls serialised, one check where a call starts), the watch of
modules' and processors' plain-typed state and its rules, the weights' addresses and versions,
the numbered states a module's graphs are kept for, and the follower that keeps one hook's graphs
in step with all of it (dropping, or selecting graphs already captured for a state).

May import: :mod:`accel.graphs`, the base modules (``options``, ``components``, ``call_shape``),
:mod:`accel.hooks.caches` and :mod:`accel.hooks.compiled` (a recompile is a change of state).
"""

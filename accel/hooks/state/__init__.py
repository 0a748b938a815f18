"""Watching Python state: what decides which code a captured forward runs, checked once per call.

Owns the scheduler's call guard (calls serialised, one check where a call starts), the watch of
modules' and processors' plain-typed state and its rules, the weights' addresses and versions,
the numbered states a module's graphs are kept for, and the follower that keeps one hook's graphs
in step with all of it (dropping, or selecting graphs already captured for a state).

The modules: ``guard`` (the per-call guard), ``states`` (the numbers that key a module's graphs
by state), ``weights`` (what a graph reads of the weights, and whether they move),
``watch_values`` (how one watched value is kept and compared), ``watch_rule`` (which values count,
what is skipped and why), ``watch`` (the check of them, well under a millisecond), ``follow`` (one
hook's graphs kept in step with all of it).

May import: :mod:`accel.graphs`, the base modules (``options``, ``components``, ``call_shape``),
:mod:`accel.hooks.caches` and :mod:`accel.hooks.compiled` (a recompile is a change of state).
"""

from .weights import offload_reason, weights_fingerprint

__all__ = ["offload_reason", "weights_fingerprint"]

"""The torch-only core: breakable CUDA graphs, their runner, and what they walk.

Nothing here imports diffusers or the rest of ``accel``. The modules, each above those it builds
on (docs/design.md lists the floors; its glossary defines the terms):

errors     ``BCGError``, the base of every error the library raises, and the core's own
nodes      what :mod:`tree` opens: torch's pytree registry, read only, and one of its own
tree       nested values: one traversal for the whole library
patches    reversible patches: the one way the library changes code and settings it does not own
config     the settings of a graph runner, read by each of its parts
bindings   where a Python function lives (what a callable wraps, every namespace binding it)
pool       a memory pool and capture stream that several graph runners share, and its counters
sites      where a capture broke: the operation's line and the function around it
containers the containers a call is given, found through its arguments, and what each holds
copyback   a break's replay output copied into its boundary buffer; weak views of pool tensors
marks      functions marked as eager breaks, and what a marked function answers to
signature  call signatures: what must match for a captured graph to serve a call
bcg        breakable CUDA graphs: one captured region as a chain of segments and eager breaks
branches   a captured call as a tree of chains: one breakable graph per decision path
stores     what a call stores into the containers and state objects it is given, put back by
           every replay
discover   the operation that broke a capture, and its function marked as an eager break
entries    a runner's captured entries, least recently used first, within a count and a budget
capture    one capture of a signature's decision path, its check against eager, the gc session
policy     how a runner captures, and what a failed capture costs
runner     per-signature capture and replay of one callable

Beyond ``accel``'s own names, the front door gives :func:`~accel.graphs.bcg.end_capture_routing`
(ends the allocator's routing into a pool after a failed ``torch.cuda.graph`` capture of one's own).
"""

from .bcg import end_capture_routing

__all__ = ["end_capture_routing"]

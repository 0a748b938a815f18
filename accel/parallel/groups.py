"""Where this rank stands in a parallel run and the process groups it talks on.

Set up once, collectively (:func:`accel.parallel.setup.set_up` fills it in), then read by every
part of the session: the router (:mod:`accel.parallel.cfg_split`) for the guidance exchange and
the calls a Ulysses group agrees on, and the session for its checks and its teardown.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .layout import Layout

__all__ = ["Groups"]


@dataclasses.dataclass
class Groups:
    """This rank's layout and groups; every group is None until set up (and after teardown).

    Attributes:
        layout: which branch and Ulysses slot this rank has (a one-rank layout until the
            process group says more).
        control: gloo group of every rank, with the session's timeout: agreement and liveness.
        ulysses_control: gloo twin of this rank's Ulysses group, for agreeing on captures.
        cfg_group: this rank's guidance pair (one rank per branch), where branches are exchanged.
        cfg_ranks: the global ranks of ``cfg_group``, by branch.
        mesh: the DeviceMesh ``(cfg, ring=1, ulysses)``.
    """

    layout: Layout
    control: Any = None
    ulysses_control: Any = None
    cfg_group: Any = None
    cfg_ranks: list[int] = dataclasses.field(default_factory=list)
    mesh: Any = None

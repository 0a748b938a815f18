"""``bcg-serve --parallel``: one image on several processes, rank 0 serving and the others following.

Every rank builds and warms up the same engine: the build's parallel setup
(``accelerate_pipeline(parallel=...)``) and the warm-up are collective, so the ranks run them in
step, and then agree on how their starts went (one failed: every rank says which, in one line).
Rank 0 then serves HTTP as one process does. Before each pipeline call its device worker sends
the call's plans (prompts, size, steps, seeds, guidance, negative prompt, adapter, bucket:
everything that makes the call what it is) to the other ranks (:class:`Relay`), which make the same call
(:func:`follow`); at the end of every step rank 0 sends whether the call stops there (its
requests all gave up), so every rank stops at the same step. Rank 0 answers; the others' images
are dropped.

The messages travel on a gloo group of their own (host-side, whatever backend the model's
collectives use), whose timeout is long: a follower waits there for as long as the server is
idle. A follower that dies is found by the next call, on rank 0: a send that fails, or a call
that fails with its parallel session broken (``pipe.accel.parallel.liveness``: a peer lost,
within ``parallel_timeout_s``). That request fails, and :attr:`Relay.lost` says the server can
serve no more (503 from then on).
When rank 0's device worker ends (a stop, a drain) it sends ``stop`` and the followers exit 0;
a follower whose rank 0 is gone exits 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import re
import signal
from collections.abc import Callable, Sequence
from typing import Any

from .errors import one_line

__all__ = ["Ranks", "Relay", "agreed_start", "follow", "join", "launch_rank"]

logger = logging.getLogger("bcg-serve")

# How long a follower waits for rank 0's next message: as long as the server may stay idle.
IDLE_TIMEOUT = datetime.timedelta(days=3650)
CALL, STOP = "call", "stop"


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's ``rank`` of ``world``, the ``device`` it computes on and the gloo ``group``
    of every rank that carries the calls."""

    rank: int
    world: int
    device: Any
    group: Any

    @property
    def leads(self) -> bool:
        return self.rank == 0


def launch_rank(parallel: str) -> tuple[int, int]:
    """(rank, world size) as the launcher's environment says, read before torch is imported;
    InputError where this process runs alone."""
    from pipelines.generation.processes import Processes, check_parallel

    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        rank, world = 0, 1
    check_parallel(parallel, Processes(rank, world))
    return rank, world


def join(parallel: str, device: Any) -> Ranks:
    """This process's place in the launch (torchrun, accelerate launch) and the calls' group;
    InputError where it runs alone. ``device``: the flags' device; a GPU rank gets its own."""
    import torch.distributed as dist

    from pipelines.generation.processes import check_parallel, detect_processes

    procs = detect_processes(cpu=device.type != "cuda")
    check_parallel(parallel, procs)
    if procs.device is not None and device.type != "cpu" and procs.device.type == device.type:
        device = procs.device  # each rank on its own GPU
    group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Ranks(procs.index, procs.count, device, group)


def agreed_start(start: Callable[[], Any], ranks: Ranks) -> Callable[[], Any]:
    """``start`` run on this rank, then every rank told how every start went: each raises the
    first failure (its own, else another rank's, named) or none does. Rank 0's engine gets its
    :class:`Relay`."""
    import torch.distributed as dist

    from pipelines.generation import RunError

    def run() -> Any:
        engine, error = None, None
        try:
            engine = start()
        except Exception as e:
            error = e
        told: list[Any] = [None] * ranks.world
        dist.all_gather_object(told, None if error is None else one_line(error), group=ranks.group)
        if error is not None:
            raise error
        failed = next(((r, why) for r, why in enumerate(told) if why is not None), None)
        if failed is not None:
            raise RunError(f"--parallel: rank {failed[0]} of {ranks.world} could not start: {failed[1]}")
        if ranks.leads:
            engine.relay = Relay(ranks)
        return engine

    return run


class Relay:
    """Rank 0's side: each call sent to the followers before it is made here (:meth:`lead`).

    ``lost``: why the ranks can make no more calls together (a follower gone, the parallel run
    broken), once a call found out; None while they can."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.lost: str | None = None

    def lead(self, engine: Any, plans: Sequence[Any], stop: Callable[[], bool] | None) -> Any:
        """``engine.make_here(plans, stop)`` on every rank; rank 0's images."""
        if self.lost is not None:
            raise RuntimeError(f"--parallel: {self.lost}")
        self._send((CALL, list(plans), stop is not None))
        try:
            return engine.make_here(plans, None if stop is None else self._stop_agreed(stop))
        except Exception:
            self.lost = self.lost or broken(engine)  # a peer lost mid-call: no call can run now
            raise

    def close(self) -> None:
        """The followers told to exit (rank 0's worker is done); a lost follower is not waited for."""
        if self.lost is None:
            with contextlib.suppress(Exception):
                _broadcast(self.ranks, (STOP,))
            self.lost = "the server stopped"

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            _broadcast(self.ranks, message)
        except Exception as e:  # gloo: a peer that exited closed its connection
            self.lost = f"a follower rank is gone ({_why(e)})"
            raise RuntimeError(f"--parallel: {self.lost}") from None

    def _stop_agreed(self, stop: Callable[[], bool]) -> Callable[[], bool]:
        def agreed() -> bool:
            try:
                return _stop_decision(self.ranks, stop())
            except Exception as e:  # the step's stop flag found the follower gone, not the exchange
                self.lost = f"a follower rank is gone ({_why(e)})"
                raise RuntimeError(f"--parallel: {self.lost}") from None

        return agreed


def follow(start: Callable[[], Any], ranks: Ranks) -> int:
    """A follower: ``start`` (agreed with the other ranks), then rank 0's calls made here until it
    says stop. Returns the exit status: 0 told to stop, 1 start failed or rank 0 gone."""
    from pipelines.generation import CallStopped

    tag = f"rank {ranks.rank} of {ranks.world}"
    try:
        engine = agreed_start(start, ranks)()
    except Exception as e:
        logger.error("%s: could not start: %s", tag, one_line(e))
        return 1
    # Rank 0 drains its running call on SIGTERM (and Ctrl-C) and then says stop: a launcher that
    # signals every rank (torchrun) must not end this one under that call.
    with contextlib.suppress(ValueError):  # not the main thread: the caller handles signals
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every rank
    logger.info("%s: following rank 0's calls", tag)
    calls = 0
    while True:
        try:
            message = _broadcast(ranks, None)
        except Exception as e:
            logger.error("%s: rank 0 is gone (%s); exiting", tag, _why(e))
            return 1
        if message[0] == STOP:
            logger.info("%s: stopped after %d call(s)", tag, calls)
            return 0
        _, plans, stops = message
        calls += 1
        stop = (lambda: _stop_decision(ranks, False)) if stops else None
        try:
            engine.make_here(plans, stop)
        except CallStopped:
            pass
        except Exception as e:  # rank 0 answers for the call; this rank goes on with the next
            why = broken(engine)
            if why is not None:  # the ranks lost one another: rank 0 fails too
                logger.error("%s: %s; exiting", tag, why)
                return 1
            logger.warning("%s: a call failed here too: %s", tag, one_line(e))


def broken(engine: Any) -> str | None:
    """Why ``engine``'s parallel run can make no more calls (a peer lost, its process group gone),
    as its session says; None while it can."""
    session = getattr(vars(engine.pipe).get("accel"), "parallel", None)
    liveness = getattr(session, "liveness", None)
    return None if liveness is None else liveness.broken or liveness.ended


def _why(error: BaseException) -> str:
    """A failed collective's reason, short: gloo's source location and advice left out."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", one_line(error))
    return text.split(". This is typically", 1)[0][:200]


def _broadcast(ranks: Ranks, message: Any) -> Any:
    """``message`` from rank 0 to every rank (None on the others); what rank 0 sent."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0, group=ranks.group)
    return box[0]


def _stop_decision(ranks: Ranks, mine: bool) -> bool:
    """Rank 0's ``mine`` (whether its call stops after this step), on every rank."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(mine)], dtype=torch.int32)
    dist.broadcast(flag, src=0, group=ranks.group)
    return bool(flag.item())

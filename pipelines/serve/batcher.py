"""The bounded queue of requests and the joining of compatible ones into one pipeline call.

Requests wait here between the route that checked them and the device worker. The worker asks
for a batch; the batcher takes the oldest request and every later one with the same
:class:`BatchKey` (same size, steps, guidance, negative prompt or not, adapter, text length),
in arrival order, while their images fit in ``max_batch`` (or in what ``limit`` admits for the key:
the memory-aware admission, :mod:`.admission`). It waits for more only until the oldest has
waited ``max_wait`` seconds, so joining never delays a request by more than that; a request
that waited longer while the device was busy leaves with whatever can join it at once. The
oldest request always leaves, even when its own images exceed the limit: the worker splits it.

It waits only while company is likely: while requests have been arriving (a running mean of the
gaps between arrivals) at most ``max_wait`` apart. A lone client sending one request after
another gets no company in ``max_wait``, and waiting would only add it to every answer; under
load the gaps are short and the wait applies (and the queue fills while the device is busy
anyway).

Each request carries a :class:`concurrent.futures.Future`. Taking it into a batch marks it
running (``set_running_or_notify_cancel``); a request cancelled before that (its client left,
or its time ran out) is dropped and never computed. Requests of other keys keep their places.

Only the standard library is used: the batcher knows nothing of pipelines, so it is tested
with plain items.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BatchKey", "Batcher", "Closed", "QueueFull", "Work"]


# Weight of the newest gap between arrivals in their running mean: about the last five count.
_GAP_WEIGHT = 0.2


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already (answered 429)."""


class Closed(Exception):
    """The server is stopping: nothing more is queued (answered 503)."""


@dataclasses.dataclass(frozen=True)
class BatchKey:
    """What requests must share to be computed by one pipeline call.

    ``negative``: whether the call passes negative prompts (a pipeline takes them for all its
    images or for none); ``lora``: the adapter active for the call (None: none); ``text`` and
    ``negative_text``: the text length the model's recipe pads the prompt and the negative
    prompt to (None where it cannot tell). Prompts padded alike have the same shapes in the
    call: it replays the graph warmed up for them, and no prompt is padded for another's sake.
    ``edit``: an edit request's own number (each brings its image: none shares its call).
    """

    width: int
    height: int
    steps: int
    guidance: float | None
    negative: bool = False
    lora: str | None = None
    text: int | None = None
    negative_text: int | None = None
    edit: int | None = None


@dataclasses.dataclass(eq=False)
class Work:
    """One request in the queue: its key, how many images it makes, what the engine needs to
    make them (``plan``), and the future its route waits on.

    ``gone``: its request gave up (its time ran out, its client left) after its batch was taken:
    the device worker makes nothing more for it, and stops a call that only it and others gone
    still wait for. ``taken``, ``device_seconds`` and ``encode_seconds``: when the device worker
    took it, the seconds of the calls that made its images and of encoding them (the access log's).
    ``bucket`` and ``partial`` (``--batching continuous``): the bucket of the running batch its
    images joined, and where a streamed request's previews go.
    """

    key: BatchKey
    images: int
    plan: Any
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    gone: bool = False
    taken: float | None = None
    device_seconds: float = 0.0
    encode_seconds: float = 0.0
    # --batching continuous: the bucket of the running batch its images joined.
    bucket: int | None = None
    # Called by the device worker with each preview (its step, its image) as it is made.
    partial: Callable[[int, Any], None] | None = None


class Batcher:
    """A FIFO of at most ``max_queue`` waiting requests, taken out in batches of at most
    ``max_batch`` images of one key, waiting at most ``max_wait`` seconds to fill one.

    ``submit`` and ``cancel`` are called from the server's event loop, ``next_batch`` from the
    device worker's thread; one lock guards the queue. Times are ``time.monotonic`` seconds.
    ``limit(key)``: the images a call of that key may have now (at most ``max_batch``); None:
    ``max_batch`` for every key.
    """

    def __init__(self, max_queue: int, max_batch: int, max_wait: float,
                 limit: Callable[[BatchKey], int] | None = None) -> None:  # fmt: skip
        if max_queue < 1 or max_batch < 1 or max_wait < 0:
            raise ValueError(f"max_queue and max_batch must be >= 1 and max_wait >= 0, got "
                             f"{max_queue}, {max_batch}, {max_wait}")  # fmt: skip
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.limit = limit
        self._queue: collections.deque[Work] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        # A running mean of the seconds between arrivals; 0 until two have come: wait, as asked.
        self._gap = 0.0
        self._last_arrival: float | None = None

    @property
    def depth(self) -> int:
        """Requests waiting (not running)."""
        with self._cond:
            return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, work: Work) -> None:
        """Queue ``work``; :class:`QueueFull` or :class:`Closed` if it cannot be, and then
        nothing is queued. ``work.images`` above ``max_batch`` is a ValueError (the route checks
        ``n`` against it first)."""
        if not 1 <= work.images <= self.max_batch:
            raise ValueError(f"a request of {work.images} images cannot fit a batch of {self.max_batch}")
        with self._cond:
            if self._closed:
                raise Closed
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            if self._last_arrival is not None:
                gap = max(work.arrived - self._last_arrival, 0.0)
                self._gap = gap if self._gap == 0.0 else (1 - _GAP_WEIGHT) * self._gap + _GAP_WEIGHT * gap
            self._last_arrival = work.arrived
            self._queue.append(work)
            self._cond.notify_all()

    def cancel(self, work: Work) -> bool:
        """Drop ``work`` if it is still waiting: True if it was (it will never run), False if it
        is running or done already (its result is then thrown away by whoever waits on it)."""
        with self._cond:
            try:
                self._queue.remove(work)
            except ValueError:
                return False
            work.future.cancel()
            self._cond.notify_all()
            return True

    def close(self) -> list[Work]:
        """Stop accepting; returns the requests that were waiting, which will never run (the
        caller answers them). A batch already taken runs to its end."""
        with self._cond:
            self._closed = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
            return waiting

    def _deadline(self, head: Work) -> float:
        """When a batch opened by ``head`` stops waiting for company: ``max_wait`` after it
        arrived while arrivals are close (their mean gap within ``max_wait``), else at once."""
        return head.arrived + (self.max_wait if self._gap <= self.max_wait else 0.0)

    def next_batch(self, timeout: float | None = None) -> list[Work] | None:
        """The next batch, its futures marked running; blocks until there is one. None once
        the batcher is closed, or when ``timeout`` seconds pass with nothing queued."""
        give_up = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if not self._await_queue(give_up):
                    return None
                head = self._queue[0]
                room = self._room(head.key)
                batch = self._joinable(head, room)
                now = time.monotonic()
                deadline = self._deadline(head)
                if sum(w.images for w in batch) < room and now < deadline:
                    self._cond.wait(deadline - now)  # more may arrive; woken by each submit
                    continue
                for w in batch:
                    self._queue.remove(w)
                running = [w for w in batch if w.future.set_running_or_notify_cancel()]
                if running:
                    return running

    def take(self, room: int, timeout: float | None = 0.0, gather: bool = False) -> list[Work] | None:
        """For ``--batching continuous``: the oldest waiting requests, of any key, while their
        images fit ``room``, their futures marked running (none where the oldest does not fit:
        requests keep their order). With nothing waiting it waits ``timeout`` seconds (None: until
        a request comes) and returns ``[]``; None once the batcher is closed. ``gather`` (the
        device idle: a batch opens with what is taken) waits for company as :meth:`next_batch`
        does, until ``room`` images wait or the oldest has waited ``max_wait``, while arrivals
        are close."""
        give_up = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            queued = self._await_queue(give_up)
            if queued is None:
                return None
            if not queued:
                return []
            while gather and self._queue and not self._closed:
                head = self._queue[0]
                deadline = self._deadline(head)
                now = time.monotonic()
                if sum(w.images for w in self._queue) >= room or now >= deadline:
                    break
                self._cond.wait(deadline - now)  # woken by each submit, cancel and close
            if self._closed:
                return None
            taken: list[Work] = []
            while self._queue and self._queue[0].images <= room:
                w = self._queue.popleft()
                if w.future.set_running_or_notify_cancel():
                    taken.append(w)
                    room -= w.images
            return taken

    def _await_queue(self, give_up: float | None) -> bool | None:
        """Under the lock: waits until a request is queued (True), the monotonic time ``give_up``
        passes with none (False; None: never), or the batcher is closed (None)."""
        while True:
            if self._closed:
                return None
            self._drop_cancelled()
            if self._queue:
                return True
            left = None if give_up is None else give_up - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left)

    def _room(self, key: BatchKey) -> int:
        if self.limit is None:
            return self.max_batch
        return max(1, min(self.max_batch, self.limit(key)))

    def _joinable(self, head: Work, room: int) -> list[Work]:
        batch, room = [head], room - head.images
        for w in itertools.islice(self._queue, 1, None):
            if room <= 0:
                break
            if w.key == head.key and w.images <= room:
                batch.append(w)
                room -= w.images
        return batch

    def _drop_cancelled(self) -> None:
        # A future cancelled outside cancel() (asyncio cancels a wrapped future with its task).
        if any(w.future.cancelled() for w in self._queue):
            self._queue = collections.deque(w for w in self._queue if not w.future.cancelled())

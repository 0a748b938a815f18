"""The batcher alone, with plain items: which requests join, in what order, how long the oldest
waits, the bounded queue, cancellation and closing; and, under threads, that every request is
taken exactly once."""

from __future__ import annotations

import random
import threading
import time

import pytest

from pipelines.serve.batcher import Batcher, BatchKey, Closed, QueueFull, Work

A = BatchKey(64, 64, 2, None)
B = BatchKey(64, 64, 2, None, lora="style")  # differs in the adapter only
C = BatchKey(32, 64, 2, None)


def work(key: BatchKey, images: int = 1, name: str = "", ago: float = 0.0) -> Work:
    return Work(key, images, plan=name, arrived=time.monotonic() - ago)


def names(batch: list[Work] | None) -> list[str]:
    assert batch is not None
    return [w.plan for w in batch]


def test_the_oldest_request_and_those_of_its_key_join_in_arrival_order() -> None:
    b = Batcher(max_queue=16, max_batch=4, max_wait=0.0)
    for w in [work(A, 1, "a1"), work(B, 1, "b1"), work(A, 2, "a2"), work(C, 1, "c1"), work(A, 1, "a3")]:
        b.submit(w)
    assert names(b.next_batch()) == ["a1", "a2", "a3"]  # 4 images, one key
    assert names(b.next_batch()) == ["b1"]  # then the oldest left, alone of its key
    assert names(b.next_batch()) == ["c1"]
    assert b.depth == 0
    assert b.next_batch(timeout=0.01) is None


def test_a_request_that_does_not_fit_waits_for_the_next_batch_without_losing_its_place() -> None:
    b = Batcher(max_queue=16, max_batch=4, max_wait=0.0)
    for w in [work(A, 3, "a3"), work(A, 2, "a2"), work(A, 1, "a1"), work(A, 2, "a2b")]:
        b.submit(w)
    assert names(b.next_batch()) == ["a3", "a1"]  # a2 does not fit beside a3; a1 does
    assert names(b.next_batch()) == ["a2", "a2b"]


def test_the_oldest_waits_at_most_max_wait_for_company() -> None:
    b = Batcher(max_queue=16, max_batch=4, max_wait=0.3)
    b.submit(work(A, 1, "first"))
    later = work(A, 1, "later")
    threading.Timer(0.05, b.submit, [later]).start()
    t0 = time.monotonic()
    batch = b.next_batch()
    waited = time.monotonic() - t0
    assert names(batch) == ["first", "later"]  # joined by one that came while it waited
    assert 0.25 <= waited < 2.0  # not full: it waited for max_wait, then left
    # A full batch leaves at once, and one whose oldest waited past max_wait while the device
    # was busy leaves with what can join it now.
    for i in range(4):
        b.submit(work(A, 1, f"f{i}"))
    t0 = time.monotonic()
    assert len(names(b.next_batch())) == 4
    b.submit(work(A, 1, "old", ago=1.0))
    assert names(b.next_batch()) == ["old"]
    assert time.monotonic() - t0 < 0.25


def test_a_lone_client_is_not_made_to_wait_for_company_that_does_not_come() -> None:
    b = Batcher(max_queue=16, max_batch=4, max_wait=0.5)
    for ago in (3.0, 2.0):  # requests a second apart: one client, one after another
        b.submit(work(A, 1, f"{ago}", ago=ago))
        assert len(names(b.next_batch())) == 1
    b.submit(work(A, 1, "now"))
    t0 = time.monotonic()
    assert names(b.next_batch()) == ["now"] and time.monotonic() - t0 < 0.25  # no wait: none comes in 0.5 s
    for i in range(6):  # then a burst: requests close together, company likely again
        b.submit(work(A, 1, f"burst{i}"))
        b.next_batch()
    b.submit(work(A, 1, "waits"))
    t0 = time.monotonic()
    assert names(b.next_batch()) == ["waits"] and time.monotonic() - t0 >= 0.4


def test_a_full_queue_refuses_and_queues_nothing() -> None:
    b = Batcher(max_queue=2, max_batch=4, max_wait=0.0)
    b.submit(work(A))
    b.submit(work(A))
    with pytest.raises(QueueFull):
        b.submit(work(A))
    assert b.depth == 2
    with pytest.raises(ValueError, match="cannot fit a batch of 4"):
        b.submit(work(A, 5))


def test_a_cancelled_request_is_never_taken() -> None:
    b = Batcher(max_queue=8, max_batch=4, max_wait=0.0)
    gone, kept, elsewhere = work(A, 1, "gone"), work(A, 1, "kept"), work(A, 1, "elsewhere")
    for w in (gone, kept, elsewhere):
        b.submit(w)
    assert b.cancel(gone) is True
    assert gone.future.cancelled()
    elsewhere.future.cancel()  # as asyncio does when the task waiting on it is cancelled
    assert names(b.next_batch()) == ["kept"]
    assert kept.future.running()
    assert b.cancel(kept) is False  # running: it finishes, whoever waits throws it away
    assert b.depth == 0


def test_closing_returns_what_waited_and_stops_everything() -> None:
    b = Batcher(max_queue=8, max_batch=4, max_wait=10.0)
    waiting = [work(A, 1, "x"), work(C, 1, "y")]
    for w in waiting:
        b.submit(w)
    taken: list[object] = []
    t = threading.Thread(target=lambda: taken.append(b.next_batch(timeout=5)))
    t.start()
    time.sleep(0.05)  # the worker waits (up to max_wait) for x's batch to fill
    assert names(b.close()) == ["x", "y"]
    t.join(5)
    assert taken == [None]  # woken by the close, it takes nothing
    with pytest.raises(Closed):
        b.submit(work(A))
    assert b.next_batch() is None


def test_under_threads_every_request_is_taken_exactly_once() -> None:
    rng = random.Random(0)
    b = Batcher(max_queue=1000, max_batch=4, max_wait=0.002)
    keys = [A, B, C]
    sent = [work(rng.choice(keys), rng.randint(1, 4), f"w{i}") for i in range(400)]
    got: list[list[Work]] = []

    def worker() -> None:
        while (batch := b.next_batch(timeout=1.0)) is not None:
            got.append(batch)

    def producer(items: list[Work]) -> None:
        for w in items:
            b.submit(w)
            if rng.random() < 0.1:
                time.sleep(0.001)

    threads = [threading.Thread(target=producer, args=(sent[i::4],)) for i in range(4)]
    consumer = threading.Thread(target=worker)
    consumer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    consumer.join(30)
    taken = [w for batch in got for w in batch]
    assert sorted(w.plan for w in taken) == sorted(w.plan for w in sent)  # none lost, none twice
    for batch in got:
        assert len({w.key for w in batch}) == 1
        assert sum(w.images for w in batch) <= 4
    assert any(len(batch) > 1 for batch in got)


def test_take_gathering_waits_for_company_while_arrivals_are_close() -> None:
    """``take(gather=True)`` (the continuous worker idle): the oldest waits for company up to
    ``max_wait``, leaves at once when ``room`` is met, and not at all while arrivals are far apart;
    without ``gather`` it takes what waits now; closed while it waits, None."""
    b = Batcher(max_queue=16, max_batch=4, max_wait=0.3)
    b.submit(work(A, 1, "first"))
    threading.Timer(0.05, b.submit, [work(B, 2, "later")]).start()  # any key joins a running batch
    t0 = time.monotonic()
    assert names(b.take(4, timeout=None, gather=True)) == ["first", "later"]
    assert 0.25 <= time.monotonic() - t0 < 2.0  # room not met: it waited max_wait
    for i in range(2):
        b.submit(work(A, 1, f"r{i}"))
    t0 = time.monotonic()
    assert names(b.take(2, timeout=None, gather=True)) == ["r0", "r1"]
    assert time.monotonic() - t0 < 0.2  # room met: at once
    b.submit(work(A, 1, "now"))
    threading.Timer(0.05, b.submit, [work(A, 1, "after")]).start()
    assert names(b.take(4, timeout=None)) == ["now"]  # no gathering: what waits now
    time.sleep(0.1)
    assert names(b.take(4)) == ["after"]

    far = Batcher(max_queue=16, max_batch=4, max_wait=0.3)
    far.submit(work(A, 1, "old", ago=5.0))
    far.submit(work(A, 1, "new"))  # 5 s apart: company is unlikely, so no wait
    assert names(far.take(2)) == ["old", "new"]
    far.submit(work(A, 1, "lone"))
    t0 = time.monotonic()
    assert names(far.take(4, timeout=None, gather=True)) == ["lone"]
    assert time.monotonic() - t0 < 0.2

    closing = Batcher(max_queue=16, max_batch=4, max_wait=5.0)
    closing.submit(work(A, 1, "waits"))
    threading.Timer(0.05, closing.close).start()
    t0 = time.monotonic()
    assert closing.take(4, timeout=None, gather=True) is None
    assert time.monotonic() - t0 < 2.0

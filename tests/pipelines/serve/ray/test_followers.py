"""A replica's follower ranks (pipelines/serve/ray/followers.py), with no Ray cluster: each started
with torchrun's environment, one that exits fails the replica's health check in one line, and the
replica's process becomes rank 0."""

from __future__ import annotations

import os
import time
import types

import pytest

from pipelines.serve.ray.followers import Followers
from pipelines.serve.ray.replica import Replica

LAUNCH = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")


def test_a_follower_that_exits_fails_the_replica_s_health(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in LAUNCH:  # put back as they were after the test: Followers sets them in this process
        monkeypatch.setenv(key, "unset")
    followers = Followers(["--max-batch", "0"], 2)  # a flag bcg-serve refuses: the follower exits 2 at once
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "2", "127.0.0.1")
    assert int(os.environ["MASTER_PORT"]) > 0
    deadline = time.monotonic() + 120
    while followers.gone() is None:
        assert time.monotonic() < deadline, "the follower did not exit"
        time.sleep(0.1)
    assert followers.gone() == "follower rank 1 exited with status 2"

    replica = object.__new__(Replica)
    replica.name, replica.followers = "r1", followers
    replica.service = types.SimpleNamespace(busy=lambda: None, lost=None)
    with pytest.raises(RuntimeError, match=r"^replica r1: follower rank 1 exited with status 2$"):
        replica.check_health()
    replica.followers = None
    replica.check_health()  # healthy without it
    followers.stop(grace=1.0)

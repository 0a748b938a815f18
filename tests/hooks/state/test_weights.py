"""Weight-change detection, offload detection and call serialisation, on the CPU."""

from __future__ import annotations

import logging
import threading

import torch
from accelerate.hooks import ModelHook as AccelerateHook
from accelerate.hooks import add_hook_to_module, remove_hook_from_module

from accel import accelerate_pipeline
from accel.hooks.state.guard import RequestLock
from accel.hooks.state.weights import offload_reason, weights_fingerprint
from pipelines.builders import build_pipeline
from tests.helpers.generate import generate


def _call(pipe, seed: int = 0) -> torch.Tensor:
    return generate(pipe, steps=3, guidance=4.0, seed=seed)  # Z-Image: guidance_scale


def test_fingerprint_sees_in_place_writes_moves_casts_and_new_parameters() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    fp = weights_fingerprint(m)
    assert weights_fingerprint(m) == fp  # stable when nothing changed
    with torch.no_grad():
        m[0].weight.add_(0)  # an in-place write bumps the version even with equal values
    assert weights_fingerprint(m) != fp
    fp = weights_fingerprint(m)
    m.load_state_dict(m.state_dict())
    assert weights_fingerprint(m) != fp
    fp = weights_fingerprint(m)
    m.to(torch.float64)
    assert weights_fingerprint(m) != fp
    fp = weights_fingerprint(m)
    m.add_module("extra", torch.nn.Linear(4, 4))
    assert weights_fingerprint(m) != fp
    fp = weights_fingerprint(m)
    m[0].scaling = {"default": 1.0}  # a PEFT-style adapter scale
    fp2 = weights_fingerprint(m)
    m[0].scaling = {"default": 0.5}
    assert fp != fp2 != weights_fingerprint(m)


def test_offload_detection() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert offload_reason(m) is None
    add_hook_to_module(m[1], AccelerateHook())
    assert "accelerate" in offload_reason(m)
    remove_hook_from_module(m[1])
    assert offload_reason(m) is None


def test_weight_change_drops_graphs_at_the_next_call(monkeypatch, caplog) -> None:
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    accelerate_pipeline(pipe)
    runner = pipe.accel.runners["transformer"]
    calls = []
    monkeypatch.setattr(runner, "release", lambda *, recapture=False: (calls.append(1) or 3) if recapture else 0)
    _call(pipe)
    assert calls == []
    with torch.no_grad():
        pipe.transformer.cap_pad_token.mul_(1.0)
    with caplog.at_level(logging.WARNING, logger="accel"):
        _call(pipe)
    assert calls == [1] and "weights changed" in caplog.text and "dropped 3 graphs" in caplog.text
    _call(pipe)
    assert calls == [1]  # once per change, not per call


def test_offload_switches_graphs_off_and_back_on(caplog) -> None:
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    ref = _call(pipe)
    accelerate_pipeline(pipe)
    runner = pipe.accel.runners["transformer"]
    add_hook_to_module(pipe.transformer, AccelerateHook())
    with caplog.at_level(logging.WARNING, logger="accel"):
        out = _call(pipe)
    assert torch.equal(out, ref) and runner.enabled is False and "offload" in caplog.text
    remove_hook_from_module(pipe.transformer)
    _call(pipe)
    assert runner.enabled is True


def test_two_threads_are_serialised_and_get_correct_images() -> None:
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    seeds = list(range(6))
    refs = {s: _call(pipe, s) for s in seeds}
    accelerate_pipeline(pipe)
    results: dict[int, torch.Tensor] = {}

    def work(mine: list[int]) -> None:
        for s in mine:
            results[s] = _call(pipe, s)

    threads = [threading.Thread(target=work, args=(seeds[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(results[s], refs[s]) for s in seeds)
    assert not pipe.accel.request_lock.busy


def test_request_lock_times_out_with_a_clear_error_and_survives_a_failed_call() -> None:
    lock = RequestLock(timeout=0.2)
    lock.begin()
    lock.begin()  # the same thread again (a call that raised before its end): no deadlock
    errors: list[str] = []

    def other() -> None:
        try:
            lock.begin()
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "another thread" in errors[0]
    lock.end()
    assert not lock.busy


def test_graphs_back_on_after_offload_from_the_first_call_still_take_the_recipe_inputs(monkeypatch) -> None:
    """The recipe's wrapped forward must serve calls once offloading stops, even when the first
    call ran while offloaded (Z-Image's prepare() adds a keyword only the wrapper accepts)."""
    import accel.hooks.graph_hook as hook_mod

    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    ref = _call(pipe)
    accelerate_pipeline(pipe)
    runner = pipe.accel.runners["transformer"]
    add_hook_to_module(pipe.transformer, AccelerateHook())
    assert torch.equal(_call(pipe), ref)  # the first call, offloaded: stock forward
    assert runner.enabled is False
    remove_hook_from_module(pipe.transformer)
    # prepare() runs only for modules on CUDA; pretend so, the runner still runs eagerly on CPU.
    monkeypatch.setattr(hook_mod, "module_device", lambda module: torch.device("cuda"))
    assert torch.equal(_call(pipe), ref)  # a TypeError about bcg_caption_pad_masks before
    assert runner.enabled is True

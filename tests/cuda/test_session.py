"""One image on two GPUs (accelerate_pipeline(parallel=...)): exactness, graphs, a clean exit, a lost rank.

Each test starts this file as a script once per rank (plain processes with the environment
torchrun gives its workers, so that a killed rank is not cleaned up by a launcher), and reads
what the ranks wrote:

* ``cfg``: Qwen-Image's two guidance branches on two GPUs equal one GPU's eager latents bit for
  bit, eagerly and with graphs (text buckets off: padding is the one thing that is not exact).
* ``ulysses``: graphs equal the same Ulysses run eagerly bit for bit, for Qwen-Image (diffusers'
  plan) and Z-Image (ours); both stay near one GPU; with the default text buckets the text mask
  travels inside the graphs too. Every rank returns the same latents. The text encoder replays
  its own graphs on every rank.
* The processes exit by themselves once done (no ``shutdown()``, no ``destroy_process_group``):
  the exit handler releases the graphs before the process group goes.
* A killed rank makes the other exit with an error within ``parallel_timeout_s``.

Full-size random-weight models by default; ``BCG_PARALLEL_SIZE=tiny`` runs the same checks on the
tiny models in seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import launch_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

ROOT = Path(__file__).resolve().parents[2]
SIZE = os.environ.get("BCG_PARALLEL_SIZE", "full")
RES = 512
STEPS = 4
PROMPT = "a red fox in fresh snow at dawn"
NEGATIVE = "blurry, low quality"
EXIT_WITHIN_S = 60.0


def _launch(scenario: str, out: Path, *extra: str) -> list[subprocess.Popen]:
    return launch_ranks(__file__, 2, out, scenario, str(out), *extra, cpu=False)


def _logs(out: Path) -> str:
    return "\n".join(f"--- rank {r}:\n{(out / f'rank{r}.log').read_text()[-4000:]}" for r in range(2))


def _run(scenario: str, out: Path, timeout: float, *extra: str) -> list[dict[str, Any]]:
    """Run a scenario; every rank must succeed and exit by itself soon after it is done."""
    procs = _launch(scenario, out, *extra)
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(procs):
            done = out / f"done{rank}"
            while p.poll() is None and not done.exists():
                if time.monotonic() > deadline:
                    pytest.fail(f"{scenario} did not finish within {timeout:.0f}s:\n{_logs(out)}")
                time.sleep(0.5)
        for rank, p in enumerate(procs):
            done = out / f"done{rank}"
            finished = float(done.read_text()) if done.exists() else time.time()
            try:
                code = p.wait(timeout=max(1.0, finished + EXIT_WITHIN_S - time.time()))
            except subprocess.TimeoutExpired:
                pytest.fail(
                    f"rank {rank} did not exit by itself within {EXIT_WITHIN_S:.0f}s of finishing:\n{_logs(out)}"
                )
            assert code == 0, f"rank {rank} exited {code}:\n{_logs(out)}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(_logs(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _exact(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(a, b), f"{what}: max abs difference {(a.float() - b.float()).abs().max().item():.3g}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def test_qwen_image_cfg_is_exact_and_ulysses_graphs_equal_ulysses_eager(tmp_path: Path) -> None:
    r0, r1 = _run("qwen-image", tmp_path, 1500)
    ref = r0["ref"]
    _exact(r1["ref"], ref, "the two GPUs' own eager runs")
    for r in (r0, r1):
        _exact(r["cfg_eager"], ref, f"cfg eager on rank {r['rank']}")
        _exact(r["cfg_graphs"], ref, f"cfg graphs on rank {r['rank']}")
        _exact(r["uly_graphs"], r["uly_eager"], f"ulysses graphs vs ulysses eager on rank {r['rank']}")
        assert r["cfg_replays"] > 0 and r["uly_replays"] > 0, "no graph was replayed"
        assert r["cfg_te_replays"] > 0 and r["uly_te_replays"] > 0, "the text encoder ran eagerly"
    for key in ("uly_eager", "uly_graphs", "uly_buckets"):
        _exact(r1[key], r0[key], f"{key}: rank 1 vs rank 0")
    for r in (r0, r1):
        _exact(r["uly_buckets"], r["uly_joined_eager"], f"joined branches, graphs vs eager on rank {r['rank']}")
        # Both calls (eager, then graphs) joined every step's pair; the warm-up's pairs come on top.
        assert r["uly_joined"][0] >= 2 * STEPS and r["uly_joined"][1] == 0, r["uly_joined"]
        assert r["uly_buckets_replays"] >= STEPS
    print(
        f"ulysses vs one GPU: {_rel(r0['uly_eager'], ref):.2e}; with text buckets: {_rel(r0['uly_buckets'], ref):.2e}"
    )
    assert _rel(r0["uly_eager"], ref) < 0.05
    assert torch.isfinite(r0["uly_buckets"]).all() and _rel(r0["uly_buckets"], ref) < 0.1


def test_z_image_ulysses_graphs_equal_ulysses_eager(tmp_path: Path) -> None:
    r0, r1 = _run("z-image", tmp_path, 900)
    for r in (r0, r1):
        _exact(r["uly_graphs"], r["uly_eager"], f"ulysses graphs vs ulysses eager on rank {r['rank']}")
        assert r["uly_replays"] > 0 and r["uly_te_replays"] > 0
        assert "one batched call" in r["cfg_error"]
    _exact(r1["uly_graphs"], r0["uly_graphs"], "rank 1 vs rank 0")
    print(f"z-image ulysses vs one GPU: {_rel(r0['uly_eager'], r0['ref']):.2e}")
    assert _rel(r0["uly_eager"], r0["ref"]) < 0.05


@pytest.mark.parametrize("parallel", ["cfg", "ulysses"])
def test_a_killed_rank_ends_the_other_within_the_timeout(tmp_path: Path, parallel: str) -> None:
    timeout = 20.0
    procs = _launch("lost", tmp_path, parallel, str(timeout))
    ready = tmp_path / "ready"
    deadline = time.monotonic() + 300
    try:
        while not ready.exists():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                pytest.fail(f"rank 1 never got going:\n{_logs(tmp_path)}")
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        start = time.monotonic()
        try:
            code = procs[0].wait(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still runs {timeout + 60:.0f}s after rank 1 was killed:\n{_logs(tmp_path)}")
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                p.kill()
                p.wait()
    log = (tmp_path / "rank0.log").read_text()
    print(f"rank 0 exited {code} {elapsed:.1f}s after rank 1 was killed")
    assert code != 0, log[-3000:]
    assert elapsed < timeout + 30, log[-3000:]
    # Ours (gloo saw the peer go, or the watchdog) or, at worst, NCCL's own watchdog.
    assert "bcg-diffusers parallel" in log or "NCCL" in log, log[-3000:]


# --------------------------------------------------------------------------------------------
# The worker: one rank
# --------------------------------------------------------------------------------------------
def _worker(scenario: str, out: Path, *extra: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format=f"rank {os.environ['RANK']} %(asctime)s %(name)s: %(message)s")
    from accel import accelerate_pipeline
    from pipelines.builders import build_pipeline

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    res: dict[str, Any] = {"rank": rank}
    log = logging.getLogger("worker")

    if scenario == "lost":
        parallel, timeout = extra[0], float(extra[1])
        pipe = build_pipeline("qwen-image", "tiny", device=device, dtype=torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)
        accelerate_pipeline(pipe, parallel=parallel, parallel_timeout_s=timeout)
        pipe.accel.warmup([(256, 256)], prompts=[PROMPT], negative_prompt=NEGATIVE, progress=False)

        def on_step(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
            if rank == 1 and i == 1:
                torch.cuda.synchronize()
                (out / "ready").touch()
                while True:  # until the test kills this rank
                    time.sleep(1)
            return kw

        for _ in range(1000):
            pipe(
                prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, height=256, width=256,
                num_inference_steps=50, output_type="latent", callback_on_step_end=on_step,
            )  # fmt: skip
        return

    name = scenario
    t0 = time.perf_counter()
    pipe = build_pipeline(name, SIZE, device=device, dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    log.info("built %s %s in %.1fs", name, SIZE, time.perf_counter() - t0)
    guidance = dict(true_cfg_scale=4.0) if name == "qwen-image" else dict(guidance_scale=4.0)
    kw = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=RES, width=RES, num_inference_steps=STEPS,
              output_type="latent", **guidance)  # fmt: skip

    def run() -> torch.Tensor:
        return pipe(**kw, generator=torch.Generator(device).manual_seed(3)).images.float().cpu()

    def warm() -> None:
        report = pipe.accel.warmup([(RES, RES)], prompts=[PROMPT], negative_prompt=NEGATIVE, progress=False)
        log.info("warm-up:\n%s", report)

    def replays(module: str = "transformer") -> int:
        return pipe.accel.stats()[module].replays

    res["ref"] = run()
    if name == "qwen-image":
        accelerate_pipeline(pipe, parallel="cfg", mode="eager")
        res["cfg_eager"] = run()
        accelerate_pipeline(pipe, parallel="cfg", text_buckets=None)
        warm()
        res["cfg_graphs"] = run()
        res["cfg_replays"] = replays()
        res["cfg_te_replays"] = replays("text_encoder")
        log.info("%s", pipe.accel.report())
    else:
        try:
            accelerate_pipeline(pipe, parallel="cfg")
        except ValueError as e:
            res["cfg_error"] = str(e)
    accelerate_pipeline(pipe, parallel="ulysses", mode="eager")
    res["uly_eager"] = run()
    accelerate_pipeline(pipe, parallel="ulysses", text_buckets=None)
    warm()
    res["uly_graphs"] = run()
    res["uly_replays"] = replays()
    res["uly_te_replays"] = replays("text_encoder")
    log.info("%s", pipe.accel.report())
    if name == "qwen-image":
        # Default buckets: the text mask travels in the graph, and the two guidance calls of a
        # step run as one batch-2 call (cfg_batch). First without graphs (no warm-up: each call
        # misses and runs eagerly), then replayed.
        accelerate_pipeline(pipe, parallel="ulysses")
        res["uly_joined_eager"] = run()
        warm()
        res["uly_buckets"] = run()
        res["uly_joined"] = pipe.accel.guidance_batches()["transformer"]
        res["uly_buckets_replays"] = replays()
    torch.save(res, out / f"rank{rank}.pt")
    # Done: the process must now exit by itself, graphs alive, process group not destroyed here.
    (out / f"done{rank}").write_text(str(time.time()))


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])

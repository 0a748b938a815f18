"""accelerate_pipeline(parallel=...) on the CPU: validation, and real runs of 2 and 4 processes (gloo).

The several-process tests start this file as a script, once per rank (plain processes with the
environment torchrun would give them, so that a killed rank is not cleaned up by a launcher), run
tiny pipelines and write what they saw to a folder the test then reads:

* CFG-parallel: the latents of a 2-process run equal one process's eager latents bit for bit,
  with and without guidance, and each rank computed only its own branch.
* Ulysses (Qwen-Image with diffusers' plan, Z-Image with ours) and CFG x Ulysses on 4 processes:
  equal to one process within float32 reordering noise; every rank returns the same latents.
* Disagreeing ranks (options, a call's shape) raise one clear error on every rank, not a hang;
  restore() puts the denoiser back exactly; the processes exit by themselves.
* A killed rank, or a hung one, makes the other exit with status 1 within the timeout.
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

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
SIZE = 64


# --------------------------------------------------------------------------------------------
# In-process: options, layouts, recipes, guard listeners
# --------------------------------------------------------------------------------------------
def test_parallel_options_are_validated() -> None:
    from accel.hooks.options import AcceleratorOptions

    assert AcceleratorOptions(parallel="cfg").parallel == "cfg"
    assert AcceleratorOptions().parallel is None
    with pytest.raises(ValueError, match=r"^parallel must be None or one of cfg, ulysses, cfg\+ulysses; got 'tp'$"):
        AcceleratorOptions(parallel="tp")  # type: ignore[arg-type]
    for bad in (0, -1.0, float("nan"), True, "10"):
        with pytest.raises(ValueError, match=r"^parallel_timeout_s must be a positive number of seconds"):
            AcceleratorOptions(parallel_timeout_s=bad)  # type: ignore[arg-type]


def test_layouts() -> None:
    from accel.parallel import plan_layout

    lay = plan_layout("cfg", 2, 1)
    assert (lay.cfg, lay.ulysses, lay.branch, lay.ulysses_index) == (2, 1, 1, 0)
    lay = plan_layout("ulysses", 4, 3)
    assert (lay.cfg, lay.ulysses, lay.branch, lay.ulysses_index) == (1, 4, 0, 3)
    lay = plan_layout("cfg+ulysses", 8, 5)
    assert (lay.cfg, lay.ulysses, lay.branch, lay.ulysses_index) == (2, 4, 1, 1)
    assert lay.ulysses_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.cfg_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError) as e:
        plan_layout("cfg", 4, 0)
    assert str(e.value) == (
        "parallel='cfg' needs 2 processes (one per guidance branch), this launch has 4; use --nproc_per_node 2, "
        "or parallel='cfg+ulysses' for 4 or more"
    )
    with pytest.raises(ValueError) as e:
        plan_layout("cfg+ulysses", 5, 0)
    assert str(e.value) == (
        "parallel='cfg+ulysses' needs an even number of processes, at least 4 (2 x N/2), this launch has 5; "
        "use parallel='cfg' on 2"
    )
    with pytest.raises(ValueError, match=r"^parallel='ulysses' needs 2 or more processes, this launch has 1$"):
        plan_layout("ulysses", 1, 0)
    with pytest.raises(ValueError, match=r"^parallel must be one of cfg, ulysses, cfg\+ulysses; got 'tp'$"):
        plan_layout("tp", 2, 0)


def test_a_single_process_is_told_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from accel import accelerate_pipeline
    from accel.parallel import ParallelConfigError
    from pipelines.builders import build_pipeline

    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    pipe = build_pipeline("qwen-image", "tiny")
    forward = pipe.transformer.forward
    with pytest.raises(ParallelConfigError, match="needs several processes: start the script with torchrun"):
        accelerate_pipeline(pipe, parallel="cfg")
    assert "accel" not in pipe.__dict__ and not hasattr(pipe.transformer, "_diffusers_hook")
    assert pipe.transformer.forward == forward


def test_recipes_know_their_branches_and_splits() -> None:
    from pipelines.builders import build_pipeline
    from pipelines.families.qwen_image.recipe import QwenImageRecipe
    from pipelines.families.z_image.recipe import ZImageRecipe

    qwen = build_pipeline("qwen-image", "tiny").transformer
    recipe = QwenImageRecipe()
    assert recipe.cfg_parallel_support(qwen) is None
    assert [recipe.cfg_branch(c) for c in ("cond", "uncond", None, "other")] == [0, 1, None, None]
    g = torch.Generator().manual_seed(0)
    kwargs = dict(
        hidden_states=torch.randn(1, 16, 64, generator=g),
        encoder_hidden_states=torch.randn(1, 7, qwen.config.joint_attention_dim, generator=g),
        encoder_hidden_states_mask=None,
        timestep=torch.tensor([0.5]),
        img_shapes=[[(1, 4, 4)]],
        return_dict=False,
    )
    with torch.no_grad():
        real = qwen(**kwargs)
    like = recipe.cfg_output_like(qwen, (), kwargs)
    assert isinstance(like, tuple) and len(like) == 1
    assert (like[0].shape, like[0].dtype) == (real[0].shape, real[0].dtype)
    # Ulysses over 2: odd text is padded with masked zeros, the rest untouched.
    _, padded = recipe.prepare_context_parallel(qwen, (), kwargs, 2)
    assert padded["encoder_hidden_states"].shape[1] == 8
    assert padded["encoder_hidden_states_mask"].tolist() == [[1] * 7 + [0]]
    with torch.no_grad():
        again = qwen(**padded)
    torch.testing.assert_close(again[0], real[0], rtol=1e-5, atol=1e-5)
    odd = {**kwargs, "hidden_states": torch.randn(1, 15, 64)}
    with pytest.raises(ValueError, match="15 image tokens do not split over 2 Ulysses ranks"):
        recipe.prepare_context_parallel(qwen, (), odd, 2)

    zimage = build_pipeline("z-image", "tiny").transformer
    zrecipe = ZImageRecipe()
    assert "one batched call" in (zrecipe.cfg_parallel_support(zimage) or "")
    plan = zrecipe.context_parallel_plan(zimage, 2)
    assert set(plan) == {"layers.0", "layers.*", "all_final_layer.2-1"}
    with pytest.raises(ValueError, match="Ulysses over 4 ranks needs a degree dividing both its 2 attention heads"):
        zrecipe.context_parallel_plan(zimage, 4)


def test_guard_listeners_hear_begin_step_and_end() -> None:
    from accel.hooks.state.guard import CallGuard
    from pipelines.builders import build_pipeline

    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    user, listener = object(), object()
    heard: list[str] = []
    guard = CallGuard.attach(pipe, user, lambda: None)
    assert guard is not None
    guard.listen(listener, begin=lambda: heard.append("begin"), step=lambda: heard.append("step"),
                 end=lambda: heard.append("end"))  # fmt: skip
    pipe("a fox", height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="latent")
    assert heard == ["begin", "step", "step", "end"]
    guard.unlisten(listener)
    guard.detach(user)
    assert "step" not in vars(pipe.scheduler)


# --------------------------------------------------------------------------------------------
# Several processes
# --------------------------------------------------------------------------------------------
def _launch(scenario: str, world: int, out: Path, *extra: str) -> list[subprocess.Popen]:
    return launch_ranks(__file__, world, out, scenario, str(out), *extra)


def _wait(procs: list[subprocess.Popen], out: Path, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(len(procs)))
        pytest.fail(f"the ranks did not exit by themselves within {timeout:.0f}s:\n{logs}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def _run(scenario: str, world: int, tmp_path: Path, *extra: str, timeout: float = 240.0) -> list[dict[str, Any]]:
    procs = _launch(scenario, world, tmp_path, *extra)
    codes = _wait(procs, tmp_path, timeout)
    logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(world)}
    assert codes == [0] * world, "\n".join(f"rank {r} exited {c}:\n{logs[r][-4000:]}" for r, c in enumerate(codes))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _assert_exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a, b), f"max abs difference {(a.float() - b.float()).abs().max().item():.3g}"


def test_two_processes_cfg_exact_ulysses_close_errors_clear(tmp_path: Path) -> None:
    results = _run("main", 2, tmp_path)
    r0, r1 = results
    # CFG-parallel is one process's eager, bit for bit, with and without guidance, on every rank.
    for r in results:
        _assert_exact(r["cfg"], r0["ref_cfg"])
        _assert_exact(r["nocfg"], r0["ref_nocfg"])
        _assert_exact(r["cfg_after_mismatch"], r0["ref_cfg"])
    # (computed, received): rank 0 computes every conditional call (with and without guidance),
    # rank 1 only the unconditional ones.
    assert r0["counts"] == (2 * STEPS, STEPS) and r1["counts"] == (STEPS, 2 * STEPS)
    # Every rank runs the text encoder and the VAE decoder through its own runners (no collectives).
    for r in results:
        assert r["accelerated"] == ["text_encoder", "transformer", "vae.decoder"], r["accelerated"]
    # Ulysses: the same computation split differently, every rank the same latents.
    assert r0["joined"] == r1["joined"] == (STEPS, 0)
    for key, ref in (("uly", "ref_cfg"), ("uly_joined", "ref_cfg"), ("z_uly", "z_ref")):
        _assert_exact(r0[key], r1[key])
        torch.testing.assert_close(r0[key], r0[ref], rtol=1e-4, atol=1e-4)
        assert not torch.equal(r0[key], torch.zeros_like(r0[key]))
    # One clear line on every rank.
    for r in results:
        assert r["options_error"].startswith(
            "bcg-diffusers parallel: the ranks disagree on option max_entries: rank 0 has 32, rank 1 has 33;"
        ), r["options_error"]
        assert "denoiser call" in r["call_error"] and "differs across ranks" in r["call_error"], r["call_error"]
        assert "rank 0 has hidden_states: tensor(1, 16, 64) float32" in r["call_error"]
        assert "rank 1 has hidden_states: tensor(1, 12, 64) float32" in r["call_error"]
        assert "cannot split transformer: Z-Image runs both guidance branches as one batched call" in r["z_cfg_error"]
        assert r["restored"], "restore() left parallel hooks or settings behind"
        assert r["patches_left"] == [], r["patches_left"]
    assert "parallel cfg: rank 1 of 2; computes guidance branch 1" in r1["report"]


def test_four_processes_cfg_times_ulysses(tmp_path: Path) -> None:
    results = _run("cfg_ulysses", 4, tmp_path)
    for r in results:
        _assert_exact(r["out"], results[0]["out"])
        torch.testing.assert_close(r["out"], results[0]["ref"], rtol=1e-4, atol=1e-4)
    assert [r["branch"] for r in results] == [0, 0, 1, 1]


def test_the_cli_with_parallel_writes_on_rank_0_only_the_images_of_one_process(tmp_path: Path) -> None:
    cli = ["--model", "qwen-image", "--device", "cpu", "--resolution", "64x64", "--steps", "2", "--quiet",
           "--prompt", "a fox", "--prompt", "a cat"]  # fmt: skip
    assert [r["status"] for r in _run("cli", 2, tmp_path, *cli)] == [0, 0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    single = tmp_path / "single"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), *cli, "--out", str(single)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(p.name for p in single.iterdir())
    assert len(names) == 2
    assert sorted(p.name for p in (tmp_path / "images0").iterdir()) == names
    assert not (tmp_path / "images1").exists(), "rank 1 wrote files"
    for name in names:  # every pixel and every PNG text chunk
        assert (tmp_path / "images0" / name).read_bytes() == (single / name).read_bytes()


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_rank_ends_the_other_within_the_timeout(tmp_path: Path, how: str) -> None:
    timeout = 6.0
    procs = _launch("lost", 2, tmp_path, how, str(timeout))
    ready = tmp_path / "ready"
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline and procs[0].poll() is None, (tmp_path / "rank0.log").read_text()[-3000:]
        time.sleep(0.1)
    start = time.monotonic()
    if how == "killed":
        procs[1].send_signal(signal.SIGKILL)
    try:
        code = procs[0].wait(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.monotonic() - start
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
            p.wait()
    log = (tmp_path / "rank0.log").read_text()
    assert code == 1, f"rank 0 exited {code} after {elapsed:.1f}s:\n{log[-3000:]}"
    assert elapsed < timeout + 20
    assert "bcg-diffusers parallel: rank 0 of 2 lost contact with the other ranks" in log, log[-3000:]


# --------------------------------------------------------------------------------------------
# The worker: one rank of a scenario
# --------------------------------------------------------------------------------------------
def _hook_state(module: torch.nn.Module) -> list[Any]:
    """What enabling and removing parallelism must leave as it found it."""
    state = []
    for name, m in module.named_modules():
        registry = m.__dict__.get("_diffusers_hook")
        processor = getattr(m, "processor", None)
        state.append(
            (
                name,
                None if registry is None else sorted(registry.hooks),
                "forward" in m.__dict__,
                None if processor is None else processor.__dict__.get("_parallel_config", "unset"),
                m.__dict__.get("_parallel_config", "unset"),
            )
        )
    return state


def _worker(scenario: str, out: Path, *extra: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format=f"rank {os.environ['RANK']}: %(name)s: %(message)s")
    torch.set_num_threads(1)
    # diffusers' enable_parallelism picks a device as rank % accelerator count, which is 0 on a
    # CPU-only machine; the CPU stands in for one device per rank here.
    torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
    from accel import accelerate_pipeline
    from accel.hooks.cfg_batch import apply_cfg_batch, remove_cfg_batch
    from accel.parallel import ParallelError
    from pipelines.builders import build_pipeline

    rank = int(os.environ["RANK"])
    res: dict[str, Any] = {}

    def qwen_kw(cfg: bool = True, size: int = SIZE) -> dict[str, Any]:
        kw: dict[str, Any] = dict(prompt="a red fox in the snow", height=size, width=SIZE, num_inference_steps=STEPS)
        if cfg:
            kw.update(negative_prompt="blurry", true_cfg_scale=4.0)
        return {**kw, "output_type": "latent"}

    def run(pipe: Any, **kw: Any) -> torch.Tensor:
        return pipe(**kw, generator=torch.Generator().manual_seed(7)).images.clone()

    if scenario == "main":
        pipe = build_pipeline("qwen-image", "tiny")
        pipe.set_progress_bar_config(disable=True)
        res["ref_cfg"], res["ref_nocfg"] = run(pipe, **qwen_kw()), run(pipe, **qwen_kw(cfg=False))
        before = _hook_state(pipe.transformer)
        try:
            accelerate_pipeline(pipe, parallel="cfg", max_entries=32 + rank)
        except ValueError as e:
            res["options_error"] = str(e)
        accelerate_pipeline(pipe, parallel="cfg", parallel_timeout_s=60)
        res["cfg"], res["nocfg"] = run(pipe, **qwen_kw()), run(pipe, **qwen_kw(cfg=False))
        hook = pipe.accel.parallel.hooks["transformer"]
        res["counts"] = (hook.computed, hook.skipped)
        res["accelerated"] = sorted(pipe.accel.stats())
        try:
            run(pipe, **qwen_kw(size=SIZE if rank == 0 else SIZE - 16))
        except ParallelError as e:
            res["call_error"] = str(e)
        res["cfg_after_mismatch"] = run(pipe, **qwen_kw())
        res["report"] = pipe.accel.report()
        pipe.accel.restore()
        accelerate_pipeline(pipe, parallel="ulysses")
        res["uly"] = run(pipe, **qwen_kw())
        # Both branches as one call through the Ulysses group, the hook applied as on a GPU.
        cfg = apply_cfg_batch(pipe.transformer, pipe.accel.hooks["transformer"].recipe, pipe.accel.guard,
                              name="transformer", user=pipe.accel, degree=2)  # fmt: skip
        res["uly_joined"] = run(pipe, **qwen_kw())
        res["joined"] = (cfg.joined, cfg.alone)
        remove_cfg_batch(pipe.transformer, pipe.accel)
        pipe.accel.restore()
        res["restored"] = _hook_state(pipe.transformer) == before

        z = build_pipeline("z-image", "tiny")
        z.set_progress_bar_config(disable=True)
        zkw = dict(prompt="a red fox", negative_prompt="blurry", guidance_scale=4.0, height=SIZE, width=SIZE,
                   num_inference_steps=STEPS, output_type="latent")  # fmt: skip
        res["z_ref"] = run(z, **zkw)
        zbefore = _hook_state(z.transformer)
        try:
            accelerate_pipeline(z, parallel="cfg")
        except ValueError as e:
            res["z_cfg_error"] = str(e)
        accelerate_pipeline(z, parallel="ulysses")
        res["z_uly"] = run(z, **zkw)
        z.accel.shutdown()
        res["restored"] = res["restored"] and _hook_state(z.transformer) == zbefore
        from accel.graphs import patches

        res["patches_left"] = patches.active()  # the destroy_process_group wrap included
    elif scenario == "cfg_ulysses":
        pipe = build_pipeline("qwen-image", "tiny")
        pipe.set_progress_bar_config(disable=True)
        res["ref"] = run(pipe, **qwen_kw())
        accelerate_pipeline(pipe, parallel="cfg+ulysses")
        res["out"] = run(pipe, **qwen_kw())
        res["branch"] = pipe.accel.parallel.layout.branch
    elif scenario == "cli":
        from pipelines.cli import main

        res["status"] = main([*extra, "--parallel", "cfg", "--out", str(out / f"images{rank}")])
    elif scenario == "lost":
        timeout = float(extra[1])  # extra[0] says how the test loses rank 1: it kills or leaves it
        pipe = build_pipeline("qwen-image", "tiny")
        pipe.set_progress_bar_config(disable=True)
        accelerate_pipeline(pipe, parallel="cfg", parallel_timeout_s=timeout)

        def on_step(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
            if rank == 1 and i == 1:
                (out / "ready").touch()
                while True:  # killed by the test, or hung until it is
                    time.sleep(1)
            return kw

        for _ in range(1000):
            pipe(**{**qwen_kw(), "num_inference_steps": 4}, callback_on_step_end=on_step)
        return
    torch.save(res, out / f"rank{rank}.pt")


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])

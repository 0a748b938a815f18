"""``bcg-serve --ray``'s flags (pipelines/serve/ray/flags.py), with no Ray cluster: bcg-serve's
flags read as bcg-serve reads them, the Ray flags mapped to Ray Serve's deployment options (its
autoscaling config checked by Ray's own class), a bad value one line and exit status 2 before
anything starts, and importing the front end imports neither Ray nor torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipelines.serve import main
from pipelines.serve.config import UsageError
from pipelines.serve.ray.flags import deployment_options, help_text, parse_ray_args, replica_ranks

MODEL = ["--model", "z-image", "--resolutions", "64x64", "--batch-sizes", "1", "2", "4"]


def test_the_flags_map_to_ray_serve_s_options() -> None:
    config, ray, rest = parse_ray_args(["--ray", *MODEL, "--queue", "8", "--min-replicas", "2", "--max-replicas",
                                        "6", "--upscale-delay", "5", "--autoscaling", "look_back_period_s=20",
                                        "--max-models-per-replica", "2"])  # fmt: skip
    assert rest == [*MODEL, "--queue", "8"]  # what each replica reads again
    assert (config.queue, config.batch_sizes, ray.max_models_per_replica) == (8, (1, 2, 4), 2)
    options = deployment_options(config, ray)
    assert options["autoscaling_config"] == {
        "min_replicas": 2,
        "max_replicas": 6,
        "target_ongoing_requests": 4.0,  # the largest bucket, full
        "upscale_delay_s": 5.0,
        "look_back_period_s": "20",
    }
    assert options["ray_actor_options"] == {"num_gpus": 1.0, "num_cpus": 1.0}
    assert (options["max_ongoing_requests"], options["max_queued_requests"]) == (8, 8)
    cpu = deployment_options(*parse_ray_args([*MODEL, "--device", "cpu"])[:2])
    assert cpu["ray_actor_options"]["num_gpus"] == 0.0
    assert cpu["autoscaling_config"]["max_replicas"] == 1


@pytest.mark.parametrize(
    ("flags", "told"),
    [
        (["--min-replicas", "3", "--max-replicas", "2"], "--max-replicas 2 is below --min-replicas 3"),
        (["--device", "cuda:1"], "--device cuda:1: Ray gives each replica its GPUs"),
        (["--device", "cpu", "--gpus-per-replica", "1"], "--gpus-per-replica 1 with --device cpu"),
        (["--autoscaling", "upscale_delay"], "give KEY=VALUE"),
        (["--autoscaling", "no_such_field=1"], "autoscaling_config: no_such_field"),
        (["--max-models-per-replica", "0"], "must be at least 1, got 0"),
        (["--queue", "0"], "--queue: must be at least 1"),
        (
            ["--parallel", "cfg", "--gpus-per-replica", "4"],
            "--parallel cfg --gpus-per-replica 4: a replica runs one process per GPU and cfg needs 2",
        ),
        (["--parallel", "ulysses", "--gpus-per-replica", "1.5"], "ulysses needs 2 or more"),
        (
            ["--parallel", "cfg+ulysses", "--gpus-per-replica", "5"],
            "cfg+ulysses needs an even number of processes, at least 4",
        ),
    ],
)
def test_a_bad_flag_is_one_line(flags: list[str], told: str) -> None:
    with pytest.raises(UsageError, match=None) as e:
        parse_ray_args([*MODEL, *flags])
    assert told in str(e.value) and "\n" not in str(e.value)


def test_a_replica_of_several_processes_reserves_one_gpu_each(tmp_path: Path) -> None:
    def gpus(*flags: str) -> tuple[float, int]:
        config, ray, _ = parse_ray_args([*MODEL, "--model", "qwen-image", *flags])
        ranks = replica_ranks(config.settings.parallel, ray.gpus_per_replica, config.settings.device)
        return deployment_options(config, ray)["ray_actor_options"]["num_gpus"], ranks

    assert gpus() == (1.0, 1)
    assert gpus("--parallel", "cfg") == (2.0, 2)  # the fewest the mode runs on
    assert gpus("--parallel", "cfg+ulysses") == (4.0, 4)
    assert gpus("--parallel", "cfg+ulysses", "--gpus-per-replica", "6") == (6.0, 6)
    assert gpus("--parallel", "ulysses", "--gpus-per-replica", "3") == (3.0, 3)
    assert gpus("--parallel", "cfg", "--device", "cpu") == (0.0, 2)  # processes on the CPU, gloo
    import torch
    from safetensors.torch import save_file

    lora = tmp_path / "a.safetensors"
    save_file({"lora_A.weight": torch.zeros(1)}, str(lora))
    with pytest.raises(UsageError, match="--lora with --ray --parallel: a replica's adapter slots are not kept"):
        parse_ray_args([*MODEL, "--parallel", "cfg", "--lora", f"a={lora}"])


def test_bcg_serve_ray_refuses_bad_input_in_one_line_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ray", *MODEL, "--min-replicas", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bcg-serve: error: argument --min-replicas: must be at least 0") and err.count("\n") == 1


def test_the_help_names_the_ray_flags_beside_bcg_serve_s(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ray", "--help"]) == 0
    out = capsys.readouterr().out
    assert out == help_text()
    for flag in ("--max-models-per-replica", "--target-ongoing-requests", "--resolutions", "--lora"):
        assert flag in out


def test_importing_the_ray_front_end_imports_neither_ray_nor_torch() -> None:
    code = ("import sys, pipelines.serve.ray, pipelines.serve.ray.flags, pipelines.serve.ray_app; "
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_replica_s_processes_are_accel_s_layouts_read_without_torch() -> None:
    """``replica_ranks`` asks accel.parallel's layout rule (loaded without accel's package, so
    without torch): it takes exactly the GPU counts :func:`accel.parallel.plan_layout` lays out, and
    by default the fewest of them, for every mode."""
    from accel.hooks.options import PARALLEL_MODES
    from accel.parallel import plan_layout

    worlds = [*range(13), 2.5, 4.0]
    code = f"""
        import json, sys
        from pipelines.serve.config import UsageError
        from pipelines.serve.ray.flags import replica_ranks
        answers = {{}}
        for mode in {list(PARALLEL_MODES)!r}:
            taken = []
            for gpus in {worlds!r}:
                try:
                    taken.append(replica_ranks(mode, gpus, "cuda"))
                except UsageError as e:
                    assert str(e).startswith(f"--parallel {{mode}} --gpus-per-replica {{gpus:g}}: "), e
            answers[mode] = [replica_ranks(mode, None, "cuda"), replica_ranks(mode, 6, "cpu"), taken]
        print(json.dumps([answers, sorted(m for m in ("torch", "accel", "ray") if m in sys.modules)]))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         check=True)  # fmt: skip
    answers, heavy = json.loads(out.stdout)
    assert heavy == []

    def lays_out(mode: str, world: float) -> bool:
        try:
            return world == int(world) and plan_layout(mode, int(world), 0).world == world
        except ValueError:
            return False

    for mode in PARALLEL_MODES:
        fitting = [int(w) for w in worlds if lays_out(mode, w)]
        fewest, on_cpu, taken = answers[mode]
        assert taken == fitting, mode
        assert fewest == on_cpu == min(fitting), mode
    assert {m: answers[m][0] for m in PARALLEL_MODES} == {"cfg": 2, "ulysses": 2, "cfg+ulysses": 4}


def test_serve_run_builds_the_application_from_the_same_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve run pipelines.serve.ray_app:build argv=...`` and ``...:app`` with BCG_SERVE_ARGS (what a
    RayService's import_path names): the application of bcg-serve --ray's flags, bad ones refused."""
    serve = pytest.importorskip("ray.serve", reason="the [ray] extra")
    from pipelines.serve import ray_app

    flags = " ".join([*MODEL, "--device", "cpu", "--max-replicas", "3"])
    assert isinstance(ray_app.build({"argv": flags}), serve.Application)
    monkeypatch.setenv("BCG_SERVE_ARGS", flags)
    assert isinstance(ray_app.app, serve.Application)
    with pytest.raises(UsageError, match="--max-replicas 3 is below --min-replicas 4"):
        ray_app.build({"argv": f"{flags} --min-replicas 4"})

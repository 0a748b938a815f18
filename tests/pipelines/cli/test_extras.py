"""Each optional extra missing is one line naming its pip install command and exit status 2, before
anything is built or bound, from every entry point (bcg-generate, bcg-serve); and the extras the
code names are those pyproject.toml declares."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from accel.hooks.fp8 import quantizers  # imported here: diffusers may warn of torchao once, as it loads
from pipelines.cli import main
from pipelines.generation import prepare as generation_prepare
from pipelines.generation.errors import InputError
from pipelines.generation.extras import EXTRAS, install_command, missing, require

ROOT = Path(__file__).resolve().parents[3]
FAST = ["--resolution", "64x64", "--steps", "2", "--quiet"]
HEAVY = ("torch", "diffusers", "transformers", "accel")


def _python(code: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    return proc, time.perf_counter() - t0


def _declared_extras() -> dict[str, set[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and newer
    with open(ROOT / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["optional-dependencies"]
    return {extra: {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower() for req in reqs}
            for extra, reqs in declared.items()}  # fmt: skip


def test_the_extras_named_are_those_pyproject_declares() -> None:
    declared = _declared_extras()
    for extra, modules in EXTRAS.items():
        assert {m.replace("_", "-") for m in modules} == declared[extra], extra
        assert declared[extra] <= declared["test"], f"the tests need the [{extra}] extra's packages too"
        assert install_command(extra) == f'pip install "bcg-diffusers[{extra}]"'


def test_a_missing_module_is_named_by_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "prometheus_client" else real(n, *a))
    assert missing("serve") == ["prometheus-client"]
    with pytest.raises(InputError) as e:
        require("serve", "bcg-serve")
    assert str(e.value) == (
        'bcg-serve needs the [serve] extra; prometheus-client is not installed: pip install "bcg-diffusers[serve]"'
    )
    with pytest.raises(ValueError, match="no extra 'servers'"):
        missing("servers")


@pytest.mark.parametrize("module", ["fastapi", "prometheus_client", "uvicorn", "python_multipart"])
def test_bcg_serve_without_the_serve_extra_is_one_line_before_torch(module: str) -> None:
    """Once the server built the model for 16 s, then died on its first import of the extra."""
    proc, seconds = _python(f"""
        import sys
        sys.modules[{module!r}] = None  # what Python does for a module that is not there
        from pipelines.serve import main
        rc = main(["--resolutions", "64x64", "--port", "0"])
        print(rc, [m for m in {HEAVY!r} if m in sys.modules])
    """)
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr[-2000:]
    package = module.replace("_", "-")
    assert proc.stderr == (
        f"bcg-serve: error: bcg-serve needs the [serve] extra; {package} is not installed: pip install "
        '"bcg-diffusers[serve]"\n'
    )
    assert seconds < 5, seconds  # the bar; it takes a fraction of a second


def test_bcg_serve_with_dbcache_without_cache_dit_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipelines.serve import main as serve

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "cache_dit" else real(n, *a))
    monkeypatch.setattr(generation_prepare, "build_model", lambda *a, **k: pytest.fail("built"))
    assert serve(["--cache", "dbcache", "--resolutions", "64x64", "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"bcg-serve: error: --cache dbcache uses cache-dit, which is not installed: {install_command('cache-dit')}\n"
    )


def test_quantize_without_torchao_names_the_fp8_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a GPU that runs float8 (stood in for here), torchao is what is missing."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    monkeypatch.setattr(quantizers, "check_fp8_device", lambda device, what="the denoiser": None)
    monkeypatch.setattr(generation_prepare, "build_model", lambda *a, **k: pytest.fail("built"))
    assert main(["--quantize", "fp8", "--dtype", "bf16", *FAST, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bcg-generate: error: --quantize fp8 needs torchao: "), err
    assert "pip install" in err and "bcg-diffusers[fp8]" in err
    assert not (tmp_path / "out").exists()

"""The one catalog (pipelines/families/catalog.py): it finds every family folder and nothing else,
a new folder is found without any other edit, each recipe is named by one entry point into its
folder, the records equal the models the builders build, the recipes' defaults are their families',
and the catalog loads without torch."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from accel import GenerationDefaults
from pipelines import families, zoo
from pipelines.families import catalog
from pipelines.releases.configs import SIZES, pipeline_class, release, vae_config

ROOT = Path(__file__).resolve().parents[3]
FOLDER = ROOT / "pipelines" / "families"
GROUP = "bcg_diffusers.recipes"


def _folders() -> list[str]:
    return sorted(p.parent.name for p in FOLDER.glob("*/__init__.py"))


def _entry_points() -> dict[str, str]:
    """The recipe entry points pyproject.toml declares, name -> ``module:Class``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return dict(project["entry-points"][GROUP])


def test_every_family_folder_is_in_the_catalog_in_its_order() -> None:
    assert sorted(catalog.FAMILIES) == _folders()
    assert {"qwen_image", "z_image", "flux", "wan", "hunyuan_video15"} <= set(catalog.FAMILIES)
    orders = [f.order for f in catalog.FAMILIES.values()]
    assert orders == sorted(orders) and len(set(orders)) == len(orders), "each family its own place"
    first = ("z-image", "qwen-image", "flux", "wan", "wan-1.3b")  # each family's first model, in order
    assert tuple(n for n in catalog.MODEL_NAMES if n in first) == first
    assert catalog.MODEL_NAMES[:4] == ("z-image", "z-image-omni", "qwen-image", "qwen-image-layered")
    assert tuple(m.name for f in catalog.FAMILIES.values() for m in f.models) == catalog.MODEL_NAMES


def test_a_new_folder_is_found_with_no_other_edit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-place rule: a package with a models.py naming FAMILY is a family; one without is an error."""
    new = tmp_path / "made_up"
    new.mkdir()
    (new / "__init__.py").write_text('"""A made-up family."""\n')
    (new / "models.py").write_text(
        "from pipelines.families.records import Family, ModelRecord\n"
        "FAMILY = Family(order=1, models=(ModelRecord('made-up', 'MadeUpPipeline', ('madeup',)),))\n"
    )
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    for name in ("pipelines.families.made_up", "pipelines.families.made_up.models"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    found = catalog._find()
    assert next(iter(found)) == "made_up" and found["made_up"].models[0].name == "made-up"
    assert list(found)[1:] == list(catalog.FAMILIES)
    (new / "models.py").write_text("FAMILY = None\n")
    monkeypatch.delitem(sys.modules, "pipelines.families.made_up.models")
    with pytest.raises(ImportError, match=r"^pipelines\.families\.made_up\.models names no Family FAMILY"):
        catalog._find()


def test_each_recipe_is_one_entry_point_into_its_family_folder() -> None:
    declared = _entry_points()
    with_recipe = sorted(f for f in _folders() if (FOLDER / f / "recipe.py").is_file())
    assert sorted(declared) == with_recipe
    for name, value in declared.items():
        module, _, cls = value.partition(":")
        assert module == catalog.module_name(name, "recipe"), value
        assert inspect.getmodule(importlib.import_module(module).__dict__[cls]).__name__ == module
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GROUP)}
    assert installed == declared, "the installed entry points are stale: pip install -e ."


@pytest.mark.parametrize("family", sorted(catalog.FAMILIES))
def test_a_recipe_s_defaults_are_its_family_s(family: str) -> None:
    record = catalog.FAMILIES[family]
    if not (FOLDER / family / "recipe.py").is_file():
        # The generic recipe serves it: front ends read these.
        assert record.generation is not None or all(m.generation is not None for m in record.models)
        return
    module = importlib.import_module(catalog.module_name(family, "recipe"))
    recipe = module.__dict__[_entry_points()[family].partition(":")[2]]
    own = recipe().generation_defaults()
    if own is None:  # the generic recipe's (None): front ends read the model's or family's by pipeline class
        assert record.models and all((m.generation or record.generation) is not None for m in record.models)
        assert all(
            catalog.pipeline_generation(m.pipeline) is (m.generation or record.generation) for m in record.models
        )
    else:
        assert own == GenerationDefaults(**record.generation)


@pytest.mark.parametrize("name", catalog.MODEL_NAMES)
def test_the_records_are_the_models_the_builders_build(name: str) -> None:
    model = catalog.known_model(name)
    assert model is not None and release(name).name == name
    cls = pipeline_class(name)
    assert model.pipeline == cls.__name__
    assert model.video == ("num_frames" in inspect.signature(cls.__call__).parameters)
    for size in SIZES:
        temporal = vae_config(name, size).get("scale_factor_temporal") if model.video else None
        assert model.frames_per_latent == temporal, size
        if model.video:
            (width, height), frames = model.video_runs[size]
            assert width % 16 == height % 16 == 0 and (frames - 1) % temporal == 0, size
    assert not model.video_runs or model.video


def test_names_are_read_in_any_spelling() -> None:
    assert catalog.known_model(" Z-Image ") is catalog.known_model("zimage") is catalog.known_model("z_image")
    assert catalog.known_model("no-such-model") is None and catalog.canonical_name("no-such-model") is None
    assert catalog.canonical_name("Wan2.1-T2V-1.3B") == "wan-1.3b" and catalog.family_of("flux.1-dev") == "flux"
    assert {a: catalog.canonical_name(a) for a in catalog.ALIASES} == catalog.ALIASES
    assert catalog.video_model_names() == ("wan", "wan-1.3b")
    with pytest.raises(KeyError):
        catalog.family_of("sd3")  # the benchmark zoo's, not a built-in model
    assert catalog.BENCHMARK_ZOO == zoo.NAMES


def test_the_catalog_loads_without_torch() -> None:
    code = textwrap.dedent("""
        import sys
        from pipelines.families import catalog
        print(catalog.MODEL_NAMES, catalog.pipeline_generation("FluxPipeline")["steps"],
              [m for m in ("torch", "diffusers", "transformers", "accel") if m in sys.modules])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(" 28 []"), proc.stdout

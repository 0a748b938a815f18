"""accel.hooks.compiled.compile on the CPU: what it tells torch's caches (the compiling itself needs CUDA)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe

from accel.hooks.compiled.compile import AUTOCAST_FUNCTIONS, cache_autocast_regions


def _autocast_nodes() -> list[Any]:
    """The autocast nodes of the graph dynamo makes for a function with an autocast-off region
    (as in Z-Image's rotary embedding)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return gm.forward

    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            y = x.float() * 2
        return y.to(x.dtype) + 1

    torch._dynamo.reset()
    try:
        torch.compile(f, backend=backend, fullgraph=True)(torch.randn(4, dtype=torch.bfloat16))
    finally:
        torch._dynamo.reset()
    return [n for g in graphs for n in g.graph.nodes if getattr(n.target, "__name__", "") in AUTOCAST_FUNCTIONS]


def test_autocast_regions_become_cacheable_for_aotautograd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inductor_config, "unsafe_marked_cacheable_functions", {})
    nodes = _autocast_nodes()
    assert {n.target.__name__ for n in nodes} == set(AUTOCAST_FUNCTIONS)
    for node in nodes:  # refused as it comes: every warm start would redo AOTAutograd
        with pytest.raises(BypassAOTAutogradCache, match="autocast"):
            check_node_safe(node)
    marked, undo = cache_autocast_regions()
    assert marked == [f"torch.amp.autocast_mode.{n}" for n in AUTOCAST_FUNCTIONS]
    assert all(inductor_config.unsafe_marked_cacheable_functions[m] == torch.__version__ for m in marked)
    for node in nodes:
        check_node_safe(node)  # no longer refused
    undo()  # only while compiled blocks live: the table is as it was
    assert inductor_config.unsafe_marked_cacheable_functions == {}


def test_the_compile_cache_folder_is_set_only_until_undone(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from accel.hooks.compiled.compile import use_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/theirs")
    folder, undo = use_compile_cache(tmp_path / "kernels")
    assert folder.is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert os.environ["TRITON_CACHE_DIR"] == "/theirs"  # the user's own wins
    undo()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and os.environ["TRITON_CACHE_DIR"] == "/theirs"


def test_the_folder_dynamo_writes_into_the_environment_is_not_taken_for_the_users(monkeypatch, tmp_path) -> None:
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from accel.hooks.compiled.compile import use_compile_cache

    monkeypatch.setenv("BCG_COMPILE_CACHE", str(tmp_path / "ours"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing dynamo leaves
    folder, undo = use_compile_cache(None)
    assert folder == tmp_path / "ours" and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    undo()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))  # the user's own
    folder, undo = use_compile_cache(None)
    assert folder == tmp_path / "theirs"
    undo()


def test_compiled_modules_are_called_with_floats_specialised_and_no_duck_sizing() -> None:
    """Dynamo's first trace of a block with symbolic floats is thrown away (inductor cannot
    tensorify them) and traced again; a compiled module's calls specialise floats from the start,
    and do not share one symbol between sizes equal by chance. The rest of the process keeps
    dynamo's defaults."""
    from accel import accelerate_pipeline
    from accel.hooks.graph_hook import graph_hook_of
    from pipelines.builders import build_pipeline

    default = torch._dynamo.config.specialize_float
    pipe = build_pipeline("z-image", "tiny")
    pipe.set_progress_bar_config(disable=True)
    seen: list[bool] = []
    pipe.transformer.layers[0].register_forward_pre_hook(
        lambda m, a: seen.append(
            torch._dynamo.config.specialize_float and not torch.fx.experimental._config.use_duck_shape
        )
    )
    accelerate_pipeline(pipe)
    hook = graph_hook_of(pipe.transformer)
    kw = dict(prompt="a fox", height=32, width=32, num_inference_steps=1, output_type="latent")
    pipe(**kw)
    assert seen and not any(seen) and default is False  # uncompiled: dynamo's default
    seen.clear()
    hook.compiled = True  # as compile=True on a GPU leaves it
    pipe(**kw)
    assert seen and all(seen)
    assert torch._dynamo.config.specialize_float is default
    assert torch.fx.experimental._config.use_duck_shape is True
    pipe.accel.restore()


def test_sizes_equal_by_chance_at_the_first_trace_do_not_recompile() -> None:
    """Qwen-Image at 1024x1024: its image tokens equal its text RoPE table's rows (4096). With
    dynamo's duck sizing both got one symbol, and the next resolution compiled again."""
    from torch._dynamo.testing import CompileCounter

    from accel.hooks.compiled.compile import tracing_settings

    def tokens_and_table(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x.sum() + table.sum()

    for settings, graphs in ((contextlib.nullcontext, 2), (tracing_settings, 1)):
        torch._dynamo.reset()
        counter = CompileCounter()
        fn = torch.compile(tokens_and_table, backend=counter, dynamic=True)
        with settings():
            fn(torch.randn(4096), torch.randn(4096))  # equal by chance
            fn(torch.randn(2304), torch.randn(4096))  # 768x768: 2304 image tokens
            fn(torch.randn(1024), torch.randn(4096))
        assert counter.frame_count == graphs, settings
    torch._dynamo.reset()


def test_blocks_given_views_and_plain_tensors_share_one_compiled_graph() -> None:
    """A model's first block gets views (embeddings), the next ones plain tensors: dynamo guards
    on view-ness, so each block variant compiled twice."""
    from torch._dynamo.testing import CompileCounter

    from accel.hooks.compiled.compile import calls_without_views

    def block(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], scale: float = 2.0) -> torch.Tensor:
        return x * scale + rope[0].sum() + rope[1].sum()

    table = torch.randn(8, 16)
    rope = (table[:4], table[4:])  # the same table slices for every block
    first = (torch.randn(1, 4, 16).view(4, 16), rope)  # an embedding, reshaped: a view
    later = (torch.randn(4, 16), rope)  # the previous block's output
    for wrap, graphs in ((lambda f: f, 2), (calls_without_views, 1)):
        torch._dynamo.reset()
        counter = CompileCounter()
        fn = wrap(torch.compile(block, backend=counter, dynamic=True))
        with torch.no_grad():
            for args in (first, later):
                assert torch.equal(fn(*args), block(*args))
        assert counter.frame_count == graphs, wrap
    # With autograd on the call is left alone (detaching would cut the graph).
    x = torch.randn(4, 16, requires_grad=True)
    out = calls_without_views(block)(x[:], (x[:2], x[2:]))
    out.sum().backward()
    assert x.grad is not None
    torch._dynamo.reset()


def test_inductor_settings_reach_torch_compile_and_unknown_ones_fail_before_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accel import accelerate_pipeline
    from accel.hooks.compiled import compile as compile_mod
    from accel.hooks.options import AcceleratorOptions
    from pipelines.builders import build_pipeline

    options = AcceleratorOptions(compile=True, inductor={"coordinate_descent_tuning": True, "epilogue_fusion": False})
    assert options.inductor == (("coordinate_descent_tuning", True), ("epilogue_fusion", False))
    assert options == AcceleratorOptions(
        compile=True, inductor=[("epilogue_fusion", False), ("coordinate_descent_tuning", True)]
    )
    kwargs = compile_mod.compile_options(options.inductor)
    ours = kwargs["options"].pop(compile_mod.PASS_SETTING)  # the library's pass, always there
    assert type(ours).__name__ == "SameCallsOnce"
    assert kwargs["options"] == {"coordinate_descent_tuning": True, "epilogue_fusion": False}
    assert kwargs["fullgraph"] is True and kwargs["dynamic"] is True
    monkeypatch.setattr(compile_mod, "INDUCTOR_OPTIONS", {"epilogue_fusion": True, "shape_padding": True})
    settings = compile_mod.compile_options(options.inductor)["options"]
    settings.pop(compile_mod.PASS_SETTING)
    assert settings == {
        "coordinate_descent_tuning": True,
        "epilogue_fusion": False,  # the user's setting wins over the library's
        "shape_padding": True,
    }
    for bad in ({"": 1}, {"x": [1]}, 3):
        with pytest.raises(ValueError, match="inductor"):
            AcceleratorOptions(inductor=bad)  # type: ignore[arg-type]

    pipe = build_pipeline("z-image", "tiny")
    forward = type(pipe.transformer).forward
    with pytest.raises(ValueError, match="unknown setting no_such_setting"):
        accelerate_pipeline(pipe, compile=True, inductor={"no_such_setting": 1})
    assert "accel" not in vars(pipe) and "_diffusers_hook" not in vars(pipe.transformer)
    assert type(pipe.transformer).forward is forward

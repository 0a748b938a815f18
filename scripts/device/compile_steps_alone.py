"""The steps of test_compile's compiled session after an uncompiled one, with the device memory
before every capture, in a process of their own (on a GPU machine; the output of one run is
samples/gpu-run-2026-12-02b/compile-steps-alone.txt).

    python3 scripts/device/compile_steps_alone.py
"""

import gc
import logging
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the project root
from accel import GraphPool, accelerate_pipeline
from pipelines.builders import build_pipeline
from tests.cuda.test_compile import PROMPTS, RESOLUTIONS, _call, _stock

logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
logging.getLogger("accel").setLevel(logging.INFO)


def mem(tag):
    torch.cuda.synchronize()
    by = {}
    for s in torch.cuda.memory._snapshot()["segments"]:
        k = tuple(s.get("segment_pool_id", (0, 0)))
        b = by.setdefault(k, [0, 0, 0])
        b[0] += s["total_size"]
        b[1] += s["allocated_size"]
        b[2] += 1
    st = torch.cuda.memory_stats()
    free, _ = torch.cuda.mem_get_info()
    print(
        f"MEM {tag}: alloc {torch.cuda.memory_allocated() / 2**30:.1f} reserved {torch.cuda.memory_reserved() / 2**30:.1f} free {free / 2**30:.1f} ooms {st.get('num_ooms')} retries {st.get('num_alloc_retries')} pools",
        {k: (round(v[0] / 2**30, 2), round(v[1] / 2**30, 2), v[2]) for k, v in by.items()},
        flush=True,
    )


orig = GraphPool.make_room


def make_room(self):
    mem("before capture")
    n = orig(self)
    if n:
        mem(f"make_room gave back {n / 2**30:.1f} GiB")
    return n


GraphPool.make_room = make_room

with torch.no_grad():
    name = "z-image"
    pipe = build_pipeline(name, "full", device="cuda", dtype=torch.bfloat16, seed=0)
    pipe.set_progress_bar_config(disable=True)
    mem("built")
    stock = _stock(pipe, name)
    mem("stock")
    accelerate_pipeline(pipe, text_buckets=None)
    pipe.accel.warmup((512, 512), prompts=PROMPTS[:1], negative_prompt="blurry, low quality", progress=False)
    mem("warm 512")
    print("equal", torch.equal(_call(pipe, name, PROMPTS[0], (512, 512), 0), stock[(512, 512)]))
    mem("call")
    pipe.accel.restore()
    gc.collect()
    torch.cuda.empty_cache()
    mem("restored")
    torch._dynamo.reset()
    accelerate_pipeline(pipe, text_buckets=None, compile=True, compile_cache_dir=pathlib.Path(tempfile.mkdtemp()))
    mem("accelerated compile")
    report = pipe.accel.warmup(RESOLUTIONS, prompts=PROMPTS, negative_prompt="blurry, low quality", progress=False)
    print(report)
    mem("compiled warm")

#!/usr/bin/env bash
# Run named steps on the GPU machine one after another, each under its own time limit, each
# writing its log (and what it makes) under $OUT; the machine's versions first.
#
#   bash scripts/device/steps.sh NAME:SECONDS:COMMAND [NAME:SECONDS:COMMAND ...]
#
# e.g. 'matrix:240:python3 -m pytest -m cuda tests/cuda/test_state_matrix.py -q -s'. A step's
# command may write files under $OUT itself. progress.txt says when each began and ended.
set -u
out=${OUT:?set OUT to the folder that comes back}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", __import__("sys").version.split()[0])
for name in ("diffusers", "transformers", "accelerate", "peft", "torchao", "cache_dit", "fastapi", "openai"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001
        print(name, "missing:", type(e).__name__)
PY
  git rev-parse --short HEAD 2>/dev/null; git status --porcelain 2>/dev/null | head -20
} > "$out/env.txt" 2>&1
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; limit=${rest%%:*}; cmd=${rest#*:}
  echo "$(date -u +%H:%M:%S) start $name" >> "$out/progress.txt"
  t0=$(date +%s)
  timeout "$limit" bash -c "$cmd" > "$out/$name.log" 2>&1
  rc=$?  # before anything else resets it (124: the time limit)
  echo "$(date -u +%H:%M:%S) end $name rc=$rc $(( $(date +%s) - t0 ))s" >> "$out/progress.txt"
done

# Runs the device steps one after another; survives between calls while the machine is warm.
# Start it in a process session of its own, e.g.
#   STEPS="cuda-tests guard" setsid nohup bash scripts/device/driver.sh > /dev/null 2>&1 &
# with the steps to run in $STEPS (default: cuda-tests caches-q caches-z; also fp8, guard). Each
# step's log, progress.txt (UTC) and, at the end, ALL_DONE go to /tmp/res; scripts/device/wait.sh
# waits for it and packs /tmp/res into $OUT.
cd "$(dirname "$0")/../.."
mkdir -p /tmp/res
step() {
  local name=$1 limit=$2; shift 2
  echo "$(date -u +%H:%M:%S) start $name" >> /tmp/res/progress.txt
  local t0=$(date +%s)
  timeout "$limit" "$@" > /tmp/res/$name.log 2>&1
  local rc=$?
  echo "$(date -u +%H:%M:%S) end $name rc=$rc $(( $(date +%s) - t0 ))s" >> /tmp/res/progress.txt
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > /tmp/res/gpu.txt 2>&1
python3 -c 'import torch, diffusers, transformers, torchao, cache_dit, peft, fastapi; print("torch", torch.__version__, "cuda", torch.version.cuda, "| diffusers", diffusers.__version__, "| transformers", transformers.__version__, "| torchao", torchao.__version__, "| cache-dit", cache_dit.__version__, "| peft", peft.__version__, "| fastapi", fastapi.__version__)' >> /tmp/res/gpu.txt 2>&1
for s in ${STEPS:-cuda-tests caches-q caches-z}; do
  case $s in
    cuda-tests) step cuda-tests 1500 python3 -m pytest -m cuda tests/cuda -q -rA --durations=40 -p no:cacheprovider ;;
    caches-q) step caches-q 400 python3 scripts/bench_caches.py --model qwen-image --variants eager dbcache dbcache+bcg-compile --runs 2 --out /tmp/res/caches-q ;;
    caches-z) step caches-z 300 python3 scripts/bench_caches.py --model z-image --variants eager dbcache dbcache+bcg-compile --runs 3 --out /tmp/res/caches-z ;;
    fp8) step fp8 600 python3 -m pytest -m cuda tests/cuda/test_fp8.py -q -rA -p no:cacheprovider ;;
    guard) step guard 300 taskset -c 3 python3 scripts/bench_guard.py --out /tmp/res/guard ;;
  esac
done
touch /tmp/res/ALL_DONE

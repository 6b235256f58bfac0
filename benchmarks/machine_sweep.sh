#!/usr/bin/env bash
# Re-measure, on the machine in front of you, every decode and update default that was tuned on one CPU class
# (issue 30: "on every machine class you measure"; docs/benchmarks.md, "Where it stands"). One benchmark at a
# time, one torch thread each; every step writes its own results file under benchmarks/results/.
#
#     bash benchmarks/machine_sweep.sh           # the micro-benchmarks (~28 min on 2 cores, Zen 4)
#     bash benchmarks/machine_sweep.sh --harness # then the default harness against TRL (~70 min more)
#
# What each one re-checks (the default it measured, where it lives):
#   decode_kernels.py         which small-M GEMM the decode should use: fp32 MKL, fbgemm fp16, oneDNN bf16
#                             (rlkit.hardware: auto's choice of decode weights)
#   decode_profile.py         where a decode step goes (bf16 copy; fp16 weights without native bf16), vs its bound
#   shared_prompt_attention.py MIN_SAVED_FRACTION (rlkit.rollout.shared_prompt)
#   attention_train.py        the actor's grouped eager attention against SDPA, CAUSAL_BLOCK
#                             (rlkit.model.attention)
#   ab.py --change headkeep   the 512 MiB budget of kept head logits (rlkit.model.forward.KEEP_LOGITS_BYTES)
#   ab.py --change castonce   bf16 weights cast once per optimizer step (ForwardPlan.cast_weights_once)
#   update_compile.py         torch.compile on the update's body (not built on Zen 4: 0.90-0.97x)
#   fp16_probe.py             what rollout.backend.dtype: auto decides here, measured fresh
#   decode_attention_kernel.py the compiled attention kernel against SDPA over fp32 and bf16 K/V
#                             (rlkit.rollout.attention_kernel: KERNEL_MAX_RATIO; rlkit.rollout.bf16_kv)
#   sampling_kernel.py        the compiled draw against torch's (DecodePlan.fused_sampling)
#   ab.py --change kernel|glue|sampling  the same three in a whole generate (DecodePlan.attention_kernel,
#                             fused_glue, fused_sampling), over the decode weights auto picks here
#   ab.py --change mlas       without native bf16: that torch step against the one ONNX Runtime graph
#                             (what rlkit.rollout.graph_probe weighs for linears: auto), in a whole generate
# The machine line (CPU model, flags, probes) is in every results file; cite them in docs/benchmarks.md
# beside the machine class.
set -euo pipefail
cd "$(dirname "$0")/.."
M=${M:-$HOME/.cache/rlkit/models/SmolLM2-135M-Instruct}
if [ ! -f "$M/config.json" ]; then
  echo "machine_sweep: no SmolLM2 at $M (set M=DIR; python benchmarks/run.py --workloads smollm2 converts it)" >&2
  exit 2
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
KEEP=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647  # the workers'
lscpu | grep "Model name"
grep -o -w -E "avx2|fma|f16c|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_bf16" /proc/cpuinfo | sort -u | tr "\n" " "
echo
# Without native bf16 (AVX2: bf16 GEMMs ~60x slower than fp32) no default trains or decodes in bf16 (auto picks
# fp32 training and fp32 or fp16 decode weights), so the bf16 measurements would only take hours to say so: the
# sweep measures fp32 and the fp16 decode there, and skips castonce (a bf16-only change).
if grep -q -w -E "avx512_bf16|amx_bf16" /proc/cpuinfo; then
  TRAIN=bf16 DECODE=bfloat16 DTYPES=fp32,bf16 HARNESS=fp32auto,bf16
else
  TRAIN=fp32 DECODE=float16 DTYPES=fp32 HARNESS=fp32auto
  echo "machine_sweep: no native bf16 here: fp32 training, float16 decode weights, harness $HARNESS"
fi
python benchmarks/fp16_probe.py
python benchmarks/decode_kernels.py --rows 1,8,16 --reps 5 --kernels linear,fbgemm_fp16,onednn_bf16
python benchmarks/decode_profile.py --shapes 16x32,8x256 --dtype $DECODE
python benchmarks/shared_prompt_attention.py
python benchmarks/attention_train.py --reps 3 --rounds 2 --dtypes $DTYPES
GLIBC_TUNABLES=$KEEP python benchmarks/ab.py --model "$M" --change headkeep --phase update --prompts 2 \
  --samples 8 --tokens 256 --reps 3 --dtype $TRAIN
if [ $TRAIN = bf16 ]; then
  GLIBC_TUNABLES=$KEEP python benchmarks/ab.py --model "$M" --change castonce --phase update --dtype bf16 \
    --prompts 4 --samples 16 --tokens 32 --micro 4 --reps 3
fi
python benchmarks/update_compile.py --model "$M" --dtypes $DTYPES
python benchmarks/decode_attention_kernel.py
python benchmarks/sampling_kernel.py
changes="kernel glue sampling"
if [ $DECODE = float16 ]; then changes="$changes mlas"; fi
for change in $changes; do
  python benchmarks/ab.py --model "$M" --change $change --phase gen --decode-dtype $DECODE --prompts 2 \
    --samples 8 --tokens 64 --reps 5
done
if [ "${1:-}" = "--harness" ]; then
  python benchmarks/run.py --dtypes $HARNESS --rounds 1 --steps 3 --warmup 3 --label "sweep-$(date +%Y%m%d)"
fi

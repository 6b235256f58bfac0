#!/bin/bash
# Time the README's main command verbatim on a fresh clone of this repository (docs/quickstart.md).
#   bash benchmarks/quickstart_fresh.sh [WORKDIR]     (default /tmp/rlkit-fresh; it is deleted first)
# The rlkit cache is empty (RLKIT_CACHE=WORKDIR-cache), so the model conversion and the bf16 probe run again;
# pip's download cache is whatever this machine has. Prints the CPU, the load before and after, rc and seconds,
# and the phase boundaries (from files' modification times). Run it on a quiet machine.
set -u
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
D=${1:-/tmp/rlkit-fresh}
rm -rf "$D" "$D-cache"; mkdir -p "$D-cache"
git clone -q "$REPO" "$D" && cd "$D" || exit 1
CMD=$(awk '/<!-- main-command -->/{f=1;next} f&&/^```bash/{i=1;next} i&&/^```/{exit} i{print}' README.md)
echo "+ $CMD"
echo "commit $(git rev-parse --short HEAD); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs);" \
     "flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load before: $LOAD_BEFORE"
start=$(date +%s.%N)
env RLKIT_CACHE="$D-cache" HF_HUB_OFFLINE=1 bash -c "$CMD" > "$D.log" 2>&1; rc=$?
end=$(date +%s.%N)
TOTAL=$(echo "$end - $start" | bc)
echo "rc=$rc total=$TOTAL s; load after: $(cut -d' ' -f1-3 /proc/loadavg); log: $D.log"
echo "started $(date -d @"${start%.*}" +%T); data written $(stat -c %y data/arithmetic/train.parquet | cut -c12-19);" \
     "run folder: $(stat -c %y outputs/rlkit/quickstart/params.json | cut -c12-19) params," \
     "$(stat -c %y outputs/rlkit/quickstart/metrics.jsonl | cut -c12-19) last metrics; ended $(date -d @"${end%.*}" +%T)"
grep "done:" "$D.log"
"$D/.venv/bin/python" "$REPO/benchmarks/quickstart_record.py" --clone "$D" --log "$D.log" --rc "$rc" \
    --seconds "$TOTAL" --started "$start" --load-before "$LOAD_BEFORE" \
    --load-after "$(cut -d' ' -f1-3 /proc/loadavg)" --args "$*"
exit "$rc"

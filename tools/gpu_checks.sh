#!/usr/bin/env bash
# The GPU checks of issues 39 (decoding) and 40 (training) on one CUDA GPU, with torch + transformers only (no Ray,
# MLflow or network), in two parts that each fit a 10-minute call on one H200:
#
#   tools/gpu_checks.sh decode [OUT]   tools/gpu_smoke.py, then bench.gpu without TTT, with the static path compiled
#                                      (reduce-overhead: CUDA graphs) beside eager and the grouped-query fold on/off
#   tools/gpu_checks.sh train [OUT]    bench.ttt on the Llama-3.1-8B-shaped draft at 2k-16k tokens in bf16, ours and
#                                      (with SPECFORGE_DIR set to a SpecForge checkout) SpecForge's sdpa and flex
#                                      backends, then one profiled step of ours at 4096 tokens
#
# OUT (default: bench/results/gpu/<UTC date>) receives every result file and each command's log; summary.txt lists
# each command with its exit status and seconds. GPU_CHECKS_DRY_RUN=1 runs the same commands on the CPU at tiny
# shapes (under three minutes on 2 cores): what to do before spending device time. PYTHON picks the interpreter (default: python3).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: tools/gpu_checks.sh decode|train [OUT]}
out=${2:-bench/results/gpu/$(date -u +%Y-%m-%d)}
py=${PYTHON:-python3}
dry=${GPU_CHECKS_DRY_RUN:-0}
mkdir -p "$out"
failed=0

run() {  # run NAME SECONDS COMMAND...: the command's output in OUT/NAME.log, one line in OUT/summary.txt
    local name=$1 limit=$2 started status
    shift 2
    started=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    status=$?
    echo "$name: exit $status after $(($(date +%s) - started)) s: $*" | tee -a "$out/summary.txt"
    [ "$status" -eq 0 ] || failed=1
}

case "$part" in
decode)
    if [ "$dry" = 1 ]; then
        run smoke 300 "$py" tools/gpu_smoke.py --cpu-dry-run
        run decode 300 "$py" -m bench.gpu --tiny --no-ttt --targets llama3.1-8b --compile default \
            --out "$out/gpu-decode.json"
    else
        run smoke 150 "$py" tools/gpu_smoke.py
        run decode 400 "$py" -m bench.gpu --no-ttt --compile reduce-overhead --budget-s 330 \
            --out "$out/gpu-decode.json"
    fi
    ;;
train)
    impls=(ours)
    [ -n "${SPECFORGE_DIR:-}" ] && impls+=(specforge specforge-flex)
    if [ "$dry" = 1 ]; then
        run ttt 300 "$py" -m bench.ttt --shape tiny --device cpu --impls "${impls[@]}" --lengths 64 128 \
            --dtypes float32 --iters 1 --out "$out/ttt-tiny.json"
        run ttt-profile 120 "$py" -m bench.ttt --shape tiny --device cpu --impls ours --lengths 128 \
            --dtypes float32 --iters 1 --profile 15 --out "$out/ttt-tiny-profile.json"
    else
        run ttt 330 "$py" -m bench.ttt --shape llama3.1-8b --device cuda --impls "${impls[@]}" \
            --lengths 2048 4096 8192 16384 --dtypes bfloat16 --iters 3 --out "$out/ttt-llama3.1-8b.json"
        run ttt-profile 150 "$py" -m bench.ttt --shape llama3.1-8b --device cuda --impls ours --lengths 4096 \
            --dtypes bfloat16 --iters 2 --profile 25 --out "$out/ttt-llama3.1-8b-profile.json"
    fi
    ;;
*)
    echo "usage: tools/gpu_checks.sh decode|train [OUT]" >&2
    exit 2
    ;;
esac
exit "$failed"

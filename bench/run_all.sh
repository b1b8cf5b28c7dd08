#!/usr/bin/env bash
# Every benchmark figure, then the plots, the summary of the targets and (writing bench/results) README.md's
# table of them.
#
#   bench/run_all.sh [OUT_DIR]            # H200; OUT_DIR defaults to bench/results
#   bench/run_all.sh --tiny [OUT_DIR]     # CPU smoke test; OUT_DIR defaults to /tmp/dflash_bench_tiny
#
# Compiled programs are kept in a persistent cache (JAX_COMPILATION_CACHE_DIR, default
# /tmp/dflash_jax_cache): the batch 1 x prompt 512 programs of spec_round, acceptance and the
# sweep are the same, so later steps load them instead of compiling. Each step's seconds are
# printed and written to OUT_DIR/run_all_times.json. Exit status 1 if any run compiled after its
# warm-up (summary.py --strict).
#
# On a fresh H200 (cold compile cache, 2026-12-04) plain_decode took 182 s, spec_round 122,
# acceptance 59 and call_cost more than 220: a whole run needs about 15 minutes, more than one
# 10-minute device call; the steps are separate scripts, run into one folder, then summary.py.
#
# Knobs (environment): BENCH_BUDGET_S (default 1080): the sweep, which runs last, skips and
# records as skipped the cells that would end past this many seconds from the start of this
# script (15 s are kept for the plots and the summary);
# BENCH_COMPILE_THREADS (default 3): > 1 compiles every sweep cell's loops up front, that many at a
# time (faster; GEMM autotuning then shares the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."

tiny=""
if [[ "${1:-}" == "--tiny" ]]; then
  tiny="--tiny"
  shift
fi
out="${1:-$([[ -n "$tiny" ]] && echo /tmp/dflash_bench_tiny || echo bench/results)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/dflash_jax_cache}"

# --tiny runs every script once, on the smallest grid that still takes each path (a drafter window in the
# sweep): that speculative tokens equal plain ones at every acceptance length is tests/test_speculative.py's job
if [[ -n "$tiny" ]]; then
  plain_args=(--tiny --prompt 32 --new 32 --reps 2)
  acceptance_args=(--batches 1 --taus 2 6.5)
  call_cost_args=()
  prefill_args=(--reps 1)
  sweep_args=(--prompts 96)
else
  plain_args=(--peer-static)
  acceptance_args=()
  call_cost_args=(--batches 1 8 --samplings sampled sampled_dense)  # summary.json's sampled-round ratios
  prefill_args=(--reps 2)  # the policy's chunk, cuDNN and Pallas attention
  sweep_args=()
fi

times=()
step() {
  local name="$1"
  shift
  local t0=$SECONDS
  echo "=== $name: $*"
  "$@"
  local dt=$((SECONDS - t0))
  echo "=== $name: ${dt} s"
  times+=("\"$name\": $dt")
}

write_times() {
  local IFS=, body
  body="${times[*]:-}"
  echo "{${body:+$body, }\"total\": $SECONDS}" > "$out/run_all_times.json"
  echo "step seconds: $(cat "$out/run_all_times.json") -> $out/run_all_times.json"
}
trap write_times EXIT

step plain_decode python bench/plain_decode.py ${plain_args[@]+"${plain_args[@]}"} --out "$out"
step spec_round python bench/spec_round.py $tiny --out "$out"
step acceptance python bench/acceptance.py $tiny ${acceptance_args[@]+"${acceptance_args[@]}"} --out "$out"
step call_cost python bench/call_cost.py $tiny ${call_cost_args[@]+"${call_cost_args[@]}"} --out "$out"
step call_dispatch python bench/call_dispatch.py $tiny --out "$out"  # what the fixed cost is made of (summary.py)
step prefill python bench/prefill.py $tiny ${prefill_args[@]+"${prefill_args[@]}"} --out "$out"
step gemm_check python bench/gemm_check.py $tiny --out "$out"
step profile_round python bench/profile_round.py $tiny --out "$out"
# the largest cell (batch 64 x prompt 8192) needs ~110 GB: let JAX's allocator take 95% of the GPU
budget=$(( ${BENCH_BUDGET_S:-1080} - SECONDS - 15 ))  # 15 s kept for the plots and the summary
step sweep env XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}" \
  python bench/sweep.py $tiny ${sweep_args[@]+"${sweep_args[@]}"} --out "$out" \
  --budget-s $(( budget > 30 ? budget : 30 )) --compile-threads "${BENCH_COMPILE_THREADS:-3}"
step plots python bench/plots.py $tiny --out "$out"

# the committed results also refresh README.md's table of the targets
summary_args=()
if [[ -z "$tiny" && "$(realpath -m "$out")" == "$(realpath -m bench/results)" ]]; then
  summary_args=(--readme README.md)
fi
step summary python bench/summary.py $tiny --out "$out" --strict ${summary_args[@]+"${summary_args[@]}"}

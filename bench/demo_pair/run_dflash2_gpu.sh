#!/usr/bin/env bash
# A DFlash2 drafter for the bundled demo target in one command: distill the target's greedy text (as
# run_gpu.sh does), train a DFlash2 drafter on it with the bundled DFlash drafter's recipe (3 layers, block 16,
# 18,000 steps, 200 s budget, seq 256, labels target) and selector rank 32, top-K 16, conv kernel 2, group 16,
# window 2048, then compare held-out acceptance with the bundled DFlash and DSpark drafters.
#   bash bench/demo_pair/run_dflash2_gpu.sh DATA WORK [DRAFTER_STEPS BUDGET_S DISTILL_SEQS PROMPTS NEW_TOKENS]
# DATA: train.npy, heldout.npy and prompts.json (steps 1-2 of the recipe, encoded with the bundled target's
# tokenizer). WORK receives target/ (the bundled one), distill.npy, drafter_dflash2/ and compare.json.
# The last three arguments (defaults 131072, 32, 128) only shrink a check run on the CPU.
set -euo pipefail
DATA=$1; WORK=$2; DSTEPS=${3:-18000}; BUDGET=${4:-200}; SEQS=${5:-131072}; PROMPTS=${6:-32}; NEW=${7:-128}
export PYTHONUNBUFFERED=1
here=$(dirname "$0")
root=$(cd "$here/../.." && pwd)
demo=$root/dflash_jax/assets/demo
mkdir -p "$WORK"
[ -d "$WORK/target" ] || cp -r "$demo/target" "$WORK/target"
[ -f "$WORK/distill.npy" ] || python "$here/distill.py" --target "$WORK/target" --data "$DATA" \
  --out "$WORK/distill.npy" --n-seqs "$SEQS" --batch $((SEQS < 4096 ? SEQS : 4096)) --prompt-len 128 --new 192 \
  --time-budget 120
python "$here/train_drafter.py" --target "$WORK/target" --data "$DATA" --train-file "$WORK/distill.npy" \
  --out "$WORK/drafter_dflash2" --steps "$DSTEPS" --seq-len 256 --labels target --time-budget "$BUDGET" \
  --family dflash2 --selector-rank 32 --selector-top-k 16 --conv-kernel-size 2 --conv-group-size 16 \
  --sliding-window 2048
python "$here/compare_drafters.py" --target "$WORK/target" --prompts "$DATA/prompts.json" --out "$WORK/compare.json" \
  --n "$PROMPTS" --new "$NEW" --drafters "$demo/drafter" "$demo/drafter_dspark" "$WORK/drafter_dflash2" \
  --extras-for "$WORK/drafter_dflash2"

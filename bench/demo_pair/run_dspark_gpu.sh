#!/usr/bin/env bash
# A DSpark drafter for the bundled demo target in one command: distill the target's greedy text
# (as run_gpu.sh does), train a DSpark drafter on it (shifted labels, Markov head of rank 32,
# confidence head), then compare held-out acceptance with the bundled DFlash drafter.
#   bash bench/demo_pair/run_dspark_gpu.sh DATA WORK [DRAFTER_STEPS BUDGET_S]
# DATA: train.npy, heldout.npy and prompts.json (steps 1-2 of the recipe, encoded with the bundled
# target's tokenizer). WORK receives target/ (the bundled one), distill.npy, drafter_dspark/ and compare.json.
set -euo pipefail
DATA=$1; WORK=$2; DSTEPS=${3:-18000}; BUDGET=${4:-200}
export PYTHONUNBUFFERED=1
here=$(dirname "$0")
root=$(cd "$here/../.." && pwd)
mkdir -p "$WORK"
[ -d "$WORK/target" ] || cp -r "$root/dflash_jax/assets/demo/target" "$WORK/target"
[ -f "$WORK/distill.npy" ] || python "$here/distill.py" --target "$WORK/target" --data "$DATA" --out "$WORK/distill.npy" \
  --n-seqs 131072 --batch 4096 --prompt-len 128 --new 192 --time-budget 120
python "$here/train_drafter.py" --target "$WORK/target" --data "$DATA" --train-file "$WORK/distill.npy" \
  --out "$WORK/drafter_dspark" --steps "$DSTEPS" --seq-len 256 --labels target --time-budget "$BUDGET" \
  --family dspark --markov-rank 32 --confidence
python "$here/compare_drafters.py" --target "$WORK/target" --prompts "$DATA/prompts.json" --out "$WORK/compare.json" \
  --drafters "$root/dflash_jax/assets/demo/drafter" "$WORK/drafter_dspark"

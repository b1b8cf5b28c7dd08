#!/usr/bin/env bash
# The demo pair's GPU steps in one command: pretrain the target, distill its greedy text,
# train the drafter on it, evaluate on held-out prompts.
#   bash bench/demo_pair/run_gpu.sh DATA WORK [TARGET_STEPS DRAFTER_STEPS BUDGET_S]
# DATA: the tokenizer step's output plus corpus.py's prompts.json. WORK receives target/,
# distill.npy, drafter/ and eval_gpu.json. Training stops at BUDGET_S seconds if not done.
# Defaults: a target trained for about 5.7 passes (a 19-pass one over-fitted: held-out loss 3.38
# against 0.74 in training); up to 25M distilled tokens (distillation stops starting batches
# after 120 s); a drafter trained on the target's own argmax (--labels target), so the
# corpus prompts inside the distilled stream teach the target's choices too.
set -euo pipefail
DATA=$1; WORK=$2; TSTEPS=${3:-600}; DSTEPS=${4:-18000}; BUDGET=${5:-200}
export PYTHONUNBUFFERED=1
here=$(dirname "$0")
[ -f "$WORK/target/model.safetensors" ] || \
  python "$here/train_target.py" --data "$DATA" --out "$WORK/target" --steps "$TSTEPS" --time-budget "$BUDGET"
python "$here/distill.py" --target "$WORK/target" --data "$DATA" --out "$WORK/distill.npy" --n-seqs 131072 --batch 4096 \
  --prompt-len 128 --new 192 --time-budget 120
python "$here/train_drafter.py" --target "$WORK/target" --data "$DATA" --train-file "$WORK/distill.npy" \
  --out "$WORK/drafter" --steps "$DSTEPS" --seq-len 256 --labels target --time-budget "$BUDGET"
python "$here/evaluate.py" --pair "$WORK" --prompts "$DATA/prompts.json" --dtype float32 --out "$WORK/eval_gpu.json"

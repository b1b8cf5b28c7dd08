#!/usr/bin/env bash
# The demo pair's GPU steps in one command: pretrain the target, distill its greedy text,
# train the drafter on it, evaluate on held-out prompts.
#   bash bench/demo_pair/run_gpu.sh DATA WORK [TARGET_STEPS DRAFTER_STEPS BUDGET_S]
# DATA: the tokenizer step's output plus corpus.py's prompts.json. WORK receives target/,
# distill.npy, drafter/ and eval_gpu.json. Training stops at BUDGET_S seconds if not done.
# Defaults: 16.8M distilled tokens (about 15 epochs at 30k steps of 32 x 256), after a first attempt with
# 1M tokens over-fitted (5.1 tokens/round on its data, 1.45 held out). Not yet run at these sizes.
set -euo pipefail
DATA=$1; WORK=$2; TSTEPS=${3:-2000}; DSTEPS=${4:-30000}; BUDGET=${5:-200}
export PYTHONUNBUFFERED=1
here=$(dirname "$0")
[ -f "$WORK/target/model.safetensors" ] || \
  python "$here/train_target.py" --data "$DATA" --out "$WORK/target" --steps "$TSTEPS" --time-budget "$BUDGET"
python "$here/distill.py" --target "$WORK/target" --data "$DATA" --out "$WORK/distill.npy" --n-seqs 65536 --batch 2048 \
  --prompt-len 64 --new 192
python "$here/train_drafter.py" --target "$WORK/target" --data "$DATA" --train-file "$WORK/distill.npy" \
  --out "$WORK/drafter" --steps "$DSTEPS" --seq-len 256 --time-budget "$BUDGET"
python "$here/evaluate.py" --pair "$WORK" --prompts "$DATA/prompts.json" --dtype float32 --out "$WORK/eval_gpu.json"

#!/usr/bin/env bash
# The real path on one GPU, in one command (no Hub needed): a Pythia-1B-shaped model through one
# SFT, one RM, one DPO and two PPO updates at the paper's per-GPU batch, bf16 under DeepSpeed ZeRO-2; prints
# and writes runs/gpu_check.md (device, versions, peak memory per stage, the PPO update's time split,
# first-epoch ratio, windowed vs full forward, decode tokens/s of the fast sampling path and of the
# plain loop). To publish it, add it at the top of benchmark/results/gpu_check.md, which keeps every check.
#
#   bash benchmark/gpu_check.sh            # random-init Pythia-1B shape, ~5-8 min on one H100 or H200 (275-486 s so far)
#   bash benchmark/gpu_check.sh --hub      # the real EleutherAI/pythia-1b-deduped (needs the Hub)
#
# Needs the requirements with a CUDA build of torch: pip install -r requirements.txt on a GPU machine that reaches
# a registry (without the CPU constraints file); on this workplace's device machines, which reach none, the wheels
# of benchmark/gpu_wheels.sh (fetched where pip works, carried as .whl/, installed as its header says). It stops in
# seconds when a stage script cannot be imported. Run it before anything else on a new GPU machine. A stage that
# fails, or a check stopped at a time limit, leaves the report so far at --out and each stage's log tail in
# gpu_check_logs/ beside it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
if [[ " $* " != *" --hub "* ]]; then
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi
exec python benchmark/gpu_check.py "$@"

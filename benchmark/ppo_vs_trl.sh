#!/usr/bin/env bash
# Side-by-side PPO throughput: ppo.py against TRL 1.12.0's PPOTrainer (the last port of the paper's
# code) on the tiny world, both in one run, alternating; prints a markdown table of episodes per
# second, the time split and the ratio, and writes it to benchmark/results/ppo_vs_trl.md (_5m.md with --config 5m).
#
#   bash benchmark/ppo_vs_trl.sh                   # from the repository root; ~4 min on 2 cores
#   bash benchmark/ppo_vs_trl.sh --rounds 3 --updates 5
#   OMP_NUM_THREADS=2 bash benchmark/ppo_vs_trl.sh  # both sides get the same thread count
#
# TRL is never a dependency of the stage scripts: it lives in its own git-ignored venv, .venv-trl
# (the project pins + trl==1.12.0), built here on first use (~90 s). It sits at the repository
# root, not under benchmark/, whose every .py file tests/test_conventions.py reads.
# Needs the tiny world's SFT and reward models (models/tiny/{sft_1,reward_1}): bash benchmark/tiny.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=cpu TRL_EXPERIMENTAL_SILENCE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

PYTHON=${PYTHON:-.venv/bin/python}
TRL_VENV=.venv-trl
if [[ ! -x "$TRL_VENV/bin/python" ]] || ! "$TRL_VENV/bin/python" -c "import trl; assert trl.__version__ == '1.12.0'" 2>/dev/null; then
  echo "=== building $TRL_VENV (project pins + trl==1.12.0)"
  rm -rf "$TRL_VENV"  # a broken or stale one, a dangling link included (venv --clear fails on a link)
  "$PYTHON" -m venv "$TRL_VENV"
  PIP_CONSTRAINT="$PWD/constraints.txt" "$TRL_VENV/bin/pip" install -q -r requirements.txt trl==1.12.0
fi
echo "=== load before: $(uptime)"
"$PYTHON" benchmark/ppo_vs_trl.py --ours_python "$PYTHON" --trl_python "$TRL_VENV/bin/python" "$@"
echo "=== load after: $(uptime)"

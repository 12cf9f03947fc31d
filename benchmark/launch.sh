#!/usr/bin/env bash
# The paper's sweep on a SLURM cluster: every stage launcher of benchmark/slurm/ submitted as an
# array over MODELS x SEEDS (benchmark/knobs.sh), chained with job dependencies:
#
#   preprocess -> sft -> reward -> ppo -> judge
#                    \-> dpo ---------------/
#
# Task i of every array is the same (model, seed), so a stage depends on its predecessors task by
# task (`aftercorr`: reward of 1B seed 44413 starts as soon as that SFT run succeeds, not when all
# twelve have). A failed predecessor cancels its dependants (--kill-on-invalid-dep); submitting
# again is cheap, since a task whose output is complete exits at once.
#
#   bash benchmark/launch.sh --dry-run             # print the sbatch commands and every task's command
#   bash benchmark/launch.sh                       # submit the whole pipeline (from any folder)
#   bash benchmark/launch.sh sft reward            # only these stages, in pipeline order
#   MODELS="EleutherAI/pythia-1b-deduped" SEEDS="44413" bash benchmark/launch.sh   # a subset
#   GPUS_PER_NODE=4 bash benchmark/launch.sh       # nodes of 4 GPUs: the same global batches, more accumulation
#
# Cluster options go to sbatch through its own environment variables, e.g. SBATCH_PARTITION,
# SBATCH_QOS, SBATCH_ACCOUNT, SBATCH_TIMELIMIT (a job reaching its time limit requeues itself and
# resumes from its latest checkpoint). The jobs inherit this shell's environment: activate the
# project's venv, log in to W&B (or TRACK=0) and set OPENAI_API_KEY (judge) before submitting.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source benchmark/knobs.sh

ALL_STAGES=(preprocess sft reward dpo ppo judge)
declare -A NEEDS=([preprocess]="" [sft]="preprocess" [reward]="sft" [dpo]="sft" [ppo]="reward" [judge]="ppo dpo")

dry_run=0
stages=()
for arg in "$@"; do
  case $arg in
    --dry-run) dry_run=1 ;;
    preprocess | sft | reward | dpo | ppo | judge) stages+=("$arg") ;;
    *) echo "usage: bash benchmark/launch.sh [--dry-run] [${ALL_STAGES[*]}]" >&2; exit 2 ;;
  esac
done
if ((${#stages[@]} == 0)); then stages=("${ALL_STAGES[@]}"); fi

if [[ " ${stages[*]} " == *" judge "* && -z $JUDGE_MODEL ]] && ((!dry_run)); then
  echo "benchmark/launch.sh: the judge stage needs JUDGE_MODEL (the paper's gpt-3.5-turbo-0125 was shut down by" \
    "OpenAI on 2026-10-23): e.g. JUDGE_MODEL=gpt-5.6-terra bash benchmark/launch.sh, or leave out the judge" \
    "stage (bash benchmark/launch.sh preprocess sft reward dpo ppo). Nothing was submitted." >&2
  exit 1
fi
if [[ " ${stages[*]} " == *" judge "* && -z ${OPENAI_API_KEY:-} ]] && ((!dry_run)); then  # the jobs inherit this shell's
  echo "benchmark/launch.sh: the judge stage needs OPENAI_API_KEY in this shell (its jobs inherit it; any non-empty" \
    "value for a server without keys, OPENAI_BASE_URL naming it), or leave out the judge stage. Nothing was" \
    "submitted." >&2
  exit 1
fi

# The global batches (each script's --batch_size default, the paper's; tests/test_launchers.py checks them). A rank's
# micro-batch x GPUS_PER_NODE must divide each, or every task of the stage would refuse at its start, after its wait.
declare -A BATCH=([sft]=128 [reward]=64 [dpo]=64 [ppo]=512)
declare -A MICRO_KNOB=([sft]=SFT_MICRO [reward]=RM_MICRO [dpo]=DPO_MICRO [ppo]=PPO_MICRO)
for model in "${MODEL_LIST[@]}"; do  # a model without knobs would fail in every task of every stage, once submitted
  if ! knobs "$model"; then echo "benchmark/launch.sh: MODELS names '$model'. Nothing was submitted." >&2; exit 1; fi
  for stage in "${stages[@]}"; do
    [[ -n ${BATCH[$stage]:-} ]] || continue
    micro=${!MICRO_KNOB[$stage]}
    if ((GPUS_PER_NODE < 1 || BATCH[$stage] % (GPUS_PER_NODE * micro))); then
      echo "benchmark/launch.sh: GPUS_PER_NODE=$GPUS_PER_NODE does not fit $stage at $model: its batch of" \
        "${BATCH[$stage]} is not a multiple of $GPUS_PER_NODE GPUs x its micro-batch $micro (${MICRO_KNOB[$stage]}," \
        "benchmark/knobs.sh). Use a GPU count that divides ${BATCH[$stage]} / $micro. Nothing was submitted." >&2
      exit 1
    fi
  done
done

n_tasks=$((${#MODEL_LIST[@]} * ${#SEED_LIST[@]}))
declare -A JOB=()  # stage -> submitted job id (the stages of this call only)
if ((!dry_run)); then mkdir -p runs/slurm; fi  # the #SBATCH --output folder
for stage in "${ALL_STAGES[@]}"; do
  [[ " ${stages[*]} " == *" $stage "* ]] || continue
  args=(--parsable --kill-on-invalid-dep=yes)
  throttle=${ARRAY_THROTTLE:-}
  if [[ $stage == judge ]]; then throttle=$JUDGE_ARRAY_THROTTLE; fi  # its own knob: the tasks share one API key
  if [[ $stage != preprocess ]]; then args+=("--array=0-$((n_tasks - 1))${throttle:+%$throttle}"); fi
  if [[ $stage =~ ^(sft|reward|dpo|ppo)$ ]]; then args+=("--gpus-per-task=$GPUS_PER_NODE"); fi  # the knob, not the #SBATCH 8
  deps=()
  for need in ${NEEDS[$stage]}; do
    [[ -n ${JOB[$need]:-} ]] || continue  # not submitted in this call: assumed done
    if [[ $need == preprocess ]]; then deps+=("afterok:${JOB[$need]}"); else deps+=("aftercorr:${JOB[$need]}"); fi
  done
  if ((${#deps[@]})); then args+=("--dependency=$(IFS=,; echo "${deps[*]}")"); fi
  if ((dry_run)); then
    JOB[$stage]="<$stage job id>"
    echo "sbatch ${args[*]} benchmark/slurm/$stage.sbatch"
    bash "benchmark/slurm/$stage.sbatch" --dry-run
  else
    JOB[$stage]=$(sbatch "${args[@]}" "benchmark/slurm/$stage.sbatch")
    echo "$stage: job ${JOB[$stage]} (logs: runs/slurm/tldr-${stage}_${JOB[$stage]}*.out)"
  fi
done

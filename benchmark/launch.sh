#!/usr/bin/env bash
# The paper's sweep on a SLURM cluster: every stage launcher of benchmark/slurm/ submitted as an
# array over MODELS x SEEDS (benchmark/knobs.sh), chained with job dependencies:
#
#   preprocess -> sft -> reward -> ppo -> judge
#                    \-> dpo ---------------/
#
# Task i of every array is the same (model, seed), so a stage depends on its predecessors task by
# task (`aftercorr`: reward of 1B seed 44413 starts as soon as that SFT run succeeds, not when all
# twelve have). A failed predecessor cancels its dependants (--kill-on-invalid-dep). Only the tasks
# with work left are submitted, so submitting again after a failure or for more seeds runs only what
# is missing, and no complete task waits for a node.
#
#   bash benchmark/launch.sh --dry-run             # print the sbatch commands and every task's command
#   bash benchmark/launch.sh                       # submit the whole pipeline (from any folder)
#   bash benchmark/launch.sh sft reward            # only these stages, in pipeline order
#   MODELS="EleutherAI/pythia-1b-deduped" SEEDS="44413" bash benchmark/launch.sh   # a subset
#   GPUS_PER_NODE=4 bash benchmark/launch.sh       # nodes of 4 GPUs: the same global batches, more accumulation
#
# A task still in the queue from an earlier call (runs/slurm/jobs.tsv records what it submitted) is not submitted
# again, and its dependants wait for it; a queued tldr-* job it did not submit is refused (QUEUED_OK=1: another
# sweep's).
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

# Only the tasks with work left are submitted (each launcher's --pending), so a sweep submitted again waits for no
# node on behalf of runs already done. A task waits for the jobs that hold its own predecessors, or, where a
# predecessor is complete, for what that one would have waited for (SLURM's aftercorr, given an array without the
# task's index, would wait for that whole array instead, and cancel the task if any of its tasks failed). With
# PUSH=1 a complete training task is submitted to push its run again; nothing waits for such a push.
declare -A WORK_JOB=()  # "stage index" -> the job that does that task's work in this call (preprocess: index 0)
declare -A WAITS=()     # "stage index" -> the dependency list of that task, whether submitted or complete
declare -A GROUP=()     # a stage's arrays: "x<dependency list>" (or "push") -> the indices in it
if ((!dry_run)); then mkdir -p runs/slurm; fi  # the #SBATCH --output folder
ranges() {  # ranges 0 1 2 5 7 8 -> 0-2,5,7-8: sbatch's --array list
  local out=() start=$1 end=$1 i
  shift
  for i in "$@" ""; do
    if [[ -n $i ]] && ((i == end + 1)); then end=$i; continue; fi
    if ((start == end)); then out+=("$start"); else out+=("$start-$end"); fi
    start=$i end=$i
  done
  (IFS=,; echo "${out[*]}")
}
waits_of() {  # waits_of STAGE I: the dependency list of task I of STAGE (predecessors submitted, or inherited)
  local need j dep list=
  for need in ${NEEDS[$1]}; do
    j=$2
    if [[ $need == preprocess ]]; then j=0; fi
    if [[ -n ${WORK_JOB[$need $j]:-} ]]; then
      if [[ $need == preprocess ]]; then dep=afterok:${WORK_JOB[$need $j]}; else dep=aftercorr:${WORK_JOB[$need $j]}; fi
      list+=,$dep
    elif [[ ${LIVE_KIND[${OUT_OF[$need $j]}]:-} == work ]]; then  # in the queue already: that job's task
      list+=,afterok:${LIVE[${OUT_OF[$need $j]}]}
    elif [[ -n ${WAITS[$need $j]:-} ]]; then  # complete (or pushed again): what it waits for, the same inputs
      list+=,${WAITS[$need $j]}
    fi  # else not in this call: done, or assumed done
  done
  tr ',' '\n' <<< "${list#,}" | awk 'NF && !seen[$0]++' | paste -sd, -  # each job once
}
if ((!dry_run)) && ! command -v sbatch >/dev/null; then
  echo "benchmark/launch.sh: sbatch is not on PATH: submit from a SLURM login node, or see the commands with" \
    "bash benchmark/launch.sh --dry-run. Nothing was submitted." >&2
  exit 1
fi
# Tasks already in the queue: launch.sh records each task it submits (runs/slurm/jobs.tsv: job, index, stage,
# folder, work or push), and a task whose folder a queued job of that record writes is not submitted again (the two
# would delete each other's checkpoints): its dependants wait for that job's task instead (not for a push). A
# queued tldr-* job missing from the record (submitted otherwise) cannot be told apart: refused, unless QUEUED_OK=1.
# A dry run looks at the queue too where squeue is at hand, and says where a submission would stop.
LEDGER=runs/slurm/jobs.tsv
declare -A LIVE=() LIVE_KIND=()  # output folder -> "<job>_<task>" ("<job>": preprocess) of the queued job writing
#                                  it, and whether it works or only pushes
refuse() {  # refuse MESSAGE: stop before submitting anything; a dry run says so and goes on
  local message
  message=$(tr -s ' \n' '  ' <<< "$1")  # one line
  if ((dry_run)); then echo "# a submission would stop here: ${message% }"; return 0; fi
  echo "benchmark/launch.sh: ${message% } Nothing was submitted." >&2
  exit 1
}
if ((!dry_run)) || command -v squeue >/dev/null; then
  # -M: a cluster named for sbatch (SBATCH_CLUSTERS) is not the one squeue asks unless named for it too
  if ! queue=$(squeue ${SBATCH_CLUSTERS:+-M "$SBATCH_CLUSTERS"} -h -r -u "${USER:-$(id -un)}" -o "%i %j" 2>&1); then
    if [[ -f $LEDGER && ${QUEUED_OK:-0} != 1 ]]; then
      refuse "squeue failed ($queue), so the tasks of earlier submissions still in the queue cannot be left out (two
        jobs in one folder delete each other's checkpoints). Try again, or QUEUED_OK=1 if none of them is queued."
    fi
    queue=
  fi
  declare -A QUEUED=() RECORDED=()
  while read -r id name; do [[ $name == tldr-* ]] && QUEUED[$id]=$name; done <<< "$queue"
  if [[ -f $LEDGER ]]; then
    while IFS=$'\t' read -r job index stage out kind; do
      RECORDED[$job]=1
      id=$job
      if [[ $index != - ]]; then id=${job}_$index; fi
      if [[ ${QUEUED[$id]:-} == "tldr-$stage" ]]; then  # the name too: SLURM reuses job ids in the end
        LIVE[$out]=$id LIVE_KIND[$out]=${kind:-work}
      fi
    done < "$LEDGER"
  fi
  unknown=
  if ((${#QUEUED[@]})); then  # (an empty array is unset to bash before 4.4)
    for id in "${!QUEUED[@]}"; do
      if [[ -z ${RECORDED[${id%%_*}]:-} ]]; then unknown+=" $id (${QUEUED[$id]})"; fi
    done
  fi
  if [[ -n $unknown && ${QUEUED_OK:-0} != 1 ]]; then
    refuse "jobs of the sweep that launch.sh did not submit are in the queue:$unknown. A task submitted now could run
      beside one of them in the same folder, and would not wait for them. Wait until they end or cancel them (scancel
      --name tldr-<stage>); QUEUED_OK=1 submits anyway (jobs of another sweep)."
  fi
fi
wandb_url=${WANDB_BASE_URL:-https://api.wandb.ai}
wandb_host=${wandb_url#*://}
wandb_host=${wandb_host%%[/:]*}  # the netrc machine `wandb login` (--host for a server of your own) writes
if ((!dry_run)) && [[ $TRACK == 1 && ! ${WANDB_MODE:-} =~ ^(offline|disabled|dryrun)$ && -z ${WANDB_API_KEY:-} ]] \
  && [[ " ${stages[*]} " =~ " "(sft|reward|dpo|ppo)" " ]] && ! grep -qsF "$wandb_host" "${NETRC:-$HOME/.netrc}"; then
  echo "benchmark/launch.sh: TRACK=1 logs every training run to W&B, but this shell has no W&B login for" \
    "$wandb_host (WANDB_API_KEY, or wandb login's ~/.netrc): every task would fail at its start. Run wandb login," \
    "or set WANDB_MODE=offline (nodes without internet; wandb sync afterwards) or TRACK=0. Nothing was submitted." >&2
  exit 1
fi
# Every stage's tasks, those of the stages not submitted too: what they wait for passes on to their dependants.
declare -A STATE=() OUT_OF=()  # "stage index" -> work, push or done; its output folder (absolute), all asked first
for stage in "${ALL_STAGES[@]}"; do
  if ! list=$(bash "benchmark/slurm/$stage.sbatch" --pending); then
    echo "benchmark/launch.sh: could not tell which $stage tasks are complete (the error above, from" \
      "bash benchmark/slurm/$stage.sbatch --pending). Nothing was submitted." >&2
    exit 1
  fi
  while IFS=$'\t' read -r i state out; do
    STATE[$stage $i]=$state OUT_OF[$stage $i]=$(realpath -m "$out")
  done <<< "$list"
done
stale=()  # complete runs that are not what their tasks now ask for (a retrained SFT under a finished RM, another
for key in "${!STATE[@]}"; do  # DATA): not built upon
  if [[ ${STATE[$key]} == stale ]]; then stale+=("${OUT_OF[$key]} ($key)"); fi
done
if ((${#stale[@]})); then
  echo "benchmark/launch.sh: these complete runs were made from inputs that were rebuilt or removed since, or with" \
    "flags other than their tasks' commands now give, and the sweep would build on them (or report them) as they are:" >&2
  printf '%s\n' "${stale[@]}" | sort | sed 's/^/  /' >&2
  echo "SLURM_ARRAY_TASK_ID=<task> bash benchmark/slurm/<stage>.sbatch says why (and starts nothing). Delete them" \
    "(rm -r each) to run them again as the sweep asks, then submit again. Nothing was submitted." >&2
  exit 1
fi
SUBMITTED=  # the jobs this call submitted
n_tasks=$((${#MODEL_LIST[@]} * ${#SEED_LIST[@]}))
for stage in "${ALL_STAGES[@]}"; do
  total=$n_tasks
  if [[ $stage == preprocess ]]; then total=1; fi
  for ((i = 0; i < total; i++)); do WAITS[$stage $i]=$(waits_of "$stage" "$i"); done
  [[ " ${stages[*]} " == *" $stage "* ]] || continue  # not in this call: done, queued, or assumed done
  work=() push=() queued=() earlier=
  for ((i = 0; i < total; i++)); do
    if [[ -n ${LIVE[${OUT_OF[$stage $i]}]:-} ]]; then  # its job is in the queue
      queued+=("$i")
      earlier+=" afterany:${LIVE[${OUT_OF[$stage $i]}]%%_*}"
      continue
    fi
    if [[ ${STATE[$stage $i]} == work ]]; then work+=("$i"); elif [[ ${STATE[$stage $i]} == push ]]; then push+=("$i"); fi
  done
  line="# $stage:"
  if ((${#queued[@]})); then line+=" tasks $(ranges "${queued[@]}") are in the queue already;"; fi
  if ((${#work[@]} + ${#push[@]} == 0)); then
    if ((${#queued[@]})); then echo "$line every other task is complete; nothing to submit"
    else echo "# $stage: every task is complete; nothing to submit"; fi
    continue
  fi
  if ((${#work[@]} < total)); then
    line+=" $((total - ${#work[@]} - ${#queued[@]})) of $total tasks complete"
    if ((${#work[@]})); then line+="; submitting tasks $(ranges "${work[@]}")"; fi
    if ((${#push[@]})); then line+="; pushing again tasks $(ranges "${push[@]}") (PUSH=1)"; fi
    echo "$line"
  fi
  for i in ${work[@]+"${work[@]}"}; do  # a predecessor nobody will run: the task would fail at its start
    for need in ${NEEDS[$stage]}; do
      j=$i
      if [[ $need == preprocess ]]; then j=0; fi
      if [[ ${STATE[$need $j]} == work && -z ${WORK_JOB[$need $j]:-} && -z ${LIVE[${OUT_OF[$need $j]}]:-} ]]; then
        echo "# warning: $stage task $i needs $need task $j (${OUT_OF[$need $j]}), which is not complete, not queued" \
          "and not in this call: it would stop at its start (add $need to the call)" >&2
      fi
    done
  done
  GROUP=()
  order=()
  for i in ${work[@]+"${work[@]}"}; do  # group the tasks by what they wait for, the ready ones first
    key=x${WAITS[$stage $i]}
    if [[ -z ${GROUP[$key]+set} ]]; then
      if [[ $key == x ]]; then order=(x ${order[@]+"${order[@]}"}); else order+=("$key"); fi
    fi
    GROUP[$key]+=" $i"
  done
  if ((${#push[@]})); then order+=(push) GROUP[push]=" ${push[*]}"; fi  # no input needed: last
  throttle=${ARRAY_THROTTLE:-}
  if [[ $stage == judge ]]; then throttle=$JUDGE_ARRAY_THROTTLE; fi  # its own knob: the tasks share one API key
  # A throttle holds per array: a throttled stage's arrays run one after another, after its arrays still queued.
  previous=$(tr ' ' '\n' <<< "$earlier" | awk 'NF && !seen[$0]++' | paste -sd, -)
  for key in "${order[@]}"; do
    read -r -a indices <<< "${GROUP[$key]}"
    tasks=$(ranges "${indices[@]}")
    deps=${key#x}
    if [[ $key == push ]]; then deps=; fi
    if [[ -n $throttle && -n $previous ]]; then deps+=${deps:+,}$previous; fi
    args=(--parsable --kill-on-invalid-dep=yes)
    if [[ $stage != preprocess ]]; then args+=("--array=$tasks${throttle:+%$throttle}"); fi
    if [[ $stage =~ ^(sft|reward|dpo|ppo)$ ]]; then args+=("--gpus-per-task=$GPUS_PER_NODE"); fi  # the knob, not the #SBATCH 8
    if [[ -n $deps ]]; then args+=("--dependency=$deps"); fi
    if ((dry_run)); then
      job="<$stage job id>"
      if ((${#order[@]} > 1)); then job="<$stage job id of task${indices[1]+s} ${tasks//,/+}>"; fi  # no comma: a list
      echo "sbatch ${args[*]} benchmark/slurm/$stage.sbatch"
    else
      # SWEEP_ARRAY (exported to the job): its --array is this script's, not the header's (common.sh).
      # --parsable: sbatch prints "<id>[;<cluster>]".
      if ! job=$(SWEEP_ARRAY=$tasks sbatch "${args[@]}" "benchmark/slurm/$stage.sbatch"); then
        before=
        if [[ -n $SUBMITTED ]]; then
          before=" Already submitted, and queued as they are:$SUBMITTED (scancel them, or let them run and submit"
          before+=" the rest once they end)."
        fi
        echo "benchmark/launch.sh: sbatch refused $stage (above).$before" >&2
        exit 1
      fi
      job=${job%%;*}
      SUBMITTED+=" $job"
      for i in "${indices[@]}"; do  # the record that tells a later call this task is in the queue
        index=$i kind=work
        if [[ $stage == preprocess ]]; then index=-; fi
        if [[ $key == push ]]; then kind=push; fi
        printf '%s\t%s\t%s\t%s\t%s\n' "$job" "$index" "$stage" "${OUT_OF[$stage $i]}" "$kind" >> "$LEDGER"
      done
      label=task${indices[1]+s}\ $tasks
      if [[ $stage == preprocess ]]; then label="one task"; fi
      if [[ $key == push ]]; then label+=", to push again"; fi
      echo "$stage: job $job, $label (logs: runs/slurm/tldr-${stage}_${job}*.out)"
    fi
    if [[ $key != push ]]; then
      for i in "${indices[@]}"; do WORK_JOB[$stage $i]=$job; done
    fi
    previous=afterany:$job
  done
  if ((dry_run)); then bash "benchmark/slurm/$stage.sbatch" --dry-run; fi
done
if ((!dry_run)) && [[ -z $SUBMITTED ]]; then
  echo "benchmark/launch.sh: every task of ${stages[*]} is complete or still in the queue; nothing was submitted"
fi
if ((!dry_run)); then  # what the sweep shows so far, at any time: Figure 1 from the judge folders, each stage's metrics
  echo "progress and results: squeue -u \$USER; python benchmark/sweep_report.py --out_root" \
    "$(printf '%q' "$(realpath -m "$OUT_ROOT")") (writes runs/sweep_report.md and .png)"
fi

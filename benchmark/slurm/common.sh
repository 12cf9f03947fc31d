# Array plumbing shared by the stage launchers in this folder (sourced; the knobs are in
# benchmark/knobs.sh). A launcher defines STAGE, TASKS ("sweep": one task per model x seed, or
# "single": one task), DONE (the file its script writes last, relative to $OUT; a `stage_done`
# function, if defined, decides instead whether that file marks a finished run), GPU ("yes" for
# the training stages: a node whose torch sees no CUDA GPU stops the task at once) and a function
# `stage_command MODEL SEED` that sets OUT (its output folder) and CMD (the command, an array).
# Then `run_stage "$@"`:
#
#   bash benchmark/slurm/<stage>.sbatch --dry-run   print every task's command; needs no SLURM
#   bash benchmark/slurm/<stage>.sbatch --pending   each task's index, state (work, push, done, stale) and folder
#   sbatch benchmark/slurm/<stage>.sbatch           SLURM runs task $SLURM_ARRAY_TASK_ID with srun (the header's
#                                                   array 0-11; another MODELS x SEEDS: --array=0-<tasks - 1>)
#   SLURM_ARRAY_TASK_ID=3 bash benchmark/slurm/<stage>.sbatch   run task 3 here, without SLURM
#
# Task i runs MODEL = MODELS[i / #SEEDS], SEED = SEEDS[i % #SEEDS] (the reference's indexing), so
# task i of every stage is the same (model, seed) and `--dependency=aftercorr` chains them.
# A task whose DONE file exists on inputs rebuilt since it ran, or made with flags other than its command's
# (stale_reasons), is `stale` and refuses to start.
# Requeue: a task whose DONE file exists exits at once (with PUSH=1 its script starts, trains nothing and pushes the
# finished run again, in case the push that ended it failed); otherwise its command carries --resume
# and --save_every, so a job requeued after a preemption, a node failure or its time limit continues
# from its latest checkpoint (SLURM itself requeues any stage after a preemption or a node failure; a stage whose
# script cannot resume sets RESUMES=no and is not requeued at its time limit). Before the limit a training run checkpoints and stops by itself
# (--stop_after_minutes: the job's time left less STOP_MARGIN_MINUTES) and the task requeues; the USR1
# trap below requeues it 10 minutes before the limit if the run has not stopped by then. A training
# attempt that saved no checkpoint past the one it started from is not requeued (it would redo the same
# work forever): the task ends at its limit and says to submit it again with a longer one.

source benchmark/knobs.sh

export TOKENIZERS_PARALLELISM=false

num_tasks() {  # how many array tasks the stage has
  if [[ $TASKS == single ]]; then echo 1; else echo $(( ${#MODEL_LIST[@]} * ${#SEED_LIST[@]} )); fi
}

task_command() {  # task_command I: MODEL, SEED, OUT and CMD of array task I
  MODEL=${MODEL_LIST[$(($1 / ${#SEED_LIST[@]}))]}
  SEED=${SEED_LIST[$(($1 % ${#SEED_LIST[@]}))]}
  stage_command "$MODEL" "$SEED"
}

print_command() {  # the command, shell-quoted, on one line
  local quoted
  quoted=$(printf '%q ' "$@")
  echo "${quoted% }"
}

requeue_self() {  # USR1 (sent by --signal=B:USR1@600 before the time limit), or a run stopped for it: requeue
  local job=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
  # A stage that starts over (RESUMES=no: preprocessing) would meet the same limit at every attempt: not again.
  if [[ ${RESUMES:-yes} == no ]]; then
    echo "$STAGE: not requeueing ${job:-$SLURM_JOB_ID}: its script cannot resume (each attempt starts over), so the" \
      "next would stop at the same time limit: submit it again with a longer one (SBATCH_TIMELIMIT, or sbatch --time)" >&2
    return 1
  fi
  # A training attempt that checkpointed nothing new (an update and its checkpoint, or the final evaluation, longer
  # than the time limit allows) would be requeued to redo the same work, forever: not again.
  if [[ $GPU == yes && -n ${STARTED_AT_UPDATE:-} ]] && (($(latest_update) <= STARTED_AT_UPDATE)); then
    echo "$STAGE: not requeueing ${job:-$SLURM_JOB_ID}: this attempt saved no checkpoint past update" \
      "$STARTED_AT_UPDATE, so the next would redo the same work (the time limit is too short for an update and its" \
      "checkpoint, or for the final evaluation): submit it again with a longer time limit (SBATCH_TIMELIMIT," \
      "or sbatch --time); it resumes from the latest checkpoint" >&2
    return 1
  fi
  echo "time limit near: requeueing ${job:-$SLURM_JOB_ID}; it resumes from the latest checkpoint"
  scontrol requeue "${job:-$SLURM_JOB_ID}"
}

latest_update() {  # the update of $OUT's latest complete checkpoint (trainer_state.json written last); 0 if none
  local path n best=0
  for path in "$OUT"/checkpoints/update_*; do
    n=${path##*/update_}
    if [[ $n =~ ^[0-9]+$ && -f $path/trainer_state.json ]] && ((10#$n > best)); then best=$((10#$n)); fi
  done
  echo "$best"
}

minutes_to_stop() {  # minutes a training run may take before it checkpoints and stops: the job's time left
  # (squeue's [days-]hours:minutes:seconds) less STOP_MARGIN_MINUTES; nothing for a job without a limit
  local left days=0 hours=0
  left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null) || return 0
  [[ $left =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]] || return 0  # UNLIMITED, NOT_SET
  days=${BASH_REMATCH[2]:-0}
  hours=${BASH_REMATCH[4]:-0}
  left=$(( ((10#$days * 24 + 10#$hours) * 60 + 10#${BASH_REMATCH[5]}) * 60 + 10#${BASH_REMATCH[6]} ))
  echo $(( left / 60 - STOP_MARGIN_MINUTES ))  # at most 0: no time to train (run_stage refuses)
}

task_done() {  # whether $OUT holds a finished run: the launcher's stage_done, else its DONE file
  if declare -F stage_done >/dev/null; then stage_done; else [[ -f $OUT/$DONE ]]; fi
}

stale_reasons() {  # prints why the finished run in $OUT no longer stands for this task (one reason a line); nothing
  # if it does. Two ways it may not, both silent otherwise:
  # - an input rebuilt or removed since it ran: each training stage records the sha256 of its inputs' args.json
  #   (input_args_json), and an upstream run trained again (say an SFT run deleted and redone after its downstream
  #   runs finished) would leave those runs "complete" on the old model;
  # - a flag of this task's command that its args.json records otherwise (DATA or a knob changed, or PREPROCESS_FLAGS,
  #   with OUT_ROOT kept), or another mixed precision (ACCELERATE_CONFIG): the run is another run than the sweep now
  #   asks for. As the scripts' own --resume, flags that change nothing it computes (where it logs and pushes,
  #   checkpoints, the fast paths) are not compared.
  [[ -f $OUT/args.json ]] || return 0  # none recorded: a Hub id, the judge
  python - "$OUT/args.json" "${CMD[@]}" <<'PY'
import hashlib, json, os, sys

try:
    saved = json.load(open(sys.argv[1]))
except (OSError, ValueError) as error:
    sys.exit(print(f"{sys.argv[1]}: unreadable ({error})") or 0)
for flag, recorded in (saved.get("input_args_json") or {}).items():
    path = saved.get(flag[2:])
    if recorded is None or not isinstance(path, str):  # a Hub id: nothing on disk to compare
        continue
    # As the stages' input_prints: a dataset's args.json sits beside its split folders, a model's inside its folder.
    folder = os.path.dirname(os.path.abspath(path)) if flag.endswith("_dataset") else path
    try:
        with open(os.path.join(folder, "args.json"), "rb") as file:
            now = hashlib.sha256(file.read()).hexdigest()[:16]
    except OSError:
        now = None
    if now != recorded:
        print(f"{flag} {path} " + ("is gone" if now is None else "was rebuilt") + " since this run used it")

# The scripts' RESUME_FLAGS and ppo.py's SPEED_ONLY_FLAGS, and preprocess_tldr.py's worker count.
FREE = {"resume", "stop_after_updates", "stop_after_minutes", "run_name", "save_every", "track", "wandb_project_name",
        "wandb_entity", "push_to_hub", "hf_entity", "fast_sampling", "compile_training", "num_proc"}
command = sys.argv[2:]
at = next((i for i, word in enumerate(command) if word.endswith(".py")), len(command))
launcher, words = command[:at], command[at + 1:]  # `accelerate launch ...`, and the script's flags
given, name = {}, None
for word in words:
    if word.startswith("--"):
        name, _, value = word[2:].replace("-", "_").partition("=")
        given[name] = [value] if value else []
    elif name is not None:
        given[name].append(word)


def same(was, now: list) -> bool:
    """Whether the recorded value `was` is what the words `now` give (as tyro reads them)."""
    if isinstance(was, bool) or not now:
        return was is (not now or now[0].lower() in ("true", "1", "yes"))
    if isinstance(was, list):
        return len(was) == len(now) and all(same(one, [word]) for one, word in zip(was, now))
    if was is None or now[0] == "None":  # tyro reads the word None as None
        return was is None and now[0] == "None"
    try:
        if isinstance(was, (int, float)):
            return was == type(was)(now[0])
    except ValueError:
        return False
    if isinstance(was, str) and was != now[0]:  # one folder by two names (./data/tldr, data/tldr) is the same
        return os.path.exists(was) and os.path.exists(now[0]) and os.path.samefile(was, now[0])
    return was == now[0]


for name, words in given.items():
    key = name[3:] if name.startswith("no_") and isinstance(saved.get(name[3:]), bool) else name
    if key in FREE or key not in saved:  # a flag added to the script after this run: nothing recorded
        continue
    if key != name:  # --no_<flag>
        words = ["false"]
    if not same(saved[key], words):
        print(f"--{key} was {saved[key]!r} in this run, the sweep now gives {' '.join(words) or 'the flag'}")

# The mixed precision the launch asks for (its --mixed_precision, else its --config_file's), as args.json records it.
asked = None
if "--mixed_precision" in launcher[:-1]:
    asked = launcher[launcher.index("--mixed_precision") + 1]
elif "--config_file" in launcher[:-1]:
    import yaml
    try:
        asked = (yaml.safe_load(open(launcher[launcher.index("--config_file") + 1])) or {}).get("mixed_precision", "no")
    except OSError:
        pass
if asked is not None and saved.get("mixed_precision", asked) != asked:
    print(f"it ran in mixed precision {saved['mixed_precision']!r}, the sweep's launch now asks for {asked!r}")
PY
}

pushes_again() {  # whether a finished run of this task starts anyway: a training stage's run pushed again (PUSH=1)
  [[ $GPU == yes && " ${CMD[*]} " == *" --push_to_hub "* ]]
}

cuda_problem() {  # prints why torch on this node cannot use a GPU; nothing when it can
  python -c 'import os, torch
if not torch.cuda.is_available():
    build = torch.version.cuda or "none, a CPU-only torch"
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    print(f"torch {torch.__version__} sees no CUDA GPU (CUDA build: {build}; CUDA_VISIBLE_DEVICES={devices})")'
}

run_stage() {  # run_stage [--dry-run | --pending]
  local n i
  n=$(num_tasks)
  if [[ ${1:-} == --pending ]]; then  # a line a task: index, state, output folder, tab-separated; the state is
    local state                       # work (left to do), push (complete; PUSH=1 starts it to push again), done,
                                      # or stale (complete, but not the run the task now asks for: stale_reasons)
    for ((i = 0; i < n; i++)); do
      task_command "$i"
      if ! task_done; then state=work; elif [[ -n $(stale_reasons) ]]; then state=stale
      elif pushes_again; then state=push; else state=done; fi
      printf '%s\t%s\t%s\n' "$i" "$state" "$OUT"
    done
    return 0
  fi
  if [[ ${1:-} == --dry-run ]]; then
    echo "# $STAGE: $n task(s) (array 0-$((n - 1)))"
    for ((i = 0; i < n; i++)); do
      task_command "$i"
      if [[ $TASKS == single ]]; then echo "# [$i] -> $OUT"; else echo "# [$i] $MODEL seed $SEED -> $OUT"; fi
      print_command "${CMD[@]}"
    done
    return 0
  fi
  if [[ -n ${1:-} ]]; then
    echo "usage: bash $0 --dry-run | bash $0 --pending | sbatch $0 | SLURM_ARRAY_TASK_ID=i bash $0" >&2
    return 2
  fi
  i=${SLURM_ARRAY_TASK_ID:-}
  if [[ -z $i && $TASKS == single ]]; then i=0; fi
  if [[ -z $i ]] || ((i >= n)); then
    echo "$STAGE: array task '${i}' is not in 0-$((n - 1)); set SLURM_ARRAY_TASK_ID or use --dry-run" >&2
    return 2
  fi
  # `sbatch <stage>.sbatch` takes the header's --array (0-11: 3 models x 4 seeds): a larger sweep would leave its
  # last tasks unsubmitted, silently. benchmark/launch.sh submits arrays of its own (SWEEP_ARRAY), subsets too.
  local header
  header=$(sed -n 's/^#SBATCH --array=//p' "$0" | head -n 1)
  if [[ -z ${SWEEP_ARRAY:-} && -n ${SLURM_ARRAY_TASK_MAX:-} && $header == "${SLURM_ARRAY_TASK_MIN:-}-$SLURM_ARRAY_TASK_MAX" ]] \
      && ((n > SLURM_ARRAY_TASK_MAX + 1)); then
    echo "$STAGE: the sweep has $n tasks (MODELS x SEEDS) and this array the header's $header: submit it with" \
      "benchmark/launch.sh, or sbatch --array=0-$((n - 1)) benchmark/slurm/$STAGE.sbatch. Nothing was started." >&2
    return 2
  fi
  task_command "$i"
  if task_done; then
    local rebuilt
    rebuilt=$(stale_reasons)
    if [[ -n $rebuilt ]]; then  # complete, but not the run this task asks for: neither skipped nor trained over
      echo "$STAGE [$i]: $OUT is complete, but not the run this task asks for: ${rebuilt//$'\n'/; }. Delete it to" \
        "run it again as asked (rm -r $(printf '%q' "$OUT")), with the runs built on it. Nothing was started." >&2
      return 1
    fi
    if ! pushes_again; then  # only the training stages push again
      echo "$STAGE [$i]: $OUT/$DONE says the run is complete, nothing to do"
      return 0
    fi
    # PUSH=1: the push at the end of its training may have failed. The script trains nothing and pushes it again.
    echo "$STAGE [$i]: $OUT/$DONE says the run is complete; it starts only to push it to the Hub again (PUSH=1)"
  fi
  if [[ $GPU == yes ]]; then
    # A training stage on a node whose torch is a CPU build (or sees no GPU) would otherwise train
    # on the CPU, silently, for weeks: stop before anything starts.
    local problem
    problem=$(cuda_problem 2>&1) || problem="python cannot check for CUDA: $problem"
    if [[ -n $problem ]]; then
      echo "$STAGE [$i] on $(hostname): $problem. This stage trains on GPUs (DeepSpeed, bf16): run it on a GPU" \
        "node whose python has a CUDA build of torch. Nothing was started." >&2
      return 1
    fi
  fi
  local minutes=
  if [[ -n ${SLURM_JOB_ID:-} && $GPU == yes ]]; then
    minutes=$(minutes_to_stop)
    # A training run checkpoints and stops before the job's time limit (--stop_after_minutes), and the task
    # requeues itself; the USR1 trap stays as the fallback (an update longer than the margin).
    if [[ -n $minutes ]] && ((minutes <= 0)); then
      # Each requeued job would load the models and stop at once (or be killed before its first checkpoint),
      # requeueing forever without progress: refuse instead.
      echo "$STAGE [$i]: the job has $((minutes + STOP_MARGIN_MINUTES)) minutes left, no more than" \
        "STOP_MARGIN_MINUTES ($STOP_MARGIN_MINUTES), the time a run keeps in hand before its limit: ask for a" \
        "longer time limit (SBATCH_TIMELIMIT=6:00:00, or sbatch --time) or set STOP_MARGIN_MINUTES lower." \
        "Nothing was started." >&2
      return 1
    fi
    if [[ -n $minutes ]]; then CMD+=(--stop_after_minutes "$minutes"); fi
  fi
  echo "$STAGE [$i] on $(hostname) at $(date -u +%FT%TZ): $(print_command "${CMD[@]}")"
  STARTED_AT_UPDATE=$(latest_update)  # requeue_self compares: did this attempt get any further?
  if [[ -n ${SLURM_JOB_ID:-} ]]; then
    trap 'requeue_self || true' USR1  # under set -e a declined requeue would end the job, and kill srun, at once
    srun "${CMD[@]}" &
    local pid=$! rc
    while true; do  # a trapped USR1 interrupts `wait`; the requeue then ends the job
      wait "$pid" && rc=0 || rc=$?
      kill -0 "$pid" 2>/dev/null || break
    done
    if [[ $rc -eq 0 && -n $minutes ]] && ! task_done; then  # stopped at --stop_after_minutes: the next job continues
      requeue_self
    fi
    return "$rc"
  else
    "${CMD[@]}"
  fi
}

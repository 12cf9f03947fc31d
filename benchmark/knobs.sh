# The paper's sweep: the one table of per-scale knobs, sourced by every launcher in benchmark/slurm/.
#
# Only scale knobs live here (model, per-rank batch sizes, offload, seeds, paths): every algorithm
# setting is the scripts' default, which is the paper's. The global batch is never set here: each
# script's --batch_size default is the paper's (SFT 128, RM 64, DPO 64, PPO 512) and the scripts
# derive gradient accumulation = batch_size / (local_micro_batch_size x 8 GPUs), e.g. 512 / (16 x 8)
# = 4 for PPO at 1B. tests/test_launchers.py checks both for every size.
#
# Source: the reference launchers (vwxyzjn/summarize_from_feedback_details, sbatches/*.sbatch at
# ee77a9a), which ran every size on one node of 8xH100 80GB:
#   - PPO: local_rollout_forward_batch_size 64 / 32 / 4 and local_micro_batch_size 16 / 4 / 1
#     (x gradient_accumulation_steps 4 / 16 / 64 = 64 per rank); 6.9B offloads the frozen reference
#     policy and reward model (DeepSpeed ZeRO-3, parameters on the CPU; ppo.py --offload).
#   - RM and DPO: local_eval_batch_size 8 / 1 / 1; micro-batch 1 (x 8 accumulation steps = 64).
#   - SFT: micro-batch 1 (x 16 accumulation steps = 128), eval batch 4 at every size.
#   - PPO's in-training eval batch was the script default, 2, at every size.
# Sizes the reference never measured otherwise are kept at its values: they are known to fit.
#
# Usage (from the repository root):  source benchmark/knobs.sh; knobs EleutherAI/pythia-2.8b-deduped
# sets SFT_MICRO SFT_EVAL RM_MICRO DPO_MICRO PREF_EVAL PPO_MICRO PPO_ROLLOUT PPO_EVAL PPO_OFFLOAD.

# model                            SFT_MICRO SFT_EVAL RM_MICRO DPO_MICRO PREF_EVAL PPO_MICRO PPO_ROLLOUT PPO_EVAL PPO_OFFLOAD
KNOBS_TABLE="
EleutherAI/pythia-1b-deduped       1         4        1        1         8         16        64          2        0
EleutherAI/pythia-2.8b-deduped     1         4        1        1         1         4         32          2        0
EleutherAI/pythia-6.9b-deduped     1         4        1        1         1         1         4           2        1
"

# The sweep: every model of the table x the paper's four seeds (SLURM array index i runs
# MODEL = MODELS[i / #SEEDS], SEED = SEEDS[i % #SEEDS], as the reference). Override with
# space-separated lists, e.g. MODELS="EleutherAI/pythia-1b-deduped" SEEDS="44413".
export MODELS=${MODELS:-EleutherAI/pythia-1b-deduped EleutherAI/pythia-2.8b-deduped EleutherAI/pythia-6.9b-deduped}
export SEEDS=${SEEDS:-44413 55513 66613 77713}
read -r -a MODEL_LIST <<< "$MODELS"
read -r -a SEED_LIST <<< "$SEEDS"

# Deterministic folders: each stage finds the previous one's artifact here. (Every knob is exported:
# the SLURM jobs inherit the submitting shell's environment, so they see the same values.)
export DATA=${DATA:-data/tldr}                 # preprocess_tldr.py: $DATA/sft, $DATA/preference
export OUT_ROOT=${OUT_ROOT:-models}            # $OUT_ROOT/<model>/{sft,reward,dpo,ppo,judge}_<seed>
export TOKENIZER_MODEL=${TOKENIZER_MODEL:-EleutherAI/pythia-1b-deduped}  # all Pythia sizes share one tokenizer

# Checkpoint every N updates, so a requeued job (--requeue; --resume) loses at most N updates.
# Updates per run with the paper's data: SFT 911, RM 1450, DPO 1450, PPO 1953.
export SAVE_EVERY_SFT=${SAVE_EVERY_SFT:-100}
export SAVE_EVERY_RM=${SAVE_EVERY_RM:-100}
export SAVE_EVERY_DPO=${SAVE_EVERY_DPO:-100}
export SAVE_EVERY_PPO=${SAVE_EVERY_PPO:-50}
# A training run checkpoints and stops this many minutes before its job's time limit (--stop_after_minutes),
# then the task requeues itself, so a time limit costs no updates: room for the last update and the checkpoint.
# The time limit must also hold a stage's final evaluation (it runs after the last update, unchecked): a job
# requeued during it resumes from the last update's checkpoint and evaluates again, and an attempt that gets no
# further than the checkpoint it started from is not requeued again (benchmark/slurm/common.sh).
export STOP_MARGIN_MINUTES=${STOP_MARGIN_MINUTES:-20}

# GPUs of the one node each training run takes (the paper's 8). Another count keeps every global batch: the
# scripts accumulate more (4 GPUs: PPO at 1B steps 16 x 8 micro-batches a rank); launch.sh refuses, before
# submitting, a count that does not divide it, and asks SLURM for that many (sbatch --gpus-per-task); several nodes
# are not supported here.
export GPUS_PER_NODE=${GPUS_PER_NODE:-8}

# Detail 8: Tech stack
# The accelerate config of every training launch: DeepSpeed ZeRO-2, bf16, 8 processes on one node
# (the paper's stack); 6.9B PPO adds ppo.py --offload (the table's PPO_OFFLOAD column).
export ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-benchmark/accelerate/deepspeed_zero2.yaml}

# More flags for preprocess_tldr.py (every length and filter is otherwise its default, the paper's). It has never
# run on the Hub's data here, and it fails, saying which flag to pass, on source rows it cannot use (a TL;DR summary
# without its leading space, an empty post, an SFT post id in two splits: PREPROCESS_FLAGS=--drop_bad_rows leaves
# them out, listed in $DATA/dropped_rows.json) or on a computed maximum length that differs from its flag (the
# paper's were computed under transformers 4.33, whose decode cleaned up spaces before re-tokenizing: e.g.
# PREPROCESS_FLAGS="--max_sft_query_response_length 563"). Empty by default: each is a choice to make knowingly.
export PREPROCESS_FLAGS=${PREPROCESS_FLAGS:-}

# PPO's sampler: ppo.py --fast_sampling (a static KV cache and a compiled one-token step; the same
# tokens as HF generate in fp32, 98-99% of them in bf16). On one H100 at 1B it took a PPO update
# from 5.82 to 5.08 s (generation 1.22 -> 0.51 s; 5.26 -> 4.80 s on one H200) for ~30 s of compiling per process
# (benchmark/results/gpu_check.md): 1953 updates repay that many times over. Measured at 1B only.
# FAST_SAMPLING=0 samples with the plain loop (sample_rollout: HF generate's draws, token for token).
export FAST_SAMPLING=${FAST_SAMPLING:-1}

# PPO's training forward and backward with each transformer layer compiled (ppo.py --compile_training).
# On one H200 at 1B, inside ppo.py: the training phase 3.71 s against 3.96 s eager (0.936x), the update
# 4.58 s with --fast_sampling, for ~13 s of compiling per process; as close to fp32 as the eager pass
# (benchmark/results/gpu_check.md, 2026-11-30). Measured at 1B only. COMPILE_TRAINING=0 trains eagerly.
export COMPILE_TRAINING=${COMPILE_TRAINING:-1}

# The LLM judge (judge.sbatch): a model of OpenAI's (OPENAI_API_KEY) or of another OpenAI-compatible server
# (OPENAI_BASE_URL). None is a default: the paper's, gpt-3.5-turbo-0125, was shut down by OpenAI on 2026-10-23,
# and any other judge's win rates are on its own scale. launch.sh refuses to submit the judge without one.
export JUDGE_MODEL=${JUDGE_MODEL:-}
# Judge tasks running at once. Every task keeps judge.py's 8 calls in flight on the same key, whose rate limit
# they share: all 12 at once would be 96 calls (the reference kept 11), and rows that run out of retries fail.
# ARRAY_THROTTLE (the GPU stages') does not apply to the judge.
export JUDGE_ARRAY_THROTTLE=${JUDGE_ARRAY_THROTTLE:-1}

# Tracking: the paper's runs log to W&B (TRACK=0 turns it off); PUSH=1 also pushes each model.
export TRACK=${TRACK:-1}
export PUSH=${PUSH:-0}

knobs() {  # knobs MODEL: set the table's knobs for MODEL, fail on a model the table lacks
  local row
  row=$(awk -v model="$1" '$1 == model' <<< "$KNOBS_TABLE")
  if [[ -z $row ]]; then
    echo "benchmark/knobs.sh: no knobs for model '$1' (known: $(awk 'NF {printf "%s ", $1}' <<< "$KNOBS_TABLE"))" >&2
    return 1
  fi
  read -r _ SFT_MICRO SFT_EVAL RM_MICRO DPO_MICRO PREF_EVAL PPO_MICRO PPO_ROLLOUT PPO_EVAL PPO_OFFLOAD <<< "$row"
}

tracking_flags() {  # the --track / --push_to_hub flags TRACK and PUSH ask for
  if [[ $TRACK == 1 ]]; then printf '%s\n' --track; fi
  if [[ $PUSH == 1 ]]; then printf '%s\n' --push_to_hub; fi
}

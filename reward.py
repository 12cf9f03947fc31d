"""Reward model (RM) training on TL;DR human preferences, normalisation and evaluation (Details 3, 6-8, 10-18).

Stage 2 of the pipeline. Starts from the SFT model of sft.py, puts a scalar head on its last hidden state, and
trains it with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) on the preference dataset written by
preprocess_tldr.py; the reward of a sequence is the head's output at its EOS token. After training, every SFT
reference summary is scored and the mean is folded into the head's bias, so the saved RM gives reference summaries a
mean reward of 0; then the RM is evaluated on `validation` (TL;DR) and `validation_cnndm` (news, never trained on).

    {output_dir}/                     ScalarModel (safetensors) + tokenizer; loads anywhere with
                                      `from reward import ScalarModel; ScalarModel.from_pretrained(path)`
    {output_dir}/args.json            these flags, derived sizes, run name, eos / pad ids, tokenizer_identity, input_args_json, launch, git commit
    {output_dir}/eval_{split}.csv     one row per pair: texts, batch, split, confidence, policies,
                                      chosen/rejected reward, accuracy (+ gold_prefers_chosen)
    {output_dir}/accuracy_{split}.md  accuracy overall and by split / batch / confidence
    {output_dir}/calibration.png      accuracy vs |reward margin| beside the ideal sigmoid
    {output_dir}/token_rewards.png    per-token reward logits of a few validation sequences
    {output_dir}/normalization.json   reference rewards before normalisation (mean/std/min/max)
                                      and the left- vs right-padding difference
    {output_dir}/eval_metrics.json    every eval/rm/* scalar below
    {output_dir}/checkpoints/         the latest --save_every checkpoint (no pickle; DeepSpeed's own files read weights-only), removed at the end
    runs/{run_name}/                  TensorBoard

    # tiny world, offline, 2 CPU cores, 3.5-7 min by CPU and hour, up to 10.5 (as benchmark/tiny.sh, after sft.py): accuracy 0.701-0.705, CNN/DM 0.555
    python reward.py --sft_model_path models/tiny/sft_1 --label_dataset data/tiny_tldr/preference \
        --query_dataset data/tiny_tldr/sft --output_dir models/tiny/reward_1 --seed 1 --lr 3e-4 \
        --batch_size 32 --local_micro_batch_size 32 --length_groups 4 --num_train_epochs 3 \
        --local_eval_batch_size 64 --gold_judge assets/tiny_world
    # one GPU, Pythia 1B, bf16 autocast (global batch 64 = 8 x 8 accumulation steps): reads
    # models/EleutherAI/pythia-1b-deduped/sft_1 and data/EleutherAI/pythia-1b-deduped/tldr, writes .../reward_1
    accelerate launch --num_processes 1 --mixed_precision bf16 reward.py \
        --base_model EleutherAI/pythia-1b-deduped --local_micro_batch_size 8 --save_every 100
    # the paper's run: 8xH100, DeepSpeed ZeRO-2, bf16 (global batch 64 = 1 x 8 x 8 processes, the reference's; knobs.sh)
    accelerate launch --config_file benchmark/accelerate/deepspeed_zero2.yaml reward.py \
        --base_model EleutherAI/pythia-1b-deduped --seed 44413 --local_micro_batch_size 1 --track --save_every 100

Details: 3 a distinct [PAD]; 6 accuracy per split (validation is out of distribution); 7 dropout off; 8 the
tech stack; 10 the paper's RM recipe; 11 the head's initialisation; 12 the reward at the EOS token; 13 per-token
reward logits are not rewards; 14 left- vs right-padded scoring agree; 15 normalisation by the reference
summaries' mean reward; 16 accuracy by batch / confidence; 17 agreement with a judge (--judged_file); 18 calibration.
Logged (TensorBoard, and W&B with --track; x-axis = training pairs seen; vs the reference's runs: docs/details.md):
  train/rm/loss                      mean Bradley-Terry loss of the update's pairs, all ranks
  train/rm/accuracy                  fraction of the update's pairs with r_chosen > r_rejected
  train/rm/chosen_rewards|rejected_rewards  mean reward of the chosen / rejected summaries
  train/rm/lr                        learning rate used by the update
  eval/rm/normalized_mean|std|min|max          reference rewards before the bias (Detail 15)
  eval/rm/normalized_right_left_diff_mean|gt_1e-2  right- minus left-padded reward (Detail 14)
  eval/rm/{split}/accuracy           fraction of pairs ranked as the labeler did
  eval/rm/{split}/accuracy/{split|batch|confidence}/{value}  the same per group (Detail 16)
  eval/rm/{split}/gold_accuracy      agreement with the tiny world's gold judge (--gold_judge)
  eval/rm/judge_agreement            agreement with a judge's verdicts (--judged_file, Detail 17)
"""

import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import datasets
import numpy as np
import pandas as pd
import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, gather_object
from huggingface_hub.utils import HFValidationError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, GPTNeoXModel, PretrainedConfig,
                          PreTrainedModel, get_scheduler)


@dataclass
class Args:
    """Reward model training on TL;DR preferences (see the module docstring of reward.py)."""

    # experiment & tracking
    exp_name: str = "reward"
    """Experiment name: part of the run name and of the Hub repo id"""
    seed: int = 1
    """Seed of the data order and the head's initialisation (paper: 44413 55513 66613 77713)"""
    run_name: Optional[str] = None
    """Run name for runs/ and W&B (None: {exp_name}__{base model}__{seed}__{unix time}; a resumed run keeps its own)"""
    track: bool = False
    """Also log to Weights & Biases (off: nothing networked)"""
    wandb_project_name: str = "tldr_summarize"
    """W&B project (with --track)"""
    wandb_entity: Optional[str] = None
    """W&B entity (with --track; None: the default of the logged-in user)"""
    output_dir: Optional[str] = None
    """Folder for the trained reward model, tokenizer, args.json, eval tables, plots and checkpoints (None: models/{base_model}/reward_{seed})"""
    push_to_hub: bool = False
    """Push the output folder to {hf_entity}/{base model name}__{exp_name}__tldr at revision run_name (with --resume, a finished run is pushed again)"""
    hf_entity: Optional[str] = None
    """Hub user or organisation to push to (None: the logged-in user, from `whoami()`)"""
    save_every: int = 0
    """Save a checkpoint (model, optimizer, scheduler, RNG states, update) every N updates (0: never)"""
    resume: bool = False
    """Continue from the latest checkpoint in {output_dir}/checkpoints (none there: start at update 0); required when there is one"""
    stop_after_updates: Optional[int] = None
    """Checkpoint and exit after this many updates, as a time-limited SLURM job would; rerun with --resume"""
    stop_after_minutes: Optional[float] = None
    """Checkpoint and exit at the first update ending this many minutes in (a job's time limit); rerun with --resume"""

    # data
    label_dataset: Optional[str] = None
    """Preference dataset: a preprocess_tldr.py folder or a Hub id, e.g. the reference's vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144, some of whose rows were tokenized from a cleaned-up query (a warning counts them; docs/details.md) (None: data/{base_model}/tldr/preference)"""
    query_dataset: Optional[str] = None
    """SFT dataset whose train references set the normalisation (Detail 15) (None: data/{base_model}/tldr/sft)"""
    total_episodes: Optional[int] = None
    """Training pairs to draw (None: the train split x num_train_epochs; 0: evaluate the initial RM)"""
    num_train_epochs: int = 1
    """Passes over the train split when total_episodes is None (Detail 10; paper: 1)"""
    num_eval_samples: Optional[int] = None
    """Evaluate on the first N pairs of each eval split; also the N references the head's bias is normalised on (Detail 15), so N changes the saved RM (None: all)"""
    judged_file: Optional[str] = None
    """judge.py's judged/<run>.csv (post, ours, other, preferred): RM agreement with the judge's verdicts (Detail 17)"""
    gold_judge: Optional[str] = None
    """Tiny world folder (e.g. assets/tiny_world): also score pairs with tiny_world.gold_score beside its noise ceiling"""

    # model
    base_model: Optional[str] = None
    """Base model the SFT model was fine-tuned from, as given to sft.py: names the default paths (None: the one the SFT model's args.json records, else EleutherAI/pythia-1b-deduped)"""
    sft_model_path: Optional[str] = None
    """SFT model (sft.py's output folder or a Hub id): the RM's backbone and tokenizer (Detail 10; None: models/{base_model}/sft_{seed})"""

    # optimization
    lr: float = 3e-6
    """AdamW learning rate (Detail 10; paper: 3e-6)"""
    eps: float = 1e-5
    """AdamW epsilon (Detail 10; paper: 1e-5)"""
    weight_decay: float = 0.01
    """AdamW weight decay (torch's default, which the reference code uses without saying so)"""
    scheduler: str = "cosine"
    """Learning-rate schedule, a transformers.get_scheduler name (Detail 10; paper: cosine to 0)"""
    batch_size: int = 64
    """Global pairs per update = local_micro_batch_size x gradient_accumulation_steps x world_size (Detail 10; paper: 64)"""
    local_micro_batch_size: int = 1
    """Pairs per forward pass per rank (a pair: its chosen and its rejected summary)"""
    length_groups: int = 1
    """Speed only: a micro-batch's pairs sorted by length into this many forwards, each as wide as its longest pair (1: one forward)"""
    local_eval_batch_size: int = 4
    """Pairs (or references) per eval forward pass per rank"""

    # derived (computed right after parsing; not flags)
    world_size: tyro.conf.Suppress[int] = 1
    """Processes (ranks) started by accelerate launch"""
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 1
    """Micro-batches per update per rank = batch_size / (local_micro_batch_size x world_size)"""
    local_batch_size: tyro.conf.Suppress[int] = 1
    """Pairs per update per rank = local_micro_batch_size x gradient_accumulation_steps"""
    micro_batch_size: tyro.conf.Suppress[int] = 1
    """Pairs per forward pass over all ranks = local_micro_batch_size x world_size"""
    num_updates: tyro.conf.Suppress[int] = 0
    """Optimizer updates = total_episodes // batch_size (paper: 92,858 // 64 = 1450)"""


# preprocess_tldr.py's PREFERENCE_DESCRIPTIONS / SFT_DESCRIPTIONS say what these columns hold.
# Training reads a pair's query and summaries apart (pair_rewards), evaluation its two whole rows.
TRAIN_PAIR_COLUMNS = ("query_token", "chosen_token", "rejected_token")
PAIR_COLUMNS = ("query_chosen_token", "query_rejected_token")
REFERENCE_COLUMNS = ("query_token", "reference_response_token", "query_reference_response_token")
EVAL_SPLITS = ("validation", "validation_cnndm")


class ScalarModelConfig(PretrainedConfig):
    """Config of ScalarModel: the backbone's config as a plain dict (no path: it loads anywhere)."""

    model_type = "scalar_model"

    def __init__(self, base_config: Optional[dict] = None, **kwargs):
        super().__init__(**kwargs)
        self.base_config = base_config or {}


class ScalarModel(PreTrainedModel):
    """A transformer backbone + Linear(hidden, 1): (B, T) ids -> (B, T) per-token reward logits."""

    config_class = ScalarModelConfig

    def __init__(self, config: ScalarModelConfig):
        super().__init__(config)
        # Built from the stored config (never a path: it loads anywhere), in the loader's dtype, not the stored one.
        self.backbone = AutoModel.from_config(AutoConfig.for_model(**config.base_config), dtype=torch.get_default_dtype())
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)  # its bias carries Detail 15
        self.post_init()

    def _init_weights(self, module):
        """Only the head is new: N(0, 1/sqrt(d_model + 1)) weight, zero bias; the backbone is loaded."""
        if module is self.head:
            init_reward_head(module)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, T) ids, (B, T) padding mask -> (B, T) scalar per position (the last hidden state through the head).
        With `positions` ((B, k) columns): (B, k), the outputs there only (hidden_states_at); the mask may then also
        be (B, 1, T, T) boolean, the keys each position reads (give position_ids too)."""
        if positions is not None:  # here in forward, where DDP and DeepSpeed see the call
            return self.head(hidden_states_at(self.backbone, input_ids, attention_mask, position_ids, positions)).squeeze(-1)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state  # (B, T, d)
        return self.head(hidden).squeeze(-1)


def init_reward_head(head: torch.nn.Linear) -> None:
    """Initialise a Linear(d_model, 1) reward head in place: weight ~ N(0, 1/sqrt(d_model + 1)), bias 0."""
    # Detail 11: Reward head initialisation
    # OpenAI's summarize-from-feedback init (the paper's footnote: the std is 1/sqrt(d+1), not
    # 1/(d+1)). With unit-scale hidden states after the final layer norm, initial rewards have a
    # std near 1, so the first sigmoid(r_c - r_r) are neither saturated nor all 0.5.
    torch.nn.init.normal_(head.weight, std=1 / math.sqrt(head.in_features + 1))
    torch.nn.init.zeros_(head.bias)


def reward_model_from_sft(sft_model_path: str) -> ScalarModel:
    """A new RM: the SFT model's backbone (no LM head), dropout off, and a fresh head (init_reward_head)."""
    # The backbone's config is stored as a dict, minus the local path it was loaded from, so the
    # saved RM never refers back to the SFT folder.
    sft_backbone = load_fp32(AutoModelForCausalLM, sft_model_path, "--sft_model_path").base_model
    # Detail 7: Disable dropout
    # With dropout on, two forwards of the same ids give different rewards (the tiny model's is 0.1).
    disable_dropout(sft_backbone)
    base_config = {key: value for key, value in sft_backbone.config.to_dict().items() if key != "_name_or_path"}
    model = ScalarModel(ScalarModelConfig(base_config=base_config))
    model.backbone.load_state_dict(sft_backbone.state_dict())
    disable_dropout(model)
    return model


def check_tokenizer(tokenizer, data_ids: Optional[dict], data_source: str) -> bool:
    """Refuse pad == EOS, make [PAD] the pad (add_pad_token), refuse ids other than `data_ids`; True if it changed."""
    # Detail 3: Leading space, EOS at the end, a distinct [PAD]
    # The SFT model's tokenizer has (or gets) the [PAD] that preprocess_tldr.py added: the ids agree. A pad
    # that IS the EOS is refused: it marks a model trained by a recipe whose masks `ids != pad` hid the
    # EOS too, so that the model never learned to stop.
    if tokenizer.pad_token is not None and tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise SetupError(f"the tokenizer's pad token {tokenizer.pad_token!r} is its EOS token: a model trained "
                         "with EOS as its pad never learned to stop; use one whose tokenizer pads otherwise")
    added = add_pad_token(tokenizer)
    ours = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if data_ids is not None and data_ids != ours:
        raise SetupError(f"{data_source} was tokenized with {data_ids}, this tokenizer has {ours}: "
                         "preprocess the data with the same base model")
    return added


def reward_indices(query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> torch.Tensor:
    """(B, T) ids -> (B,): the EOS position = first pad at or after `context_length`, minus 1 (T - 1 if none)."""
    # Detail 12: Extract the reward at the EOS token
    # Only the EOS position has read the whole summary, so only its output is trained (and used as
    # the reward). Right-padded query+response rows: context 0, the first pad ends the sequence.
    # Left-padded query ++ right-padded response (PPO's layout): the query's own pads come first,
    # so the search starts at the response (context = query width). No pad: the last position.
    return first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length


def get_reward(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> tuple:
    """(B, T) ids with pads -> ((B, T) per-token reward logits, (B,) reward at each row's EOS)."""
    attention_mask = query_responses != pad_token_id  # (B, T)
    # Pads are masked out of attention and replaced by a valid id; no position_ids are passed (the
    # reference's convention): with left padding, positions shift by the pad count, which rotary
    # embeddings (relative positions) do not see. Detail 14 measures what is left of it.
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    reward_logits = model(input_ids=input_ids, attention_mask=attention_mask)  # (B, T)
    eos = reward_indices(query_responses, pad_token_id, context_length)  # (B,)
    return reward_logits, reward_logits[torch.arange(reward_logits.size(0), device=eos.device), eos]


def rm_update(accelerator, model, optimizer, micro_batches: list, pad_token_id: int, length_groups: int) -> dict:
    """All ranks: one update of the Bradley-Terry loss over `micro_batches` (train rows) -> {name: (GAS,) stats}."""
    stats = []
    for batch in micro_batches:
        queries, chosen, rejected = (batch[column].to(accelerator.device) for column in TRAIN_PAIR_COLUMNS)  # as stored
        with accelerator.accumulate(model):
            # (micro,) each: the rewards of the right-padded rows query+chosen and query+rejected (one row a pair)
            chosen_rewards, rejected_rewards = pair_rewards_by_length(model, queries, chosen, rejected, pad_token_id,
                                                                      length_groups)
            # Bradley-Terry: P(chosen preferred) = sigmoid(r_c - r_r); maximise its log-likelihood.
            loss = -torch.nn.functional.logsigmoid(chosen_rewards.float() - rejected_rewards.float()).mean()  # fp32
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        stats.append({"loss": loss.detach().float(), "accuracy": (chosen_rewards > rejected_rewards).float().mean(),
                      "chosen_rewards": chosen_rewards.detach().float().mean(),
                      "rejected_rewards": rejected_rewards.detach().float().mean()})
    return {name: torch.stack([step[name] for step in stats]) for name in stats[0]}


def normalise_rewards(accelerator, model, references, pad_token_id: int, local_eval_batch_size: int) -> tuple:
    """All ranks: the references' mean reward taken off the head's bias, in the module and in the fp32 state dict
    returned, with the statistics of the references' rewards before."""
    scores = score_dataset(accelerator, model, references, {
        "right": ("query_reference_response_token",),  # right-padded query+reference, as in training
        "left": ("query_token", "reference_response_token"),  # left-padded query ++ reference, as in PPO
    }, pad_token_id, local_eval_batch_size)
    # Detail 14: Left- vs right-padded reward extraction
    # PPO scores left-padded queries followed by its samples; the RM was trained on right-padded
    # rows. Same tokens, other positions and pads: the two rewards should agree to ~1e-6 in fp32.
    # Right minus left, the reference's sign: its bf16 6.9B RM gave -5.4e-4 (the paper); it flags 1e-2.
    right_left_diff = scores["right"] - scores["left"]
    # Detail 15: Reward normalisation from SFT reference summaries
    # Stiennon et al.: "normalize the reward model outputs such that the reference summaries from
    # our dataset achieve a mean score of 0". Only the mean, folded into the head's bias: the saved
    # weights (and the PPO critic initialised from them, Detail 22) output normalised rewards.
    reference_mean = float(scores["right"].mean())
    state_dict = shift_head_bias(accelerator, model, -reference_mean)  # what is saved, and what is evaluated
    normalization = {"mean": reference_mean, "std": float(scores["right"].std()), "min": float(scores["right"].min()),
                     "max": float(scores["right"].max()), "references": len(references),
                     "right_left_diff_mean": float(right_left_diff.mean()),
                     "right_left_diff_gt_1e-2": float((np.abs(right_left_diff) > 1e-2).mean())}
    accelerator.print(f"normalisation over {len(references)} SFT references: " + ", ".join(
        f"{key} {value:.4g}" for key, value in normalization.items()) + f"; head bias -= {reference_mean:.4f}")
    return state_dict, normalization


def rm_agreement(preferred: list[str], ours_scores: list, other_scores: list) -> tuple[Optional[float], int]:
    """Fraction of decided judgments ("ours" or the other side) where score ordering agrees; and their count."""
    # Detail 17: Agreement with an LLM judge
    # The RM "prefers ours" iff score > other score (strict, as the reference's eval/analyze_rm.py:
    # an RM tie agrees with nobody). Malformed verdicts, gold ties and rows without scores do not count.
    agree = [s > o if p == "ours" else s < o for p, s, o in zip(preferred, ours_scores, other_scores)
             if p not in ("malformed", "tie", "unjudged") and s is not None and o is not None]
    return (sum(agree) / len(agree) if agree else None), len(agree)


def main() -> None:
    """The stage, top to bottom (run at the end of the file, once the plumbing below the fence is defined)."""
    # ---- args & sizes ----
    args = tyro.cli(Args, use_underscores=True)  # --help shows --flag_name as the docs write it; --flag-name works too
    accelerator = start_accelerator(args, reward_flag_problems, "reward.py")  # every flag is checked first
    # Detail 8: Tech stack
    # `accelerate launch` decides the backend: one CPU process, DDP, or DeepSpeed ZeRO-2 with bf16.
    # The script names the accumulation (over any number in the accelerate config) and the micro-batch
    # (DeepSpeed reads no DataLoader here), and turns off clipping (accelerate fills in 1.0; the reference code does not clip).
    accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps
    if accelerator.state.deepspeed_plugin is not None:
        accelerator.state.deepspeed_plugin.deepspeed_config.update(
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            train_micro_batch_size_per_gpu=args.local_micro_batch_size, gradient_clipping=0.0)

    # ---- data and tokenizer: every bad input fails here, before a model is loaded or anything is written ----
    preference, sft, judged, tokenizer, recorded = rm_inputs(args, accelerator)  # also sets args.num_updates
    pad_id = tokenizer.pad_token_id
    train = preference["train"].with_format("torch", columns=list(TRAIN_PAIR_COLUMNS))
    resume_from = checkpoint_to_resume(args, accelerator)  # with --resume: the latest checkpoint, if it fits

    # ---- seeding & data order ----
    local_seed = args.seed + accelerator.process_index * 100003
    random.seed(local_seed)
    np.random.seed(local_seed)
    torch.manual_seed(args.seed)  # the head's initialisation: the same on every rank
    torch.backends.cudnn.deterministic = True
    # One permutation per pass, seeded alike on every rank (the reference shuffles with a per-rank
    # seed, so its ranks read overlapping subsets): ranks read disjoint pairs, each pair once per pass.
    local_order = local_episode_order(len(train), args.num_updates, args.gradient_accumulation_steps, args.world_size,
                                      args.local_micro_batch_size, args.seed, accelerator.process_index)

    # ---- model, run name & logging ----
    model = reward_model_from_sft(args.sft_model_path).train()
    refuse(vocabulary_problem(tokenizer, model.backbone.get_input_embeddings().weight.size(0),
                              f"--sft_model_path {args.sft_model_path}"))
    run_name, writer = start_logging(args, accelerator, resume_from, recorded, "pairs")

    # ---- optimizer & schedule ----
    # Detail 10: RM setup
    # The paper's recipe: initialised from the SFT model, AdamW (eps 1e-5; torch's weight decay 0.01, as the reference),
    # lr 3e-6 with a cosine decay to 0 over one epoch in updates of 64 pairs (1450 updates).
    optimizer = adamw(model.parameters(), args, accelerator.device)  # fused on a GPU (below the fence)
    scheduler = get_scheduler(args.scheduler, optimizer, num_warmup_steps=0, num_training_steps=args.num_updates)
    # The scheduler stays unprepared (stepped once per update by us); save_checkpoint stores its state.
    model, optimizer = accelerator.prepare(model, optimizer)
    problem = rotary_problem({"model": model})
    refuse(problem and f"rotary frequencies below fp32 after accelerator.prepare: {problem}")
    start_update = resume(accelerator, args, resume_from, model, optimizer, scheduler)

    # ---- training loop ----
    stop_at = args.num_updates if args.stop_after_updates is None else min(args.stop_after_updates, args.num_updates)
    progress = tqdm(range(start_update, stop_at), desc="reward", disable=not accelerator.is_main_process)
    for update in progress:
        micro_batches = [train[indices] for indices in local_order[update].tolist()]
        stats = rm_update(accelerator, model, optimizer, micro_batches, pad_id, args.length_groups)  # {name: (GAS,)}
        lr = scheduler.get_last_lr()[0]  # the rate this update used
        scheduler.step()
        means = accelerator.reduce({name: values.mean() for name, values in stats.items()}, reduction="mean")
        logged = {**{name: value.item() for name, value in means.items()}, "lr": lr}
        if accelerator.is_main_process:
            for key, value in logged.items():
                writer.add_scalar(f"train/rm/{key}", value, (update + 1) * args.batch_size)  # x: pairs seen
            progress.set_postfix(loss=f"{logged['loss']:.4f}", accuracy=f"{logged['accuracy']:.3f}", lr=f"{lr:.2e}")
        # A nan / inf stops every rank here, before this update is saved; then the --save_every checkpoint.
        if check_and_checkpoint(accelerator, args, update + 1, stats["loss"], run_name, model, optimizer, scheduler):
            stop_at = update + 1  # --stop_after_minutes have passed: checkpointed, stop here
            break
    if stop_at < args.num_updates:  # a time-limited job: the checkpoint is written, continue with --resume
        return stop_early(accelerator, writer, max(stop_at, start_update), args.num_updates)
    staging = staging_folder(args.output_dir) if accelerator.is_main_process else None  # swapped in once complete

    # ---- normalisation ----
    references = first_rows(sft["train"], args.num_eval_samples).with_format("torch", columns=list(REFERENCE_COLUMNS))
    state_dict, normalization = normalise_rewards(accelerator, model, references, pad_id, args.local_eval_batch_size)
    metrics = {f"eval/rm/normalized_{key}": value for key, value in normalization.items() if key != "references"}

    # ---- evaluation ----
    # Detail 6: The preference validation split is out of distribution
    # Its pairs come from policies train never shows, and validation_cnndm is news: each split is reported apart.
    calibration = {}
    for split in EVAL_SPLITS:
        eval_set = first_rows(preference[split], args.num_eval_samples)
        rewards = score_dataset(accelerator, model, eval_set.with_format("torch", columns=list(PAIR_COLUMNS)),
                                {"chosen": ("query_chosen_token",), "rejected": ("query_rejected_token",)},
                                pad_id, args.local_eval_batch_size)
        if not accelerator.is_main_process:
            continue
        table = pair_table(eval_set, rewards)
        table["accuracy"] = pair_accuracy(table, tie=0.0)  # a tie is wrong, as in the reference; identical summaries 1/2
        # Detail 16: Accuracy differs by batch / confidence / split
        # Batches differ in policies, instructions and labelers; confidence 4-6 pairs are near coin flips (Table 5).
        by_group = grouped_accuracy(table, ("split", "batch", "confidence"))
        metrics.update(accuracy_metrics(by_group, f"eval/rm/{split}/accuracy"))
        report = f"# RM accuracy on {split} ({len(table)} pairs)\n\n" + markdown_table(by_group)
        if args.gold_judge is not None:
            metrics[f"eval/rm/{split}/gold_accuracy"], gold_report = gold_agreement(table, eval_set, split,
                                                                                    args.gold_judge, "RM")
            report += gold_report
        # Detail 18: RM calibration
        # A calibrated RM is right with probability sigmoid(margin) (Bai et al., 2022): bins 0.5 wide.
        calibration[split] = calibration_bins(table, 0.5)
        write_split_results(staging, split, table, report, calibration[split], f"eval_{split}.csv",
                            f"eval/rm/{split}/samples" if args.track else None)
    if accelerator.is_main_process:
        # Detail 13: Non-EOS reward logits are not valid rewards
        # Only the EOS logit is trained; elsewhere the head gives anything (mostly negative in the paper): plotted.
        samples = token_reward_samples(accelerator.unwrap_model(model), preference["validation"], pad_id, accelerator.device)
        write_plots(staging, calibration, samples)
    if judged is not None:
        metrics["eval/rm/judge_agreement"] = judge_agreement(accelerator, model, tokenizer, judged, args)

    # ---- save ----
    save_rm(accelerator, args, run_name, writer, model, tokenizer, staging, state_dict,
            {"normalization.json": normalization, "eval_metrics.json": metrics})


# ---- plumbing and fast paths: no Detail below ----
# Fast paths, and the helpers of the maths above.


def pair_rewards(model, queries: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor,
                 pad_token_id: int) -> tuple:
    """== (get_reward(model, query ++ chosen, right-padded)[1], get_reward(model, query ++ rejected, right-padded)[1]).

    (B, T_q) left-padded queries, (B, T_r) right-padded chosen and rejected summaries -> (B,) rewards of each,
    from ONE row per pair, query ++ chosen ++ rejected (tests/test_reward.py checks the equality)."""
    # Speed only: the two rows of a pair repeat its query, most of their tokens (~130 of ~150 in the
    # tiny world; TL;DR queries run to 512 tokens, summaries to 53). Here the query is read once.
    # The rejected summary's tokens do not attend to the chosen summary.
    # Both summaries take the positions right after the query.
    # The three parts sit back to back, pads only at the row's end: the row is as wide as the longest
    # pair, not as the longest query plus twice the longest summary (15-17% fewer tokens in the tiny world's batches).
    # 1/1.8 of the time of two rows on the tiny world; 1/2.5 with the last layer at the EOS only (benchmark/reward_pair_rows.py).
    query_width, response_width = queries.shape[1], chosen.shape[1]
    # (B, 1) each: the tokens of each part (the queries' pads are on the left, the summaries' on the right)
    query_length, chosen_length, rejected_length = [(ids != pad_token_id).sum(1, keepdim=True)
                                                    for ids in (queries, chosen, rejected)]
    chosen_end = query_length + chosen_length  # (B, 1): first column after the chosen summary
    row_end = chosen_end + rejected_length  # (B, 1): first pad of the row
    column = torch.arange(int(row_end.max()), device=queries.device)[None, :]  # (1, T)
    # (B, T): 0 query, 1 chosen, 2 rejected, 3 pad
    part = (column >= query_length).long() + (column >= chosen_end).long() + (column >= row_end).long()
    # (B, T): where each column's token is in query ++ chosen ++ rejected as they came. The query's tokens end
    # where the chosen summary starts (column T_q there), so one offset serves both; pads read column 0.
    source = (column + torch.where(part == 2, query_width + response_width - chosen_end, query_width - query_length)
              ).masked_fill(part == 3, 0)
    input_ids = torch.cat((queries, chosen, rejected), dim=1).gather(1, source)  # (B, T)
    is_token = part < 3  # (B, T)
    position_ids = torch.where(part == 2, column - chosen_length, column).masked_fill(~is_token, 0)  # (B, T)
    causal = column.T >= column  # (T, T): row = the reading position, column = the read one
    # (B, T, T): causal, no rejected position reads a chosen one, no position reads a pad
    reads = causal & ~((part[:, :, None] == 2) & (part[:, None, :] == 1)) & is_token[:, None, :]
    attention_mask = reads | torch.eye(column.size(1), dtype=torch.bool, device=queries.device)  # a pad reads itself
    # Each summary's reward is at its last token: its EOS, or its last column if it has no pad (reward_indices).
    # Only these two outputs are used: the model's last layer computes them alone (hidden_states_at).
    eos = torch.cat((chosen_end, row_end), 1) - 1  # (B, 2): the chosen's and the rejected's reward columns
    rewards = model(input_ids=torch.masked_fill(input_ids, ~is_token, 0), attention_mask=attention_mask[:, None],
                    position_ids=position_ids, positions=eos)  # (B, 2)
    return rewards[:, 0], rewards[:, 1]


def pair_rewards_by_length(model, queries: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor,
                           pad_token_id: int, groups: int) -> tuple:
    """== pair_rewards(model, queries, chosen, rejected, pad_token_id), the pairs scored in `groups` forwards by length.

    Speed only (tests/test_reward.py checks the equality): a row is as wide as the longest pair of its
    forward, so the pairs are sorted by length and split into `groups` groups, each as wide as its own
    longest pair. Each pair's reward and gradient are its own whatever its neighbours; only the sums run
    in another order. 4 groups of 8 pairs in the tiny world (tiny.sh): ~20% fewer token cells, ~35% less attention."""
    if groups == 1:  # one forward: nothing to sort
        return pair_rewards(model, queries, chosen, rejected, pad_token_id)
    lengths = sum((ids != pad_token_id).sum(1) for ids in (queries, chosen, rejected))  # (B,) tokens of each pair
    order = lengths.argsort(stable=True)  # (B,) shortest first
    parts = [pair_rewards(model, queries[rows], chosen[rows], rejected[rows], pad_token_id)
             for rows in order.chunk(groups)]
    unsort = order.argsort()  # (B,): where each pair went
    return tuple(torch.cat(side)[unsort] for side in zip(*parts))


def hidden_states_at(backbone, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: Optional[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """== backbone(input_ids, attention_mask, position_ids).last_hidden_state[rows, positions]: (B, k, d) for (B, k)
    columns, up to float rounding (tests/test_reward.py checks it).

    Speed only: GPT-NeoX's forward, except that the LAST layer computes only the k columns asked for. It still
    needs every column's keys and values, but its queries, attention output and MLP only there (the earlier
    layers feed keys and values to later columns, so they run in full). The RM reads two columns of a pair's
    row of ~150: the tiny world's 3-layer RM trains 1.21x faster in tiny.sh's layout, 1.40x in one forward
    (benchmark/results/reward_pair_rows.md)."""
    rows = torch.arange(input_ids.size(0), device=input_ids.device)[:, None]  # (B, 1)
    if not sdpa_gpt_neox(backbone):
        if attention_mask.dim() == 4 and backbone.config._attn_implementation == "eager":
            # sdpa reads a boolean mask as it is; eager attention adds the mask to its scores
            attention_mask = torch.zeros(attention_mask.shape, dtype=backbone.dtype, device=attention_mask.device
                                         ).masked_fill(~attention_mask, torch.finfo(backbone.dtype).min)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return hidden.last_hidden_state[rows, positions]
    if position_ids is None:  # as the backbone numbers the columns
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
    return last_layer_at(backbone, input_ids, attention_mask, position_ids, lambda x: x[rows, positions])


def last_layer_at(backbone, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  select) -> torch.Tensor:
    """== select(backbone(input_ids, attention_mask, position_ids).last_hidden_state) for a GPT-NeoX run by SDPA,
    `select` picking k positions along dim 1 of a (B, T, ...) tensor: (B, k, d)."""
    # transformers internals, used by this fast path only
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import create_causal_mask
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    # GPT-NeoX's forward, except that the LAST layer computes only the positions asked for: it
    # still needs the keys and values of every position, but its queries, attention output and MLP
    # only there (the earlier layers feed keys and values to later positions, so they run in full).
    hidden = backbone.embed_in(input_ids)  # (B, T, d)
    mask = create_causal_mask(config=backbone.config, inputs_embeds=hidden, attention_mask=attention_mask,
                              past_key_values=None, position_ids=position_ids)  # (B, 1, T, T) or None: causal only
    cos, sin = backbone.rotary_emb(hidden, position_ids=position_ids)
    for layer in backbone.layers[:-1]:
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin))
    layer, attention = backbone.layers[-1], backbone.layers[-1].attention
    qkv = attention.query_key_value(layer.input_layernorm(hidden))  # (B, T, 3 * d)
    query, key, value = qkv.view(*hidden.shape[:2], -1, 3 * attention.head_size).transpose(1, 2).chunk(3, dim=-1)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)  # (B, heads, T, head_size) each
    if mask is None:
        mask = torch.ones(hidden.size(1), hidden.size(1), dtype=torch.bool, device=hidden.device).tril()
        mask = mask.expand(hidden.size(0), 1, -1, -1)  # (B, 1, T, T)
    rows_of = lambda x: select(x.transpose(1, 2)).transpose(1, 2)  # noqa: E731  (B, h, T, ...) -> (B, h, k, ...)
    attention_output, _ = sdpa_attention_forward(attention, rows_of(query), key, value, rows_of(mask),
                                                 scaling=attention.scaling, dropout=0.0, is_causal=False)
    attention_output = attention.dense(attention_output.flatten(2))  # (B, k, heads, head_size) -> (B, k, d)
    residual = select(hidden)  # (B, k, d)
    if layer.use_parallel_residual:
        hidden = layer.mlp(layer.post_attention_layernorm(residual)) + attention_output + residual
    else:
        attention_output = attention_output + residual
        hidden = layer.mlp(layer.post_attention_layernorm(attention_output)) + attention_output
    return backbone.final_layer_norm(hidden)


def sdpa_gpt_neox(backbone) -> bool:
    """Whether `backbone` is a GPT-NeoX model run by SDPA: the one whose layers hidden_states_at calls itself."""
    return isinstance(backbone, GPTNeoXModel) and getattr(backbone.config, "_attn_implementation", None) == "sdpa"


def trim_right_padding(query_responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """(B, T) ids -> (B, T') with the trailing columns that are pad in every row dropped (at least 1 kept)."""
    # Rows are padded to the longest sequence of the whole dataset: a batch rarely needs all of it,
    # and an all-pad column costs compute and changes nothing (the EOS index stays where it was, or
    # becomes the last index of a row that now ends exactly at its EOS).
    used = (query_responses != pad_token_id).any(0).nonzero()  # (n, 1): columns with a token
    return query_responses[:, :int(used.max()) + 1 if len(used) else 1]


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B,): index of the first True of each row, T for a row without one."""
    row_len = bools.size(-1)
    # (B, T): a False costs T + its index, a True just its index; the minimum is the first True
    zero_or_index = row_len * (~bools).long() + torch.arange(row_len, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability of `model` to 0: nn.Dropout modules, float *dropout* attributes, config."""
    # Pythia's dropout is 0 already; the tiny model's is 0.1.
    # nn.Dropout modules are not all of it: GPT-NeoX attention copies the float
    # `config.attention_dropout` into a module attribute and applies it functionally.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    for name, value in vars(model.config).items():  # saved with the model: later loads start at 0 too
        if "dropout" in name and isinstance(value, float):
            setattr(model.config, name, 0.0)


def episode_order(num_rows: int, num_episodes: int, seed: int) -> torch.Tensor:
    """(num_episodes,) row indices: a fresh seeded permutation of the rows per pass, passes concatenated."""
    generator = torch.Generator().manual_seed(seed)
    passes = -(-num_episodes // num_rows)  # ceil: the last pass may be used in part
    perms = [torch.randperm(num_rows, generator=generator) for _ in range(passes)]
    return torch.cat(perms)[:num_episodes] if perms else torch.zeros(0, dtype=torch.long)


def local_episode_order(num_rows: int, num_updates: int, gradient_accumulation_steps: int, world_size: int,
                        local_micro_batch_size: int, seed: int, rank: int) -> torch.Tensor:
    """(U, GAS, local micro) row indices that rank `rank` reads: the slice [u, m, rank] of episode_order."""
    # Update u, micro-step m, rank r reads the slice [u, m, r]: ranks read disjoint rows, each once per pass.
    sizes = (num_updates, gradient_accumulation_steps, world_size, local_micro_batch_size)
    return episode_order(num_rows, math.prod(sizes), seed).view(sizes)[:, :, rank]


def shift_head_bias(accelerator, model, shift: float) -> dict:
    """All ranks: head.bias += `shift` in the module and, on rank 0, in its fp32 state dict (returned, for saving)."""
    # The trained weights in fp32 (under DeepSpeed the masters: its bf16 module copy is not what we
    # save); the shift goes onto the saved bias in fp32, and onto the module's for the evaluation.
    state_dict = fp32_state_dict(accelerator, model)  # every rank must call it; only rank 0 gets it
    if state_dict:
        state_dict["head.bias"] = state_dict["head.bias"] + shift
    with torch.no_grad():
        accelerator.unwrap_model(model).head.bias += shift
    return state_dict


# Evaluation: sharded scoring, tables, plots.


@torch.no_grad()
def score_dataset(accelerator, model, dataset, layouts: dict, pad_token_id: int, local_eval_batch_size: int) -> dict:
    """All ranks: {name: (N,) reward of each row} for layouts {name: token columns concatenated left to right}.

    The context length of a layout is the width of all its columns but the last (0 for one column)."""
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    rows = []
    batches = eval_batches(len(dataset), accelerator.process_index, accelerator.num_processes, local_eval_batch_size)
    for indices, real in tqdm(batches, desc="score", disable=not accelerator.is_main_process):
        batch = dataset[indices]
        scores = {}
        for name, columns in layouts.items():
            parts = [batch[column].to(accelerator.device) for column in columns]
            context_length = sum(part.shape[1] for part in parts[:-1])
            query_responses = trim_right_padding(torch.cat(parts, dim=1), pad_token_id)
            scores[name] = rewards_at_eos(unwrapped, query_responses, pad_token_id, context_length)  # (B,)
        rows += [(i, {name: score[j].item() for name, score in scores.items()}) for j, i in enumerate(indices[:real])]
    unwrapped.train()
    rows = sorted(gather_object(rows), key=lambda row: row[0])  # every rank's rows, in dataset order
    return {name: np.array([row[1][name] for row in rows]) for name in layouts}


def rewards_at_eos(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> torch.Tensor:
    """== get_reward(model, query_responses, pad_token_id, context_length)[1]: (B,) the reward at each row's EOS,
    up to float rounding (tests/test_reward.py checks it).

    Speed only: the model's last layer runs at the EOS column alone (hidden_states_at), as pair_rewards does in
    training. get_reward runs it at every column to return every position's reward logit; scoring reads one."""
    attention_mask = query_responses != pad_token_id  # (B, T): get_reward's mask, ids and (no) position_ids
    eos = reward_indices(query_responses, pad_token_id, context_length)  # (B,)
    return model(input_ids=torch.masked_fill(query_responses, ~attention_mask, 0), attention_mask=attention_mask,
                 positions=eos[:, None])[:, 0]


def eval_batches(num_rows: int, rank: int, world_size: int, batch_size: int) -> list:
    """[(row indices, number of real rows)] of rank `rank`: rows rank, rank + W, ... in batches of `batch_size`;
    every rank gets the same batches count and sizes, a rank one row short repeating its last row (not kept)."""
    # Frozen models run as ZeRO-3 engines (ppo.py --offload) gather their parameters in every forward,
    # a collective: a rank with one batch fewer would leave the others waiting forever.
    mine = list(range(rank, num_rows, world_size))
    per_rank = -(-num_rows // world_size)  # ceil
    padded = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))
    return [(padded[start:start + batch_size], max(0, min(batch_size, len(mine) - start)))
            for start in range(0, per_rank, batch_size)]


def first_rows(dataset, num_rows: Optional[int]):
    """The first `num_rows` rows of `dataset` (all of them when None): --num_eval_samples caps every evaluation."""
    return dataset if num_rows is None else dataset.select(range(min(num_rows, len(dataset))))


# What the evaluation after training reads besides the token columns (pair_table, token_reward_samples).
TABLE_COLUMNS = ("query", "chosen", "rejected", "batch", "split", "extra", "chosen_policy", "rejected_policy",
                 "query_token_len")


def pair_table(eval_set, rewards: dict) -> pd.DataFrame:
    """One row per preference pair: texts, labeling batch, split, confidence, policies, both rewards."""
    table = pd.DataFrame({
        "query": eval_set["query"], "chosen": eval_set["chosen"], "rejected": eval_set["rejected"],
        "batch": eval_set["batch"], "split": eval_set["split"],
        "confidence": [(extra or {}).get("confidence") for extra in eval_set["extra"]],
        "chosen_policy": eval_set["chosen_policy"], "rejected_policy": eval_set["rejected_policy"],
        "chosen_reward": rewards["chosen"], "rejected_reward": rewards["rejected"]})
    return table


def pair_accuracy(table: pd.DataFrame, tie: float) -> np.ndarray:
    """Per pair of `table` (chosen / rejected texts and rewards): 1 ranked as labeled, 0 the other way, `tie` for
    equal rewards; 1/2 for a pair of two identical summaries, whatever their rewards."""
    # Identical summaries (the real data has some, the tiny world 3 of its 512 validation pairs) carry a
    # label no model can learn, and their two rewards differ by float rounding only: counted by the sign,
    # they moved the accuracy by up to 3 pairs from one CPU to another.
    margin = table["chosen_reward"] - table["rejected_reward"]
    ranked = np.where(margin > 0, 1.0, np.where(margin < 0, 0.0, tie))
    return np.where(table["chosen"] == table["rejected"], 0.5, ranked)


def grouped_accuracy(table: pd.DataFrame, groups: tuple) -> pd.DataFrame:
    """Rows (group, value, accuracy, pairs): 'all' first, then each value of each `groups` column of `table`."""
    out = [("all", "all", table["accuracy"].mean(), len(table))]
    for group in groups:
        parts = list(table.groupby(group, dropna=False, sort=True))
        if all(isinstance(value, str) for value, _ in parts):  # batch3 before batch10, as a reader counts
            parts.sort(key=lambda item: [int(piece) if piece.isdigit() else piece
                                         for piece in re.split(r"(\d+)", item[0])])
        for value, part in parts:
            # A column with missing values is float in pandas: show confidence 9.0 as "9"
            value = int(value) if isinstance(value, float) and value.is_integer() else value
            out.append((group, str(value), part["accuracy"].mean(), len(part)))
    return pd.DataFrame(out, columns=["group", "value", "accuracy", "pairs"])


def accuracy_metrics(by_group: pd.DataFrame, key: str) -> dict:
    """{key: overall accuracy, key/group/value: accuracy of each group} from grouped_accuracy's rows."""
    return {key + ("" if row.group == "all" else f"/{row.group}/{row.value}"): row.accuracy
            for row in by_group.itertuples()}


def calibration_bins(table: pd.DataFrame, bin_width: float) -> pd.DataFrame:
    """Rows (low, high, pairs, accuracy, ideal) per bin of |margin| = |r_chosen - r_rejected| of the pairs of `table`;
    accuracy = the mean of its `accuracy` column (pair_accuracy: ties counted as the stage's accuracy counts them)."""
    margins, accurate = (table["chosen_reward"] - table["rejected_reward"]).to_numpy(), table["accuracy"].to_numpy()
    bins = np.floor(np.abs(margins) / bin_width).astype(int)  # bin k holds k * width <= |margin| < (k + 1) * width
    out = []
    for k in np.unique(bins):
        inside = bins == k
        # Ideal: a calibrated RM predicts P(chosen preferred) = sigmoid(margin); at the bin's centre
        center = (k + 0.5) * bin_width
        out.append((k * bin_width, (k + 1) * bin_width, int(inside.sum()), float(accurate[inside].mean()),
                    1 / (1 + math.exp(-center))))
    return pd.DataFrame(out, columns=["low", "high", "pairs", "accuracy", "ideal"])


def markdown_table(frame: pd.DataFrame) -> str:
    """A pandas DataFrame as a markdown table (floats with 3 decimals)."""
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def token_reward_samples(model, validation, pad_token_id: int, device) -> list:
    """[(title, per-token reward logits up to a few pads past the EOS, query length, EOS index)] of both rows of
    the first two pairs of `validation`."""
    examples = validation.select(range(min(2, len(validation))))
    ids = torch.tensor(list(examples["query_chosen_token"]) + list(examples["query_rejected_token"]))  # (2n, T)
    with torch.no_grad():
        logits, _ = get_reward(model, ids.to(device), pad_token_id, context_length=0)  # (2n, T)
    eos = reward_indices(ids, pad_token_id, 0)  # (2n,)
    samples = []
    for i in range(len(ids)):
        pair, kind = i % len(examples), ("chosen", "rejected")[i // len(examples)]
        samples.append((f"validation pair {pair}, {kind}", logits[i, :int(eos[i]) + 6].tolist(),
                        int(list(examples["query_token_len"])[pair]), int(eos[i])))  # + a few pads
    return samples


def gold_agreement(table: pd.DataFrame, eval_set, split: str, gold_judge: str, who: str) -> tuple:
    """Rank 0: (agreement of `who`'s ordering with the tiny world's gold judge, a report line); adds
    table["gold_prefers_chosen"]. Pairs the gold judge ties (e.g. two identical summaries) do not count;
    a pair whose two rewards `who` ties counts 1/2."""
    import tiny_world  # the tiny world's gold judge, beside this script; imported only when asked

    noise_ceiling = load_json(os.path.join(gold_judge, "world.json"))["noise_ceiling"]
    # The labels are Bradley-Terry noise around the gold judge: agreement with the gold
    # ordering is what a reward should learn; the noise ceiling bounds accuracy on the labels.
    posts = [f"{info['title']}\n{info['article'] if split == 'validation_cnndm' else info['post']}"
             for info in eval_set["info"]]
    texts = [(s[c]["text"], s[1 - c]["text"]) for s, c in zip(eval_set["summaries"], eval_set["choice"])]
    gold_margin = np.array([tiny_world.gold_margin(p, c, r) for p, (c, r) in zip(posts, texts)])  # 0: a gold tie
    table["gold_prefers_chosen"] = np.where(gold_margin == 0, np.nan, gold_margin > 0)
    decided = gold_margin != 0
    # From the rewards, not the accuracy column: the RM's accuracy counts a tie as wrong (pair_accuracy's `tie`).
    margin = table["chosen_reward"] - table["rejected_reward"]
    agree = np.where(margin == 0, 0.5, (margin > 0) == (gold_margin > 0))
    gold_accuracy = float(agree[decided].mean())
    return gold_accuracy, (f"\nGold judge: {who} agrees with the gold ordering on {gold_accuracy:.3f} of {decided.sum()} "
                           f"pairs without a gold tie; accuracy on the labels {table['accuracy'].mean():.3f} vs "
                           f"noise ceiling {noise_ceiling.get(split, float('nan')):.3f}\n")


def judge_agreement(accelerator, model, tokenizer, judged: pd.DataFrame, args) -> float:
    """All ranks: rm_agreement of the RM's scores of the judged (query, response) and (query, reference) texts (nan: none)."""
    # The judge compared a model's summary with another (the human reference, by default); the RM
    # agrees when it ranks the two the same way. Texts are rebuilt as preprocess_tldr.py builds
    # them: query + " " + summary + EOS, right-padded, a "[PAD]" or "<|endoftext|>" typed in a text read as text
    # (split_special_tokens, as preprocess_tldr.py's encode_text): the reward is read at the one real EOS.
    ids = {name: [row + [tokenizer.eos_token_id] for row in tokenizer(
               [f"{query.strip()} {str(text).strip()}" for query, text in zip(judged["query"], judged[name])],
               add_special_tokens=False, split_special_tokens=True)["input_ids"]]
           for name in ("response", "reference")}
    width = max(len(row) for rows in ids.values() for row in rows)
    pad_id = tokenizer.pad_token_id
    judged_set = datasets.Dataset.from_dict({name: [row + [pad_id] * (width - len(row)) for row in rows]
                                             for name, rows in ids.items()}).with_format("torch")
    rewards = score_dataset(accelerator, model, judged_set, {name: (name,) for name in ids}, pad_id,
                            args.local_eval_batch_size)
    agreement, decided = rm_agreement(list(judged["preferred"]), list(rewards["response"]), list(rewards["reference"]))
    agreement = float("nan") if agreement is None else agreement
    accelerator.print(f"RM agrees with the judge on {agreement:.3f} of the {decided} decided judgments in {args.judged_file}")
    return agreement


def write_split_results(staging: str, split: str, table: pd.DataFrame, report: str, calibration: pd.DataFrame,
                        csv_name: str, wandb_key: Optional[str]) -> None:
    """Rank 0: `csv_name` and accuracy_{split}.md into `staging`, the table to W&B as `wandb_key` (--track: not None);
    report and calibration printed."""
    table.to_csv(os.path.join(staging, csv_name), index=False, lineterminator="\r\n")  # a bare "\r" quoted (write_summaries)
    with open(os.path.join(staging, f"accuracy_{split}.md"), "w") as file:
        file.write(report)
    if wandb_key is not None:
        import wandb

        wandb.log({wandb_key: wandb.Table(dataframe=table)})
    print(report)
    print(f"calibration on {split}:\n" + markdown_table(calibration))


def write_plots(staging: str, calibration: dict, token_samples: list) -> None:
    """Rank 0: calibration.png ({split: calibration_bins}) and token_rewards.png (token_reward_samples) into `staging`."""
    plot_calibration(calibration, os.path.join(staging, "calibration.png"))
    plot_token_rewards(token_samples, os.path.join(staging, "token_rewards.png"))


def plot_calibration(tables: dict, path: str) -> None:
    """Save accuracy vs |margin| per split ({split: calibration_bins frame}) beside the ideal sigmoid."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6, 4))
    for split, bins in tables.items():
        ax.plot((bins["low"] + bins["high"]) / 2, bins["accuracy"], "o-", label=split)
    grid = np.linspace(0, max([1.0] + [bins["high"].max() for bins in tables.values()]), 100)
    ax.plot(grid, 1 / (1 + np.exp(-grid)), "k--", label="ideal: sigmoid(margin)")
    ax.set(xlabel="|r_chosen - r_rejected|", ylabel="accuracy", ylim=(0, 1.02), title="RM calibration (Detail 18)")
    ax.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_token_rewards(samples: list, path: str) -> None:
    """Save per-token reward logits along sequences: samples = [(title, (T,) logits, query length, EOS index)]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(samples), 1, figsize=(10, 2.2 * len(samples)), squeeze=False)
    for ax, (title, logits, query_length, eos) in zip(axes[:, 0], samples):
        ax.plot(range(len(logits)), logits, lw=1)
        ax.axvline(query_length - 0.5, color="grey", ls=":", label="response starts")
        ax.plot([eos], [logits[eos]], "r*", ms=12, label=f"EOS: {logits[eos]:.2f} (the reward)")
        ax.axhline(0, color="black", lw=0.5)
        ax.set(title=title, ylabel="reward logit")
        ax.legend(loc="lower left", fontsize=7)
    axes[-1, 0].set_xlabel("position")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


# Run setup: flags, inputs, tokenizer, models, logging.
# The inputs whose args.json --resume compares (input_prints): model folders, then dataset folders.
INPUTS = (("sft_model_path",), ("label_dataset", "query_dataset"))
# Flags that may change between an interrupted run and its resumption (see output_dir_problem).
# None of these changes what the run computes.
RESUME_FLAGS = ("resume", "stop_after_updates", "stop_after_minutes", "run_name", "save_every",
                "track", "wandb_project_name", "wandb_entity", "push_to_hub", "hf_entity")  # where it logs and publishes
# Rules of the flag checks: (test, what to pass instead). A NaN fails every comparison.
POSITIVE = (lambda value: 0 < value < math.inf, "a finite number > 0")
NON_NEGATIVE = (lambda value: 0 <= value < math.inf, "a finite number >= 0")
AT_LEAST_1 = (lambda value: value >= 1, "an integer >= 1")
AT_LEAST_0 = (lambda value: value >= 0, "an integer >= 0")
NONE_OR_AT_LEAST_1 = (lambda value: value is None or value >= 1, "an integer >= 1, or no flag")


class SetupError(ValueError):
    """Flags, data, tokenizer or output folder the script cannot use; raised before any compute."""


class RunFinished(Exception):
    """--resume of a run whose output folder holds its finished results: nothing to train (exit status 0)."""

    def __init__(self, output_dir: str, flags: dict):
        super().__init__(f"{output_dir} holds the finished run of these flags")
        self.output_dir, self.flags = output_dir, flags


def refuse(problem: Optional[str]) -> None:
    """Raise SetupError(problem) when there is a problem."""
    if problem:
        raise SetupError(problem)


def reward_flag_problems(args: Args, world_size: int) -> list:
    """One line per flag that cannot work, naming it and what to pass instead; empty if all can. Loads and writes nothing."""
    # Every flag is checked before anything is loaded or written, and all problems are listed at once:
    # a bad value would otherwise surface inside AdamW, after training, or never (a model saved untrained).
    problems = flag_range_problems(args, {
        "seed": (lambda seed: 0 <= seed < 2 ** 32 - 100003 * world_size, f"an integer in [0, 2^32 - {100003 * world_size})"),
        "save_every": AT_LEAST_0, "stop_after_updates": NONE_OR_AT_LEAST_1,
        "stop_after_minutes": (lambda minutes: minutes is None or 0 <= minutes < math.inf, "minutes >= 0, or no flag"),
        "num_train_epochs": AT_LEAST_1,
        "total_episodes": (lambda n: n is None or n == 0 or n >= args.batch_size,
                           f"0 (evaluate the initial RM only) or at least one batch, --batch_size {args.batch_size}"),
        "num_eval_samples": (NONE_OR_AT_LEAST_1[0], "an integer >= 1 (the normalisation needs a reference), or no flag"),
        "lr": POSITIVE, "eps": POSITIVE, "weight_decay": NON_NEGATIVE, "local_eval_batch_size": AT_LEAST_1,
        "length_groups": AT_LEAST_1})
    try:
        gradient_accumulation(args.batch_size, args.local_micro_batch_size, world_size)
    except SetupError as error:
        problems.append(str(error))
    problem = scheduler_problem(args.scheduler)
    problems += [problem] if problem else []
    if args.judged_file is not None and not os.path.isfile(args.judged_file):
        problems.append(f"--judged_file {args.judged_file}: no such file (want judge.py's judged/<run>.csv)")
    if args.gold_judge is not None and not os.path.isfile(os.path.join(args.gold_judge, "world.json")):
        problems.append(f"--gold_judge {args.gold_judge}: no world.json there (want a tiny world folder)")
    if args.output_dir is not None and os.path.isfile(args.output_dir):
        problems.append(f"--output_dir {args.output_dir} is a file: choose a folder")
    return problems


def flag_range_problems(args, rules: dict) -> list:
    """['--flag value: want ...'] for each flag of `rules` ({flag: (ok(value) -> bool, what to pass)}) whose value fails."""
    return [f"--{flag} {getattr(args, flag)}: want {want}" for flag, (ok, want) in rules.items()
            if not ok(getattr(args, flag))]


def gradient_accumulation(batch_size: int, local_micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per update per rank so that micro x accumulation x world = batch_size exactly."""
    per_step = local_micro_batch_size * world_size
    if batch_size <= 0 or local_micro_batch_size <= 0 or batch_size % per_step:
        raise SetupError(f"--batch_size {batch_size} is not a positive multiple of --local_micro_batch_size "
                         f"{local_micro_batch_size} x world size {world_size} = {per_step}")
    return batch_size // per_step


def scheduler_problem(name: str) -> Optional[str]:
    """Why transformers.get_scheduler cannot build `name` as the stages use it (stepped once per update); None if it can."""
    if name == "reduce_lr_on_plateau":  # steps on a metric, which the stages do not pass
        return f"--scheduler {name}: it needs a metric at every step; want e.g. cosine, linear or constant"
    try:
        get_scheduler(name, SchedulerProbe(), num_warmup_steps=0, num_training_steps=1)
    except (ValueError, TypeError) as error:
        return f"--scheduler {name}: {str(error).splitlines()[0]}; want e.g. cosine, linear or constant"
    return None


class SchedulerProbe(torch.optim.Optimizer):
    """An optimizer with one parameter group and nothing to step, for `scheduler_problem` to build a schedule on.
    Torch's own optimizers import torch._dynamo when built (~2 s): every failed start would pay it."""

    def __init__(self):  # Optimizer.__init__ left out on purpose (above); this is all a schedule reads
        self.defaults, self.param_groups, self.state = {"lr": 1.0}, [{"lr": 1.0, "params": []}], {}


def adamw(parameters, args, device: torch.device) -> torch.optim.AdamW:
    """== torch.optim.AdamW(parameters, lr=args.lr, eps=args.eps, weight_decay=args.weight_decay), with the step as one
    fused kernel on a GPU: the same update, 11 ms instead of 30 ms for 1B weights on an H100 (benchmark/results/gpu_check.md)."""
    return torch.optim.AdamW(parameters, lr=args.lr, eps=args.eps, weight_decay=args.weight_decay,
                             fused=device.type == "cuda")


def gpu_problem(environ, cuda_available: bool) -> Optional[str]:
    """Why this launch cannot run: it asks for a GPU (DeepSpeed, bf16 / fp16) and sees none; None if it can."""
    # A SLURM job on a node whose torch is a CPU build would otherwise train on the CPU, silently,
    # for days. A CPU rehearsal is fine when it says so: DS_ACCELERATOR=cpu, or accelerate's --cpu.
    deepspeed = environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    precision = environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if cuda_available or not (deepspeed or precision != "no"):
        return None
    if deepspeed and environ.get("DS_ACCELERATOR") == "cpu":
        return None
    if not deepspeed and environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return None
    asked = "DeepSpeed" if deepspeed else f"mixed precision {precision}"
    rehearsal = "DS_ACCELERATOR=cpu" if deepspeed else "accelerate launch --cpu"
    return (f"this launch asks for a GPU ({asked}), but torch {torch.__version__} sees no CUDA device "
            f"(CUDA build: {torch.version.cuda or 'none, a CPU-only torch'}). Run it on a GPU node with a CUDA "
            f"build of torch, or, for a CPU rehearsal on purpose, use {rehearsal}")


def start_accelerator(args, flag_problems, script: str) -> Accelerator:
    """The Accelerator of this launch, once the launch and every flag are checked; sets the derived sizes of `args`."""
    problem = gpu_problem(os.environ, torch.cuda.is_available())
    if problem:
        raise SetupError(problem)
    # DeepSpeed without GPUs (a CPU rehearsal of the ZeRO-2 launch) needs the gloo backend, not nccl.
    deepspeed_on_cpu = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and not torch.cuda.is_available()
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else [])
    problems = flag_problems(args, accelerator.num_processes)
    sharded = sharded_parameters_problem(accelerator.state.deepspeed_plugin, script)
    if sharded:
        problems.append(sharded)
    if problems:
        raise SetupError(f"{script} cannot start (nothing was loaded or written):\n  " + "\n  ".join(problems))
    args.world_size = accelerator.num_processes
    args.gradient_accumulation_steps = gradient_accumulation(args.batch_size, args.local_micro_batch_size,
                                                             args.world_size)
    args.local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.micro_batch_size = args.local_micro_batch_size * args.world_size
    return accelerator


def sharded_parameters_problem(deepspeed_plugin, script: str) -> Optional[str]:
    """Why a DeepSpeed launch at ZeRO stage 3 cannot run `script`; None for no DeepSpeed or stages 0-2."""
    # ZeRO-3 shards every parameter as the model loads: the checks of the model (its embedding rows read 0)
    # and the evaluations' single-rank forwards would fail or wait on the other ranks.
    if deepspeed_plugin is None or deepspeed_plugin.zero_stage != 3:
        return None
    return (f"DeepSpeed ZeRO stage 3: {script} checks and evaluates its model with whole parameters, which ZeRO-3 "
            "shards as the model loads. Use ZeRO-2, the paper's (benchmark/accelerate/deepspeed_zero2.yaml)")


def rm_inputs(args, accelerator) -> tuple:
    """(preference, sft, judged or None, tokenizer, what args.json records of them), every one checked;
    fills in the default paths and num_updates of `args`."""
    name, prints = resolve_paths(args, accelerator, "reward")
    preference, sft = load_datasets(args, {"label_dataset": (("train",) + EVAL_SPLITS, TRAIN_PAIR_COLUMNS + PAIR_COLUMNS),
                                           "query_dataset": (("train",), REFERENCE_COLUMNS)})
    refuse(table_columns_problem(args.label_dataset, preference, EVAL_SPLITS))
    judged = load_judged(args.judged_file) if args.judged_file is not None else None
    tokenizer, identity = rm_tokenizer(args, accelerator, preference, sft)
    warning = cleaned_query_warning(args.label_dataset, preference["train"], tokenizer.pad_token_id)
    if warning:
        accelerator.print(warning)
    train_pairs = len(preference["train"])
    total_episodes = train_pairs * args.num_train_epochs if args.total_episodes is None else args.total_episodes
    args.num_updates = total_episodes // args.batch_size
    if args.total_episodes is None and args.num_updates == 0:
        raise SetupError(f"--label_dataset {args.label_dataset}: its train split ({train_pairs} pairs) x --num_train_epochs "
                         f"{args.num_train_epochs} is less than one batch of {args.batch_size}: pass --total_episodes")
    recorded = {"base_model_name": name, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                "tokenizer_identity": identity, "input_args_json": prints,
                "mixed_precision": accelerator.mixed_precision}  # compared on --resume, as the flags are
    return preference, sft, judged, tokenizer, recorded


def resolve_paths(args, accelerator, stage: str) -> tuple:
    """Fill in the default paths of `args`, tidy its output folder and check every input; (the base model's name,
    input_prints of the inputs)."""
    # The stages chain by convention: preprocess_tldr.py -> data/{base_model}/tldr, sft.py ->
    # models/{base_model}/sft_{seed}, this script -> models/{base_model}/{stage}_{seed}.
    name = model_name(args.base_model) if args.base_model else None
    make_sft = f"python sft.py --base_model {args.base_model or 'EleutherAI/pythia-1b-deduped'} --seed {args.seed}"
    hub_id = args.sft_model_path is not None and is_hub_id(args.sft_model_path)  # no args.json to read here
    if args.sft_model_path is None:
        args.sft_model_path = os.path.join("models", name or "EleutherAI/pythia-1b-deduped", f"sft_{args.seed}")
    else:
        make_sft += f" --output_dir {args.sft_model_path}"
    if args.query_dataset is not None:  # the SFT data this command was given: the one to fine-tune on
        make_sft += f" --query_dataset {args.query_dataset}"
    recorded = recorded_base_model(args.sft_model_path)
    warning = policy_writer_warning(args.sft_model_path, "--sft_model_path")
    if warning:
        accelerator.print(warning)
    if name and recorded and name != recorded:
        raise SetupError(f"--sft_model_path {args.sft_model_path} was fine-tuned from {recorded}, not from --base_model "
                         f"{args.base_model}: pass --base_model {recorded} or another --sft_model_path")
    if hub_id and not name:  # the default (1B) would name a 2.8B model's folders, run and repository
        raise SetupError(f"--sft_model_path {args.sft_model_path}: no such folder here, so a Hub id, and no args.json "
                         "here says which base model it was fine-tuned from: check the path, or pass --base_model (it "
                         "names the output folder, the run and the Hub repository)")
    make_data, instead = preprocess_hint(args.base_model, args.sft_model_path,
                                         {"--label_dataset": "preference", "--query_dataset": "sft"})
    name = name or recorded or "EleutherAI/pythia-1b-deduped"
    args.base_model = args.base_model or name
    args.label_dataset = args.label_dataset or os.path.join("data", name, "tldr", "preference")
    args.query_dataset = args.query_dataset or os.path.join("data", name, "tldr", "sft")
    args.output_dir = args.output_dir or os.path.join("models", name, f"{stage}_{args.seed}")
    if accelerator.is_main_process:
        tidy_output_dir(args.output_dir)  # finish or drop what a killed save left beside or inside it
    accelerator.wait_for_everyone()
    prints = input_prints(args, *INPUTS)  # its inputs as this start finds them: compared on --resume, recorded
    # Every missing input at once (a start each was a start too many); the output folder once they are all there.
    problems = [problem for problem in (push_problem(args, name),
                                        input_problem(args.sft_model_path, "--sft_model_path", make_sft),
                                        input_problem(args.label_dataset, "--label_dataset", make_data, instead),
                                        input_problem(args.query_dataset, "--query_dataset", make_data, instead))
                if problem]
    problem = ("\n  ".join(problems)
               or output_dir_problem(args.output_dir, {**asdict(args), "input_args_json": prints,
                                                       "mixed_precision": accelerator.mixed_precision},
                                     RESUME_FLAGS + (
                   "world_size", "gradient_accumulation_steps", "local_batch_size", "micro_batch_size", "num_updates")))
    refuse(problem)
    return name, prints


def model_name(base_model: str) -> str:
    """The name of a base model in default paths: a Hub id as it is (org/name), a local model folder its own name."""
    # Every base model gets its own folders (data/{name}/tldr, models/{name}/sft_{seed}, ...), so a
    # 1B SFT model is never picked up by a 2.8B run; each stage records the name in its args.json.
    return os.path.basename(os.path.normpath(base_model)) if os.path.isdir(base_model) else base_model


def policy_writer_warning(folder: str, flag: str) -> Optional[str]:
    """A warning when the model folder `folder` given as `flag` was written by dpo.py or ppo.py (its args.json says),
    not by sft.py: the run would start from a tuned policy where the paper starts from the SFT model; None if not."""
    # Allowed (PPO on top of DPO is an experiment), but never silent: the stages' folders sit side by side.
    path = os.path.join(folder, "args.json")
    saved = load_json(path) if os.path.isfile(path) else {}
    writer = "ppo.py" if "kl_coef" in saved else "dpo.py" if "beta" in saved else None
    return writer and (f"warning: {flag} {folder} was written by {writer}, not by sft.py (its args.json says so): "
                       "this run starts from that policy, not from an SFT model as the paper's does")


def recorded_base_model(folder: str) -> Optional[str]:
    """The base model name (`model_name`) recorded in the args.json of the stage output `folder`; None if none."""
    path = os.path.join(folder, "args.json")
    if not os.path.isfile(path):
        return None
    return load_json(path).get("base_model_name")


def preprocess_hint(base_model: Optional[str], sft_model_path: str, splits: dict) -> tuple:
    """(the command that builds the default data, from `base_model`, else the one the SFT model's args.json records;
    where that args.json names preprocess_tldr.py's output here, the flags {flag: split} passing it instead, or "")."""
    path = os.path.join(sft_model_path, "args.json")
    saved = load_json(path) if os.path.isfile(path) else {}
    make = f"python preprocess_tldr.py --base_model {base_model or saved.get('base_model') or 'EleutherAI/pythia-1b-deduped'}"
    data = saved.get("query_dataset")
    folder = os.path.dirname(os.path.normpath(data)) if isinstance(data, str) else ""
    if not folder or not os.path.isfile(os.path.join(folder, "args.json")):
        return make, ""
    flags = " ".join(f"{flag} {os.path.join(folder, split)}" for flag, split in splits.items())
    return make, f", or pass the data {sft_model_path} was fine-tuned on: `{flags}`"


def input_problem(path: str, flag: str, make: str, instead: str = "") -> Optional[str]:
    """Why the input `path` (given or defaulted by `flag`) is missing, with the command `make` that creates it (and
    `instead`, another way, if any); None if present."""
    # A Hub id (org/name, no such local folder) is left to from_pretrained / load_dataset to fetch.
    if os.path.exists(path) or is_hub_id(path):
        return None
    return (f"{flag} {path}: no such folder. Create it with `{make}`{instead}, "
            f"or pass {flag} PATH (a folder or a Hub id)")


def is_hub_id(path: str) -> bool:
    """Whether `path` names a Hub repository (org/name, no such local folder; not under this checkout's models/, data/)."""
    return (not os.path.exists(path) and re.fullmatch(r"[\w.-]+/[\w.-]+", path) is not None
            and not path.startswith(("models/", "data/")))


def load_data(path: str, flag: str):
    """The DatasetDict at `path` (a folder preprocess_tldr.py saved, or a Hub id); a load that fails names `flag`."""
    try:
        return datasets.load_from_disk(path) if os.path.isdir(path) else datasets.load_dataset(path)
    except (OSError, ValueError) as error:  # not on the Hub or unreachable (offline, gated), a broken folder
        # preprocess_tldr.py's output folder itself holds the two datasets: the flag wants one of them.
        inside = os.path.join(path, "preference" if flag == "--label_dataset" else "sft")
        which = f"pass {inside} (the folder holds preprocess_tldr.py's datasets)" if os.path.isdir(inside) else (
            "pass a folder that preprocess_tldr.py wrote, or a Hub dataset id this machine can reach")
        raise SetupError(f"{flag} {path}: cannot load it ({type(error).__name__}: {error}); {which}") from error


def output_dir_problem(output_dir: str, flags: dict, ignored: tuple) -> Optional[str]:
    """Why `output_dir` cannot hold this run (another run's args.json, foreign files, this run finished), None if it
    can; RunFinished for a --resume of this run when it has finished."""
    folder = os.path.abspath(output_dir)
    while not os.path.exists(folder):  # the nearest part of the path that exists must be a folder
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"--output_dir {output_dir}: {folder} is a file, not a folder: choose a new or empty folder"
    path = os.path.join(output_dir, "args.json")
    if not os.path.isfile(path):
        if os.path.isdir(output_dir) and os.listdir(output_dir):
            return f"--output_dir {output_dir} is not empty and has no args.json: choose an empty or new folder"
        return None
    if os.listdir(output_dir) == ["args.json"]:  # a start that failed before any work: nothing to lose
        return None
    saved = load_json(path)
    # The mixed precision accelerate ran with is recorded since 2026-12-03: a run recorded before resumes unchecked.
    saved.setdefault("mixed_precision", flags.get("mixed_precision"))
    changed = [f"{k}={saved.get(k)!r} there, {v!r} now" for k, v in flags.items()
               if k not in ignored and saved.get(k) != v]
    if changed:
        return (f"--output_dir {output_dir} holds a different run ({'; '.join(changed)}): "
                "choose another folder, or delete it (that run's own flags and --resume continue it if unfinished)")
    if os.path.isfile(os.path.join(output_dir, "eval_metrics.json")):  # finished: its folder is published whole
        if flags.get("resume"):  # a repeated or requeued start of a run that has ended: keep it, train nothing
            raise RunFinished(output_dir, flags)
        return (f"--output_dir {output_dir} holds the finished run of these flags: nothing is retrained over it. "
                "Delete the folder, or choose another, to train it again")
    checkpoint = latest_checkpoint(os.path.join(output_dir, "checkpoints"))
    if checkpoint is not None and not flags.get("resume"):  # starting again at update 0 would discard them
        return (f"--output_dir {output_dir} holds an unfinished run, checkpointed at update {checkpoint[0]}: "
                "pass --resume to continue it, or choose another folder (or delete this one) to start again")
    return None


def input_prints(args, model_flags: tuple, data_flags: tuple) -> dict:
    """--flag -> the first 16 hex digits of the sha256 of the args.json that made its input (in a model folder; beside
    a dataset's splits); None for a Hub id or a folder without one. Recorded: --resume refuses rewritten inputs."""
    prints = {}
    for flag in model_flags + data_flags:
        path = getattr(args, flag)
        folder = path if flag in model_flags else os.path.dirname(os.path.abspath(path))
        saved = os.path.join(folder, "args.json")
        if os.path.isfile(saved):
            with open(saved, "rb") as file:
                prints[f"--{flag}"] = hashlib.sha256(file.read()).hexdigest()[:16]
        else:
            prints[f"--{flag}"] = None
    return prints


def push_problem(args, base_model_name: str) -> Optional[str]:
    """With --push_to_hub: why the Hub would refuse the repository or branch this run is pushed to, at its end, where
    --resume cannot rename them (the repository: {base model}__{exp_name}__tldr; the branch: the run name)."""
    if not args.push_to_hub:
        return None
    from huggingface_hub import constants, get_token  # imported here: only with --push_to_hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(f"{args.hf_entity or 'user'}/{base_model_name.replace('/', '_')}__{args.exp_name}__tldr")
    except HFValidationError as error:
        return f"--push_to_hub: --exp_name {args.exp_name!r} or --hf_entity {args.hf_entity!r} names no Hub repository: {error}"
    if args.run_name is not None and (not re.fullmatch(r"\w[\w.-]*", args.run_name) or ".." in args.run_name):
        return f"--push_to_hub: --run_name {args.run_name!r} names no git branch: want letters, digits, _ . - (no '..')"
    # The push comes after hours of training: what would stop it is found now (the run would be kept, unpushed).
    if constants.HF_HUB_OFFLINE:
        return ("--push_to_hub: HF_HUB_OFFLINE is set in this shell, so the push at the end would fail: unset it, or "
                "train without --push_to_hub and push later (the same command with --resume --push_to_hub)")
    if get_token() is None:
        return ("--push_to_hub: no Hub token on this machine, so the push at the end would fail: log in first "
                "(`hf auth login`, or HF_TOKEN in the environment)")
    return None


def load_datasets(args, wanted: dict) -> list:
    """[the DatasetDict of each flag of `wanted`] ({flag: (splits, columns)}), refused if a split or column is missing."""
    loaded = []
    for flag, (splits, columns) in wanted.items():
        path = getattr(args, flag)
        loaded.append(load_data(path, f"--{flag}"))
        missing = missing_columns(loaded[-1], splits, columns)
        if missing:
            raise SetupError(f"--{flag} {path} lacks {missing}: build it with preprocess_tldr.py")
    return loaded


def ids_in_data(dataset_dict, column: str) -> Optional[dict]:
    """{"eos_token_id", "pad_token_id"} read off a right-padded token column (a response, its EOS, then pads) in the
    first 256 rows of the first split: most rows end with pads, each after its EOS; None when that is not what they
    show (most rows unpadded, or no one id before the pads in nine padded rows of ten)."""
    # A Hub dataset comes without preprocess_tldr.py's args.json: the ids its rows hold are what there is to compare
    # (the reference's datasets pad with [PAD] = 50277; a tokenizer padding with another id would read it as text).
    rows = [[int(t) for t in row] for row in next(iter(dataset_dict.values()))[:256][column]]
    lasts = [row[-1] for row in rows]
    pad = max(set(lasts), key=lasts.count)  # the most common last id
    ends = [next(t for t in reversed(row) if t != pad) for row in rows if row[-1] == pad and set(row) != {pad}]
    eos = max(set(ends), key=ends.count) if ends else None  # the most common id before the pads
    if 2 * lasts.count(pad) <= len(rows) or eos is None or 10 * ends.count(eos) < 9 * len(ends):
        return None
    return {"eos_token_id": eos, "pad_token_id": pad}


def table_columns_problem(path: str, preference, splits: tuple) -> Optional[str]:
    """Why the evaluation after training could not read the eval `splits` of --label_dataset `path` (a column of
    TABLE_COLUMNS missing), found at the start and not after the last update; None if nothing."""
    missing = missing_columns(preference, splits, TABLE_COLUMNS)
    return (f"--label_dataset {path} lacks {missing}, which the evaluation after training reads: build it with "
            "preprocess_tldr.py") if missing else None


def cleaned_query_warning(path: str, train, pad_id: int, rows: int = 1000) -> Optional[str]:
    """A warning when --label_dataset `path` has no preprocess_tldr.py args.json beside it (a Hub dataset) and some of
    its first `rows` train rows do not open their query+chosen ids with their query's ids; None otherwise."""
    # The reference built its datasets under transformers 4.33, whose decode cleaned up the query (" ," to ",", " 's"
    # to "'s") before it was tokenized again with the summary: on such posts the row holds other query ids than
    # query_token, and its label mask (query_token's length) also hides the summary's first ids.
    built_with = os.path.join(os.path.dirname(os.path.abspath(path)), "args.json")
    if (os.path.isdir(path) and os.path.isfile(built_with)) or "query_token" not in train.column_names:
        return None
    head = train.select(range(min(rows, len(train))))
    queries = ([token for token in query if token != pad_id] for query in head["query_token"])
    apart = sum(list(row[:len(query)]) != query for query, row in zip(queries, head["query_chosen_token"]))
    return (f"warning: in {apart} of the first {len(head)} train rows of --label_dataset {path} (no preprocess_tldr.py "
            "args.json beside it), the query's ids do not open the query+chosen row: its query text was cleaned up "
            "before the row was tokenized (the reference's datasets: transformers 4.33 rewrote \" ,\" as \",\"). On those "
            "rows reward.py trains on the query's own ids, not the row's, and dpo.py's label masks hide the summary's "
            "first ids too (docs/details.md); preprocess_tldr.py builds rows without this") if apart else None


def missing_columns(dataset_dict, splits: tuple, columns: tuple) -> list:
    """['split' or 'split.column' for each missing split or column]; empty when all are there."""
    missing = [split for split in splits if split not in dataset_dict]
    return missing + [f"{split}.{column}" for split in splits if split in dataset_dict
                      for column in columns if column not in dataset_dict[split].column_names]


def load_judged(judged_file: str) -> pd.DataFrame:
    """judge.py's judged/<run>.csv with its texts renamed as in a sample table: query, response, reference."""
    # judge.py's judged/<run>.csv names the texts post / ours / other; a sample table query / response / reference.
    judged = pd.read_csv(judged_file, keep_default_na=False).rename(
        columns={"post": "query", "ours": "response", "other": "reference"})
    lacking = sorted({"query", "response", "reference", "preferred"} - set(judged.columns))
    if lacking:
        raise SetupError(f"--judged_file {judged_file} lacks columns {lacking}: want judge.py's "
                         "judged/<run>.csv (post, ours, other, preferred)")
    return judged


def rm_tokenizer(args, accelerator, preference, sft) -> tuple:
    """(the SFT model's tokenizer, checked by check_tokenizer against each dataset's ids, its tokenizer_identity)."""
    tokenizer = load_tokenizer(args.sft_model_path, "--sft_model_path")
    for path, data, column in ((args.label_dataset, preference, "query_chosen_token"),
                               (args.query_dataset, sft, "reference_response_token")):  # must be this tokenizer's ids
        built_with = os.path.join(os.path.dirname(os.path.abspath(path)), "args.json")
        if os.path.isdir(path) and os.path.isfile(built_with):
            built = load_json(built_with)
            data_ids = {key: built.get(key) for key in ("pad_token_id", "eos_token_id")}
        else:  # a Hub dataset (no preprocess_tldr.py args.json): the ids its rows hold
            data_ids = ids_in_data(data, column)
        if check_tokenizer(tokenizer, data_ids, f"{path} ({built_with} or its rows)"):
            accelerator.print(f"added the pad token [PAD] (id {tokenizer.pad_token_id}) to {args.sft_model_path}")
    identity = tokenizer_identity(tokenizer)
    problem = identity_problem({
        f"--sft_model_path {args.sft_model_path} (its tokenizer)": identity,
        f"--sft_model_path {args.sft_model_path} (its args.json)": recorded_tokenizer_identity(args.sft_model_path),
        **{f"--{flag} {path} ({os.path.dirname(os.path.abspath(path))}/args.json)":
           recorded_tokenizer_identity(os.path.dirname(os.path.abspath(path))) if os.path.isdir(path) else None
           for flag, path in (("label_dataset", args.label_dataset), ("query_dataset", args.query_dataset))}})
    refuse(problem)
    return tokenizer, identity


def load_tokenizer(path: str, flag: str):
    """AutoTokenizer of `path` with right padding; a SetupError naming `flag` when there is none."""
    try:
        return AutoTokenizer.from_pretrained(path, padding_side="right")
    except (OSError, HFValidationError) as error:  # the latter: a path that is no folder and no Hub id
        raise SetupError(f"{flag} {path}: no tokenizer at {path}, and none of that name on the Hub's main branch "
                         f"(or the Hub cannot be reached): {error}. A repository that keeps each run on a branch (the "
                         f"reference's and this project's pushes do) is read from a download: `hf download {path} "
                         "--revision RUN_NAME --local-dir DIR`, then pass DIR") from error


def add_pad_token(tokenizer) -> bool:
    """Make [PAD] the pad token of `tokenizer`, whatever pad it came with (none, EOS or another); True if it changed."""
    # As the reference: transformers 5 loads Pythia's tokenizer with the pad "<|padding|>" (id 1; none under
    # 4.x), and [PAD] (id 50277) is the pad of the reference's datasets and checkpoints under either version.
    if tokenizer.pad_token == "[PAD]":
        return False
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return True


def tokenizer_identity(tokenizer) -> str:
    """sha256 (hex) of the tokenizer's vocabulary, as sorted (token, id) pairs, and of its special tokens map."""
    # Two tokenizers with the same EOS and [PAD] ids may still map every other id to another token: a
    # model would then train on, or score, text it cannot read, silently. Every stage records this in
    # its args.json (taken after add_pad_token) and compares it across everything it loads.
    payload = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "special_tokens": tokenizer.special_tokens_map},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def recorded_tokenizer_identity(folder: str) -> Optional[str]:
    """The "tokenizer_identity" of `folder`/args.json (a stage's output or preprocess_tldr.py's data folder); None if none."""
    path = os.path.join(folder, "args.json")
    if not os.path.isfile(path):
        return None
    return load_json(path).get("tokenizer_identity")


def identity_problem(sides: dict) -> Optional[str]:
    """{what: tokenizer identity, or None when unknown} -> why the known ones differ, each side named; None if they agree."""
    known = {what: identity for what, identity in sides.items() if identity is not None}
    if len(set(known.values())) <= 1:
        return None
    return ("these inputs come from different tokenizers (tokenizer_identity = sha256 of vocabulary and special tokens): "
            + "; ".join(f"{what} has {identity[:16]}" for what, identity in known.items())
            + ". Preprocess the data and train every model from one base model's tokenizer")


def vocabulary_problem(tokenizer, rows: int, what: str) -> Optional[str]:
    """Why `what`, a model with `rows` embedding rows, cannot read every id of `tokenizer` but [PAD]; None if it can."""
    # [PAD] may lie past the table: it is replaced by a valid id before every forward.
    largest = max(i for i in tokenizer.get_vocab().values() if i != tokenizer.pad_token_id)
    if largest < rows:
        return None
    return (f"{what} has {rows} embedding rows, but the tokenizer has ids up to {largest}: it was not trained "
            "with this tokenizer; use models and data made from one base model")


def load_fp32(model_class, path: str, flag: str):
    """`model_class.from_pretrained(path)` in fp32 whatever dtype it was saved in (Pythia's Hub weights are fp16)."""
    # transformers 5 loads a checkpoint in its saved dtype: fp16 weights trained with plain AdamW get
    # no fp32 master copy and no loss scaling. Training keeps fp32 weights; bf16 comes only as mixed
    # precision from accelerate (autocast) or DeepSpeed (bf16 compute copies, fp32 masters).
    config = os.path.join(path, "config.json")
    model_type = load_json(config).get("model_type") if os.path.isfile(config) else None  # None: a Hub id
    if model_type == "scalar_model":
        # The stages' folders look alike (models/.../sft_1, reward_1): say which one this is, not a loader's traceback.
        raise SetupError(f"{flag} {path} holds a reward model (reward.py's output); {flag} takes sft.py's output or "
                         "a base model")
    from safetensors import SafetensorError  # a file cut short (it names no folder)

    try:
        model, loading = model_class.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except (OSError, HFValidationError) as error:  # the latter: a path that is no folder and no Hub id
        raise SetupError(f"{flag} {path}: no model folder at {path}, and no model of that name on the Hub "
                         f"(or the Hub cannot be reached): {error}") from error
    except SafetensorError as error:  # a file cut short: a copy or a download that stopped part way
        raise SetupError(f"{flag} {path}: its weights cannot be read ({error}): copy or train the model "
                         "again") from error
    # from_pretrained starts every weight the checkpoint lacks at random, and only prints a report: a checkpoint of
    # another layout (the reference code's reward models: lm_backbone.*, scalar_head.*) would train or score as noise.
    lacking = sorted(loading["missing_keys"]) + sorted(key for key, *_ in loading["mismatched_keys"])
    refuse(lacking and f"{flag} {path}: {len(lacking)} of the model's weights are not in its checkpoint "
           f"({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}) and would start at random; it holds "
           f"{', '.join(sorted(loading['unexpected_keys'])[:3]) or 'no other weights'} instead: another layout. {flag} "
           "takes sft.py's output or a base model (such as EleutherAI/pythia-1b-deduped)")
    return model


def rotary_problem(models: dict) -> Optional[str]:
    """{name: model} -> the rotary `inv_freq` buffers stored below fp32 (None if there are none)."""
    # Rotary angles are position x inv_freq: rounded to bf16 (8 bits of mantissa) the angle at
    # distance 565 of Pythia-1B is off by ~0.25 rad, and two copies of one model that disagree on
    # it disagree on every log-prob. DeepSpeed casts parameters only; a blanket .to(bf16) does not.
    low = [f"{name}: {module_name}.inv_freq is {buffer.dtype}" for name, model in models.items()
           for module_name, module in model.named_modules()
           for buffer_name, buffer in module.named_buffers(recurse=False)
           if buffer_name == "inv_freq" and buffer.dtype != torch.float32]
    return "; ".join(low) or None


def start_logging(args, accelerator, resume_from: Optional[tuple], recorded: dict, unit: str) -> tuple:
    """(run name, rank 0's SummaryWriter or None); rank 0 writes args.json (flags, `recorded`, git commit) and starts W&B;
    the batch sizes printed, counted in `unit`."""
    if resume_from is not None:  # a resumed run logs on into its own TensorBoard folder
        run_name = args.run_name or load_json(os.path.join(resume_from[1], "trainer_state.json"))["run_name"]
    else:
        start_time = broadcast_object_list([int(time.time())])[0]  # rank 0's clock: one name for all ranks
        # The model's name too: a sweep's array starts its sizes at once, and their runs/ folders must differ.
        model = os.path.basename(recorded["base_model_name"])
        run_name = args.run_name or f"{args.exp_name}__{model}__{args.seed}__{start_time}"
    writer = None
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        write_text_atomic(os.path.join(args.output_dir, "args.json"), json.dumps({
            **asdict(args), "run_name": run_name, **recorded,
            "git_commit": git_commit(os.path.dirname(os.path.abspath(__file__))),
            # How `accelerate launch` ran it: without --config_file it takes the machine's default accelerate config,
            # which can turn on DeepSpeed, bf16 or torch dynamo, and no flag of this script would show it.
            # Its mixed precision is in `recorded`, beside the flags: --resume compares it.
            "launch": {"distributed_type": str(accelerator.distributed_type.value), "processes": accelerator.num_processes,
                       "dynamo_backend": str(accelerator.state.dynamo_plugin.backend.value)}}, indent=2))
        if args.track:
            import wandb  # imported here: without --track nothing touches the network

            # One W&B run per run name: a resumed (requeued) run logs on into the run it started.
            # Before the writer: sync_tensorboard reads only the TensorBoard writers made after wandb.init.
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                       config=asdict(args), name=run_name, id=wandb_run_id(run_name), resume="allow", save_code=True)
        writer = SummaryWriter(f"runs/{run_name}")
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{key}|{value}|" for key, value in asdict(args).items()))
    accelerator.print(f"run {run_name}: {args.num_updates} updates of {args.batch_size} {unit} = "
                      f"{args.local_batch_size} per rank x {args.world_size} ranks, in micro-batches of "
                      f"{args.micro_batch_size} = {args.local_micro_batch_size} per rank x {args.world_size} "
                      f"({args.gradient_accumulation_steps} accumulation steps)")
    return run_name, writer


def wandb_run_id(run_name: str) -> str:
    """The W&B run id of `run_name`: its characters W&B allows, at most 64 (a longer name: a prefix and a hash)."""
    run_id = re.sub(r"[^\w.-]", "_", run_name)
    return run_id if len(run_id) <= 64 else f"{run_id[:47]}-{hashlib.sha256(run_name.encode()).hexdigest()[:16]}"


def git_commit(folder: str) -> Optional[str]:
    """The git commit checked out in `folder`, None outside a git checkout."""
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True)
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


# Fault handling and checkpoints.


def check_and_checkpoint(accelerator, args, updates_done: int, losses: torch.Tensor, run_name: str, model, optimizer,
                         scheduler) -> bool:
    """All ranks: stop all on a non-finite loss or weight; save a checkpoint every --save_every (and at the last
    update), at --stop_after_updates and once --stop_after_minutes have passed: True then, if updates remain (the
    run stops there)."""
    checkpoints = os.path.join(args.output_dir, "checkpoints")
    if not all_finite(accelerator, model, losses):
        raise FloatingPointError(nonfinite_message(updates_done, args.num_updates, checkpoints))
    out_of_time = args.stop_after_minutes is not None and broadcast_object_list(  # rank 0's clock decides for all
        [time.monotonic() - PROCESS_START >= 60 * args.stop_after_minutes])[0]
    # With --save_every, the last update too: a job requeued during the final evaluation then redoes no update.
    if (args.save_every and (updates_done % args.save_every == 0 or updates_done == args.num_updates)) \
            or updates_done == args.stop_after_updates or out_of_time:
        save_checkpoint(accelerator, checkpoints, updates_done, run_name, model, optimizer, scheduler)
    return out_of_time and updates_done < args.num_updates


PROCESS_START = time.monotonic()  # --stop_after_minutes counts from here (the script's import)


def all_finite(accelerator, model, losses: torch.Tensor) -> bool:
    """All ranks: whether `losses` and every parameter of `model` are finite on every rank (one all-reduce)."""
    # Summed over ranks, so that every rank stops at the same update (a rank stopping alone would
    # leave the others waiting in the next collective).
    local = torch.stack([torch.isfinite(losses).all()] + [torch.isfinite(p).all() for p in model.parameters()]).all()
    return accelerator.reduce((~local).float().reshape(1), reduction="sum").item() == 0


def nonfinite_message(update: int, num_updates: int, checkpoints: str) -> str:
    """Why the run stops at `update` (counted from 1) with a nan / inf, and which checkpoint it keeps."""
    last = latest_checkpoint(checkpoints)
    kept = (f"the last checkpoint, {last[1]} (update {last[0]}), is kept as it was" if last else
            "no checkpoint was written before it (--save_every N keeps one every N updates)")
    return (f"update {update} of {num_updates}: the loss or the weights are not finite (nan or inf) on at least one "
            f"rank, so the run stops before saving anything of it; {kept}. Try a lower --lr (or look at the data of "
            f"update {update}) in a new --output_dir; --resume with these flags continues from the kept checkpoint")


def resume(accelerator, args, resume_from: Optional[tuple], model, optimizer, scheduler) -> int:
    """All ranks: the update to start at, after loading `resume_from` ((update, path) or None) when there is one."""
    from safetensors import SafetensorError  # a file cut short (it names no folder)

    if resume_from is not None:
        try:
            load_checkpoint(accelerator, resume_from[1], model, optimizer, scheduler)  # also the RNG states of that update
        except SetupError:
            raise
        except (SafetensorError, ValueError, KeyError, EOFError, RuntimeError) as error:  # a file damaged on disk
            raise SetupError(f"--resume: {resume_from[1]} cannot be read ({type(error).__name__}: {error}): delete "
                             "it to resume from the checkpoint before it, or start again without --resume") from error
        accelerator.print(f"resumed from {resume_from[1]} at update {resume_from[0]}")
        return resume_from[0]
    if args.resume:
        accelerator.print(f"--resume: no checkpoint in {os.path.join(args.output_dir, 'checkpoints')}, starting at update 0")
    return 0


def latest_checkpoint(folder: str) -> Optional[tuple]:
    """(update, path) of the newest complete `update_{k}` checkpoint in `folder`, None if there is none."""
    complete = [(int(name.split("_")[1]), os.path.join(folder, name))
                for name in (os.listdir(folder) if os.path.isdir(folder) else [])
                if re.fullmatch(r"update_\d+", name) and os.path.isfile(os.path.join(folder, name, "trainer_state.json"))]
    return max(complete) if complete else None


def checkpoint_to_resume(args, accelerator) -> Optional[tuple]:
    """With --resume: (update, path) of the latest complete checkpoint, if this launch can load it; else None."""
    found = latest_checkpoint(os.path.join(args.output_dir, "checkpoints")) if args.resume else None
    # DeepSpeed saves one optimizer shard per process and loads only on as many (DDP resumes on any number).
    folder = os.path.join(found[1], "deepspeed") if found else ""
    shards = [name for name in os.listdir(folder) if name.endswith("optim_states.pt")] if os.path.isdir(folder) else []
    if shards and accelerator.state.deepspeed_plugin is not None and len(shards) != accelerator.num_processes:
        raise SetupError(f"--resume: {found[1]} was saved by DeepSpeed on {len(shards)} processes, and DeepSpeed "
                         f"resumes only on as many (this launch has {accelerator.num_processes}): relaunch with "
                         f"--num_processes {len(shards)}, or delete {os.path.dirname(found[1])} and start again")
    return found


def save_checkpoint(accelerator, folder: str, update: int, run_name: str, model, optimizer, scheduler) -> None:
    """All ranks: write {folder}/update_{update} whole (as update_{update}.partial, then renamed), then drop older ones."""
    # A kill at any moment leaves the previous checkpoint or this one complete on disk: the older ones
    # go only after the rename has made this one complete (and the loop saves only finite weights).
    path = os.path.join(folder, f"update_{update}")
    partial = path + ".partial"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # what a killed save left
        os.makedirs(partial)
    accelerator.wait_for_everyone()
    save_training_state(accelerator, partial, model, optimizer)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # JSON, not pickle: the scheduler's state_dict and the counters are plain numbers.
        state = {"update": update, "run_name": run_name,
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None}
        with open(os.path.join(partial, "trainer_state.json"), "w") as file:
            json.dump(state, file)
        if os.path.isdir(path):  # this update was saved before (a rerun of it): keep that copy
            shutil.rmtree(partial)
        else:
            os.rename(partial, path)
        for name in os.listdir(folder):
            if name != os.path.basename(path):
                shutil.rmtree(os.path.join(folder, name))
    accelerator.wait_for_everyone()


def save_training_state(accelerator, folder: str, model, optimizer) -> None:
    """All ranks: the model and optimizer state, and this rank's RNG states, into `folder`, in formats that run no code."""
    if accelerator.state.deepspeed_plugin is not None:
        # ZeRO shards the optimizer over the ranks: DeepSpeed writes its own files (torch.save),
        # which load_checkpoint reads back with load_weights_only.
        model.save_checkpoint(folder, tag="deepspeed")
    elif accelerator.is_main_process:  # DDP: every rank holds the same weights and optimizer state
        save_model(accelerator.unwrap_model(model), os.path.join(folder, "model.safetensors"))
        state = optimizer.state_dict()  # AdamW: {"state": {index: {name: tensor}}, "param_groups": [plain values]}
        save_file({f"{index}.{name}": value.contiguous() for index, values in state["state"].items()
                   for name, value in values.items()}, os.path.join(folder, "optimizer.safetensors"))
        with open(os.path.join(folder, "optimizer.json"), "w") as file:
            json.dump({"param_groups": state["param_groups"]}, file)
    save_rng_state(os.path.join(folder, f"rng_state_{accelerator.process_index}"))


def load_checkpoint(accelerator, path: str, model, optimizer, scheduler) -> dict:
    """All ranks: restore what save_checkpoint wrote in `path`, unpickling nothing; its trainer_state.json."""
    state = load_json(os.path.join(path, "trainer_state.json"))
    deepspeed = accelerator.state.deepspeed_plugin is not None
    needed = ["deepspeed"] if deepspeed else ["model.safetensors", "optimizer.safetensors", "optimizer.json"]
    missing = [name for name in needed if not os.path.exists(os.path.join(path, name))]
    if missing:
        raise SetupError(f"--resume: {path} lacks {missing} (it holds {sorted(os.listdir(path))}): it was written by "
                         "an older version or another launch (DeepSpeed or not). Older checkpoints are pickles, which "
                         "can run code when loaded and are never opened: resume with the launch that wrote it, or "
                         f"delete {os.path.dirname(path)} and start again without --resume")
    if deepspeed:
        model.checkpoint_engine.load = load_weights_only  # DeepSpeed's own loader would run any pickled code
        loaded, _ = model.load_checkpoint(path, tag="deepspeed", load_lr_scheduler_states=False)
        if loaded is None:
            raise SetupError(f"--resume: DeepSpeed found no checkpoint in {path}/deepspeed (its log above says why): "
                             f"delete {path} to resume from an earlier one, or start again without --resume")
    else:
        load_model(accelerator.unwrap_model(model), os.path.join(path, "model.safetensors"))  # copied onto its device
        param_groups = load_json(os.path.join(path, "optimizer.json"))["param_groups"]
        for group in param_groups:
            group["betas"] = tuple(group["betas"])  # JSON has no tuples
        optimizer_state = {}
        for name, tensor in load_file(os.path.join(path, "optimizer.safetensors")).items():
            index, key = name.split(".", 1)
            optimizer_state.setdefault(int(index), {})[key] = tensor
        optimizer.load_state_dict({"state": optimizer_state, "param_groups": param_groups})
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    # A checkpoint ends an update, so accumulate() starts the next one afresh, whatever the accumulation is now
    # (a DDP resume on another number of processes accumulates over another number of micro-batches;
    # DeepSpeed resumes only on as many, checkpoint_to_resume).
    accelerator.step = 0
    if not load_rng_state(os.path.join(path, f"rng_state_{accelerator.process_index}")):
        print(f"note: {path} has no RNG state of rank {accelerator.process_index} (saved by fewer processes); "
              "this rank keeps its seeded one")
    return state


def save_rng_state(path: str) -> None:
    """This process's python and numpy RNG states as `path`.json, torch's (CPU, CUDA) as `path`.safetensors."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with open(path + ".json", "w") as file:
        json.dump({"python": [python_state[0], list(python_state[1]), python_state[2]],
                   "numpy": [numpy_state[0], numpy_state[1].tolist(), int(numpy_state[2]), int(numpy_state[3]),
                             float(numpy_state[4])]}, file)
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda_{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    save_file(tensors, path + ".safetensors")


def load_rng_state(path: str) -> bool:
    """Restore the RNG states save_rng_state wrote at `path`; False if there are none."""
    if not os.path.isfile(path + ".json"):
        return False
    state = load_json(path + ".json")
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    np.random.set_state((state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    tensors = load_file(path + ".safetensors")
    torch.set_rng_state(tensors["torch"])
    # This process's GPU only: a resume may see more GPUs than the save did (or none were seen: a CPU rehearsal).
    device = f"cuda_{torch.cuda.current_device()}" if torch.cuda.is_available() else None
    if device in tensors:
        torch.cuda.set_rng_state(tensors[device])
    return True


def load_weights_only(path: str, map_location=None):
    """torch.load(`path`) building only tensors, plain containers and the 4 data-only DeepSpeed classes its files hold."""
    # DeepSpeed's own loader calls torch.load(weights_only=False): a pickle planted in a checkpoint would
    # run its code on --resume. Its ZeRO-1/2 files hold, besides tensors and containers, these classes.
    import pickle

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    def zero_stage_by_name(enum, name: str):
        """getattr(ZeroStageEnum, name) for a member's name, and nothing else getattr could reach."""
        # Python 3.11.2 (Debian 12's python3) pickles an Enum member as getattr(its class, its name), 3.11.7 by
        # value. Allowing getattr itself would hand a planted file every attribute of every allowed class.
        if enum is not ZeroStageEnum or name not in ZeroStageEnum.__members__:
            raise pickle.UnpicklingError(f"{path}: getattr({enum!r}, {name!r}) is not a ZeroStageEnum member")
        return ZeroStageEnum[name]

    allowed = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, (zero_stage_by_name, "builtins.getattr")]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location=map_location, weights_only=True)


# Outputs: written beside output_dir, swapped in whole; the Hub.


def save_rm(accelerator, args, run_name: str, writer, model, tokenizer, staging: str, state_dict: dict,
            results: dict) -> None:
    """All ranks wait; rank 0 logs the eval metrics, writes the RM, tokenizer and `results` ({file name: dict} as
    JSON) to `staging`, swaps it in as output_dir and pushes it (--push_to_hub)."""
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    metrics = results["eval_metrics.json"]
    for key, value in metrics.items():
        writer.add_scalar(key, value, args.num_updates * args.batch_size)
    save_fp32(accelerator.unwrap_model(model), staging, state_dict)  # safetensors, fp32, bias normalised
    tokenizer.save_pretrained(staging)
    for file_name, content in results.items():
        with open(os.path.join(staging, file_name), "w") as file:
            json.dump(content, file, indent=2)
    publish_output(staging, args.output_dir)  # the checkpoints go with the old folder: only an unfinished run needs them
    writer.close()
    print("\n".join(f"{key}: {metrics[key]:.4f}" for key in metrics if key.count("/") == 3 or "normalized" in key))
    print(f"saved {args.output_dir}; TensorBoard: runs/{run_name}/")
    if torch.cuda.is_available():  # what benchmark/gpu_check.sh reports per stage
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB")
    if args.push_to_hub:
        push_to_hub(args.output_dir, args.exp_name, args.hf_entity)
    if args.track:
        import wandb

        wandb.finish()


def fp32_state_dict(accelerator, model) -> dict:
    """All ranks call it; rank 0 gets the model's state dict in fp32 (under DeepSpeed its fp32 master weights, not
    the bf16 copies, on the CPU; else the model's own tensors, where they are: change none in place), the other
    ranks, which save nothing, an empty dict."""
    plugin = accelerator.state.deepspeed_plugin  # ZeRO-2 at most: ZeRO-3, whose copy is a collective, is refused at start
    # Each rank's own bf16 copy, cloned to the CPU: rank 0's alone (all 8: ~110 GB of host memory at 6.9B).
    state_dict = accelerator.get_state_dict(model) if accelerator.is_main_process else {}
    if plugin is not None:
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in accelerator.unwrap_model(model).named_parameters():
            master = safe_get_full_fp32_param(param)  # collective: a full fp32 copy on this GPU; None if frozen
            # To the CPU one at a time: kept on the GPU, all of them (4 bytes a parameter, 27 GB at 6.9B) would not
            # fit beside the training states.
            if master is not None and accelerator.is_main_process:
                state_dict[name] = master.cpu()
            del master
    if not accelerator.is_main_process:
        return {}
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state_dict.items()}


def save_fp32(model, output_dir: str, state_dict: dict) -> None:
    """`model.save_pretrained` with an fp32 `state_dict`, its config saying float32 (the dtype of the weights saved)."""
    model.save_pretrained(output_dir, state_dict=state_dict)
    model.config.dtype = "float32"  # save_pretrained wrote the dtype of the module's bf16 compute copy under DeepSpeed
    model.config.save_pretrained(output_dir)


def push_to_hub(output_dir: str, exp_name: str, hf_entity: Optional[str]) -> None:
    """Upload `output_dir` to {hf_entity}/{base model}__{exp_name}__tldr, on the branch of its run name; the base
    model's name and the run name from its args.json."""
    from huggingface_hub import HfApi  # imported here: without --push_to_hub nothing touches the network

    # The base model's name as the default paths hold it (a Hub id, or a local folder's own name), "/" as "_":
    # one repository for every seed of a stage and base model, as the reference code names them, and never a
    # local path (an absolute --sft_model_path made a name past the Hub's 96 characters, and public).
    recorded = load_json(os.path.join(output_dir, "args.json"))
    repo_name, run_name = recorded["base_model_name"].replace("/", "_"), recorded["run_name"]
    api = HfApi()
    try:
        repo_id = f"{hf_entity or api.whoami()['name']}/{repo_name}__{exp_name}__tldr"
        api.create_repo(repo_id, exist_ok=True)
        api.create_branch(repo_id, branch=run_name, exist_ok=True)  # one branch per run, all seeds in one repo
        api.upload_folder(folder_path=output_dir, repo_id=repo_id, revision=run_name)
    except Exception as error:  # the run itself is saved: say how to push it again
        raise RuntimeError(f"pushing {output_dir} to the Hub failed ({type(error).__name__}); the run is saved there, "
                           "and the same command with --resume pushes it again") from error
    print(f"pushed https://huggingface.co/{repo_id}/tree/{run_name}")


def push_again(output_dir: str, flags: dict) -> None:
    """Rank 0 pushes a finished run's folder to the Hub again, to the repository and branch of its args.json; the
    Hub keeps the files it already has."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"nothing to train: {output_dir} holds the finished run of these flags; pushing it again (--push_to_hub)")
        push_to_hub(output_dir, flags["exp_name"], flags["hf_entity"])


def load_json(path: str) -> dict:
    """The JSON object in the file at `path`; a SetupError naming the file when it is not valid JSON."""
    with open(path) as file:
        try:
            return json.load(file)
        except json.JSONDecodeError as error:  # edited by hand or cut short: say which file, and what to do
            raise SetupError(f"{path} is not valid JSON ({error}): it was edited or cut short after it was written. "
                             "Restore it, or remove the folder it is in and run the stage that wrote it again") from None


def write_atomic(path: str, write) -> None:
    """Create `path` whole or not at all: `write(tmp_path)` writes beside it, then a rename replaces it."""
    # A kill mid-write leaves the old file (or none) and a `.partial` that the next run overwrites;
    # a reader never sees half a results.json. os.replace is atomic within one file system.
    partial = path + ".partial"
    write(partial)
    os.replace(partial, path)


def write_text_atomic(path: str, text: str) -> None:
    """write_atomic for a text file (UTF-8)."""
    def write(partial: str) -> None:
        with open(partial, "w", encoding="utf-8", newline="") as file:
            file.write(text)
    write_atomic(path, write)


def scratch_path(output_dir: str, kind: str) -> str:
    """The sibling of `output_dir` where its final contents are written ("partial"), complete ("new") or retired ("old")."""
    parent, name = os.path.split(os.path.abspath(output_dir))
    return os.path.join(parent, f".{name}.{kind}")


def staging_folder(output_dir: str) -> str:
    """Rank 0: a new, empty sibling folder where the run writes its final model and results (publish_output)."""
    staging = scratch_path(output_dir, "partial")
    shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
    os.makedirs(staging)
    return staging


def publish_output(staging: str, output_dir: str) -> None:
    """Rank 0: the complete `staging` becomes `output_dir` (args.json and the like carried over, checkpoints dropped)."""
    # Written beside and swapped in whole: a kill at any moment leaves the old folder (args.json and the
    # checkpoints, or a finished run's model) or the new one, never a mix; the next start finishes a swap.
    for name in os.listdir(output_dir):
        source, target = os.path.join(output_dir, name), os.path.join(staging, name)
        if name != "checkpoints" and not name.endswith(".partial") and not os.path.exists(target):
            (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, target)
    os.rename(staging, scratch_path(output_dir, "new"))  # complete: from here on, the new folder wins
    finish_publish(output_dir)


def finish_publish(output_dir: str) -> None:
    """Swap a complete `.new` sibling in for `output_dir` (the old one renamed `.old`, then deleted); drop other scratch."""
    new, old = scratch_path(output_dir, "new"), scratch_path(output_dir, "old")
    if os.path.isdir(new):
        if os.path.isdir(output_dir):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(output_dir, old)
        os.rename(new, output_dir)  # between the two renames there is no output_dir, but .old and .new are whole
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(scratch_path(output_dir, "partial"), ignore_errors=True)


def tidy_output_dir(output_dir: str) -> None:
    """Rank 0, at start: finish a swap a kill interrupted, and remove the `.partial` files and folders kills left."""
    finish_publish(output_dir)
    for folder in (output_dir, os.path.join(output_dir, "checkpoints")):
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if name.endswith(".partial"):
                path = os.path.join(folder, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)


def stop_early(accelerator, writer, stop_at: int, num_updates: int) -> None:
    """--stop_after_updates or --stop_after_minutes: the checkpoint is written; close the log (rank 0's writer) and say how to continue."""
    accelerator.print(f"stopped after update {stop_at} of {num_updates}; continue with --resume")
    if writer is not None:
        writer.close()


def leave_process_group(finished: bool) -> None:
    """Every rank, last: leave the process group; after a finished run of several processes, exit at once.

    gloo's worker threads still run after destroy_process_group under DeepSpeed (4 run loops and 2 TCP loops per
    rank), and the interpreter's teardown of them aborted a rank now and then after its outputs were saved (SIGABRT,
    "terminate called without an active exception"; twice in CI). Everything is written and closed by then, so
    os._exit skips that teardown."""
    if not torch.distributed.is_initialized():
        return
    torch.distributed.destroy_process_group()
    if finished:
        wandb = sys.modules.get("wandb")  # os._exit skips the exit handler that closes a W&B run left open
        if wandb is not None and wandb.run is not None:  # (a run stopped early: a finished one closed it itself)
            wandb.finish()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    finished = False
    try:
        main()  # here, at the end, so that every helper below the fence is defined when it runs
        finished = True
    except SetupError as error:  # a flag or input it cannot use: the message, not a traceback, says what to do
        sys.exit(f"SetupError: {error}")
    except RunFinished as done:  # a repeated or requeued start of a finished run: nothing is trained
        if done.flags["push_to_hub"]:  # its push at the end of training may have failed: push it again
            push_again(done.output_dir, done.flags)
        else:
            print(f"nothing to do: {done}")
        finished = True
    except KeyboardInterrupt:  # Ctrl-C: what to do next, not a traceback of wherever it landed
        print("interrupted: each --save_every checkpoint is written whole, so the same command with --resume continues "
              "from the latest one (with none, it starts again at update 0)", file=sys.stderr)
        sys.exit(130)  # the shell's status for Ctrl-C
    finally:
        leave_process_group(finished)

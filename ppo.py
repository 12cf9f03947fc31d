"""PPO from the RM's scores: RLHF of the SFT policy on TL;DR prompts (Details 3, 7, 8, 12, 14, 20-25).

Stage 3 of the pipeline. The policy and a frozen reference start from sft.py's model, the RM and the critic from
reward.py's. Each update samples `response_length` tokens for a batch of SFT prompts, truncates them after the first
EOS, scores them with the RM (-1 without an EOS), adds a per-token KL penalty to the reference, computes GAE
advantages, and takes 4 epochs of clipped PPO steps on policy and critic together. At the end (and every --eval_every
updates) the RM scores the policy's summaries of validation prompts (temperature 0.01) beside the human references.

    {output_dir}/                   the policy: a causal-LM folder + tokenizer (loads with from_pretrained)
    {output_dir}/args.json          these flags, derived sizes, run name, eos / pad ids, tokenizer_identity, input_args_json, launch, git commit
    {output_dir}/eval_{split}.csv   columns query, response, reference, score, reference_score (judge.py)
    {output_dir}/eval_metrics.json  {split: {score, reference_score, eos_fraction, response_length}}
    {output_dir}/checkpoints/       the latest --save_every checkpoint (no pickle; DeepSpeed's own files read weights-only), removed at the end
    runs/{run_name}/                TensorBoard; samples_{split}_{episode}.csv of every evaluation

    # tiny world, offline, 1.1-3 min on 2 CPU cores, by CPU and hour (as benchmark/tiny.sh): win rate vs the references 0.508 (SFT 0.338)
    python ppo.py --base_model assets/tiny_world/pythia-tiny --query_dataset data/tiny_tldr/sft \
        --sft_model_path models/tiny/sft_1 --reward_model_path models/tiny/reward_1 \
        --output_dir models/tiny/ppo_1 --seed 1 --total_episodes 1280 --batch_size 64 --local_micro_batch_size 16 \
        --lr 1e-4 --response_length 44 --local_eval_batch_size 128 --eval_every 5 --zero_critic_head
    # one GPU, Pythia 1B, bf16 autocast (512 = 16 x 32 accumulation steps, the paper's micro-batch; memory unmeasured)
    accelerate launch --num_processes 1 --mixed_precision bf16 ppo.py \
        --base_model EleutherAI/pythia-1b-deduped --local_micro_batch_size 16 --save_every 50
    # the paper's run at 1B: 8xH100, ZeRO-2, bf16 (512 = 16 x 4 x 8 processes; every size: knobs.sh); 6.9B: --offload
    accelerate launch --config_file benchmark/accelerate/deepspeed_zero2.yaml ppo.py --seed 44413 --track --save_every 50 \
        --base_model EleutherAI/pythia-1b-deduped --local_micro_batch_size 16 --local_rollout_forward_batch_size 64

Logged (TensorBoard, W&B with --track; x-axis = episodes; t: a response's valid tokens; vs the reference: docs/details.md):
  objective/kl | non_score_reward  mean over responses of sum_t (logp - ref_logp) | the same x -kl_coef
  objective/entropy           mean over responses of sum_t of the sampling entropy
  objective/scores | rlhf_reward  mean RM score after the EOS trick (-1 without an EOS) | scores + non_score_reward
  objective/eos_fraction      fraction of responses that contain an EOS
  objective/response_length   mean tokens per response, EOS included
  objective/validation_score  mean RM score of the validation samples (at each evaluation)
  policy/approxkl             mean over micro-batches (all epochs) of the masked 0.5 * (logp_new - logp_old)^2
  policy/clipfrac             the same mean of the fraction of valid tokens whose clipped loss term is the larger
  policy/ratio                the same mean of the ratio exp(logp_new - logp_old) over valid tokens
  policy/ratio_first_epoch[_max_deviation]  its mean (max |ratio - 1|) before the first step: 1 up to (bf16) noise
  policy/loss | lr            clipped policy loss | learning rate of the update
  value/loss                  0.5 * the larger of the clipped and unclipped squared errors of the values
  value/clipfrac              the same mean of the fraction of value tokens where the clipped error was the larger
  time/episodes_per_second    episodes / wall time since the start
  time/generation|scoring|training  seconds of the update in sampling / no-grad forwards / PPO epochs
  eval/ppo/{split}/score|reference_score|eos_fraction|response_length  final (and periodic) evaluation
"""

import functools
import gc
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
import torch.nn.functional as F
import tyro
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, gather_object
from huggingface_hub.utils import HFValidationError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache,
                          GPTNeoXModel, PretrainedConfig, PreTrainedModel, StaticCache)


@dataclass
class Args:
    """PPO on TL;DR prompts (see the module docstring of ppo.py)."""

    # experiment & tracking
    exp_name: str = "ppo"
    """Experiment name: part of the run name and of the Hub repo id"""
    seed: int = 1
    """Seed of the prompt order, sampling and minibatch shuffles (paper: 44413 55513 66613 77713)"""
    run_name: Optional[str] = None
    """Run name for runs/ and W&B (None: {exp_name}__{base model}__{seed}__{unix time}; a resumed run keeps its own)"""
    track: bool = False
    """Also log to Weights & Biases (off: nothing networked)"""
    wandb_project_name: str = "tldr_summarize"
    """W&B project (with --track)"""
    wandb_entity: Optional[str] = None
    """W&B entity (with --track; None: the default of the logged-in user)"""
    output_dir: Optional[str] = None
    """Folder for the trained policy, tokenizer, args.json, eval tables and checkpoints (None: models/{base_model}/ppo_{seed})"""
    push_to_hub: bool = False
    """Push the output folder to {hf_entity}/{base model name}__{exp_name}__tldr at revision run_name (with --resume, a finished run is pushed again)"""
    hf_entity: Optional[str] = None
    """Hub user or organisation to push to (None: the logged-in user, from `whoami()`)"""
    save_every: int = 0
    """Save a checkpoint (policy, critic, optimizer, RNG states, update) every N updates (0: never)"""
    resume: bool = False
    """Continue from the latest checkpoint in {output_dir}/checkpoints (none there: start at update 0); required when there is one"""
    stop_after_updates: Optional[int] = None
    """Checkpoint and exit after this many updates, as a time-limited SLURM job would; rerun with --resume"""
    stop_after_minutes: Optional[float] = None
    """Checkpoint and exit at the first update ending this many minutes in (a job's time limit); rerun with --resume"""

    # data
    query_dataset: Optional[str] = None
    """SFT dataset whose train queries are the prompts: a folder of preprocess_tldr.py (e.g. data/tldr/sft) or a Hub id (None: data/{base_model}/tldr/sft)"""
    total_episodes: int = 1_000_000
    """Prompts (episodes) to sample in all (Detail 20; paper: 1,000,000, about 8.6 passes over 116,722)"""
    eval_every: int = 0
    """Also evaluate every N updates (0: only at the end)"""
    eval_test: bool = False
    """Also evaluate on the test split at the end (validation is always evaluated)"""
    num_eval_samples: Optional[int] = None
    """Evaluate on the first N rows of each eval split (None: all; 0: skip evaluation)"""

    # model
    base_model: Optional[str] = None
    """Base model the SFT model was fine-tuned from, as given to sft.py: names the default paths and the Hub repo (None: the one the SFT model's args.json records, else EleutherAI/pythia-1b-deduped)"""
    sft_model_path: Optional[str] = None
    """SFT model (sft.py's output folder or a Hub id): the policy's and the reference policy's start (None: models/{base_model}/sft_{seed})"""
    reward_model_path: Optional[str] = None
    """Reward model (reward.py's output folder): the scorer and the critic's start (Detail 22) (None: models/{base_model}/reward_{seed})"""
    response_length: int = 53
    """Tokens sampled per prompt, past the EOS (Detail 23; paper: 53): sampling stops early only once every row has an EOS"""
    temperature: float = 0.7
    """Sampling temperature of the rollouts (Detail 20; paper: 0.7)"""
    eval_temperature: float = 0.01
    """Sampling temperature of the evaluation (reference code: 0.01; the paper states none)"""
    fast_sampling: bool = False
    """Sample rollouts and evaluations with StaticSampler (a static KV cache and a compiled one-token step): the same tokens as the plain loop in fp32 (in bf16 on a GPU rounding moves ~1-2% of draws), 1.35-1.98x faster than HF generate on CPU, 1.8-2.5x the plain loop at 1B on one H100 / H200; its compile (25-60 s per process and rank, cold) pays off only after ~20-200 updates on a CPU, hence off by default (the SLURM launchers turn it on; benchmark/README.md); not with ZeRO-3"""
    compile_training: bool = False
    """Compile each GPT-NeoX layer of policy and critic but the last (torch.compile, one region a layer) for the PPO epochs' forwards and backwards only: the same outputs up to float rounding; inside ppo.py at 1B on one H200, the training phase took 0.936x the eager one's time, as close to fp32 as eager (benchmark/results/gpu_check.md), for ~12-17 s of compiling per process; on a CPU 0.95-1.02x, and never with bf16, hence off by default (the SLURM launchers turn it on); not with ZeRO-3"""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of policy and critic (memory for compute), in every layer but the last (run on the response window only)"""
    offload: bool = False
    """Run the reference policy and the RM as DeepSpeed ZeRO-3 inference engines with CPU offload (6.9B)"""

    # optimization
    lr: float = 3e-6
    """AdamW learning rate, decayed linearly to 0 over the updates (Detail 20; paper: 3e-6)"""
    eps: float = 1e-5
    """AdamW epsilon (Detail 20; paper: 1e-5)"""
    weight_decay: float = 0.01
    """AdamW weight decay (torch's default, which the reference code uses without saying so)"""
    batch_size: int = 512
    """Global episodes per update = local_micro_batch_size x gradient_accumulation_steps x num_minibatches x world_size (Detail 20; paper: 512)"""
    num_minibatches: int = 1
    """Minibatches per PPO epoch, one optimizer step each (Detail 20; paper: 1)"""
    local_micro_batch_size: int = 1
    """Episodes per training forward pass per rank; the losses are token means per micro-batch (as in the reference code), so this also weighs the tokens (the paper's runs: 16 / 4 / 1 at 1B / 2.8B / 6.9B, benchmark/knobs.sh)"""
    length_groups: int = 1
    """Speed only: the rows of a training micro-batch, and of the rollout's reference, critic and RM forwards (not those of --offload's engines), sorted by query length into at most this many forwards, each as wide as its longest query (1: one forward; only the float rounding changes)"""
    local_rollout_forward_batch_size: int = 64
    """Prompts per sampling call and per no-grad forward per rank: memory, and which random draws each prompt gets (other samples, from the same distribution)"""
    local_eval_batch_size: int = 4
    """Eval prompts per sampling call per rank"""

    # algorithm
    num_ppo_epochs: int = 4
    """Passes over each batch (Detail 20; paper: 4)"""
    kl_coef: float = 0.05
    """KL coefficient beta of the per-token penalty -beta * (logp - ref_logp) (Detail 20; paper: 0.05)"""
    gamma: float = 1.0
    """Discount factor (Detail 20; paper: 1)"""
    lam: float = 0.95
    """GAE lambda (Detail 20; paper: 0.95)"""
    cliprange: float = 0.2
    """Policy ratio clip (Detail 20; paper: 0.2)"""
    cliprange_value: float = 0.2
    """Value clip around the rollout values (Detail 20; paper: 0.2)"""
    vf_coef: float = 0.1
    """Value loss coefficient (Detail 20; paper: 0.1)"""
    whiten_rewards: bool = False
    """Whiten the rewards without shifting their mean (Detail 24; paper's released runs: off)"""
    non_eos_penalty: bool = True
    """EOS trick: replace the score of a response without EOS by penalty_reward_value (Detail 23; paper: on)"""
    penalty_reward_value: float = -1.0
    """Score of a response without EOS (Detail 23; paper: -1)"""
    score_after_eos: bool = False
    """Add the score one token after the EOS, as the reference code does (default: on the EOS, as the paper)"""
    zero_critic_head: bool = False
    """Start the critic's head at 0 (first values 0), its backbone still the RM's (default: the RM's head too, Detail 22). For short runs: the head's outputs before the EOS were never trained (Detail 13), and over 20 updates, not the paper's 1,953, they steer PPO toward an early EOS (benchmark/results/compare_worlds_rebuilt.md)"""

    # derived (computed right after parsing; not flags)
    world_size: tyro.conf.Suppress[int] = 1
    """Processes (ranks) started by accelerate launch"""
    local_batch_size: tyro.conf.Suppress[int] = 1
    """Episodes per update per rank = batch_size / world_size"""
    mini_batch_size: tyro.conf.Suppress[int] = 1
    """Episodes per optimizer step over all ranks = batch_size / num_minibatches"""
    local_mini_batch_size: tyro.conf.Suppress[int] = 1
    """Episodes per optimizer step per rank = local_batch_size / num_minibatches"""
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 1
    """Micro-batches per optimizer step per rank = local_mini_batch_size / local_micro_batch_size"""
    micro_batch_size: tyro.conf.Suppress[int] = 1
    """Episodes per forward pass over all ranks = local_micro_batch_size x world_size"""
    num_updates: tyro.conf.Suppress[int] = 0
    """PPO updates = total_episodes // batch_size (paper: 1,000,000 // 512 = 1953)"""


def reward_indices(query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> torch.Tensor:
    """(B, T) ids -> (B,): the EOS position = first pad at or after `context_length`, minus 1 (T - 1 if none)."""
    # Detail 12: Extract the reward at the EOS token
    # Only the EOS position has read the whole summary, so only its output is trained and read as the reward.
    # PPO's rows are a left-padded query ++ a right-padded response: the search for a pad starts after the query.
    return first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length


def get_reward(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> tuple:
    """(B, T) ids with pads -> ((B, T) per-token reward logits, (B,) reward at each row's EOS)."""
    attention_mask = query_responses != pad_token_id  # (B, T)
    # Pads are masked out of attention and replaced by a valid id.
    # No position_ids, as in the reference code: left pads shift the positions, which rotary embeddings do not see.
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    reward_logits = model(input_ids=input_ids, attention_mask=attention_mask)  # (B, T)
    eos = reward_indices(query_responses, pad_token_id, context_length)  # (B,)
    return reward_logits, reward_logits[torch.arange(reward_logits.size(0), device=eos.device), eos]


def get_values(critic, query_responses: torch.Tensor, pad_token_id: int, context_length: int, groups: int = 1):
    """(B, T) ids -> (B, T_resp) values V(s_t) before each response token: get_reward(critic, ...)[0][:, T_q - 1:-1]."""
    # The critic is a trained copy of the RM (Detail 22): its output at t, having read the tokens up to t, is V(s_t).
    return response_outputs(critic, query_responses, pad_token_id, context_length, groups)[:, :-1]


def eos_trick(scores: torch.Tensor, contains_eos: torch.Tensor, penalty_reward_value: float) -> torch.Tensor:
    """(B,) RM scores, (B,) bool -> (B,) scores, replaced by `penalty_reward_value` where there is no EOS."""
    # Detail 23: EOS trick
    # At most response_length tokens, truncated after the first EOS (the reference code always samples all of them).
    # Without an EOS the RM's score is undefined (it is trained on the EOS logit only): REPLACE it, do not decrease it.
    # The constant (-1) also teaches the policy to stop in time.
    return torch.where(contains_eos, scores, torch.full_like(scores, penalty_reward_value))


def response_masks(postprocessed_responses: torch.Tensor, pad_token_id: int, score_after_eos: bool) -> tuple:
    """(B, T) truncated responses -> ((B,) EOS index, (B, T) token padding mask, (B, T) value padding mask).

    EOS index = first pad - 1 (T - 1 without a pad: no EOS, or one on the last token). Masks: True where NOT trained.
    Tokens: after the EOS. Values: after the token that carries the score (the EOS, or EOS + 1 with score_after_eos)."""
    # Detail 3: Leading space, EOS at the end, a distinct [PAD]
    # [PAD] is never the EOS (check_tokenizer refuses that): the first pad of a truncated response comes after its EOS.
    eos_index = first_true_indices(postprocessed_responses == pad_token_id) - 1  # (B,): the reference's sequence_lengths
    positions = torch.arange(postprocessed_responses.size(1), device=postprocessed_responses.device)  # (T,)
    padding_mask = positions.unsqueeze(0) > eos_index.unsqueeze(1)  # (B, T)
    value_padding_mask = positions.unsqueeze(0) > (eos_index + int(score_after_eos)).unsqueeze(1)
    return eos_index, padding_mask, value_padding_mask


def compute_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, scores: torch.Tensor,
                    eos_index: torch.Tensor, padding_mask: torch.Tensor, kl_coef: float,
                    score_after_eos: bool) -> tuple:
    """(B, T) log-probs of policy and reference, (B,) scores -> (B, T) rewards, (B, T) kl, (B, T) -kl_coef * kl."""
    kl = (logprobs - ref_logprobs).masked_fill(padding_mask, 0.0)  # (B, T): 0 after the EOS
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    # The score goes on the EOS token, as in the paper (Figure 11).
    # The reference code puts it one token later when there is room (score_after_eos).
    # A response without EOS gets it on its last token.
    index = eos_index + int(score_after_eos)  # (B,)
    index = torch.where(index < rewards.size(1), index, eos_index)
    rewards[torch.arange(rewards.size(0), device=rewards.device), index] += scores
    return rewards, kl, non_score_reward


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, all_reduce=None) -> torch.Tensor:
    """(B, T) values, (B, T) bool mask of valid positions -> (B, T) whitened values, 0 where not valid.

    Mean and biased variance over the valid positions of every process (`all_reduce` sums over them; None: this one)."""
    all_reduce = all_reduce or (lambda tensor: tensor)
    weights = mask.to(values.dtype)
    total, count = all_reduce(torch.stack([(values * weights).sum(), weights.sum()]))
    mean = total / count
    variance = all_reduce(((values - mean) ** 2 * weights).sum()) / count
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:  # Detail 24 keeps the rewards' mean: only their scale changes
        whitened = whitened + mean
    return whitened * weights


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple:
    """(B, T) rewards and values (0 where not valid) -> ((B, T) GAE advantages, (B, T) returns = A + V)."""
    advantages_reversed, last_gae = [], torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.size(1))):
        next_value = values[:, t + 1] if t + 1 < rewards.size(1) else torch.zeros_like(values[:, t])  # V_T = 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # (B, T)
    return advantages, advantages + values


def ppo_losses(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               vpred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, token_mask: torch.Tensor,
               value_mask: torch.Tensor, cliprange: float, cliprange_value: float) -> dict:
    """(B, T) tensors and bool masks of valid tokens / values -> {pg_loss, vf_loss, and masked statistics}."""
    # Value loss: the larger of the clipped and the unclipped squared error (PPO's pessimism).
    # Clipped, the new value moves at most cliprange_value away from the rollout's.
    vpred_clipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1, vf_losses2 = (vpred - returns) ** 2, (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), value_mask)
    # Policy loss: the clipped surrogate objective, negated.
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses1, pg_losses2), token_mask)
    return {"pg_loss": pg_loss, "vf_loss": vf_loss, "approxkl": 0.5 * masked_mean(log_ratio ** 2, token_mask),
            "ratio": masked_mean(ratio, token_mask), "ratio_max_deviation": ((ratio - 1).abs() * token_mask).max(),
            "pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).float(), token_mask),
            "vf_clipfrac": masked_mean((vf_losses2 > vf_losses1).float(), value_mask)}


def rollout(args, policy, ref_policy, critic, reward_model, queries: torch.Tensor, sample, pad_token_id: int,
            eos_token_id: int, temperature: float, unsampled: torch.Tensor) -> tuple:
    """No grad: (B, T_q) queries -> ({query_responses (B, T) untruncated; logprobs, entropy, ref_logprobs, values
    (B, T_resp); scores (B,) before the EOS trick}, seconds spent sampling)."""
    context_length, groups = queries.shape[1], args.length_groups  # groups: the scoring forwards' (speed only)
    out = {key: [] for key in ("query_responses", "logprobs", "entropy", "ref_logprobs", "values", "scores")}
    generation_time = 0.0
    for start in range(0, len(queries), args.local_rollout_forward_batch_size):  # chunks: memory, and the draws' order
        query = queries[start:start + args.local_rollout_forward_batch_size]  # (b, T_q)
        tick = time.time()
        # Always response_length columns: sampled past a row's EOS until every row has one; truncate_response cuts them.
        # (b, T_q + T_resp) ids, and (b, T_resp, V) "scores" (HF generate's name): the logits sampled from / temperature.
        query_response, sample_scores = sample(policy, query, pad_token_id, eos_token_id, args.response_length,
                                               temperature, unsampled)
        response = query_response[:, context_length:]  # (b, T_resp)
        # The behaviour log-probs come from the sampling scores: no second forward of the policy.
        out["logprobs"].append(gather_logprobs(sample_scores, response))
        out["entropy"].append(entropy_from_logits(sample_scores))
        del sample_scores  # (b, T_resp, V): the largest tensor of the rollout
        generation_time += time.time() - tick
        # The reference policy's log-probs of the untruncated response, at the same temperature, on the policy's support.
        ref_logits = response_logits(ref_policy, query_response, pad_token_id, context_length, groups)
        out["ref_logprobs"].append(gather_logprobs(scaled_logits(ref_logits, temperature, unsampled), response))
        del ref_logits  # (b, T_resp, V): freed before the critic's forward
        out["values"].append(get_values(critic, query_response, pad_token_id, context_length, groups).float())
        # Detail 14: Left- vs right-padded reward extraction
        # PPO scores the left-padded query followed by its right-padded (truncated) response.
        # The RM was trained on right-padded rows: the two layouts give the same reward (reward.py measures it).
        postprocessed = truncate_response(response, eos_token_id, pad_token_id)
        score = get_score(reward_model, torch.cat((query, postprocessed), 1), pad_token_id, context_length, groups)
        out["query_responses"].append(query_response)
        out["scores"].append(score.float())
    return {key: torch.cat(value) for key, value in out.items()}, generation_time


def ppo_epochs(accelerator, model, optimizer, args, batch: dict, context_length: int, pad_token_id: int,
               temperature: float, unsampled: torch.Tensor) -> tuple:
    """All ranks: num_ppo_epochs passes of clipped PPO steps over the rollout `batch` ({name: (B_loc, ...)})
    -> ({policy/* and value/* statistic: scalar; the max deviation: all ranks'}, each micro-batch's pg and vf loss)."""
    stats = {key: [] for key in ("pg_loss", "vf_loss", "pg_clipfrac", "vf_clipfrac", "approxkl", "ratio",
                                 "ratio_max_deviation")}
    responses, logprobs, values = batch["responses"], batch["logprobs"], batch["values"]
    for epoch in range(args.num_ppo_epochs):
        permutation = torch.randperm(args.local_batch_size, device=accelerator.device)
        for mini_start in range(0, args.local_batch_size, args.local_mini_batch_size):
            for micro_start in range(mini_start, mini_start + args.local_mini_batch_size, args.local_micro_batch_size):
                mb = permutation[micro_start:micro_start + args.local_micro_batch_size]  # (micro,) rows
                # Positions from n on are masked in every row of the micro-batch (after its EOS and value target).
                n = trained_width(batch["eos_index"][mb], responses.size(1), args.score_after_eos)
                with accelerator.accumulate(model):
                    # (micro, n, V), (micro, n): the first n columns of logits[:, context_length - 1 : -1] and values
                    logits, vpred = response_logits_and_values_by_length(model, batch["query_responses"][mb],
                                                                         pad_token_id, context_length, n, args.length_groups)
                    logits = scaled_logits(logits, temperature, unsampled)  # as sampled: same T, same support
                    # Back to (micro, T_resp): the masked positions take the rollout's values (ratio 1, no loss).
                    new_logprobs = torch.cat((gather_logprobs(logits, responses[mb, :n]), logprobs[mb, n:]), 1)
                    vpred = torch.cat((vpred.float(), values[mb, n:]), 1)
                    micro_stats = ppo_losses(new_logprobs, logprobs[mb], batch["advantages"][mb], vpred, values[mb],
                                             batch["returns"][mb], ~batch["padding_mask"][mb],
                                             ~batch["value_padding_mask"][mb], args.cliprange, args.cliprange_value)
                    loss = micro_stats["pg_loss"] + args.vf_coef * micro_stats["vf_loss"]  # no entropy bonus
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                for key, value in micro_stats.items():
                    stats[key].append(value.detach())
            if epoch == 0 and mini_start == 0:  # before the first optimizer step: must be 1
                ratio_first_epoch = torch.stack(stats["ratio"]).mean()
                first_deviation = torch.stack(stats["ratio_max_deviation"]).max()  # this rank's
    losses = torch.stack(stats["pg_loss"] + stats["vf_loss"])  # every micro-batch's, for the finite check
    means = {key: torch.stack(value).mean() for key, value in stats.items()}
    return {"policy/approxkl": means["approxkl"], "policy/clipfrac": means["pg_clipfrac"],
            "policy/ratio": means["ratio"], "policy/ratio_first_epoch": ratio_first_epoch, "policy/loss": means["pg_loss"],
            "policy/ratio_first_epoch_max_deviation": accelerator.gather(first_deviation.reshape(1)).max(),
            "value/loss": means["vf_loss"], "value/clipfrac": means["vf_clipfrac"]}, losses


def main() -> None:
    """The stage, top to bottom (run at the end of the file, once the plumbing below the fence is defined)."""
    # ---- args & sizes ----
    args = tyro.cli(Args, use_underscores=True)  # --help shows --flag_name as the docs write it; --flag-name works too
    accelerator = start_ppo_accelerator(args)  # every flag is checked first; sets the derived sizes
    # Detail 8: Tech stack
    # `accelerate launch` decides the backend: one CPU process, DDP, or DeepSpeed ZeRO-2 with bf16.
    # One optimizer step per minibatch, accumulated over its micro-batches.
    # DeepSpeed is told the accumulation (else the accelerate config's number wins), the micro-batch, and no clipping.
    accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps
    if accelerator.state.deepspeed_plugin is not None:
        accelerator.state.deepspeed_plugin.deepspeed_config.update(
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            train_micro_batch_size_per_gpu=args.local_micro_batch_size, gradient_clipping=0.0)
    # T + 1e-7, as in the reference code: its log-probs, to the bit (T <= 0 is refused at start).
    # The one divisor of every log-prob (scaled_logits).
    temperature, eval_temperature = args.temperature + 1e-7, args.eval_temperature + 1e-7

    # ---- data and tokenizer: every bad input fails here, before a model is loaded or anything is written ----
    dataset, eval_splits, tokenizer, recorded = ppo_inputs(args, accelerator)  # also fills in the default paths
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    train = dataset["train"].with_format("torch", columns=["query_token"])
    context_length = train[0]["query_token"].shape[0]  # T_q: every query is left-padded to this width
    resume_from = checkpoint_to_resume(args, accelerator)  # with --resume: the latest checkpoint, if it fits

    # ---- seeding & data order ----
    seed_everything(args.seed + accelerator.process_index * 100003)  # sampling differs per rank
    # Detail 21: Reuse the SFT prompts, reshuffle at each pass
    # 1M episodes are ~8.6 passes over the SFT train split, each pass a fresh permutation.
    # Seeded alike on every rank: update u, rank r reads the slice [u, r], and no prompt repeats within a pass.
    order = episode_order(len(train), args.num_updates * args.batch_size, args.seed)
    local_order = order.view(args.num_updates, args.world_size, args.local_batch_size)[:, accelerator.process_index]

    # ---- models, run name & logging ----
    policy = load_fp32(AutoModelForCausalLM, args.sft_model_path, "--sft_model_path")
    ref_policy = load_fp32(AutoModelForCausalLM, args.sft_model_path, "--sft_model_path")
    # Detail 22: Value model initialised from the RM
    # The critic: a trainable copy of the RM, its head's normalising bias (Detail 15) too; first values: its outputs.
    critic = load_fp32(ScalarModel, args.reward_model_path, "--reward_model_path")
    if args.zero_critic_head:  # first values 0, the backbone still the RM's: a short run's start (see Args)
        torch.nn.init.zeros_(critic.head.weight), torch.nn.init.zeros_(critic.head.bias)
    reward_model = load_fp32(ScalarModel, args.reward_model_path, "--reward_model_path")
    refuse(model_problems(args, tokenizer, policy, critic))
    unsampled = torch.tensor(unsampled_token_ids(tokenizer, policy.get_output_embeddings().weight.size(0)), device=accelerator.device)
    # Detail 7: Disable dropout
    # With dropout on, two forwards of the same ids differ: the first PPO ratio would not be 1, the scores noisy.
    for network in (policy, ref_policy, critic, reward_model):
        disable_dropout(network)
    ref_policy.eval().requires_grad_(False), reward_model.eval().requires_grad_(False)
    if args.offload:  # the frozen models as ZeRO-3 inference engines, their parameters on the CPU (6.9B)
        ref_policy, reward_model = offload_frozen_models(accelerator, args, ref_policy, reward_model)
    run_name, writer = start_ppo_logging(args, accelerator, resume_from, recorded)

    # ---- optimizer ----
    # Detail 20: PPO setup
    # Table 7: AdamW (eps 1e-5) with lr 3e-6 decayed linearly, one optimizer over policy and critic.
    # Batch 512 in 1 minibatch, 4 epochs, KL 0.05, gamma 1, lambda 0.95, clips 0.2 / 0.2, vf 0.1, T 0.7.
    # One module: one prepare, one optimizer, one backward (and --compile_training, --gradient_checkpointing).
    model = PolicyAndValueWrapper(policy, critic, args.compile_training, args.gradient_checkpointing)
    optimizer = adamw(model.parameters(), args, accelerator.device)  # fused on a GPU (below the fence)
    model, optimizer = accelerator.prepare(model, optimizer)
    ref_policy, reward_model = frozen_like_trained(accelerator, args.offload, model, ref_policy, reward_model)
    start_update = resume(accelerator, args, resume_from, model, optimizer)
    unwrapped = accelerator.unwrap_model(model)  # sampling and the rollout's forwards use the plain modules
    # HF generate's sampling (softmax(logits / T), [PAD] and unowned rows masked): a loop that stops once every row
    # has its EOS, or the fast path (a static cache and a compiled step, a chunk's rows), the same samples in fp32.
    chunk = min(args.local_rollout_forward_batch_size, args.local_batch_size)  # rollout()'s chunks
    sample_responses = StaticSampler(chunk) if args.fast_sampling else sample_rollout
    sample_summaries = summary_sampler(args, pad_id, eos_id, eval_temperature, unsampled)  # the same, at T_eval
    evaluate = functools.partial(evaluate_and_log, accelerator, args, dataset, unwrapped.policy, reward_model,
                                 tokenizer, sample_summaries, writer, run_name)

    # ---- training loop ----
    start_clock = time.time()
    stop_at = args.num_updates if args.stop_after_updates is None else min(args.stop_after_updates, args.num_updates)
    progress = tqdm(range(start_update, stop_at), desc="ppo", disable=not accelerator.is_main_process)
    for update in progress:
        # 0. Learning rate: linear decay from lr (first update) towards 0 (last update: lr / num_updates).
        lr = args.lr * (1.0 - update / args.num_updates)
        optimizer.param_groups[0]["lr"] = lr
        queries = train[local_order[update].tolist()]["query_token"].to(accelerator.device)  # (B_loc, T_q)

        # 1. Rollout: sample responses, then score them with the frozen models and the critic.
        clock = time.time()
        unwrapped.eval()  # no dropout either way; eval() lets the sampler keep its KV cache under checkpointing
        with torch.no_grad(), accelerator.autocast():
            batch, generation_time = rollout(args, unwrapped.policy, ref_policy, unwrapped.critic, reward_model,
                                             queries, sample_responses, pad_id, eos_id, temperature, unsampled)
        unwrapped.train()  # policy and critic: checkpointing recomputes only in train mode (from_pretrained: eval)
        responses = batch["query_responses"][:, context_length:]  # (B_loc, T_resp)
        postprocessed_responses = truncate_response(responses, eos_id, pad_id)
        scoring_time = time.time() - clock - generation_time

        # 2. EOS trick: a response without EOS gets penalty_reward_value as its score.
        contains_eos = (postprocessed_responses == eos_id).any(dim=1)  # (B_loc,)
        scores = batch["scores"]
        if args.non_eos_penalty:
            scores = eos_trick(scores, contains_eos, args.penalty_reward_value)

        # 3. Masks: tokens after the EOS are not trained; values also not after the scored token.
        eos_index, padding_mask, value_padding_mask = response_masks(postprocessed_responses, pad_id, args.score_after_eos)
        values = batch["values"].masked_fill(value_padding_mask, 0.0)

        # 4. Per-token rewards: -kl_coef * (logp - ref_logp) up to the EOS, plus the score on the EOS (or one later).
        rewards, kl, non_score_reward = compute_rewards(batch["logprobs"], batch["ref_logprobs"], scores, eos_index,
                                                        padding_mask, args.kl_coef, args.score_after_eos)
        sum_over_processes = lambda tensor: accelerator.reduce(tensor, reduction="sum")  # noqa: E731
        if args.whiten_rewards:
            # Detail 24: Reward whitening is optional
            # Rescale the rewards to unit std around their mean (kept), over all valid positions of all processes.
            rewards = whiten(rewards, ~value_padding_mask, shift_mean=False, all_reduce=sum_over_processes)

        # 5. GAE over the response positions; returns before the advantages are whitened.
        advantages, returns = compute_gae(rewards, values, args.gamma, args.lam)
        # Detail 25: Advantage whitening
        # Zero mean, unit variance over every valid token of the whole batch.
        # Global statistics: the reference code whitens per GPU, so its normalisation changed with the GPU count.
        advantages = whiten(advantages, ~padding_mask, shift_mean=True, all_reduce=sum_over_processes)

        # 6. PPO epochs: shuffle, split into minibatches (one optimizer step each) of micro-batches.
        clock = time.time()
        batch.update(responses=responses, values=values, advantages=advantages, returns=returns, padding_mask=padding_mask,
                     value_padding_mask=value_padding_mask, eos_index=eos_index)
        ppo_stats, losses = ppo_epochs(accelerator, model, optimizer, args, batch, context_length, pad_id,
                                       temperature, unsampled)
        training_time = time.time() - clock

        # 7. Log: per-rank means, averaged over ranks (every rank holds local_batch_size episodes).
        valid = (~padding_mask).float()
        mean_kl, mean_non_score = kl.sum(1).mean(), non_score_reward.sum(1).mean()
        stats = {"objective/kl": mean_kl, "objective/entropy": (batch["entropy"] * valid).sum(1).mean(),
                 "objective/non_score_reward": mean_non_score, "objective/scores": scores.mean(),
                 "objective/rlhf_reward": scores.mean() + mean_non_score, "objective/response_length": valid.sum(1).mean(),
                 "objective/eos_fraction": contains_eos.float().mean(), **ppo_stats}
        means = {key: value.item() for key, value in accelerator.reduce(stats, reduction="mean").items()}
        episode = (update + 1) * args.batch_size
        timings = {"time/generation": generation_time, "time/scoring": scoring_time, "time/training": training_time,
                   "time/episodes_per_second": (episode - start_update * args.batch_size) / (time.time() - start_clock)}
        log_update(writer, progress, episode, {**means, **timings, "policy/lr": lr})
        due = args.eval_every and (update + 1) % args.eval_every == 0 and update + 1 < args.num_updates
        if due and all_finite(accelerator, model, losses):  # a nan / inf policy is not sampled
            evaluate(("validation",), episode)  # before the checkpoint: a resumed run draws what an unbroken one draws
        if check_and_checkpoint(accelerator, args, update + 1, losses, run_name, model, optimizer):
            stop_at = update + 1  # --stop_after_minutes have passed: checkpointed, stop here (a nan / inf raises)
            break
    if stop_at < args.num_updates:  # a time-limited job: the checkpoint is written, continue with --resume
        return stop_early(accelerator, writer, max(stop_at, start_update), args.num_updates)

    # ---- evaluation: summaries sampled at eval_temperature, scored by the RM beside the references ----
    all_metrics = evaluate(eval_splits, args.num_updates * args.batch_size)

    # ---- save ----
    save_ppo(accelerator, args, run_name, writer, model, tokenizer, all_metrics)


# ---- plumbing and fast paths: no Detail below ----
# The RM as ppo.py loads it; the forwards of the response window only (fast paths).


class ScalarModelConfig(PretrainedConfig):
    """Config of ScalarModel: the backbone's config as a plain dict (no path: it loads anywhere)."""

    model_type = "scalar_model"

    def __init__(self, base_config: Optional[dict] = None, **kwargs):
        super().__init__(**kwargs)
        self.base_config = base_config or {}


class ScalarModel(PreTrainedModel):
    """A transformer backbone + Linear(hidden, 1): (B, T) ids -> (B, T) per-token outputs (reward.py's RM, loaded)."""

    config_class = ScalarModelConfig

    def __init__(self, config: ScalarModelConfig):
        super().__init__(config)
        # Built from the stored config (never a path: it loads anywhere), in the loader's dtype, not the stored one.
        self.backbone = AutoModel.from_config(AutoConfig.for_model(**config.base_config), dtype=torch.get_default_dtype())
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)  # its bias carries the RM's normalisation
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) ids, (B, T) padding mask -> (B, T) scalar per position (the last hidden state through the head)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, d)
        return self.head(hidden).squeeze(-1)


def response_logits(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int,
                    groups: int = 1) -> torch.Tensor:
    """== model(input_ids=ids, pads as 0, attention_mask=ids != pad).logits[:, context_length - 1 : -1]

    (B, T) query ++ response ids -> (B, T_resp, V): the logits that predict the response tokens, from a forward of
    the response window only (response_window) whose last layer runs at the response positions only
    (last_hidden_states), the rows in `groups` forwards by query length (by_query_length; not for a DeepSpeed
    engine, whose every forward gathers its weights anew); tests/test_ppo.py checks the equality."""
    if groups > 1 and isinstance(model, PreTrainedModel):
        forward = lambda rows: response_logits(model, rows, pad_token_id, context_length)  # noqa: E731
        return by_query_length(forward, query_responses, pad_token_id, context_length, groups)
    response_length = query_responses.shape[1] - context_length
    input_ids, attention_mask, position_ids = response_window(query_responses, pad_token_id, context_length,
                                                              response_length)
    if not isinstance(model, PreTrainedModel):  # a DeepSpeed engine (--offload) runs its own forward
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     logits_to_keep=response_length, return_dict=True).logits
    hidden = last_hidden_states(model.base_model, input_ids, attention_mask, position_ids, response_length)
    return model.get_output_embeddings()(hidden)  # (B, T_resp, V): what logits_to_keep computes, bit for bit


def response_outputs(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int,
                     groups: int = 1, window: bool = False) -> torch.Tensor:
    """== get_reward(model, query_responses, pad_token_id, context_length)[0][:, context_length - 1:]

    (B, T) query ++ response ids -> (B, T_resp + 1): a ScalarModel's outputs from the last query position on, from a
    forward whose last layer runs there only (last_hidden_states: bit for bit on CPU, tests/test_ppo.py). With
    `groups` > 1, the rows in that many forwards by query length (by_query_length; not for a DeepSpeed engine), each
    a `window`: the columns from the first query token of any of its rows on (response_window's), at their positions
    in the full row, so only the float rounding changes."""
    if groups > 1 and isinstance(model, PreTrainedModel):
        forward = lambda rows: response_outputs(model, rows, pad_token_id, context_length, window=True)  # noqa: E731
        return by_query_length(forward, query_responses, pad_token_id, context_length, groups)
    if not isinstance(model, PreTrainedModel):  # a DeepSpeed engine (--offload) runs its own forward
        return get_reward(model, query_responses, pad_token_id, context_length)[0][:, context_length - 1:]
    num_positions = query_responses.size(1) - context_length + 1
    if window:  # the columns at their positions in the full row
        input_ids, attention_mask, position_ids = response_window(query_responses, pad_token_id, context_length,
                                                                  num_positions)
    else:
        attention_mask = query_responses != pad_token_id  # (B, T)
        input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
        # get_reward passes no position ids: the model numbers the columns 0 ... T - 1, as these do.
        position_ids = torch.arange(query_responses.size(1), device=query_responses.device).expand_as(input_ids)
    hidden = last_hidden_states(model.backbone, input_ids, attention_mask, position_ids, num_positions)
    # The head runs on get_reward's (B, T, d) shape: on (B, n, d) the matmul may round its sums otherwise (~1e-7).
    full = torch.cat((hidden.new_zeros(hidden.size(0), context_length - 1, hidden.size(-1)), hidden), 1)  # (B, T, d)
    return model.head(full).squeeze(-1)[:, context_length - 1:]


def get_score(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int,
              groups: int = 1) -> torch.Tensor:
    """== get_reward(model, query_responses, pad_token_id, context_length)[1]: (B,) the RM's output at each row's EOS
    (response_outputs' `groups`: speed only)."""
    outputs = response_outputs(model, query_responses, pad_token_id, context_length, groups)  # (B, T_resp + 1)
    eos = reward_indices(query_responses, pad_token_id, context_length) - (context_length - 1)  # (B,) in outputs
    return outputs[torch.arange(outputs.size(0), device=eos.device), eos]


def response_logits_and_values(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int,
                               num_outputs: int) -> tuple:
    """== (policy logits[:, context_length - 1 : -1], get_values(critic, ...)), their first num_outputs columns

    (B, T) query ++ response ids -> ((B, n, V), (B, n)) from the PolicyAndValueWrapper `model`: a forward of the
    response window whose last layer runs at those n positions only (tests/test_ppo.py checks the equality)."""
    input_ids, attention_mask, position_ids = response_window(query_responses, pad_token_id, context_length,
                                                              num_outputs)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 num_outputs=num_outputs)


def response_logits_and_values_by_length(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int,
                                         num_outputs: int, groups: int) -> tuple:
    """== response_logits_and_values(model, query_responses, pad_token_id, context_length, num_outputs), the rows
    in `groups` forwards sorted by query length (by_query_length; tests/test_ppo.py checks the equality).

    The tiny world's micro-batches of 16: 2 groups hold 11% fewer token columns, 20% fewer attention scores."""
    def forward(rows):
        return response_logits_and_values(model, rows, pad_token_id, context_length, num_outputs)
    return by_query_length(forward, query_responses, pad_token_id, context_length, groups)


def by_query_length(forward, query_responses: torch.Tensor, pad_token_id: int, context_length: int, groups: int):
    """== forward(query_responses): its (B, ...) output (or a tuple of them), from `groups` calls on the rows sorted
    by query length (or fewer, as torch.chunk splits them: 16 rows in 5 groups make 4 calls of 4 rows).

    Speed only (--length_groups): every query is left-padded to one width, and a windowed forward
    (response_window) is as wide as the longest query of its rows: rows of similar length together
    drop more of the pads. Each row's outputs are its own whatever its neighbours; only the float
    rounding of sums over shorter rows changes."""
    if groups == 1:  # one forward: nothing to sort
        return forward(query_responses)
    lengths = (query_responses[:, :context_length] != pad_token_id).sum(1)  # (B,) query tokens of each row
    order = lengths.argsort(stable=True)  # (B,) shortest first
    parts = [forward(query_responses[rows]) for rows in order.chunk(groups)]
    unsort = order.argsort()  # (B,): where each row went
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(side)[unsort] for side in zip(*parts))
    return torch.cat(parts)[unsort]


class PolicyAndValueWrapper(torch.nn.Module):
    """Policy and critic as one module: one accelerator.prepare, one optimizer, one backward (and how that backward
    runs: compiled layers, recomputed activations)."""

    def __init__(self, policy: torch.nn.Module, critic: torch.nn.Module, compile_layers: bool = False,
                 checkpoint_activations: bool = False, backend: str = "inductor"):
        super().__init__()
        self.policy, self.critic = policy, critic
        if checkpoint_activations:  # --gradient_checkpointing: recomputed in the backward, memory for compute
            policy.activation_checkpointing_enable()
            critic.backbone.activation_checkpointing_enable()
        # --compile_training: each backbone's layers but the last, compiled for this forward only (compiled_layers,
        # with torch.compile's `backend`). A tuple, not a ModuleList: the compiled wrappers share the layers'
        # parameters and register none.
        self.compiled = (tuple(compiled_layers(backbone, backend) for backbone in (policy.base_model, critic.backbone))
                         if compile_layers else (None, None))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                num_outputs: int) -> tuple:
        """== (policy logits, critic outputs)[:, -num_outputs:]: (B, T) ids, mask, positions -> ((B, n, V), (B, n))."""
        policy_hidden = last_hidden_states(self.policy.base_model, input_ids, attention_mask, position_ids, num_outputs,
                                           self.compiled[0])
        critic_hidden = last_hidden_states(self.critic.backbone, input_ids, attention_mask, position_ids, num_outputs,
                                           self.compiled[1])
        return self.policy.get_output_embeddings()(policy_hidden), self.critic.head(critic_hidden).squeeze(-1)


def compiled_layers(backbone, backend: str = "inductor") -> list:
    """== backbone.layers[:-1]: the same layers, each wrapped by torch.compile (one region a layer).

    Speed only (--compile_training; tests/test_ppo.py checks the outputs and gradients against the eager
    layers). Every layer runs the same code, so one graph serves them all. It is compiled for any number
    of rows and any width (dynamic shapes), as the window's width changes from one micro-batch to the next.
    Later calls compile again only for a window without pads (no mask: a second graph), or once if the
    first width equalled a weight's size (dynamo then takes it for that size). Only PolicyAndValueWrapper,
    the PPO epochs' forward, runs the wrappers: sampling and scoring call the layers themselves, eagerly
    (HF generate's growing cache would recompile at every step). Regional rather than whole-model
    compilation: it compiles in seconds, not a minute, for most of the gain (benchmark/compile_training.py).
    main refuses other backbones before this runs (model_problems)."""
    return [explain_compile_errors(torch.compile(layer, backend=backend, dynamic=True), "--compile_training",
                                   "COMPILE_TRAINING=0") for layer in backbone.layers[:-1]]


def explain_compile_errors(compiled, flag: str, knob: str):
    """== compiled; a failure of torch.compile's backend names the flag that asked for it and how to run without it."""
    # A node without a C compiler, or a GPU node without Triton, fails at the first compiled call, after the models
    # are loaded (the sampler's in the first rollout, the layers' in the first PPO epoch). The flag changes speed only.
    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.ShortenTraceback as error:  # BackendCompilerFailed, TritonMissing, GPUTooOldForTriton
            raise RuntimeError(f"{flag}: torch.compile could not build its code here ({type(error).__name__}, above). "
                               f"{flag} changes speed only: run without it (the SLURM launchers: {knob}; a run "
                               "with checkpoints continues from them with --resume), or give the machine a working C "
                               "compiler (and Triton on a GPU)") from error
    return call


def sdpa_gpt_neox(backbone) -> bool:
    """Whether `backbone` is a GPT-NeoX model run by SDPA: the one whose layers last_hidden_states calls itself."""
    return isinstance(backbone, GPTNeoXModel) and getattr(backbone.config, "_attn_implementation", None) == "sdpa"


def last_hidden_states(backbone, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       num_positions: int, layers: Optional[list] = None) -> torch.Tensor:
    """== backbone(input_ids, attention_mask, position_ids).last_hidden_state[:, -num_positions:]: (B, num_positions, d).

    `layers`: what runs in place of backbone.layers[:-1], i.e. their compiled forms (compiled_layers)."""
    if not sdpa_gpt_neox(backbone):
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return hidden.last_hidden_state[:, -num_positions:]
    # The outputs are the full forward's, bit for bit on CPU; on a typical PPO row (a long query, a
    # short response) this skips most of the last layer.
    return last_layer_at(backbone, input_ids, attention_mask, position_ids, lambda x: x[:, -num_positions:], layers)


def last_layer_at(backbone, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  select, layers: Optional[list] = None) -> torch.Tensor:
    """== select(backbone(input_ids, attention_mask, position_ids).last_hidden_state) for a GPT-NeoX run by SDPA,
    `select` picking k positions along dim 1 of a (B, T, ...) tensor: (B, k, d).

    `layers`: what runs in place of backbone.layers[:-1], i.e. their compiled forms (compiled_layers)."""
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
    for layer in layers or backbone.layers[:-1]:
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


def response_window(query_responses: torch.Tensor, pad_token_id: int, context_length: int, num_outputs: int) -> tuple:
    """(B, T) left-padded query ++ response ids -> (B, W) ids, mask and position ids of the columns that the
    outputs at positions context - 1 ... context + num_outputs - 2 (predicting response tokens 0 ... num_outputs - 1) read."""
    # Columns before `start` are pads in every row (keys that no position attends to); columns
    # from `stop` on come after the last position used (causal attention: never read). The kept
    # columns keep their positions in the full row (which a forward without position ids numbers
    # 0 ... T - 1), so the outputs are those of the full forward, up to the float rounding of sums
    # over a shorter row. Padded rows cost as much as real ones: this skips what is never used.
    start = min(int(first_true_indices(query_responses[:, :context_length] != pad_token_id).min()), context_length - 1)
    window = query_responses[:, start:context_length + num_outputs - 1]  # (B, W)
    attention_mask = window != pad_token_id
    position_ids = torch.arange(start, start + window.size(1), device=window.device).expand_as(window)
    return torch.masked_fill(window, ~attention_mask, 0), attention_mask, position_ids


def trained_width(eos_index: torch.Tensor, response_length: int, score_after_eos: bool) -> int:
    """(micro,) EOS indices (-1: the response starts with [PAD]) -> response positions the micro-batch trains, 1 ... T."""
    # Positions after a row's EOS (and after its value target) are masked in every loss: the
    # forward only computes the first n. Never 0: x[:, -0:] would select every position.
    return max(1, min(response_length, int(eos_index.max()) + 1 + int(score_after_eos)))


# Sampling: the plain loop (HF generate's draws) and its fast path, for rollouts and evaluations.


def sample_rollout(model, queries: torch.Tensor, pad_token_id: int, eos_token_id: int, response_length: int,
                   temperature: float, unsampled: torch.Tensor) -> tuple:
    """== HF generate (sft.py's `generate`) with GenerationConfig(temperature, response_length new tokens, `unsampled`
    suppressed) up to each row's EOS: ((B, T_q + T_resp) ids, (B, T_resp, V) scores = logits / T).

    A plain KV-cache loop that stops once EVERY row holds an EOS (tests/test_ppo.py checks the equality). The tokens
    after a row's EOS are never used (truncated, masked, causal attention): the steps after the last row's EOS only
    cost time. They become EOS fillers (scores 0), and their random draws are still taken, so the random stream, and
    every later sample, is what the full length gives. Masked scores are the lowest float, not generate()'s -inf."""
    attention_mask = queries != pad_token_id  # (B, T_q), grows by one column per step
    position_ids = (attention_mask.long().cumsum(1) - 1).masked_fill(~attention_mask, 0)  # generate()'s convention
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.masked_fill(queries, ~attention_mask, 0), attention_mask=attention_mask,
                   position_ids=position_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    tokens, scores = [], []
    has_eos = torch.zeros(queries.size(0), dtype=torch.bool, device=queries.device)
    while True:
        score, probs = sampling_distribution(logits[:, -1], temperature, unsampled)  # (B, V) each
        token = torch.multinomial(probs, num_samples=1).squeeze(1)  # (B,)
        tokens.append(token)
        scores.append(score)
        has_eos |= token == eos_token_id
        if len(tokens) == response_length or has_eos.all():
            break
        attention_mask = torch.cat((attention_mask, attention_mask.new_ones(queries.size(0), 1)), 1)
        position_ids = position_ids[:, -1:] + 1  # (B, 1)
        logits = model(input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, use_cache=True).logits
    for _ in range(response_length - len(tokens)):  # the skipped steps' draws (a draw's use of the stream
        torch.multinomial(torch.ones_like(score), num_samples=1)  # depends on the shape only)
    # EOS as filler, not [PAD]: [PAD] may lie past the vocabulary (log-probs are gathered at these
    # ids too, then masked); every row has ended, so truncate_response pads them all anyway.
    tokens += [torch.full_like(token, eos_token_id)] * (response_length - len(tokens))
    scores += [torch.zeros_like(score)] * (response_length - len(scores))
    return torch.cat((queries, torch.stack(tokens, 1)), 1), torch.stack(scores, 1)


def sampling_distribution(logits: torch.Tensor, temperature: float, unsampled: torch.Tensor) -> tuple:
    """(B, V) next-token logits -> ((B, V) scores = logits / T with the `unsampled` ids masked, (B, V) probabilities drawn from)."""
    score = scaled_logits(logits, temperature, unsampled)
    probs = F.softmax(score, dim=-1)
    # Weights blown up by a too large step give nan / inf logits, on which multinomial raises (on one rank only).
    # Such a row draws uniformly from the sampled ids instead, and its log-probs stay non-finite.
    # The update's finite check then stops every rank together; finite rows are drawn from as they are.
    uniform = torch.ones_like(probs).index_fill(-1, unsampled, 0.0)
    return score, torch.where(torch.isfinite(probs).all(-1, keepdim=True), probs, uniform)


class StaticSampler:
    """== sample_rollout(model, queries, ...), token for token in fp32, with a preallocated KV cache and a compiled one-token step.

    The fast path of the rollout and evaluation samplers (--fast_sampling). Every call is padded to
    `batch_size` rows and `T_q + response_length` cache columns, so the decode step has one shape
    and compiles once per process (torch.compile: inductor's C++ kernels on a CPU, CUDA graphs on
    a GPU) and allocates nothing per step. The prefill is sample_rollout's first forward, run in
    4 forwards of rows of similar length (prefill_by_length). The scores agree with
    sample_rollout's up to float rounding (sums over other shapes, in another order), and the
    tokens are the same in fp32 (tests/test_ppo.py; benchmark/sampling.py checks the compiled step); in bf16 on a
    GPU, rounding moves ~1-2% of draws (benchmark/results/gpu_check.md)."""

    def __init__(self, batch_size: int, backend: Optional[str] = "inductor"):
        self.batch_size = batch_size  # rows of every decode step: a smaller batch is padded to it
        # torch.compile's backend; None runs the same step eagerly. (Tests use None and "aot_eager": the same
        # traced graph without inductor's C++ code generation, most of the 25-60 s a cold compile takes.)
        self.backend = backend
        self.cache, self.step = None, None
        self.shapes = set()  # (T_q, T_resp) of the calls so far: a new one compiles the step for its shape

    def __call__(self, model, queries: torch.Tensor, pad_token_id: int, eos_token_id: int, response_length: int,
                 temperature: float, unsampled: torch.Tensor) -> tuple:
        """(b, T_q) left-padded queries, b <= batch_size -> what sample_rollout returns for them."""
        rows, context_length = queries.shape
        if rows > self.batch_size:
            raise ValueError(f"{rows} queries for a sampler of {self.batch_size} rows")
        if self.step is None:
            self.step = decode_step if self.backend is None else explain_compile_errors(torch.compile(
                decode_step, backend=self.backend, mode="reduce-overhead" if queries.is_cuda else None, dynamic=False),
                "--fast_sampling", "FAST_SAMPLING=0")
        if self.cache is None or self.cache.get_max_length() != context_length + response_length:
            # GPU: one cache for the process, at the fixed addresses CUDA graphs replay. CPU: one per call.
            self.cache = OneDtypeStaticCache(config=model.config, max_cache_len=context_length + response_length)
        # (B, T_q): the rows past `rows` repeat the last query; they are decoded but never drawn for.
        queries = torch.cat((queries, queries[-1:].expand(self.batch_size - rows, -1)))
        attention_mask = queries != pad_token_id
        position_ids = (attention_mask.long().cumsum(1) - 1).masked_fill(~attention_mask, 0)  # generate()'s convention
        # The prefill's keys and values are copied into the static cache, whose unused columns the causal mask hides.
        # 4 groups: 0.61 s a call against 0.67 (2) and 0.74 (1) on the tiny world, 2.73 against 2.90 and 2.98 at 5M.
        logits, keys_values = prefill_by_length(model, torch.masked_fill(queries, ~attention_mask, 0), attention_mask,
                                                position_ids, groups=4)
        self.cache.reset()
        for layer_index in range(len(keys_values)):
            self.cache.update(*keys_values[layer_index], layer_index)
            keys_values[layer_index] = None  # freed once copied: the two caches never all live at once
        del keys_values
        # (B, T_q + T_resp): fixed for the whole call; a column is read only once its token is in the cache
        attention_mask = torch.cat((attention_mask, attention_mask.new_ones(self.batch_size, response_length)), 1)
        score, probs = sampling_distribution(logits[:, -1], temperature, unsampled)  # (B, V) each
        tokens, scores = [], []
        has_eos = torch.zeros(rows, dtype=torch.bool, device=queries.device)
        # One query per row: attention as plain matmuls and a softmax ("eager"), which the compiler
        # fuses; SDPA's CPU kernel is made for many queries: 1.2-1.7x as long on an EPYC, ~1x on a Xeon (benchmark/results/sampling_split.md).
        attention = model.config._attn_implementation
        model.set_attn_implementation("eager")
        try:
            while True:
                token = draw_tokens(probs[:rows])  # (b,): sample_rollout's draws, from the same random stream
                tokens.append(token)
                scores.append(score[:rows].clone())  # a copy: a CUDA graph overwrites its outputs at the next step
                has_eos |= token == eos_token_id
                if len(tokens) == response_length or has_eos.all():
                    break
                position_ids = position_ids[:, -1:] + 1  # (B, 1)
                token = torch.cat((token, token.new_zeros(self.batch_size - rows)))  # (B,): padding rows read id 0
                score, probs = self.step(model, token, position_ids, attention_mask, self.cache, temperature, unsampled)
        finally:
            model.set_attn_implementation(attention)
            if not queries.is_cuda:
                self.cache = None  # dropped at the call's end, so that the PPO epochs do not hold it
        if (context_length, response_length) not in self.shapes:
            self.shapes.add((context_length, response_length))
            # Compiling leaves dynamo's tracing objects in reference cycles holding this call's cache (90 MiB at the 5M
            # benchmark) until Python's cyclic collector runs, often only after the PPO epochs, whose peak it raises.
            gc.collect()
        for _ in range(response_length - len(tokens)):  # the skipped steps' draws, as in sample_rollout
            draw_tokens(torch.ones_like(scores[0]))
        tokens += [torch.full_like(token[:rows], eos_token_id)] * (response_length - len(tokens))
        scores += [torch.zeros_like(scores[0])] * (response_length - len(scores))
        return torch.cat((queries[:rows], torch.stack(tokens, 1)), 1), torch.stack(scores, 1)


def prefill_by_length(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      groups: int) -> tuple:
    """== model(input_ids, attention_mask, position_ids, past_key_values=DynamicCache(), logits_to_keep=1): the logits
    and every layer's keys and values, up to float rounding; the keys and values of pads are 0 where they were dropped.

    (B, T_q) left-padded queries -> ((B, 1, V) logits, [(keys, values), (B, heads, T_q, head_size) each] per layer),
    from `groups` forwards of rows sorted by length, each cut to its longest row (tests/test_ppo.py)."""
    # Every query is left-padded to one width (pads are 31% of the tiny world's query columns, 11% at
    # 5M): a group of rows of similar length drops the pad columns its rows share, keys that none of
    # them reads. The outputs keep their positions (position_ids): only the float rounding changes.
    rows, width = input_ids.shape
    lengths = attention_mask.sum(1)  # (B,) real tokens, at the right end of each row
    logits, keys_values = None, None
    for group in lengths.argsort(stable=True).chunk(groups):
        keep = max(int(lengths[group].max()), 1)  # the group's longest row: the columns width - keep ... width - 1
        cache = DynamicCache(config=model.config)
        group_logits = model(input_ids=input_ids[group, -keep:], attention_mask=attention_mask[group, -keep:],
                             position_ids=position_ids[group, -keep:], past_key_values=cache, use_cache=True,
                             logits_to_keep=1).logits  # (g, 1, V)
        if logits is None:
            logits = group_logits.new_empty(rows, *group_logits.shape[1:])
            keys_values = [tuple(tensor.new_zeros(rows, tensor.size(1), width, tensor.size(3))
                                 for tensor in (layer.keys, layer.values)) for layer in cache.layers]
        logits[group] = group_logits
        for (keys, values), layer in zip(keys_values, cache.layers):
            keys[group, :, -keep:], values[group, :, -keep:] = layer.keys, layer.values
    return logits, keys_values


def draw_tokens(probs: torch.Tensor) -> torch.Tensor:
    """== torch.multinomial(probs, num_samples=1).squeeze(1): (B, V) probabilities -> (B,) ids, drawn from the same random stream."""
    if probs.device.type != "cpu":
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    # On a CPU, torch.multinomial draws one sample as argmax(probs / E), E ~ Exp(1) one per entry, in
    # float32, each from a float64 uniform U as -log1p(-U). Drawn here the same way, it takes a third
    # of the time of multinomial's own exponential draws (a large cost of a small model's decode
    # step); tests/test_ppo.py checks the ids and the random stream against torch.multinomial's.
    noise = -torch.log1p(-torch.empty(probs.shape, dtype=torch.float64).uniform_())  # (B, V)
    return (probs / noise.float()).argmax(-1)


class OneDtypeStaticCache(StaticCache):
    """== StaticCache, its values written in its keys' dtype. Under accelerate's autocast (bf16, no DeepSpeed)
    GPT-NeoX's keys leave the rotary embedding in fp32 and its values stay bf16: StaticCache, typed by the first
    keys, refuses the bf16 values, where sample_rollout's DynamicCache stores them as fp32 (exactly: bf16 -> fp32
    loses nothing, and autocast casts them back for the matmul). Otherwise the dtypes agree and nothing changes."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return super().update(key_states, value_states.to(key_states.dtype), layer_idx, *args, **kwargs)


def decode_step(model, token: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache,
                temperature: float, unsampled: torch.Tensor) -> tuple:
    """== sampling_distribution(model(token, ..., cache).logits[:, -1], T, unsampled): StaticSampler's compiled step."""
    logits = model(input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=position_ids,
                   past_key_values=cache, use_cache=True).logits  # (B, 1, V)
    return sampling_distribution(logits[:, -1], temperature, unsampled)


def summary_sampler(args, pad_token_id: int, eos_token_id: int, temperature: float, unsampled: torch.Tensor):
    """The evaluation's sampler: (policy, (B, T_q) queries) -> ((B, T_q + T_resp) queries ++ ids sampled at
    `temperature`, EOS cut later; (B, T_resp, V) scores): the rollout's sampler, or StaticSampler with --fast_sampling."""
    # sample_rollout, not HF generate: the same tokens (tests/test_ppo.py), and it stops once every row has ended.
    # A row whose logits / T overflow is drawn uniformly (sampling_distribution) where generate's multinomial would
    # crash; ppo_evaluate counts it and evaluate_and_log refuses it with a message that says why.
    sample = StaticSampler(args.local_eval_batch_size) if args.fast_sampling else sample_rollout
    return lambda policy, queries: sample(policy, queries, pad_token_id, eos_token_id, args.response_length,
                                          temperature, unsampled)


# Helpers of the maths above.


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, V) temperature-scaled logits and (B, T) ids -> (B, T) log-prob of each id."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) temperature-scaled logits -> (B, T) entropy of each softmax distribution."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the True positions of `mask` (0 when there are none)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def scaled_logits(logits: torch.Tensor, temperature: float, unsampled: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> mask_logits(logits.float() / temperature, unsampled): what sampling draws from, and what the
    behaviour, reference and trained log-probs are read from."""
    # fp32 before the division, whatever the model's dtype: bf16 logits (DeepSpeed) divided in bf16 would round
    # the reference policy's and the trained policy's log-probs once more than the sampler's.
    return mask_logits(logits.float() / temperature, unsampled)


def mask_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> the same with the columns `token_ids` at the dtype's lowest value (probability 0)."""
    # The lowest finite value, not -inf: softmax gives exactly 0 there and entropy's p * logit stays 0, not NaN.
    return logits.index_fill(-1, token_ids, torch.finfo(logits.dtype).min)


def unsampled_token_ids(tokenizer, vocab_rows: int) -> list:
    """Ids that sampling never emits: [PAD] and the embedding rows past the tokenizer (no token owns them)."""
    # Pythia's embedding has 50304 rows for 50277 tokens, and the [PAD] we add is 50277: a sampled
    # [PAD] in mid-summary would move the EOS the reward is read at, and an unowned row decodes to
    # nothing. Their logits are masked wherever the policy samples (a departure from the reference code).
    # A [PAD] past the table (a model without spare rows) has no logit: it cannot be sampled, nor masked.
    return sorted(i for i in {tokenizer.pad_token_id, *range(len(tokenizer), vocab_rows)} if i < vocab_rows)


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B,): index of the first True of each row, T for a row without one."""
    row_len = bools.size(-1)
    # (B, T): a False costs T + its index, a True just its index; the minimum is the first True
    zero_or_index = row_len * (~bools).long() + torch.arange(row_len, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def truncate_response(responses: torch.Tensor, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """(B, T_resp) ids -> (B, T_resp): ids after each row's first EOS set to pad (the EOS is kept)."""
    eos_index = first_true_indices(responses == eos_token_id)  # (B,): T_resp where no EOS
    positions = torch.arange(responses.size(1), device=responses.device).view(1, -1)  # (1, T_resp)
    return torch.masked_fill(responses, positions > eos_index.unsqueeze(1), pad_token_id)


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


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast `model`'s parameters (not its buffers) to `dtype`, in place, as DeepSpeed casts the trained model."""
    # A plain .to(bf16) would also round the fp32 rotary frequencies (see rotary_problem).
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def episode_order(num_rows: int, num_episodes: int, seed: int) -> torch.Tensor:
    """(num_episodes,) row indices: a fresh seeded permutation of the rows per pass, passes concatenated."""
    generator = torch.Generator().manual_seed(seed)
    passes = -(-num_episodes // num_rows)  # ceil: the last pass may be used in part
    perms = [torch.randperm(num_rows, generator=generator) for _ in range(passes)]
    return torch.cat(perms)[:num_episodes] if perms else torch.zeros(0, dtype=torch.long)


# Evaluation: sampling, scoring, sharding and outputs.


@torch.no_grad()
def ppo_evaluate(accelerator, policy, reward_model, dataset, tokenizer, sample_summaries,
                 local_eval_batch_size: int) -> tuple:
    """All ranks: sample (`sample_summaries(policy, (B, T_q) queries)` -> ((B, T_q + T_resp) ids, scores)) and score
    `dataset` -> ({score, reference_score, eos_fraction, response_length}, rows in split order, number of prompts
    whose sampling scores were not finite, over all ranks)."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    policy.eval()
    rows, nonfinite = [], torch.zeros(1, device=accelerator.device)
    batches = eval_batches(len(dataset), accelerator.process_index, accelerator.num_processes, local_eval_batch_size)
    for indices, real in tqdm(batches, desc="eval", disable=not accelerator.is_main_process):
        batch = dataset[indices]
        queries = batch["query_token"].to(accelerator.device)  # (B, T_q), left-padded
        references = batch["reference_response_token"].to(accelerator.device)  # (B, T_ref), right-padded
        context_length = queries.shape[1]
        with accelerator.autocast():
            query_responses, sample_scores = sample_summaries(policy, queries)
            # Finite weights may still give logits / T_eval beyond the float range (T_eval 0.01): such a row was drawn
            # uniformly (sampling_distribution), and is counted, not passed off as the policy's summary.
            nonfinite += (~torch.isfinite(sample_scores[:real])).flatten(1).any(1).sum()
            del sample_scores  # (B, T_resp, V)
            responses = truncate_response(query_responses[:, context_length:], eos_id, pad_id)  # (B, T_resp)
            scores = get_score(reward_model, torch.cat((queries, responses), 1), pad_id, context_length)
            reference_scores = get_score(reward_model, torch.cat((queries, references), 1), pad_id, context_length)
        for j, (i, query, response, reference) in enumerate(list(zip(
                indices, tokenizer.batch_decode(queries, skip_special_tokens=True),
                tokenizer.batch_decode(responses, skip_special_tokens=True),
                tokenizer.batch_decode(references, skip_special_tokens=True)))[:real]):
            rows.append({"index": i, "query": query.strip(), "response": response.strip(),
                         "reference": reference.strip(), "score": scores[j].item(),
                         "reference_score": reference_scores[j].item(),
                         "eos": bool((responses[j] == eos_id).any()), "length": int((responses[j] != pad_id).sum())})
    policy.train()
    nonfinite = int(accelerator.reduce(nonfinite, reduction="sum").item())  # every rank learns of any rank's
    rows = sorted(gather_object(rows), key=lambda row: row["index"])  # every rank's rows, in split order
    metrics = {"score": float(np.mean([row["score"] for row in rows])),
               "reference_score": float(np.mean([row["reference_score"] for row in rows])),
               "eos_fraction": float(np.mean([row["eos"] for row in rows])),
               "response_length": float(np.mean([row["length"] for row in rows]))}
    return metrics, rows, nonfinite


def eval_batches(num_rows: int, rank: int, world_size: int, batch_size: int) -> list:
    """[(row indices, number of real rows)] of rank `rank`: rows rank, rank + W, ... in batches of `batch_size`;
    every rank gets the same batches count and sizes, a rank one row short repeating its last row (not kept)."""
    # Frozen models run as ZeRO-3 engines (--offload) gather their parameters in every forward,
    # a collective: a rank with one batch fewer would leave the others waiting forever.
    mine = list(range(rank, num_rows, world_size))
    per_rank = -(-num_rows // world_size)  # ceil
    padded = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))
    return [(padded[start:start + batch_size], max(0, min(batch_size, len(mine) - start)))
            for start in range(0, per_rank, batch_size)]


def evaluate_and_log(accelerator, args, dataset, policy, reward_model, tokenizer, sample_summaries, writer,
                     run_name: str, splits: tuple, episode: int) -> dict:
    """All ranks: ppo_evaluate the policy on `splits` -> {split: metrics}; rank 0 logs eval/ppo/*, writes the
    sample tables runs/{run_name}/samples_{split}_{episode}.csv and prints the metrics."""
    out = {}
    for split in splits if args.num_eval_samples != 0 else ():
        eval_set = dataset[split].with_format("torch", columns=list(REQUIRED_COLUMNS))
        if args.num_eval_samples is not None:
            eval_set = eval_set.select(range(min(args.num_eval_samples, len(eval_set))))
        metrics, rows, nonfinite = ppo_evaluate(accelerator, policy, reward_model, eval_set, tokenizer,
                                                sample_summaries, args.local_eval_batch_size)
        if nonfinite:  # every rank raises
            raise FloatingPointError(overflow_message(args, split, episode, nonfinite, len(eval_set)))
        out[split] = metrics
        if accelerator.is_main_process:
            for key, value in metrics.items():
                writer.add_scalar(f"eval/ppo/{split}/{key}", value, episode)
            if split == "validation":
                writer.add_scalar("objective/validation_score", metrics["score"], episode)
            table = pd.DataFrame(rows, columns=["query", "response", "reference", "score", "reference_score"])
            write_atomic(os.path.join(f"runs/{run_name}", f"samples_{split}_{episode}.csv"),  # "\r\n": a bare "\r" quoted
                         lambda partial: table.to_csv(partial, index=False, lineterminator="\r\n"))
            if args.track:
                import wandb

                wandb.log({f"eval/ppo/{split}/samples": wandb.Table(dataframe=table)})
            print(f"eval/{split} after {episode} episodes: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return out


def overflow_message(args, split: str, episode: int, nonfinite: int, prompts: int) -> str:
    """Why the evaluation of `split` after `episode` episodes stops: the policy's logits / T_eval are not finite."""
    last = latest_checkpoint(os.path.join(args.output_dir, "checkpoints"))
    kept = (f"the last checkpoint, {last[1]} (update {last[0]}), is kept as it was" if last else
            "no checkpoint was written before it")
    return (f"the evaluation of {split} after {episode} episodes: the policy's logits divided by the evaluation "
            f"temperature ({args.eval_temperature}) are not finite (inf or nan) for {nonfinite} of {prompts} prompts, "
            f"though its weights are finite: they have grown too large. Nothing of this evaluation is written; {kept}. "
            "Try a lower --lr in a new --output_dir")


def log_update(writer, progress, episode: int, logged: dict) -> None:
    """Rank 0 (the one with a writer): every scalar of `logged` at x = `episode`, and the progress line."""
    if writer is None:
        return
    for key, value in logged.items():
        writer.add_scalar(key, value, episode)
    progress.set_postfix(score=f"{logged['objective/scores']:.3f}", kl=f"{logged['objective/kl']:.3f}",
                         ratio0=f"{logged['policy/ratio_first_epoch']:.5f}",
                         eos=f"{logged['objective/eos_fraction']:.2f}")


# Run setup: flags, inputs, tokenizer, models, logging.
# The prompts, and the human references that the evaluation scores beside the samples.
REQUIRED_COLUMNS = ("query_token", "reference_response_token")
# The inputs whose args.json --resume compares (input_prints): model folders, then dataset folders.
INPUTS = (("base_model", "sft_model_path", "reward_model_path"), ("query_dataset",))
# Flags that may change between an interrupted run and its resumption (see output_dir_problem).
# None of these changes what the run computes.
RESUME_FLAGS = ("resume", "stop_after_updates", "stop_after_minutes", "run_name", "save_every",
                "track", "wandb_project_name", "wandb_entity", "push_to_hub", "hf_entity")  # where it logs and publishes
POSITIVE = (lambda value: 0 < value < math.inf, "a finite number > 0")
NON_NEGATIVE = (lambda value: 0 <= value < math.inf, "a finite number >= 0")
AT_LEAST_1 = (lambda value: value >= 1, "an integer >= 1")
AT_LEAST_0 = (lambda value: value >= 0, "an integer >= 0")
NONE_OR_AT_LEAST_1 = (lambda value: value is None or value >= 1, "an integer >= 1, or no flag")
NONE_OR_AT_LEAST_0 = (lambda value: value is None or value >= 0, "an integer >= 0, or no flag")
# Speed only: a checkpointed run may continue without them (requeued onto a node that cannot compile), its
# remaining updates then equal to the run that kept them up to float rounding, not bit for bit.
SPEED_ONLY_FLAGS = ("fast_sampling", "compile_training")


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


def ppo_flag_problems(args: Args, world_size: int) -> list:
    """One line per flag that cannot work, naming it and what to pass instead; empty if all can. Loads and writes nothing."""
    # Every flag is checked before anything is loaded or written, and all problems are listed at once:
    # a bad value would otherwise surface inside AdamW or the rollout, or after training.
    unit = (lambda value: 0 <= value <= 1, "a number in [0, 1]")
    problems = flag_range_problems(args, {
        "seed": (lambda seed: 0 <= seed < 2 ** 32 - 100003 * world_size, f"an integer in [0, 2^32 - {100003 * world_size})"),
        "save_every": AT_LEAST_0, "stop_after_updates": NONE_OR_AT_LEAST_1,
        "stop_after_minutes": (lambda minutes: minutes is None or 0 <= minutes < math.inf, "minutes >= 0, or no flag"),
        "total_episodes": (lambda n: n >= args.batch_size, f"at least one batch, --batch_size {args.batch_size}"),
        "eval_every": AT_LEAST_0, "num_eval_samples": NONE_OR_AT_LEAST_0, "response_length": AT_LEAST_1,
        "temperature": POSITIVE, "eval_temperature": POSITIVE, "lr": POSITIVE, "eps": POSITIVE,
        "weight_decay": NON_NEGATIVE, "local_rollout_forward_batch_size": AT_LEAST_1, "local_eval_batch_size": AT_LEAST_1,
        "length_groups": AT_LEAST_1,
        "num_ppo_epochs": AT_LEAST_1, "kl_coef": NON_NEGATIVE, "gamma": unit, "lam": unit, "cliprange": POSITIVE,
        "cliprange_value": POSITIVE, "vf_coef": NON_NEGATIVE,
        "penalty_reward_value": (math.isfinite, "a finite number")})
    try:
        ppo_batch_sizes(args.batch_size, world_size, args.num_minibatches, args.local_micro_batch_size)
    except SetupError as error:
        problems.append(str(error))
    if args.output_dir is not None and os.path.isfile(args.output_dir):
        problems.append(f"--output_dir {args.output_dir} is a file: choose a folder")
    return problems


def flag_range_problems(args, rules: dict) -> list:
    """['--flag value: want ...'] for each flag of `rules` ({flag: (ok(value) -> bool, what to pass)}) whose value fails."""
    return [f"--{flag} {getattr(args, flag)}: want {want}" for flag, (ok, want) in rules.items()
            if not ok(getattr(args, flag))]


def ppo_batch_sizes(batch_size: int, world_size: int, num_minibatches: int, local_micro_batch_size: int) -> dict:
    """The derived sizes of Args (local_batch_size ... micro_batch_size), each an exact division."""
    # Named by the flags, with the --batch_size that fits: world size x --num_minibatches x --local_micro_batch_size.
    unit = world_size * num_minibatches * local_micro_batch_size
    fix = (f"pass a --batch_size that is a multiple of world size {world_size} x --num_minibatches {num_minibatches} "
           f"x --local_micro_batch_size {local_micro_batch_size} = {unit}" if unit > 0 else
           "pass --num_minibatches and --local_micro_batch_size of at least 1")

    def exact(numerator: int, denominator: int, what: str, of: str) -> int:
        if denominator <= 0 or numerator <= 0 or numerator % denominator:
            raise SetupError(f"{what} is not a positive multiple of {of} {denominator}: {fix}")
        return numerator // denominator

    local_batch_size = exact(batch_size, world_size, f"--batch_size {batch_size}", "world size")
    local_mini_batch_size = exact(local_batch_size, num_minibatches,
                                  f"--batch_size {batch_size} / world size {world_size} = {local_batch_size}",
                                  "--num_minibatches")
    return {"local_batch_size": local_batch_size,
            "mini_batch_size": exact(batch_size, num_minibatches, f"--batch_size {batch_size}", "--num_minibatches"),
            "local_mini_batch_size": local_mini_batch_size,
            "gradient_accumulation_steps": exact(local_mini_batch_size, local_micro_batch_size, (
                f"--batch_size {batch_size} / world size {world_size} / --num_minibatches {num_minibatches} = "
                f"{local_mini_batch_size} episodes per rank and minibatch"), "--local_micro_batch_size"),
            "micro_batch_size": local_micro_batch_size * world_size}


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


def start_ppo_accelerator(args) -> Accelerator:
    """The Accelerator of this launch, once the launch and every flag are checked; sets the derived sizes of `args`."""
    problem = gpu_problem(os.environ, torch.cuda.is_available())
    if problem:
        raise SetupError(problem)
    # DeepSpeed without GPUs (a CPU rehearsal of the ZeRO-2 launch) needs the gloo backend, not nccl.
    deepspeed_on_cpu = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and not torch.cuda.is_available()
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else [])
    zero3 = zero3_problem(accelerator.state.deepspeed_plugin)
    problems = ppo_flag_problems(args, accelerator.num_processes) + ([zero3] if zero3 else [])
    if args.compile_training and accelerator.device.type == "cpu" and accelerator.mixed_precision == "bf16":
        # Inductor's C++ code for the layers' bf16 backward fails to build (torch 2.13, dynamic shapes).
        problems.append("--compile_training with bf16 on a CPU: torch's compiler cannot build the layers' bf16 "
                        "backward for a CPU, and on a CPU the flag gains little or nothing (0.95-1.02x): drop --compile_training")
    if problems:
        raise SetupError("ppo.py cannot start (nothing was loaded or written):\n  " + "\n  ".join(problems))
    args.world_size = accelerator.num_processes
    sizes = ppo_batch_sizes(args.batch_size, args.world_size, args.num_minibatches, args.local_micro_batch_size)
    args.local_batch_size, args.mini_batch_size = sizes["local_batch_size"], sizes["mini_batch_size"]
    args.local_mini_batch_size = sizes["local_mini_batch_size"]
    args.gradient_accumulation_steps, args.micro_batch_size = sizes["gradient_accumulation_steps"], sizes["micro_batch_size"]
    args.num_updates = args.total_episodes // args.batch_size
    return accelerator


def zero3_problem(deepspeed_plugin) -> Optional[str]:
    """Why a DeepSpeed launch at ZeRO stage 3 cannot train here; None for no DeepSpeed or stages 0-2."""
    # ZeRO-3 gathers each layer's weights in every forward, with every rank taking part; sampling stops on
    # each rank once its own rows have ended, so the ranks would wait on each other forever. (--offload
    # runs the frozen models as ZeRO-3 engines that never sample: they are fine.)
    if deepspeed_plugin is None or deepspeed_plugin.zero_stage != 3:
        return None
    return ("DeepSpeed ZeRO stage 3 for the trained policy and critic: each rank's sampling stops at its own rows' "
            "last EOS, and ZeRO-3 needs every rank in every forward, so the ranks would hang. Use ZeRO-2, the paper's "
            "(benchmark/accelerate/deepspeed_zero2.yaml), and --offload for the frozen models of 6.9B")


def ppo_inputs(args, accelerator) -> tuple:
    """(the SFT dataset, its eval splits, the SFT model's tokenizer, what args.json records of them), every one
    checked; fills in the default paths of `args` and tidies its output folder."""
    # The stages chain by convention: preprocess_tldr.py -> data/{base_model}/tldr, then
    # models/{base_model}/{sft,reward}_{seed}, and this script -> models/{base_model}/ppo_{seed}.
    name = model_name(args.base_model) if args.base_model else None
    make = {}  # flag -> the command that creates its default (the data's: that and another way, preprocess_hint)
    for flag, stage in (("sft_model_path", "sft"), ("reward_model_path", "reward")):
        # The base model: as given, else as the SFT model's args.json records it (for the reward model's command).
        base = args.base_model or name or "EleutherAI/pythia-1b-deduped"
        make[flag] = f"python {stage}.py --base_model {base} --seed {args.seed}"
        hub_id = getattr(args, flag) is not None and is_hub_id(getattr(args, flag))  # no args.json to read here
        if getattr(args, flag) is None:
            setattr(args, flag, os.path.join("models", name or "EleutherAI/pythia-1b-deduped", f"{stage}_{args.seed}"))
        else:
            make[flag] += f" --output_dir {getattr(args, flag)}"
        if args.query_dataset is not None:  # the SFT data this command was given (the RM's references too)
            make[flag] += f" --query_dataset {args.query_dataset}"
        recorded = recorded_base_model(getattr(args, flag))
        warning = flag == "sft_model_path" and policy_writer_warning(args.sft_model_path, "--sft_model_path")
        if warning:
            accelerator.print(warning)
        if name and recorded and name != recorded:
            raise SetupError(f"--{flag} {getattr(args, flag)} was trained from {recorded}, not from --base_model "
                             f"{args.base_model}: pass --base_model {recorded} or another --{flag}")
        if hub_id and not name and not recorded:  # the default (1B) would name a 2.8B model's folders and repository
            raise SetupError(f"--{flag} {getattr(args, flag)}: no such folder here, so a Hub id, and no args.json here "
                             "says which base model it was trained from: check the path, or pass --base_model (it "
                             "names the output folder, the run and the Hub repository)")
        name = name or recorded  # the SFT model's record names the reward model's default too
    make["query_dataset"] = preprocess_hint(args.base_model, args.sft_model_path, {"--query_dataset": "sft"})
    name = name or "EleutherAI/pythia-1b-deduped"
    args.base_model = args.base_model or name
    args.query_dataset = args.query_dataset or os.path.join("data", name, "tldr", "sft")
    args.output_dir = args.output_dir or os.path.join("models", name, f"ppo_{args.seed}")
    if accelerator.is_main_process:
        tidy_output_dir(args.output_dir)  # finish or drop what a killed save left beside or inside it
    accelerator.wait_for_everyone()
    prints = input_prints(args, *INPUTS)  # its inputs as this start finds them: compared on --resume, recorded
    refuse("\n  ".join(ppo_input_problems(args, name, make))  # the output folder once every input is right
           or output_dir_problem(args.output_dir, {**asdict(args), "input_args_json": prints,
                                                   "mixed_precision": accelerator.mixed_precision},
                                 RESUME_FLAGS + SPEED_ONLY_FLAGS + (
               "world_size", "local_batch_size", "mini_batch_size", "local_mini_batch_size",
               "gradient_accumulation_steps", "micro_batch_size", "num_updates")))
    local_dataset = os.path.isdir(args.query_dataset)
    dataset = load_data(args.query_dataset, "--query_dataset")
    eval_splits = ("validation", "test") if args.eval_test else ("validation",)
    missing = missing_columns(dataset, ("train",) + eval_splits, REQUIRED_COLUMNS)
    if missing:
        raise SetupError(f"{args.query_dataset} lacks {missing}: build it with preprocess_tldr.py")
    tokenizer, identity = ppo_tokenizer(args, accelerator, dataset, local_dataset)
    recorded = {"base_model_name": name, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                "tokenizer_identity": identity, "input_args_json": prints,
                "mixed_precision": accelerator.mixed_precision}  # compared on --resume, as the flags are
    return dataset, eval_splits, tokenizer, recorded


def ppo_tokenizer(args, accelerator, dataset, local_dataset: bool) -> tuple:
    """(the SFT model's tokenizer, checked against the dataset's ids and the RM's tokenizer, its tokenizer_identity)."""
    tokenizer = load_tokenizer(args.sft_model_path, "--sft_model_path")  # sft.py saved it with its [PAD]
    built_with = os.path.join(os.path.dirname(os.path.abspath(args.query_dataset)), "args.json")
    if local_dataset and os.path.isfile(built_with):
        built = load_json(built_with)
        data_ids = {key: built.get(key) for key in ("eos_token_id", "pad_token_id")}
    else:  # a Hub dataset: the ids its rows end with
        data_ids = ids_in_data(dataset, "reference_response_token")
        accelerator.print(f"note: no args.json beside {args.query_dataset}; its rows end with the ids {data_ids}")
    if check_tokenizer(tokenizer, data_ids, f"{args.query_dataset} ({built_with} or its rows)"):
        accelerator.print(f"added the pad token [PAD] (id {tokenizer.pad_token_id}) to {args.sft_model_path}")
    # The RM scores the policy's token ids: it must read them as the same tokens (its own tokenizer,
    # saved by reward.py, with [PAD] by the same rule), and its embedding must hold every id (main).
    # AutoTokenizer reads the folder's config.json too: known by its model_type, it loads without
    # transformers' "model of type `scalar_model`" warning.
    AutoConfig.register(ScalarModelConfig.model_type, ScalarModelConfig, exist_ok=True)
    reward_tokenizer = load_tokenizer(args.reward_model_path, "--reward_model_path")
    add_pad_token(reward_tokenizer)
    identity = tokenizer_identity(tokenizer)
    refuse(identity_problem({
        f"--sft_model_path {args.sft_model_path} (its tokenizer)": identity,
        f"--sft_model_path {args.sft_model_path} (its args.json)": recorded_tokenizer_identity(args.sft_model_path),
        f"--reward_model_path {args.reward_model_path} (its tokenizer)": tokenizer_identity(reward_tokenizer),
        f"--reward_model_path {args.reward_model_path} (its args.json)": recorded_tokenizer_identity(args.reward_model_path),
        f"--query_dataset {args.query_dataset} ({built_with})":
            recorded_tokenizer_identity(os.path.dirname(built_with)) if local_dataset else None}))
    return tokenizer, identity


def check_tokenizer(tokenizer, data_ids: Optional[dict], data_source: str) -> bool:
    """Refuse pad == EOS, make [PAD] the pad (add_pad_token), refuse ids other than `data_ids`; True if it changed."""
    # The SFT model's tokenizer gets (or has) the [PAD] that preprocess_tldr.py added, so the ids agree. A pad that
    # IS the EOS is refused: it marks a model trained by a recipe whose masks `ids != pad` hid the EOS too.
    if tokenizer.pad_token is not None and tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise SetupError(f"the tokenizer's pad token {tokenizer.pad_token!r} is its EOS token: a model trained "
                         "with EOS as its pad never learned to stop; use one whose tokenizer pads otherwise")
    added = add_pad_token(tokenizer)
    ours = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if data_ids is not None and data_ids != ours:
        raise SetupError(f"{data_source} was tokenized with {data_ids}, this tokenizer has {ours}: "
                         "preprocess the data with the same base model")
    return added


def ppo_input_problems(args, name: str, make: dict) -> list:
    """Every missing or swapped input at once ([] if none), before any model loads: a start each was a start too many,
    and swapped model folders cost minutes of loading at 6.9B before the load refused them."""
    problems = (push_problem(args, name), input_problem(args.sft_model_path, "--sft_model_path", make["sft_model_path"]),
                input_problem(args.reward_model_path, "--reward_model_path", make["reward_model_path"]),
                kind_problem(args.sft_model_path, "--sft_model_path", wants_rm=False),
                kind_problem(args.reward_model_path, "--reward_model_path", wants_rm=True),
                input_problem(args.query_dataset, "--query_dataset", *make["query_dataset"]))
    return [problem for problem in problems if problem]

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


def missing_columns(dataset_dict, splits: tuple, columns: tuple) -> list:
    """['split' or 'split.column' for each missing split or column]; empty when all are there."""
    missing = [split for split in splits if split not in dataset_dict]
    return missing + [f"{split}.{column}" for split in splits if split in dataset_dict
                      for column in columns if column not in dataset_dict[split].column_names]


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


def model_problems(args, tokenizer, policy, critic) -> Optional[str]:
    """A --compile_training that compiled_layers cannot serve, else vocabulary_problem of the policy
    (--sft_model_path), else of the critic, the RM's copy (--reward_model_path)."""
    for backbone, flag in ((policy.base_model, "--sft_model_path"), (critic.backbone, "--reward_model_path")):
        if args.compile_training and not sdpa_gpt_neox(backbone):
            attention = getattr(backbone.config, "_attn_implementation", None)
            return (f"--compile_training compiles GPT-NeoX layers run by SDPA; {flag} {getattr(args, flag[2:])} is "
                    f"{type(backbone).__name__} with {attention!r} attention: drop --compile_training")
    return (vocabulary_problem(tokenizer, policy.get_input_embeddings().weight.size(0),
                               f"--sft_model_path {args.sft_model_path}")
            or vocabulary_problem(tokenizer, critic.backbone.get_input_embeddings().weight.size(0),
                                  f"--reward_model_path {args.reward_model_path}"))


def load_fp32(model_class, path: str, flag: str):
    """`model_class.from_pretrained(path)` in fp32 whatever dtype it was saved in (Pythia's Hub weights are fp16)."""
    # transformers 5 loads a checkpoint in its saved dtype: fp16 weights trained with plain AdamW get
    # no fp32 master copy and no loss scaling. Training keeps fp32 weights; bf16 comes only as mixed
    # precision from accelerate (autocast) or DeepSpeed (bf16 compute copies, fp32 masters).
    wants_rm = model_class.__name__ == "ScalarModel"
    refuse(kind_problem(path, flag, wants_rm))
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
           f"takes {'reward.py' if wants_rm else 'sft.py'}'s output{'' if wants_rm else ' or a base model'}")
    return model


def kind_problem(path: str, flag: str, wants_rm: bool) -> Optional[str]:
    """Why the model folder `path` is not of the kind `flag` takes (a reward model or not, by its config.json's
    model_type); None when it is, or when there is no config.json here to read (a Hub id)."""
    config = os.path.join(path, "config.json")
    model_type = load_json(config).get("model_type") if os.path.isfile(config) else None  # None: a Hub id
    if model_type is None or (model_type == "scalar_model") == wants_rm:
        return None
    # The stages' folders look alike (models/.../sft_1, reward_1): say which one this is, not a loader's traceback.
    found = ("a reward model (reward.py's output)" if model_type == "scalar_model" else
             f"a causal LM ({model_type}: sft.py's output or a base model)" if model_type else
             "a model whose config.json names no model_type (the reference code's reward models are such)")
    wanted = "reward.py's output" if wants_rm else "sft.py's output or a base model"
    return f"{flag} {path} holds {found}; {flag} takes {wanted}"

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


def offload_frozen_models(accelerator, args, ref_policy, reward_model) -> tuple:
    """(reference policy, RM) as DeepSpeed ZeRO-3 inference engines whose parameters stay on the CPU (--offload)."""
    # They stream their parameters to the GPU layer by layer (the paper's 6.9B runs). Needs a DeepSpeed
    # launch (tests: 2 CPU processes, against the same launch without it). Every rank must call every
    # forward (parameters are gathered collectively), which the rollout does; unequal eval shards would hang.
    import deepspeed

    ds_config = {"train_micro_batch_size_per_gpu": args.local_micro_batch_size,
                 "bf16": {"enabled": accelerator.mixed_precision == "bf16"},
                 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                       "stage3_param_persistence_threshold": 1e4},
                 "prescale_gradients": False, "wall_clock_breakdown": False}
    ref_policy = deepspeed.initialize(model=ref_policy, config=ds_config)[0]  # (an engine's .eval() returns None)
    reward_model = deepspeed.initialize(model=reward_model, config=ds_config)[0]
    ref_policy.eval(), reward_model.eval()
    return ref_policy, reward_model


def frozen_like_trained(accelerator, offload: bool, model, ref_policy, reward_model) -> tuple:
    """(reference policy, RM) on the prepared `model`'s precision path; refused if a rotary inv_freq is below fp32."""
    if not offload:
        # DeepSpeed's bf16 parameters with fp32 buffers, or fp32 under accelerate's autocast.
        # A more precise reference would make the KL start away from 0 by the rounding difference alone.
        dtype = next(model.parameters()).dtype
        # Cast on the CPU, then moved: fp32 copies on the GPU first would take 4 bytes a parameter each.
        ref_policy = cast_parameters(ref_policy, dtype).to(accelerator.device)
        reward_model = cast_parameters(reward_model, dtype).to(accelerator.device)
    problem = rotary_problem({"policy and critic": model, "reference": ref_policy, "reward model": reward_model})
    refuse(problem and f"rotary frequencies below fp32 after accelerator.prepare: {problem}")
    return ref_policy, reward_model


def start_ppo_logging(args, accelerator, resume_from: Optional[tuple], recorded: dict) -> tuple:
    """(run name, rank 0's SummaryWriter or None); rank 0 writes args.json (flags, `recorded`, git commit) and starts W&B."""
    start_time = broadcast_object_list([int(time.time())])[0]  # rank 0's clock: one name for all ranks
    # The model's name too: a sweep's array starts its sizes at once, and their runs/ folders must differ.
    model = os.path.basename(recorded["base_model_name"])
    run_name = args.run_name or f"{args.exp_name}__{model}__{args.seed}__{start_time}"
    if resume_from is not None and args.run_name is None:  # a resumed run logs on into its own folder
        run_name = load_json(os.path.join(resume_from[1], "trainer_state.json"))["run_name"]
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
    accelerator.print(f"run {run_name}: {args.num_updates} updates of {args.batch_size} episodes = "
                      f"{args.local_batch_size} per rank x {args.world_size} ranks; {args.num_minibatches} "
                      f"minibatch(es) of {args.mini_batch_size} = {args.local_micro_batch_size} x "
                      f"{args.gradient_accumulation_steps} per rank x {args.world_size}; {args.micro_batch_size} per forward")
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


def check_and_checkpoint(accelerator, args, updates_done: int, losses: torch.Tensor, run_name: str, model,
                         optimizer) -> bool:
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
        save_checkpoint(accelerator, checkpoints, updates_done, run_name, model, optimizer)
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


def resume(accelerator, args, resume_from: Optional[tuple], model, optimizer) -> int:
    """All ranks: the update to start at, after loading `resume_from` ((update, path) or None) when there is one."""
    from safetensors import SafetensorError  # a file cut short (it names no folder)

    if resume_from is not None:
        try:
            load_checkpoint(accelerator, resume_from[1], model, optimizer)  # also the RNG states of that update
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


def save_checkpoint(accelerator, folder: str, update: int, run_name: str, model, optimizer) -> None:
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
        # JSON, not pickle: the counters are plain numbers (PPO anneals its lr by hand: no scheduler to save).
        state = {"update": update, "run_name": run_name,
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


def load_checkpoint(accelerator, path: str, model, optimizer) -> dict:
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


def save_ppo(accelerator, args, run_name: str, writer, model, tokenizer, all_metrics: dict) -> None:
    """All ranks wait; rank 0 writes the policy (fp32), tokenizer, eval tables and eval_metrics.json to a staging
    folder, swaps it in as output_dir and pushes it (--push_to_hub)."""
    accelerator.wait_for_everyone()
    policy = accelerator.unwrap_model(model).policy
    # The policy's weights alone: the critic is not saved, and its fp32 copy would cost rank 0 ~41 GB at 6.9B.
    policy_state = fp32_state_dict(accelerator, policy)  # every rank must call it
    if not accelerator.is_main_process:
        return
    # Saved, they let a plain `model.generate` elsewhere stop at EOS (an SFT model from the Hub may lack them).
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    staging = staging_folder(args.output_dir)  # swapped in whole once complete
    save_fp32(policy, staging, policy_state)
    tokenizer.save_pretrained(staging)
    for split in all_metrics:  # the final tables, where judge.py reads them
        shutil.copy(os.path.join(f"runs/{run_name}", f"samples_{split}_{args.num_updates * args.batch_size}.csv"),
                    os.path.join(staging, f"eval_{split}.csv"))
    with open(os.path.join(staging, "eval_metrics.json"), "w") as file:
        json.dump(all_metrics, file, indent=2)
    publish_output(staging, args.output_dir)  # the checkpoints go with the old folder: only an unfinished run needs them
    writer.close()
    print(f"saved {args.output_dir}; TensorBoard and every evaluation's samples: runs/{run_name}/")
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


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's generators, and ask cuDNN for deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = True


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

"""TRL 1.12.0's `trl.experimental.ppo.PPOTrainer` on the same tiny PPO run as ppo.py, timed per update.

Runs in the benchmark's own venv (.venv-trl at the repository root: the project pins + trl==1.12.0; TRL is
never a dependency of the stage scripts). benchmark/ppo_vs_trl.sh starts it; it prints one JSON
line `TIMINGS {...}` with the wall time of every update and the time split of every update.

Same inputs as ppo.py: the policy and the reference from the SFT folder, the value model and the
reward model from the RM folder (our ScalarModel, behind an adapter that gives TRL the
`base_model_prefix` backbone and `.score` head it reads: same weights, same head), the same
prompts in the same order (ppo.py's episode_order), fp32, dropout off, AdamW with the same eps and
weight decay, linear learning-rate decay, 4 PPO epochs, 1 minibatch, the same micro batch and
rollout chunk, temperature 0.7, kl coef 0.05, stop token = EOS.
"""

import argparse
import json
import os
import sys
import time

import datasets
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithPadding, TrainerCallback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ppo import ScalarModel, check_tokenizer, disable_dropout, episode_order  # noqa: E402

import trl.experimental.ppo.ppo_trainer as trl_ppo  # noqa: E402
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: E402


class TrlScalarModel(torch.nn.Module):
    """Our ScalarModel as TRL's get_reward / PolicyAndValueWrapper read a value or reward model.

    TRL calls `getattr(model, model.base_model_prefix)` for the backbone (with output_hidden_states)
    and applies `model.score` to the last hidden state: here the very same backbone and head modules."""

    base_model_prefix = "backbone"

    def __init__(self, scalar_model: ScalarModel):
        super().__init__()
        self.backbone, self.score, self.config = scalar_model.backbone, scalar_model.head, scalar_model.config


class Timer:
    """Seconds spent in wrapped functions, per category, reset at each update."""

    def __init__(self):
        self.seconds = {"generation": 0.0, "scoring": 0.0}

    def wrap(self, function, category):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                # forward() also serves the training step (with grad): only no-grad calls are scoring
                if category != "scoring" or not torch.is_grad_enabled():
                    self.seconds[category] += time.perf_counter() - start
        return timed


class UpdateClock(TrainerCallback):
    """Wall time and split of each PPO update (TRL calls on_step_end once per update)."""

    def __init__(self, timer: Timer):
        self.timer, self.updates, self.last = timer, [], None

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        total = now - self.last
        split = dict(self.timer.seconds)
        self.updates.append({"total": total, **split, "training": total - sum(split.values())})
        self.timer.seconds = dict.fromkeys(split, 0.0)
        self.last = now


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base_model", required=True)
    parser.add_argument("--query_dataset", required=True)
    parser.add_argument("--sft_model_path", required=True)
    parser.add_argument("--reward_model_path", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--local_micro_batch_size", type=int, default=16)
    parser.add_argument("--local_rollout_forward_batch_size", type=int, default=64)
    parser.add_argument("--num_minibatches", type=int, default=1)
    parser.add_argument("--num_ppo_epochs", type=int, default=4)
    parser.add_argument("--response_length", type=int, default=44)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--kl_coef", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.base_model, padding_side="right")
    check_tokenizer(tokenizer, None, args.query_dataset)
    train = datasets.load_from_disk(args.query_dataset)["train"]
    # ppo.py's prompts, in ppo.py's order (every query is left-padded to the same width already), and one batch more:
    # in a loader's last batch accelerate syncs every micro-batch, so TRL's last update would step 16 times, not 4.
    order = episode_order(len(train), (args.updates + 1) * args.batch_size, args.seed).tolist()
    prompts = train.select(order).select_columns(["query_token"]).rename_column("query_token", "input_ids")

    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path)
    ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path)
    value_model = TrlScalarModel(ScalarModel.from_pretrained(args.reward_model_path))
    reward_model = TrlScalarModel(ScalarModel.from_pretrained(args.reward_model_path))
    for model in (policy, ref_policy, value_model, reward_model):
        disable_dropout(model)  # TRL only zeroes nn.Dropout modules; GPT-NeoX attention has a float too
    ref_policy.eval().requires_grad_(False)
    reward_model.eval().requires_grad_(False)

    config = PPOConfig(
        output_dir=args.output_dir, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_cpu=True, bf16=False, fp16=False, seed=args.seed, optim="adamw_torch", learning_rate=args.lr,
        adam_epsilon=1e-5, weight_decay=0.01, lr_scheduler_type="linear",
        per_device_train_batch_size=args.local_micro_batch_size,
        gradient_accumulation_steps=args.batch_size // args.local_micro_batch_size,  # TRL: batch = micro x GAS
        num_mini_batches=args.num_minibatches, num_ppo_epochs=args.num_ppo_epochs,
        total_episodes=args.updates * args.batch_size,
        local_rollout_forward_batch_size=args.local_rollout_forward_batch_size,
        response_length=args.response_length, temperature=args.temperature, kl_coef=args.kl_coef,
        stop_token="eos", missing_eos_penalty=1.0, num_sample_generations=0)
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, train_dataset=prompts, value_model=value_model,
                         eval_dataset=prompts.select(range(args.batch_size)))
    # Same prompts in the same order as ppo.py: replace the shuffled loader (its batches are the same size).
    trainer.dataloader = trainer.accelerator.prepare(DataLoader(
        prompts, batch_size=args.batch_size, shuffle=False, drop_last=True,
        collate_fn=DataCollatorWithPadding(tokenizer)))

    timer = Timer()
    trl_ppo.batch_generation = timer.wrap(trl_ppo.batch_generation, "generation")
    trl_ppo.forward = timer.wrap(trl_ppo.forward, "scoring")  # ref forward (no grad) and training forward
    trl_ppo.get_reward = timer.wrap(trl_ppo.get_reward, "scoring")  # values and scores (no grad)
    clock = UpdateClock(timer)
    trainer.add_callback(clock)
    trainer.train()
    print("TIMINGS " + json.dumps({"threads": torch.get_num_threads(), "updates": clock.updates}), flush=True)


if __name__ == "__main__":
    main()

"""A non-finite loss (issue 16): every training stage checks the loss and the weights on every update
(all ranks agree), stops at the first nan / inf with a message that names the update and what to
try, and never lets a checkpoint holding it replace a good one.

Each stage runs on the tiny world with a learning rate of 1e6 and a checkpoint after every update:
the first update leaves huge (still finite) weights, whose next update is not finite. The checkpoint
of the last finite update must survive, hold finite weights and load; no model may be saved.
"""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ppo
import reward
import sft
from conftest import REPO, WORLD, one_process, run_python
from test_ppo import make_reward_model

BASE = str(WORLD / "pythia-tiny")
HUGE_LR = ["--lr", "1e6", "--save_every", "1"]


def stage_command(script, tiny_tldr, tmp_path):
    """A tiny run of `script` (4 updates at most) writing to tmp_path/out."""
    small = ["--batch_size", "8", "--local_micro_batch_size", "4", "--local_eval_batch_size", "8"]
    if script == "sft.py":
        return ["--base_model", BASE, "--query_dataset", tiny_tldr / "sft", *small, "--total_episodes", "32",
                "--response_length", "8", "--num_eval_samples", "8"]
    if script in ("reward.py", "dpo.py"):
        return ["--sft_model_path", BASE, "--label_dataset", tiny_tldr / "preference", "--query_dataset",
                tiny_tldr / "sft", *small, "--total_episodes", "32", "--num_eval_samples", "8"]
    make_reward_model(tmp_path / "rm")
    return ["--base_model", BASE, "--query_dataset", tiny_tldr / "sft", "--sft_model_path", BASE,
            "--reward_model_path", tmp_path / "rm", "--total_episodes", "32", "--batch_size", "8",
            "--local_micro_batch_size", "4", "--local_rollout_forward_batch_size", "8", "--response_length", "8",
            "--num_eval_samples", "8", "--local_eval_batch_size", "8", "--num_ppo_epochs", "1", "--eval_every", "2"]


@pytest.mark.parametrize("script", ["sft.py", "reward.py", "dpo.py", "ppo.py"])
def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(script, tiny_tldr, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / script), *stage_command(script, tiny_tldr, tmp_path), "--output_dir", out,
           *HUGE_LR]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_python(cmd, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("FloatingPointError: update "), result.stderr[-3000:]
    stopped_at = int(message.split()[2])
    assert stopped_at >= 2 and "not finite" in message and "--lr" in message and "--resume" in message
    # The checkpoint of the update before is kept whole, finite and loadable; nothing later was saved.
    checkpoints = sorted(path.name for path in (out / "checkpoints").iterdir())
    assert checkpoints == [f"update_{stopped_at - 1}"], checkpoints
    assert f"update_{stopped_at - 1} (update {stopped_at - 1}), is kept as it was" in message
    folder = out / "checkpoints" / checkpoints[0]
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["update"] == stopped_at - 1
    tensors = load_file(str(folder / "model.safetensors"))
    assert all(torch.isfinite(tensor).all() for tensor in tensors.values())
    assert all(torch.isfinite(tensor).all() for tensor in load_file(str(folder / "optimizer.safetensors")).values())
    if script == "reward.py":
        model = reward.reward_model_from_sft(BASE)
    elif script == "ppo.py":  # policy and critic, trained as one module
        model = ppo.PolicyAndValueWrapper(AutoModelForCausalLM.from_pretrained(BASE),
                                          ppo.ScalarModel.from_pretrained(tmp_path / "rm"))
    else:
        model = AutoModelForCausalLM.from_pretrained(BASE)
    model.load_state_dict(tensors, strict=True)  # loads into the stage's model
    assert not (out / "model.safetensors").exists() and not (out / "eval_metrics.json").exists()
    if script == "ppo.py":  # --eval_every 2: the evaluation due at the non-finite update did not sample its policy
        samples = sorted(path.name for path in (tmp_path / "runs").glob("*/samples_validation_*.csv"))
        assert samples == [f"samples_validation_{8 * update}.csv" for update in range(2, stopped_at, 2)], samples


def test_a_nonfinite_loss_or_weight_on_any_rank_stops_the_run():
    """all_finite: a nan loss with finite weights, an inf weight with a finite loss (the loss of the next update would
    be nan, too late: this update's checkpoint would hold it), or either on another rank (the all-reduced count)."""
    model = torch.nn.Linear(2, 2)
    assert sft.all_finite(one_process(), model, torch.ones(3))
    assert not sft.all_finite(one_process(), model, torch.tensor([1.0, float("nan")]))
    other_rank_not_finite = one_process()
    other_rank_not_finite.reduce = lambda tensor, reduction: tensor + 1
    assert not sft.all_finite(other_rank_not_finite, model, torch.ones(3))
    with torch.no_grad():
        model.bias[1] = float("inf")
    assert not sft.all_finite(one_process(), model, torch.ones(3))

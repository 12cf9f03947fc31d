"""Tests of reward.py: pure helpers against hand-built tensors and tables, then real runs.

  - Detail 11: the head's initial weights have std 1/sqrt(d_model + 1) and a zero bias
  - Detail 12: the reward index on right-padded and on left-padded-query layouts, with and without pads
  - Detail 14: a tiny RM scores a sequence the same in both layouts
  - Detail 15: folding the mean into the head's bias makes the references' mean reward 0
  - Detail 16 / 18: grouped accuracy and calibration bins on hand-made tables
  - a 1-process run interrupted after 3 updates and resumed, and the same run on 2 processes:
    each pair read once per epoch, the same final weights, outputs written, the saved RM loads
    from a moved folder and gives the SFT references a mean reward of 0
"""

import json
import math
import os
import shutil
import socket
import sys

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import REPO, WORLD, early_exits, multi_process_slot, one_process, run_python, slice_tiny_tldr

import reward

ENV = dict(os.environ)


def test_head_init_statistics():
    """Detail 11: weight ~ N(0, 1/sqrt(d + 1)) on a wide head, bias 0; ScalarModel applies it to its head."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16383, 1)  # 16,383 weights: the sample std is within ~1% of the true one
    reward.init_reward_head(head)
    assert abs(head.weight.std().item() * math.sqrt(16384) - 1) < 0.03
    assert abs(head.weight.mean().item()) < 4 / math.sqrt(16384) / math.sqrt(16383)  # 4 standard errors
    assert torch.equal(head.bias, torch.zeros(1))
    # Seeded, exact: the same standard normal draws times 1/sqrt(d + 1), 1/2 at d = 3 (1/sqrt(d) would give 0.577).
    small = torch.nn.Linear(3, 1)
    torch.manual_seed(1)
    reward.init_reward_head(small)
    torch.manual_seed(1)
    torch.testing.assert_close(small.weight.detach(), torch.empty(1, 3).normal_() / 2, rtol=1e-6, atol=0)
    base = dict(model_type="gpt_neox", hidden_size=1024, num_attention_heads=4, num_hidden_layers=1,
                intermediate_size=32, vocab_size=16)
    model = reward.ScalarModel(reward.ScalarModelConfig(base_config=base))
    assert abs(model.head.weight.std().item() * math.sqrt(1025) - 1) < 0.1  # not the default std 0.02
    assert torch.equal(model.head.bias.detach(), torch.zeros(1))


PAD = 1  # the tiny world's [PAD] id; EOS is 0


@pytest.mark.parametrize("ids, expected", [
    ([[5, 6, 7, 0, PAD, PAD], [5, 6, 0, PAD, PAD, PAD]], [3, 2]),  # padded rows: the EOS before the first pad
    ([[5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 0, PAD]], [5, 4]),  # a row without pad: the last index
])
def test_reward_index_right_padded(ids, expected):
    """Detail 12, training layout: right-padded query+response, context 0."""
    assert reward.reward_indices(torch.tensor(ids), PAD, 0).tolist() == expected


@pytest.mark.parametrize("ids, expected", [
    # left-padded query of width 4 ++ right-padded response: the query's pads are skipped
    ([[PAD, PAD, 5, 6, 7, 0, PAD, PAD], [PAD, 5, 6, 7, 8, 9, 0, PAD]], [5, 6]),
    # a query without pads, and a response without pads: the last index
    ([[4, 5, 6, 7, 8, 9, 10, 0], [PAD, PAD, PAD, 7, 8, 0, PAD, PAD]], [7, 5]),
])
def test_reward_index_left_padded_query(ids, expected):
    """Detail 12, PPO layout: left-padded query ++ right-padded response, context = query width 4."""
    assert reward.reward_indices(torch.tensor(ids), PAD, 4).tolist() == expected


class IdentityRM(torch.nn.Module):
    """A fake RM whose per-token reward logit is the (masked) input id: shows what get_reward reads."""

    def forward(self, input_ids, attention_mask):
        return (input_ids * attention_mask).float()


class PositionRM(torch.nn.Module):
    """A fake RM whose per-token reward logit is its position + 1: shows which index get_reward reads."""

    def forward(self, input_ids, attention_mask):
        return (torch.arange(input_ids.shape[1]) + 1.0).expand(input_ids.shape).clone()


def test_get_reward_reads_the_eos_logit():
    ids = torch.tensor([[PAD, 3, 4, 9, 0, PAD], [2, 3, 4, 5, 8, 7]])
    logits, rewards = reward.get_reward(IdentityRM(), ids, PAD, context_length=2)
    assert logits[0, 0] == 0  # pads reach the model as id 0, masked
    assert rewards.tolist() == [0.0, 7.0]  # the logits at the indices below
    # By position, so that no pad can pass for the EOS: row 0's EOS at index 4 (the pad before the context is
    # skipped, the one after it ends the summary), row 1 has no pad (its last index, 5).
    _, rewards = reward.get_reward(PositionRM(), ids, PAD, context_length=2)
    assert rewards.tolist() == [5.0, 6.0]


def tiny_scalar_model(seed=0):
    """A ScalarModel on the tiny world's base-model config, random weights, dropout off."""
    torch.manual_seed(seed)
    config = json.loads((WORLD / "pythia-tiny" / "config.json").read_text())
    model = reward.ScalarModel(reward.ScalarModelConfig(base_config=config))
    reward.disable_dropout(model)
    return model.eval()


def test_left_and_right_padding_give_the_same_reward():
    """Detail 14: the same tokens scored right-padded and as left-padded query ++ response."""
    model = tiny_scalar_model()
    query, response = [11, 12, 13, 14, 15], [21, 22, 0]  # response ends with EOS
    right = torch.tensor([query + response + [PAD] * 4])  # (1, 12)
    left = torch.tensor([[PAD] * 3 + query + response + [PAD] * 2])  # query width 8, response width 5
    with torch.no_grad():
        _, r_right = reward.get_reward(model, right, PAD, 0)
        _, r_left = reward.get_reward(model, left, PAD, 8)
    assert abs(r_right.item() - r_left.item()) < 1e-4



def pad_rows(rows: list, width: int, left: bool = False) -> torch.Tensor:
    """Id lists -> (len(rows), width) ids, each row padded with [PAD] on the right (or on the left)."""
    return torch.tensor([[PAD] * (width - len(r)) + r if left else r + [PAD] * (width - len(r)) for r in rows])

@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_pair_rewards_match_separate_rows(attention):
    """Training's one row per pair (query ++ chosen ++ rejected) gives each summary the reward, and the loss
    the gradient, of its own right-padded query+summary row: queries of different lengths, summaries with
    and without pads, a rejected summary longer than the chosen one."""
    model = tiny_scalar_model(seed=2).train()  # train mode: what the training loop runs (dropout is off)
    model.backbone.set_attn_implementation(attention)
    queries = [[11, 12, 13, 14, 15, 16], [17, 18, 19], [20, 21, 22, 23]]
    chosen = [[31, 32, 0], [33, 0], [34, 35, 36, 37, 0]]
    rejected = [[41, 42, 43, 44, 45, 0], [46, 0], [47, 48, 0]]
    rows = pad_rows([q + c for q, c in zip(queries, chosen)] + [q + r for q, r in zip(queries, rejected)], 12)
    responses = pad_rows(chosen + rejected, 6)  # one width for both: chosen row 2 and rejected row 0 fill it

    def loss_and_grads(chosen_rewards, rejected_rewards):
        loss = -torch.nn.functional.logsigmoid(chosen_rewards - rejected_rewards).mean()
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        return loss, torch.cat([g.flatten() for g in grads])

    _, separate = reward.get_reward(model, rows, PAD, 0)
    packed = reward.pair_rewards(model, pad_rows(queries, 9, left=True), *responses.split(3), PAD)
    assert torch.allclose(torch.cat(packed), separate, atol=1e-5), (packed, separate)
    assert separate.std() > 0.1  # distinct rewards: a mix-up of rows or summaries would show
    loss_separate, grads_separate = loss_and_grads(*separate.split(3))
    loss_packed, grads_packed = loss_and_grads(*packed)
    assert abs(loss_separate.item() - loss_packed.item()) < 1e-5
    assert torch.allclose(grads_packed, grads_separate, atol=1e-5, rtol=1e-4)


def test_pair_row_mask_gives_every_position_something_to_read():
    """The one-row pair's (B, 1, T, T) attention mask: every position, a pad included, reads at least one column
    (the row's first query token, and a pad itself). A query row with nothing to read is NaN in CUDA's
    memory-efficient attention (0 in the CPU kernels, where the other tests run), and NaN spreads through the backward."""
    seen = {}

    def model(input_ids, attention_mask, position_ids, positions):
        seen["mask"] = attention_mask
        return torch.zeros(len(input_ids), 2)

    queries = pad_rows([[11, 12, 13, 14, 15, 16], [17, 18, 19]], 6, left=True)
    chosen, rejected = pad_rows([[31, 0], [33, 34, 35, 0]], 4), pad_rows([[41, 42, 0], [46, 0]], 4)
    reward.pair_rewards(model, queries, chosen, rejected, PAD)
    mask = seen["mask"]  # (B, 1, T, T): row 0 ends 2 columns before row 1, so it has pads
    assert mask.shape == (2, 1, 11, 11) and mask.any(-1).all()

def test_rewards_at_eos_equal_get_reward():
    """rewards_at_eos (evaluation's scoring, the last layer at the EOS column only) == get_reward's EOS rewards:
    right-padded rows (context 0), left-padded query ++ right-padded response (context = the query's width), a row
    without pads. In float64, where the two agree to ~1e-14: an EOS read one column off would not."""
    model = tiny_scalar_model(seed=4).double()
    right = torch.tensor([[11, 12, 13, 21, 0, PAD, PAD], [14, 15, 16, 17, 22, 23, 0], [18, 24, 0, PAD, PAD, PAD, PAD]])
    left = torch.tensor([[PAD, PAD, 11, 12, 21, 0, PAD], [13, 14, 15, 16, 22, 23, 0], [PAD, 17, 18, 19, 24, PAD, PAD]])
    for rows, context_length in ((right, 0), (left, 4)):
        with torch.no_grad():
            expected = reward.get_reward(model, rows, PAD, context_length)[1]
            got = reward.rewards_at_eos(model, rows, PAD, context_length)
        assert got.shape == (3,) and expected.std() > 0.05  # distinct rewards: a row mix-up would show
        assert torch.allclose(got, expected, rtol=0, atol=1e-10), (got, expected)


@pytest.mark.parametrize("parallel_residual", [True, False])
@pytest.mark.parametrize("mask", ["padding", "4-D", "none"])
def test_hidden_states_at_equal_the_full_forward_at_those_columns(mask, parallel_residual):
    """hidden_states_at (the last layer at the asked columns only) == the backbone's full forward read at those
    columns, outputs and gradients: a (B, T) padding mask, a (B, 1, T, T) boolean mask with position ids (pair_rewards'
    layout), or none; both of GPT-NeoX's residual forms; the columns in any order, the first and the last among them.
    In float64, where the two agree to ~1e-14: a wrong mask row or column would not (float32 rounds them ~1e-6
    apart). (The fallback for other attentions is the full forward itself; test_pair_rewards_match_separate_rows
    runs it with eager attention.)"""
    model = tiny_scalar_model(seed=5).train().double()
    model.backbone.config.use_parallel_residual = parallel_residual
    for layer in model.backbone.layers:
        layer.use_parallel_residual = parallel_residual
    ids = torch.randint(1, 200, (3, 10), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(3, 10, dtype=torch.bool)
    padding[0, 7:] = padding[2, :2] = False  # a right-padded row and a left-padded one
    position_ids = None
    if mask == "4-D":  # each row reads an arbitrary causal subset, as pair_rewards builds it
        reads = torch.ones(10, 10, dtype=torch.bool).tril().repeat(3, 1, 1) & padding[:, None, :]
        reads[1, 6:, 3:6] = False  # columns 6 on do not read columns 3-5 (a rejected summary and the chosen one)
        attention_mask = (reads | torch.eye(10, dtype=torch.bool))[:, None]
        position_ids = torch.tensor([list(range(10)), list(range(6)) + list(range(3, 7)), list(range(10))])
    else:
        attention_mask = padding if mask == "padding" else torch.ones(3, 10, dtype=torch.long)
    positions = torch.tensor([[6, 0], [9, 5], [2, 9]])  # (B, 2)
    rows = torch.arange(3)[:, None]
    assert reward.sdpa_gpt_neox(model.backbone)  # the fast path proper, not the fallback
    fast = reward.hidden_states_at(model.backbone, ids, attention_mask, position_ids, positions)  # (B, 2, d)
    plain = model.backbone(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids
                           ).last_hidden_state[rows, positions]
    assert fast.shape == plain.shape == (3, 2, model.config.base_config["hidden_size"])
    assert torch.allclose(fast, plain, rtol=0, atol=1e-10), (fast - plain).abs().max()
    parameters = list(model.backbone.parameters())
    fast_grads = torch.autograd.grad(fast.pow(2).sum(), parameters)
    plain_grads = torch.autograd.grad(plain.pow(2).sum(), parameters)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-10) for a, b in zip(fast_grads, plain_grads))
    rewards = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, positions=positions)
    assert rewards.shape == (3, 2) and torch.allclose(rewards, model.head(plain).squeeze(-1), rtol=0, atol=1e-10)
    assert (plain[0, 0] - plain[1, 0]).abs().max() > 1e-3  # distinct rows: a mix-up would show


@pytest.mark.parametrize("groups", [2, 3, 5])
def test_pair_rewards_by_length_match_one_forward(groups):
    """The pairs sorted by length into `groups` forwards (the longest pair first in the batch, groups of
    unequal sizes, more groups than pairs) give every pair the reward, and the loss the gradient, of one forward."""
    model = tiny_scalar_model(seed=3).train()
    queries = [[11, 12, 13, 14, 15, 16, 17], [18, 19], [20, 21, 22, 23], [24, 25, 26]]
    chosen = [[31, 32, 33, 0], [34, 0], [35, 36, 0], [37, 38, 39, 0]]
    rejected = [[41, 42, 43, 0], [44, 45, 0], [46, 0], [47, 48, 49, 0]]
    batch = (pad_rows(queries, 8, left=True), pad_rows(chosen, 5), pad_rows(rejected, 5))

    def rewards_and_grads(rewards):
        loss = -torch.nn.functional.logsigmoid(rewards[0] - rewards[1]).mean()
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        return torch.cat(rewards).detach(), torch.cat([g.flatten() for g in grads])

    one, one_grads = rewards_and_grads(reward.pair_rewards(model, *batch, PAD))
    grouped, grouped_grads = rewards_and_grads(reward.pair_rewards_by_length(model, *batch, PAD, groups))
    assert one.std() > 0.1  # distinct rewards: pairs put back in the wrong order would show
    assert torch.allclose(grouped, one, atol=1e-5), (grouped, one)
    assert torch.allclose(grouped_grads, one_grads, atol=1e-5, rtol=1e-4)


def test_pair_rewards_do_not_depend_on_the_inputs_padding_width():
    """rm_update passes the dataset's columns as stored (queries left-padded, summaries right-padded to the
    longest of the dataset): all-pad columns on either side change no reward, to the last bit."""
    model = tiny_scalar_model(seed=4).eval()
    queries, chosen, rejected = torch.tensor([[PAD, 5, 6], [4, 5, 6]]), torch.tensor([[7, 0], [8, 0]]), torch.tensor(
        [[9, 0], [0, PAD]])
    widened = (torch.cat((torch.full((2, 4), PAD), queries), 1), torch.cat((chosen, torch.full((2, 3), PAD)), 1),
               torch.cat((rejected, torch.full((2, 3), PAD)), 1))
    with torch.no_grad():
        tight, wide = reward.pair_rewards(model, queries, chosen, rejected, PAD), reward.pair_rewards(model, *widened, PAD)
    assert all(torch.equal(a, b) for a, b in zip(tight, wide)), (tight, wide)
    assert tight[0][0] != tight[1][1]  # distinct rewards


def test_normalization_bias_makes_the_mean_zero():
    """Detail 15 through reward.normalise_rewards on a small RM: it scores the references right-padded (as in
    training), takes their mean off the head's bias, in the module and in the state dict it returns for saving, and
    the references' rewards then average 0; scored left-padded (Detail 14) they agree."""
    import datasets

    model = tiny_scalar_model(seed=1)
    generator = torch.Generator().manual_seed(0)
    queries, responses, rows = [], [], []
    for query_length, response_length in ((3, 2), (4, 3), (2, 1), (4, 2), (1, 3), (3, 3)):
        query = torch.randint(2, 1000, (query_length,), generator=generator).tolist()
        response = torch.randint(2, 1000, (response_length,), generator=generator).tolist() + [0]  # EOS = 0
        queries.append([PAD] * (4 - query_length) + query)  # left-padded query, as preprocess writes it
        responses.append(response + [PAD] * (4 - len(response)))
        rows.append(query + response + [PAD] * (8 - query_length - len(response)))  # right-padded, as in training
    references = datasets.Dataset.from_dict({"query_token": queries, "reference_response_token": responses,
                                             "query_reference_response_token": rows}).with_format("torch")
    accelerator = one_process()
    accelerator.get_state_dict = lambda module: dict(module.state_dict())
    bias = model.head.bias.item()
    with torch.no_grad():
        _, before = reward.get_reward(model, torch.tensor(rows), PAD, 0)
    state_dict, normalization = reward.normalise_rewards(accelerator, model, references, PAD, 4)
    with torch.no_grad():
        _, after = reward.get_reward(model.eval(), torch.tensor(rows), PAD, 0)
    assert abs(before.mean().item()) > 1e-3  # the test would pass trivially otherwise
    assert normalization["mean"] == pytest.approx(before.mean().item(), abs=1e-5)
    assert model.head.bias.item() == pytest.approx(bias - before.mean().item(), abs=1e-5)  # subtracted, not added
    assert state_dict["head.bias"].item() == pytest.approx(model.head.bias.item(), abs=1e-6)  # what is saved
    assert abs(after.mean().item()) < 1e-5
    assert torch.allclose(after - before, -before.mean().expand(6), atol=1e-5)  # a shift, nothing else
    assert abs(normalization["right_left_diff_mean"]) < 1e-4 and normalization["references"] == 6


def test_normalise_rewards_logs_right_minus_left_as_the_reference_and_shifts_by_the_right_mean(monkeypatch):
    """Detail 14's difference has the reference's sign (right- minus left-padded, the paper's -5.4e-4 at 6.9B),
    so a run's number compares with the paper's as it stands; Detail 15 shifts by the right-padded mean only."""
    scores = {"right": np.array([1.0, 2.0, 3.0]), "left": np.array([1.5, 2.0, 2.995])}
    monkeypatch.setattr(reward, "score_dataset", lambda *args, **kwargs: scores)
    monkeypatch.setattr(reward, "shift_head_bias", lambda accelerator, model, shift: {"shift": shift})
    state, normalization = reward.normalise_rewards(one_process(), None, [0, 1, 2], PAD, 2)
    assert state == {"shift": -2.0}
    assert normalization["right_left_diff_mean"] == pytest.approx((-0.5 + 0.0 + 0.005) / 3)
    assert normalization["right_left_diff_gt_1e-2"] == pytest.approx(1 / 3)  # only |-0.5| > 1e-2
    assert (normalization["mean"], normalization["references"]) == (2.0, 3)


def test_shift_head_bias_moves_the_module_on_every_rank_and_the_saved_bias_on_rank_0():
    """Detail 15's shift reaches the module every rank evaluates with, and the fp32 state dict only rank 0 saves;
    the other ranks hold no state dict (an fp32 copy of the RM per rank through the whole evaluation)."""
    from types import SimpleNamespace

    for main in (True, False):
        model = torch.nn.Module()
        model.head = torch.nn.Linear(2, 1)
        bias = model.head.bias.item()
        accelerator = SimpleNamespace(get_state_dict=lambda module: dict(module.state_dict()),
                                      unwrap_model=lambda m: m, is_main_process=main,
                                      state=SimpleNamespace(deepspeed_plugin=None))
        state_dict = reward.shift_head_bias(accelerator, model, -0.5)
        assert model.head.bias.item() == pytest.approx(bias - 0.5)
        if main:
            assert state_dict["head.bias"].item() == pytest.approx(bias - 0.5) and "head.weight" in state_dict
        else:
            assert state_dict == {}


def test_grouped_accuracy_hand_made_table():
    """Detail 16: accuracy overall and per value of each grouping column; a missing confidence is a group."""
    table = pd.DataFrame({"accuracy": [1.0, 0.0, 1.0, 1.0, 0.0],
                          "split": ["valid1", "valid1", "valid2", "valid2", "valid2"],
                          "batch": ["b6", "b7", "b7", "b7", "b6"],
                          "confidence": [1, 9, 9, None, 9]})
    out = reward.grouped_accuracy(table, ("split", "batch", "confidence"))
    got = {(row.group, row.value): (round(row.accuracy, 4), row.pairs) for row in out.itertuples()}
    assert got == {("all", "all"): (0.6, 5), ("split", "valid1"): (0.5, 2), ("split", "valid2"): (0.6667, 3),
                   ("batch", "b6"): (0.5, 2), ("batch", "b7"): (0.6667, 3),
                   ("confidence", "1"): (1.0, 1), ("confidence", "9"): (0.3333, 3),
                   ("confidence", "nan"): (1.0, 1)}
    assert out.iloc[0].group == "all"
    # The real data's batches run batch3 ... batch22: in the order a reader counts, not as strings sort
    batches = pd.DataFrame({"accuracy": [1.0] * 4, "batch": ["batch10", "batch3", "cnndm0", "batch22"]})
    assert list(reward.grouped_accuracy(batches, ("batch",)).value) == ["all", "batch3", "batch10", "batch22", "cnndm0"]
    # What the run publishes of it: eval_metrics.json's (and W&B's) keys, and accuracy_<split>.md's rows.
    key = "eval/rm/validation/accuracy"
    assert reward.accuracy_metrics(out, key) == pytest.approx({
        key: 0.6, f"{key}/split/valid1": 0.5, f"{key}/split/valid2": 2 / 3, f"{key}/batch/b6": 0.5,
        f"{key}/batch/b7": 2 / 3, f"{key}/confidence/1": 1.0, f"{key}/confidence/9": 1 / 3, f"{key}/confidence/nan": 1.0})
    assert reward.markdown_table(out).splitlines() == [
        "| group | value | accuracy | pairs |", "|---|---|---|---|", "| all | all | 0.600 | 5 |",
        "| split | valid1 | 0.500 | 2 |", "| split | valid2 | 0.667 | 3 |", "| batch | b6 | 0.500 | 2 |",
        "| batch | b7 | 0.667 | 3 |", "| confidence | 1 | 1.000 | 1 |", "| confidence | 9 | 0.333 | 3 |",
        "| confidence | nan | 1.000 | 1 |"]


def test_pair_accuracy_by_hand():
    """Detail 16's per-pair accuracy: the sign of the margin, `tie` at 0, and 1/2 for two identical summaries whatever
    their rewards (dpo.py's copy is the same code: tests/test_conventions.py)."""
    table = pd.DataFrame({"chosen": [" a", " a", " a", " b", " b"], "rejected": [" b", " b", " b", " b", " b"],
                          "chosen_reward": [1.0, -1.0, 0.5, 0.2441356, 3.0],
                          "rejected_reward": [0.0, 0.0, 0.5, 0.2441359, 3.0]})
    assert reward.pair_accuracy(table, tie=0.0).tolist() == [1.0, 0.0, 0.0, 0.5, 0.5]
    assert reward.pair_accuracy(table, tie=0.5).tolist() == [1.0, 0.0, 0.5, 0.5, 0.5]


def test_calibration_bins_hand_made_margins():
    """Detail 18: bins of |margin| 0.5 wide; accuracy = the bin's mean of the accuracy column (positive margins
    right, a tie as pair_accuracy counts it: the plot and the accuracy table agree); ideal = sigmoid(centre)."""
    margins = [0.1, -0.2, 0.3, 0.7, -0.9, 1.6]
    table = pd.DataFrame({"chosen": [" a"] * 6, "rejected": [" b"] * 6, "chosen_reward": margins,
                          "rejected_reward": [0.0] * 6})
    table["accuracy"] = reward.pair_accuracy(table, tie=0.0)
    out = reward.calibration_bins(table, 0.5)
    assert out["low"].tolist() == [0.0, 0.5, 1.5]
    assert out["pairs"].tolist() == [3, 2, 1]
    assert np.allclose(out["accuracy"], [2 / 3, 0.5, 1.0])
    assert np.allclose(out["ideal"], [1 / (1 + math.exp(-c)) for c in (0.25, 0.75, 1.75)])
    # a tie (DPO before any update: every implicit reward 0) counts 1/2 in both, not as wrong in the plot only
    tied = pd.concat([table, pd.DataFrame({"chosen": [" a"], "rejected": [" b"], "chosen_reward": [0.0],
                                           "rejected_reward": [0.0]})], ignore_index=True)
    tied["accuracy"] = reward.pair_accuracy(tied, tie=0.5)
    assert reward.calibration_bins(tied, 0.5)["accuracy"].tolist()[0] == pytest.approx((1 + 0 + 1 + 0.5) / 4)


# ---------------------------------------------------------------------------------------------
# Real runs on a small slice of the tiny world
# ---------------------------------------------------------------------------------------------

TRAIN_PAIRS, BATCH, EPOCHS = 32, 8, 2  # 8 updates of 8 pairs: each pair twice, once per epoch


@pytest.fixture(scope="module")
def small_world(tiny_tldr, tmp_path_factory):
    """Slices of the preprocessed tiny world (32 train pairs, 15 + 7 eval pairs, 23 references) + a judged CSV."""
    root = tmp_path_factory.mktemp("small_world")
    slice_tiny_tldr(tiny_tldr, root, TRAIN_PAIRS, "train", 23)
    validation = datasets.load_from_disk(str(tiny_tldr / "sft"))["validation"].select(range(10))
    # judge.py's judged/<run>.csv columns (a malformed verdict counts for neither side)
    pd.DataFrame({"post": validation["query"], "ours": validation["summary"],
                  "other": list(reversed(validation["summary"])),
                  "preferred": ["ours", "reference"] * 4 + ["malformed", "ours"]}).to_csv(root / "judged.csv", index=False)
    return root


def run_reward(small_world, output_dir, *extra, processes=1, deepspeed=False):
    """Run reward.py on the small world (1 process, or CPU processes with accelerate launch: DDP or DeepSpeed)."""
    flags = ["--sft_model_path", str(WORLD / "pythia-tiny"), "--label_dataset", str(small_world / "preference"),
             "--query_dataset", str(small_world / "sft"), "--output_dir", str(output_dir), "--lr", "1e-3",
             "--batch_size", str(BATCH), "--num_train_epochs", str(EPOCHS), "--local_eval_batch_size", "8", *extra]
    if processes == 1:
        cmd = [sys.executable, str(REPO / "reward.py"), *flags]
    else:  # ENV_NOTES: CPU DDP needs --multi_gpu with ACCELERATE_USE_CPU; CPU DeepSpeed must not set it
        # (fp32: the config's bf16 is for GPUs)
        backend = (["--config_file", str(REPO / "benchmark/accelerate/deepspeed_zero2.yaml")] if deepspeed else
                   ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"])
        with socket.socket() as sock:  # a free port: other test sessions may launch at the same time
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *backend, "--num_processes", str(processes),
               "--mixed_precision", "no", "--main_process_port", str(port), str(REPO / "reward.py"), *flags]
    env = {key: value for key, value in ENV.items() if key != "ACCELERATE_USE_CPU"}
    env.update({"ACCELERATE_USE_CPU": "1"} if processes > 1 and not deepspeed else {})
    with multi_process_slot(processes):
        result = run_python(cmd, cwd=output_dir.parent, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def assert_each_pair_once_per_epoch(output_dir, processes):
    """The rows each rank read, per update: every epoch's updates read every train pair exactly once.

    The rows come from the run's own args.json (seed, sizes, world size) through local_episode_order,
    the function the training loop reads its micro-batches with."""
    run = json.loads((output_dir / "args.json").read_text())
    assert run["world_size"] == processes
    orders = [reward.local_episode_order(TRAIN_PAIRS, run["num_updates"], run["gradient_accumulation_steps"],
                                         run["world_size"], run["local_micro_batch_size"], run["seed"], r)
              for r in range(processes)]  # (U, GAS, micro) per rank
    seen = [{str(u): order[u].flatten().tolist() for u in range(run["num_updates"])} for order in orders]
    updates_per_epoch = TRAIN_PAIRS // BATCH
    for epoch in range(EPOCHS):
        rows = [row for ranks in seen for u in range(epoch * updates_per_epoch, (epoch + 1) * updates_per_epoch)
                for row in ranks[str(u)]]
        assert sorted(rows) == list(range(TRAIN_PAIRS)), f"epoch {epoch}: {sorted(rows)}"
    if processes > 1:  # the ranks read disjoint pairs in every update
        for u in seen[0]:
            assert not set(seen[0][u]) & set(seen[1][u])


@pytest.fixture(scope="module")
def resumed_run(small_world, tmp_path_factory):
    """1 process, micro-batch 4 x 2 accumulation steps; stopped after 3 of 8 updates, then resumed."""
    output_dir = tmp_path_factory.mktemp("resumed") / "rm"
    first = run_reward(small_world, output_dir, "--local_micro_batch_size", "4", "--stop_after_updates", "3",
                       "--gold_judge", str(WORLD), "--judged_file", str(small_world / "judged.csv"))
    assert "stopped after update 3 of 8" in first
    assert (output_dir / "checkpoints" / "update_3" / "trainer_state.json").is_file()
    second = run_reward(small_world, output_dir, "--local_micro_batch_size", "4", "--resume",
                        "--gold_judge", str(WORLD), "--judged_file", str(small_world / "judged.csv"))
    assert "resumed from" in second and "at update 3" in second
    return output_dir


def test_resumed_run_is_the_uninterrupted_run_bit_for_bit(resumed_run, small_world, tmp_path):
    """The same run, never stopped: the same weights to the bit and the same evaluation table, byte for byte."""
    from safetensors.torch import load_file

    out = tmp_path / "rm"
    run_reward(small_world, out, "--local_micro_batch_size", "4", "--gold_judge", str(WORLD),
               "--judged_file", str(small_world / "judged.csv"))
    whole, resumed = load_file(out / "model.safetensors"), load_file(resumed_run / "model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[key], resumed[key]) for key in whole)
    assert (out / "eval_validation.csv").read_bytes() == (resumed_run / "eval_validation.csv").read_bytes()


def test_run_interrupted_and_resumed_writes_a_normalised_portable_rm(resumed_run, small_world, tmp_path):
    out = resumed_run
    assert_each_pair_once_per_epoch(out, processes=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "args.json", "eval_validation.csv",
                 "eval_validation_cnndm.csv", "accuracy_validation.md", "accuracy_validation_cnndm.md",
                 "calibration.png", "token_rewards.png", "normalization.json", "eval_metrics.json"):
        assert (out / name).is_file(), name
    assert not (out / "checkpoints").exists()  # removed when the run ends
    args = json.loads((out / "args.json").read_text())
    assert (args["num_updates"], args["gradient_accumulation_steps"], args["local_micro_batch_size"]) == (8, 2, 4)
    metrics = json.loads((out / "eval_metrics.json").read_text())
    for key in ("eval/rm/validation/accuracy", "eval/rm/validation_cnndm/accuracy", "eval/rm/validation/gold_accuracy",
                "eval/rm/judge_agreement", "eval/rm/validation/accuracy/confidence/9"):
        assert 0 <= metrics[key] <= 1, key
    table = pd.read_csv(out / "eval_validation.csv")
    assert len(table) == 15 and {"chosen_reward", "rejected_reward", "accuracy", "gold_prefers_chosen",
                                 "batch", "confidence", "chosen_policy"} <= set(table.columns)
    assert table["accuracy"].mean() == pytest.approx(metrics["eval/rm/validation/accuracy"])
    assert metrics["eval/rm/judge_agreement"] * 9 == pytest.approx(round(metrics["eval/rm/judge_agreement"] * 9))
    normalization = json.loads((out / "normalization.json").read_text())
    assert normalization["references"] == 23 and abs(normalization["right_left_diff_mean"]) < 1e-3

    # The saved RM: safetensors, no path in its config, loads from a moved folder, references average 0.
    config_text = (out / "config.json").read_text()
    assert "_name_or_path" not in config_text and str(REPO) not in config_text and "pythia-tiny" not in config_text
    moved = tmp_path / "renamed_rm"
    shutil.copytree(out, moved)
    model = reward.ScalarModel.from_pretrained(str(moved)).eval()
    assert model.config.base_config["attention_dropout"] == 0.0  # Detail 7: saved with dropout off
    references = datasets.load_from_disk(str(small_world / "sft"))["train"].with_format(
        "torch", columns=["query_reference_response_token"])
    with torch.no_grad():
        _, rewards = reward.get_reward(model, references[:]["query_reference_response_token"], PAD, 0)
    assert abs(rewards.mean().item()) < 1e-3


def test_two_processes_read_each_pair_once_and_match_one_process(resumed_run, small_world, tmp_path):
    """2 CPU processes x micro-batch 2 x 2 accumulation steps = the 1-process run's updates, split in two; and its
    evaluation: the odd splits (15 and 7 pairs, 23 references) shared out over the ranks and back, each row once, in
    the split's order, with the 1-process run's rewards and normalising mean."""
    out = tmp_path / "rm2"
    run_reward(small_world, out, "--local_micro_batch_size", "2", processes=2)
    assert_each_pair_once_per_epoch(out, processes=2)
    assert json.loads((out / "args.json").read_text())["world_size"] == 2
    two = reward.ScalarModel.from_pretrained(str(out)).state_dict()
    one = reward.ScalarModel.from_pretrained(str(resumed_run)).state_dict()
    for key in one:  # same pairs per micro-step, gradients averaged over ranks: the same updates
        assert torch.allclose(one[key], two[key], atol=1e-4), key
    for name in ("eval_validation.csv", "eval_validation_cnndm.csv"):
        a, b = pd.read_csv(resumed_run / name), pd.read_csv(out / name)
        assert len(a) == len(b) == {"eval_validation.csv": 15, "eval_validation_cnndm.csv": 7}[name]
        assert a["query"].equals(b["query"]) and (a["chosen_reward"] - b["chosen_reward"]).abs().max() < 1e-4, name
    one, two = (json.loads((folder / "normalization.json").read_text()) for folder in (resumed_run, out))
    assert one["references"] == two["references"] == 23
    assert abs(one["mean"] - two["mean"]) < 1e-4, (one, two)


def test_bad_inputs_fail_before_any_model_is_loaded(small_world, tmp_path):
    """A dataset without the pair columns, an output folder holding another run, other token ids (Detail 3)."""
    base = ["--sft_model_path", str(WORLD / "pythia-tiny"), "--query_dataset", str(small_world / "sft"),
            "--batch_size", "8"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "args.json").write_text(json.dumps({"lr": 0.5}))
    (tmp_path / "b" / "eval_metrics.json").write_text("{}")  # that run's work (an args.json alone is a failed start)
    other_ids = tmp_path / "other_ids"  # Detail 3: data tokenized with other pad / eos ids than the model's
    shutil.copytree(small_world, other_ids)
    (other_ids / "args.json").write_text(json.dumps({"pad_token_id": 5, "eos_token_id": 0}))
    pairs = len(datasets.load_from_disk(str(small_world / "preference"))["train"])
    too_few = ["--num_train_epochs", "1", "--batch_size", str(8 * pairs)]  # one pass, no whole batch: no update
    no_policy = datasets.load_from_disk(str(small_world / "preference"))  # read only by the evaluation after training
    no_policy["validation"] = no_policy["validation"].remove_columns("chosen_policy")
    no_policy.save_to_disk(str(tmp_path / "no_policy"))
    starts = [(small_world / "sft", "a", []), (small_world / "preference", "b", []),
              (other_ids / "preference", "c", []), (small_world / "preference", "d", too_few),
              (tmp_path / "no_policy", "e", [])]
    wrong, taken, mismatch, short, late = early_exits([  # one interpreter for the four starts (conftest.early_exits)
        (tmp_path, REPO / "reward.py", base + ["--label_dataset", labels, "--output_dir", tmp_path / out, *extra])
        for labels, out, extra in starts], env=ENV)
    assert wrong.returncode != 0 and "SetupError" in wrong.stderr and "lacks ['validation'" in wrong.stderr
    assert late.returncode != 0 and (f"--label_dataset {tmp_path / 'no_policy'} lacks ['validation.chosen_policy'], "
                                     "which the evaluation after training reads") in late.stderr, late.stderr[-2000:]
    assert not (tmp_path / "e").exists()
    assert taken.returncode != 0 and "holds a different run" in taken.stderr
    assert mismatch.returncode != 0 and "was tokenized with {'pad_token_id': 5, 'eos_token_id': 0}" in mismatch.stderr
    assert short.returncode != 0 and (f"its train split ({pairs} pairs) x --num_train_epochs 1 is less than one batch "
                                      f"of {8 * pairs}: pass --total_episodes") in short.stderr, short.stderr[-2000:]
    for result in (wrong, taken, mismatch, short):
        assert "Loading weights" not in result.stdout + result.stderr
    assert not any((tmp_path / name).exists() for name in "acd")
    assert sorted(os.listdir(tmp_path / "b")) == ["args.json", "eval_metrics.json"]  # untouched


def test_deepspeed_zero2_matches_one_process(resumed_run, small_world, tmp_path):
    """The paper's launcher config on 2 CPU processes (fp32: bf16 is for GPUs): DeepSpeed reads the
    micro-batch and the accumulation from the script and must not clip gradients (accelerate fills
    in clipping at 1.0; the paper's runs do not clip), then it matches the 1-process run like DDP."""
    out = tmp_path / "rm_deepspeed"
    run_reward(small_world, out, "--local_micro_batch_size", "2", processes=2, deepspeed=True)
    assert_each_pair_once_per_epoch(out, processes=2)
    two = reward.ScalarModel.from_pretrained(str(out)).state_dict()
    one = reward.ScalarModel.from_pretrained(str(resumed_run)).state_dict()
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-4), key


@pytest.mark.parametrize("dtype_key", ["dtype", "torch_dtype"])
def test_a_reward_model_whose_base_config_says_fp16_loads_whole_in_fp32(tmp_path, dtype_key):
    """A reward model folder whose stored base_config names float16 (the reference's RMs keep Pythia's config,
    `torch_dtype: float16`; transformers 5 writes `dtype`) loads in the loader's dtype, backbone and head alike:
    from_config alone would build an fp16 backbone under an fp32 head, which ppo.py's fp32 load did not undo."""
    import ppo

    base = dict(model_type="gpt_neox", hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                intermediate_size=32, vocab_size=16, **{dtype_key: "float16"})
    reward.ScalarModel(reward.ScalarModelConfig(base_config=base)).save_pretrained(tmp_path / "rm")
    for model_class in (reward.ScalarModel, ppo.ScalarModel):
        model = ppo.load_fp32(model_class, str(tmp_path / "rm"), "--reward_model_path")
        assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}


def test_rm_update_descends_the_bradley_terry_loss(tiny_tldr):
    """Detail 10: rm_update's loss is -log sigmoid(r_chosen - r_rejected), the mean over the update's pairs (4 pairs
    in 2 micro-batches of 2, accumulated): its logged loss equals that of the rewards before the step, and one SGD
    step on it widens every pair's margin toward the chosen summary."""
    import contextlib

    class Accumulating:  # the parts of an Accelerator that rm_update uses; backward divides by the 2 steps
        device = torch.device("cpu")
        accumulate = staticmethod(lambda model: contextlib.nullcontext())
        backward = staticmethod(lambda loss: (loss / 2).backward())

    train = datasets.load_from_disk(str(tiny_tldr / "preference"))["train"]
    batch = train.with_format("torch", columns=list(reward.TRAIN_PAIR_COLUMNS))[list(range(4))]
    model = tiny_scalar_model()
    with torch.no_grad():
        chosen, rejected = reward.pair_rewards(model, *(batch[c] for c in reward.TRAIN_PAIR_COLUMNS), PAD)
    assert (chosen - rejected).abs().min() > 1e-4  # a random head: the pairs are not tied
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)

    class Accumulated:  # as accelerate's prepared optimizer: steps and zeroes at the update's last micro-step only
        calls = 0

        def step(self):
            self.calls += 1
            if self.calls == 2:
                sgd.step()

        def zero_grad(self):
            if self.calls == 2:
                sgd.zero_grad()

    optimizer = Accumulated()
    parts = [{key: value[start:start + 2] for key, value in batch.items()} for start in (0, 2)]
    stats = reward.rm_update(Accumulating(), model, optimizer, parts, PAD, 1)
    by_hand = [-torch.nn.functional.logsigmoid(chosen[rows] - rejected[rows]).mean() for rows in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(stats["loss"], torch.stack(by_hand))  # each micro-step's, before the step
    # The logged training accuracy and reward means (train/rm/*), each micro-step's, before the step.
    halves = (slice(0, 2), slice(2, 4))
    assert stats["accuracy"].tolist() == [(chosen[rows] > rejected[rows]).float().mean().item() for rows in halves]
    torch.testing.assert_close(stats["chosen_rewards"], torch.stack([chosen[rows].mean() for rows in halves]))
    torch.testing.assert_close(stats["rejected_rewards"], torch.stack([rejected[rows].mean() for rows in halves]))
    with torch.no_grad():
        new_chosen, new_rejected = reward.pair_rewards(model, *(batch[c] for c in reward.TRAIN_PAIR_COLUMNS), PAD)
    assert ((new_chosen - new_rejected) > (chosen - rejected)).all()


# ---------------------------------------------------------------------------------------------
# The evaluation's outputs: what reaches eval_<split>.csv, accuracy_<split>.md and eval_metrics.json
# ---------------------------------------------------------------------------------------------

def gold_pairs():
    """Hand-made comparison rows (as preprocess_tldr.py keeps them) whose gold margins are known."""
    post, good, bad = "My landlord cancelled my lease.", " my landlord cancelled my lease", " my boss sold my car"
    info = {"title": "Help", "post": post, "article": None}
    rows = [([good, bad], 0), ([bad, good], 0), ([good, bad], 0), ([good, good], 0), ([bad, good], 1)]
    eval_set = {"info": [info] * len(rows), "choice": [c for _, c in rows],
                "summaries": [[{"text": t} for t in texts] for texts, _ in rows]}
    # the labels' side: right, right (against the gold), a tie, a tie (identical summaries), wrong
    texts = [(s[c]["text"], s[1 - c]["text"]) for s, c in zip(eval_set["summaries"], eval_set["choice"])]
    table = pd.DataFrame({"chosen": [c for c, _ in texts], "rejected": [r for _, r in texts],
                          "chosen_reward": [1.0, 0.5, 0.25, 0.5, -1.0], "rejected_reward": [0.0, -0.5, 0.25, 0.0, 2.0]})
    table["accuracy"] = reward.pair_accuracy(table, tie=0.0)  # as reward.py's main: an RM tie is no right answer
    return eval_set, table


def test_gold_agreement_by_hand():
    """Agreement of the ordering with the gold judge's: 1 where the side the RM puts first is the gold's better one,
    1/2 for an RM tie, gold ties (identical summaries) left out; chosen = summaries[choice]. CNN/DM rows are judged
    against their article; the report quotes the noise ceiling of its own split."""
    eval_set, table = gold_pairs()
    agreement, report = reward.gold_agreement(table, eval_set, "validation", str(WORLD), "RM")
    # pair 0 agrees; pair 1's label is against the gold (the RM follows the label: disagrees); pair 2 an RM tie;
    # pair 3 a gold tie (not counted); pair 4: chosen = the good one (choice 1), the RM ranks it last: disagrees
    assert agreement == pytest.approx((1 + 0 + 0.5 + 0) / 4)
    assert table["gold_prefers_chosen"].tolist()[:3] == [1.0, 0.0, 1.0] and math.isnan(table["gold_prefers_chosen"][3])
    assert table["gold_prefers_chosen"][4] == 1.0
    ceilings = json.loads((WORLD / "world.json").read_text())["noise_ceiling"]
    assert f"on {agreement:.3f} of 4 pairs" in report and f"noise ceiling {ceilings['validation']:.3f}" in report
    news = {**eval_set, "info": [{"title": "News", "post": None,
                                  "article": "(CNN) -- The mayor closed the bridge."}] * 5}
    news["summaries"] = [[{"text": t["text"].replace("my landlord cancelled my lease", "the mayor closed the bridge")}
                          for t in pair] for pair in eval_set["summaries"]]
    agreement, report = reward.gold_agreement(table.copy(), news, "validation_cnndm", str(WORLD), "RM")
    assert agreement == pytest.approx((1 + 0 + 0.5 + 0) / 4)
    assert f"noise ceiling {ceilings['validation_cnndm']:.3f}" in report


def test_pair_table_keeps_each_side_with_its_own_policy_and_reward():
    eval_set = {"query": ["q0", "q1"], "chosen": [" c0", " c1"], "rejected": [" r0", " r1"], "batch": ["b3", "b4"],
                "split": ["valid1", "valid2"], "extra": [{"confidence": 7}, {"confidence": None}],
                "chosen_policy": ["sup4", "ref"], "rejected_policy": ["sup1", "sup2"]}
    table = reward.pair_table(eval_set, {"chosen": np.array([0.5, -1.0]), "rejected": np.array([0.25, 2.0])})
    assert table["chosen_policy"].tolist() == ["sup4", "ref"] and table["rejected_policy"].tolist() == ["sup1", "sup2"]
    assert table["chosen_reward"].tolist() == [0.5, -1.0] and table["rejected_reward"].tolist() == [0.25, 2.0]
    assert table["confidence"][0] == 7 and pd.isna(table["confidence"][1])  # a missing confidence stays missing
    table["accuracy"] = reward.pair_accuracy(table, tie=0.0)
    assert table["accuracy"].tolist() == [1.0, 0.0]


def test_write_split_results_writes_the_table_and_the_report_as_they_are(tmp_path):
    table = pd.DataFrame({"chosen": [" a", " b"], "chosen_reward": [0.5, -1.0], "accuracy": [1.0, 0.0]})
    calibration = pd.DataFrame({"low": [0.0], "high": [0.5], "pairs": [2], "accuracy": [0.5], "ideal": [0.56]})
    reward.write_split_results(str(tmp_path), "validation", table, "# report\n", calibration, "eval_validation.csv", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accuracy_validation.md", "eval_validation.csv"]
    assert (tmp_path / "eval_validation.csv").read_text().splitlines()[0] == "chosen,chosen_reward,accuracy"
    assert pd.read_csv(tmp_path / "eval_validation.csv").equals(table)
    assert (tmp_path / "accuracy_validation.md").read_text() == "# report\n"


def test_score_dataset_returns_the_real_rows_in_dataset_order(monkeypatch):
    """Rank 1 of 2 over 7 rows in batches of 2 scores rows 1, 3, 5 (its last batch padded with row 5, not kept); the
    rows come back in dataset order however gather_object joins the ranks' lists (here: reversed)."""
    model = tiny_scalar_model()
    rows = [[11 + i, 12, 13 + i, 0] for i in range(7)]
    dataset = datasets.Dataset.from_dict({"ids": pad_rows(rows, 6).tolist()}).with_format("torch")
    monkeypatch.setattr(reward, "gather_object", lambda rows: list(reversed(rows)))
    got = reward.score_dataset(one_process(1, 2), model, dataset, {"x": ("ids",)}, PAD, 2)["x"]
    with torch.no_grad():
        expected = [reward.get_reward(model, torch.tensor([rows[i]]), PAD, 0)[1].item() for i in (1, 3, 5)]
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_judge_agreement_ranks_each_response_against_its_reference_as_the_rm_scores_them(monkeypatch):
    """The RM agrees with a judgment when it scores the side the judge preferred higher; each text scored as
    preprocess_tldr.py builds it (query, a space, the summary, EOS); malformed verdicts and ties do not count."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    model = tiny_scalar_model(seed=3)
    monkeypatch.setattr(reward, "gather_object", lambda rows: rows)
    queries = [f"SUBREDDIT: r/tifu\n\nPOST: my {a} broke my {o}\n\nTL;DR:" for a, o in
               [("boss", "car"), ("sister", "phone"), ("uncle", "bike"), ("coach", "keys"), ("aunt", "rent"),
                ("wife", "dog")]]
    responses = ["boss broke car", "my sister broke my phone", "uncle", "coach broke keys and more", "aunt rent", "dog"]
    references = ["my boss broke my car", "sister phone", "my uncle broke my bike", "keys", "my aunt broke my rent", "x"]

    def score(query, text):
        ids = tokenizer(f"{query} {text}{tokenizer.eos_token}", add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            return reward.get_reward(model, ids, PAD, 0)[1].item()

    preferred = ["ours" if score(q, r) > score(q, f) else "reference" for q, r, f in zip(queries, responses, references)]
    assert len(set(preferred)) == 2  # both verdicts occur
    preferred[-2:] = ["malformed", "tie"]
    judged = pd.DataFrame({"query": queries, "response": responses, "reference": references, "preferred": preferred})
    args = type("Args", (), {"local_eval_batch_size": 4, "judged_file": "judged.csv"})()
    scored, score_dataset = {}, reward.score_dataset

    def spy(accelerator, model, dataset, layouts, pad_token_id, batch_size):  # the rows the RM scores
        scored.update({name: [[t for t in row if t != PAD] for row in dataset[:][name].tolist()] for name in layouts})
        return score_dataset(accelerator, model, dataset, layouts, pad_token_id, batch_size)

    monkeypatch.setattr(reward, "score_dataset", spy)
    assert reward.judge_agreement(one_process(), model, tokenizer, judged, args) == 1.0
    for name, texts in (("response", responses), ("reference", references)):
        assert scored[name] == [tokenizer(f"{q} {t}{tokenizer.eos_token}", add_special_tokens=False).input_ids
                                for q, t in zip(queries, texts)], name
    judged["preferred"] = [{"ours": "reference", "reference": "ours"}.get(p, p) for p in preferred]
    assert reward.judge_agreement(one_process(), model, tokenizer, judged, args) == 0.0
    # An EOS or [PAD] typed in a text is text: the one EOS id is the last (the reward is read there), no pad inside
    judged["response"] = ["boss broke <|endoftext|> car", "sister [PAD] phone"] + responses[2:]
    reward.judge_agreement(one_process(), model, tokenizer, judged, args)
    assert [row.count(tokenizer.eos_token_id) for row in scored["response"][:2]] == [1, 1]
    assert all(row[-1] == tokenizer.eos_token_id for row in scored["response"])
    assert scored["response"][0] == tokenizer(f"{queries[0]} boss broke <|endoftext|> car", add_special_tokens=False,
                                              split_special_tokens=True).input_ids + [tokenizer.eos_token_id]
    assert len(scored["response"][1]) > len(tokenizer(f"{queries[1]} sister phone").input_ids) + 1  # [PAD] kept as text


def test_token_reward_samples_are_each_rows_reward_logits_up_to_a_few_pads_past_its_eos(tiny_tldr):
    """Detail 13's plot: both rows of the first two validation pairs, named by pair and side, with the query length
    and the EOS index of that row."""
    validation = datasets.load_from_disk(str(tiny_tldr / "preference"))["validation"]
    model = tiny_scalar_model()
    samples = reward.token_reward_samples(model, validation, PAD, torch.device("cpu"))
    assert [title for title, *_ in samples] == ["validation pair 0, chosen", "validation pair 1, chosen",
                                                "validation pair 0, rejected", "validation pair 1, rejected"]
    for (title, logits, query_length, eos), (pair, side) in zip(samples, [(0, "chosen"), (1, "chosen"),
                                                                           (0, "rejected"), (1, "rejected")]):
        ids = torch.tensor([validation[pair][f"query_{side}_token"]])
        with torch.no_grad():
            row_logits, _ = reward.get_reward(model, ids, PAD, 0)
        assert eos == int(reward.reward_indices(ids, PAD, 0)[0]) and ids[0, eos] == 0  # the EOS
        assert query_length == validation[pair]["query_token_len"]
        np.testing.assert_allclose(logits, row_logits[0, :eos + 6].tolist(), atol=1e-5)
    assert samples[0][2] != samples[1][2]  # the two pairs' queries differ in length: each row gets its own


def test_a_hub_dataset_whose_query_ids_do_not_open_the_row_is_named(small_world, tmp_path):
    """The reference's datasets tokenized each row from a cleaned-up query text (transformers 4.33: " ," as ","):
    on such posts the row's query ids are not query_token. A dataset without preprocess_tldr.py's args.json beside it
    (a Hub dataset) is checked on its first train rows and the count is printed; ours (args.json beside) is not."""
    import dpo

    train = datasets.load_from_disk(str(small_world / "preference"))["train"].select(range(10))
    pad = json.loads((small_world / "args.json").read_text())["pad_token_id"]
    hub_like = tmp_path / "hub" / "preference"  # no args.json in tmp_path / "hub"

    def cleaned(row, i):  # rows 2 and 5: the first query id rewritten in the query+chosen row only
        if i in (2, 5):
            first = next(j for j, token in enumerate(row["query_token"]) if token != pad)
            ids = list(row["query_chosen_token"])
            ids[0] = row["query_token"][first] + 1
            row["query_chosen_token"] = ids
        return row

    for module in (reward, dpo):
        assert module.cleaned_query_warning(str(hub_like), train, pad) is None  # every row opens with its query
        warning = module.cleaned_query_warning(str(hub_like), train.map(cleaned, with_indices=True), pad)
        assert warning.startswith(f"warning: in 2 of the first 10 train rows of --label_dataset {hub_like} (no "
                                  "preprocess_tldr.py args.json beside it), the query's ids do not open"), warning
        assert module.cleaned_query_warning(str(hub_like), train.map(cleaned, with_indices=True), pad, rows=2) is None
        # preprocess_tldr.py's own folder: its args.json says how it was built, nothing to check
        assert module.cleaned_query_warning(str(small_world / "preference"),
                                            train.map(cleaned, with_indices=True), pad) is None

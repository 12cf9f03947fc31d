"""Tests of dpo.py: the loss and the log-probs against hand computation, then real runs.

  - Detail 19: the DPO / IPO / conservative-DPO losses and the implicit rewards on hand-picked log-probs;
    summed log-probs count the summary's tokens (EOS included) and nothing else, whatever the padding;
    micro-batches of 1 and of 4 give the same gradient for the same 4 pairs (the reference code's
    un-reduced loss is right only for micro-batch 1)
  - Detail 7: policy and reference loaded from the same model give h exactly 0 (with dropout left on they do not)
  - a 1-process run (micro-batch 4 x 2 accumulation steps) interrupted after 3 updates and resumed,
    and the same run on 2 processes: the same final weights; tables, samples and metrics written
  - bad inputs fail with a SetupError before any model is loaded
The subprocess runs use the tiny base model as the "SFT model", as tests/test_reward.py does.
"""

import contextlib
import json
import math
import os
import shutil
import socket
import sys
from types import SimpleNamespace

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import dpo
from conftest import (REPO, WORLD, early_exits, multi_process_slot, run_python, sampler_with_junk_after_eos,
                      slice_tiny_tldr)

ENV = dict(os.environ)
EOS, PAD = 0, 1  # the tiny world's ids (data/tiny_tldr/args.json)
BASE = WORLD / "pythia-tiny"


def test_dpo_loss_and_implicit_rewards_by_hand():
    """Detail 19: h = (-10 - -11) - (-12 - -11) = 2, beta 0.05: rewards +-0.05, loss -log sigmoid(0.1)."""
    logps = [torch.tensor([-10.0, -5.0]), torch.tensor([-12.0, -5.0]), torch.tensor([-11.0, -5.0]),
             torch.tensor([-11.0, -5.0])]  # chosen, rejected, ref chosen, ref rejected; pair 2: pi = pi_ref
    losses, chosen, rejected = dpo.dpo_loss(*logps, beta=0.05)
    assert torch.allclose(chosen, torch.tensor([0.05, 0.0])) and torch.allclose(rejected, torch.tensor([-0.05, 0.0]))
    assert torch.allclose(losses, torch.tensor([math.log(1 + math.exp(-0.1)), math.log(2)]))
    ipo, _, _ = dpo.dpo_loss(*logps, beta=0.05, ipo=True)  # (h - 1 / (2 beta))^2 = (2 - 10)^2
    assert torch.allclose(ipo, torch.tensor([64.0, 100.0]))
    smoothed, _, _ = dpo.dpo_loss(*logps, beta=0.05, label_smoothing=0.1)
    expected = 0.9 * math.log(1 + math.exp(-0.1)) + 0.1 * math.log(1 + math.exp(0.1))
    assert torch.allclose(smoothed, torch.tensor([expected, math.log(2)]))


def tiny_model(seed=None):
    """The tiny world's base model, dropout off; with a seed, its weights moved by small seeded noise."""
    model = AutoModelForCausalLM.from_pretrained(BASE)
    dpo.disable_dropout(model)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def test_sequence_logprobs_sum_only_the_summary_tokens():
    """Detail 19: the sum over the response of log p(id), EOS included, query and pads excluded, any padding;
    the fast path equals the plain masked sum over all positions."""
    model = tiny_model(seed=0).eval()
    rows = [([5, 6, 7, 8], [20, 21, EOS]), ([9, 10], [22, 23, 24, 25, EOS])]  # (query, response) pairs
    width = 10
    ids = torch.tensor([q + r + [PAD] * (width - len(q) - len(r)) for q, r in rows])  # (2, 10) right-padded
    labels = torch.tensor([[PAD] * len(q) + r + [PAD] * (width - len(q) - len(r)) for q, r in rows])
    with torch.no_grad():
        got = dpo.sequence_logprobs(model, ids, labels, PAD)
        for i, (query, response) in enumerate(rows):  # naive: each row alone, unpadded, one term per token
            logits = model(torch.tensor([query + response])).logits[0].log_softmax(-1)  # (T, V)
            expected = sum(logits[len(query) - 1 + k, token] for k, token in enumerate(response))
            assert abs(got[i].item() - expected.item()) < 1e-4, (i, got[i], expected)
        # The plain expression its docstring opens with: every position's log-softmax, masked, summed.
        mask = labels[:, 1:] != PAD  # (B, T-1)
        logprobs = model(input_ids=ids.masked_fill(ids == PAD, 0), attention_mask=ids != PAD).logits[:, :-1].log_softmax(-1)
        plain = (logprobs.gather(2, labels[:, 1:].masked_fill(~mask, 0).unsqueeze(2)).squeeze(2) * mask).sum(1)
        assert torch.allclose(got, plain, atol=1e-5), (got, plain)


def pairs(tiny_tldr, n):
    """The first n train pairs of the tiny world as dpo.py reads them: {column: (n, T) tensor}."""
    train = datasets.load_from_disk(str(tiny_tldr / "preference"))["train"]
    return train.with_format("torch", columns=list(dpo.PAIR_COLUMNS))[list(range(n))]


class Accumulating:
    """The parts of an Accelerator that dpo_update and implicit_rewards use, on one CPU process: backward divides by
    the accumulation steps, as accelerator.backward does while accumulating."""

    device, process_index, num_processes, is_main_process = torch.device("cpu"), 0, 1, True

    def __init__(self, steps: int = 1):
        self.steps = steps

    def accumulate(self, model):
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss):
        (loss / self.steps).backward()

    def unwrap_model(self, model):
        return model


class KeepGradients:
    """An optimizer that neither steps nor zeroes: after dpo_update the parameters hold the update's gradient."""

    def step(self):
        pass

    def zero_grad(self):
        pass


def test_micro_batch_1_and_4_give_the_same_gradient(tiny_tldr):
    """dpo_update's loss is a mean per micro-batch, divided by the accumulation steps: 4 x 1 = 1 x 4 pairs, the
    gradient of the mean DPO loss over the 4 pairs (a sum would scale it with the micro-batch)."""
    batch = pairs(tiny_tldr, 4)
    # float64: the two ways sum the same terms in another order, and in float32 an embedding row whose gradient
    # nearly cancels differs by ~2e-6 (the world's pairs of 0670dbd); in float64 the tolerance below holds.
    reference = tiny_model().double().eval()
    args = SimpleNamespace(beta=0.05, ipo=False, label_smoothing=0.0)
    gradients = []
    for micro in (4, 1):
        policy = tiny_model(seed=1).double()  # moved away from the reference: h differs per pair
        parts = [{key: value[start:start + micro] for key, value in batch.items()} for start in range(0, 4, micro)]
        stats = dpo.dpo_update(Accumulating(4 // micro), policy, reference, KeepGradients(), parts, PAD, args)
        gradients.append({name: p.grad.clone() for name, p in policy.named_parameters()})
        assert stats["loss"].abs().max() > 0 and max(g.abs().max() for g in gradients[-1].values()) > 1e-4
    # by hand: the mean loss over the 4 pairs, one backward
    policy = tiny_model(seed=1).double()
    with torch.no_grad():
        ref_logps = dpo.pair_logprobs(reference, batch, PAD)
    dpo.dpo_loss(*dpo.pair_logprobs(policy, batch, PAD), *ref_logps, beta=0.05)[0].mean().backward()
    gradients.append({name: p.grad.clone() for name, p in policy.named_parameters()})
    for name in gradients[0]:
        assert torch.allclose(gradients[0][name], gradients[1][name], atol=1e-6, rtol=1e-4), name
        assert torch.allclose(gradients[0][name], gradients[2][name], atol=1e-6, rtol=1e-4), name


def test_logged_training_accuracy_counts_a_tie_as_half(tiny_tldr):
    """At the first update the policy is the reference: every implicit reward is 0, every pair a tie, and the logged
    accuracy is 1/2 (the evaluation's rule), not the 0 of a strict >; a policy moved away ranks each pair."""
    batch = pairs(tiny_tldr, 4)
    args = SimpleNamespace(beta=0.05, ipo=False, label_smoothing=0.0)
    reference = tiny_model().double().eval()
    stats = dpo.dpo_update(Accumulating(1), tiny_model().double(), reference, KeepGradients(), [batch], PAD, args)
    assert stats["accuracy"].tolist() == [0.5] and stats["loss"].item() == pytest.approx(math.log(2))
    policy = tiny_model(seed=1).double()
    stats = dpo.dpo_update(Accumulating(1), policy, reference, KeepGradients(), [batch], PAD, args)
    with torch.no_grad():
        _, chosen, rejected = dpo.dpo_loss(*dpo.pair_logprobs(policy, batch, PAD), *dpo.pair_logprobs(reference, batch, PAD),
                                           beta=0.05)
    assert (chosen != rejected).all() and stats["accuracy"].item() == (chosen > rejected).double().mean().item()


def test_implicit_rewards_are_beta_times_the_log_ratio_of_each_summary(tiny_tldr):
    """Detail 19: the evaluation's implicit rewards are beta (log pi(y|x) - log pi_ref(y|x)) of the chosen and of the
    rejected summary, each with its own reference log-prob; exactly 0 for the reference itself. Rows in dataset
    order (evaluation batches of 3 over 5 pairs: the last batch padded)."""
    train = datasets.load_from_disk(str(tiny_tldr / "preference"))["train"]
    dataset = train.select(range(5)).with_format("torch", columns=list(dpo.PAIR_COLUMNS))
    reference, policy = tiny_model().eval(), tiny_model(seed=1).eval()
    with torch.no_grad():
        rewards = dpo.implicit_rewards(Accumulating(), policy, reference, dataset, PAD, 0.05, 3)
        same = dpo.implicit_rewards(Accumulating(), reference, reference, dataset, PAD, 0.05, 3)
        chosen, rejected = dpo.pair_logprobs(policy, dataset[:], PAD)
        ref_chosen, ref_rejected = dpo.pair_logprobs(reference, dataset[:], PAD)
    np.testing.assert_allclose(rewards["chosen"], (0.05 * (chosen - ref_chosen)).numpy(), atol=1e-5)
    np.testing.assert_allclose(rewards["rejected"], (0.05 * (rejected - ref_rejected)).numpy(), atol=1e-5)
    assert np.abs(rewards["chosen"] - rewards["rejected"]).max() > 1e-3  # the two sides differ
    assert np.abs(same["chosen"]).max() < 1e-6 and np.abs(same["rejected"]).max() < 1e-6


def test_evaluation_samples_cut_at_eos_and_both_tables_come_back_in_dataset_order(tiny_tldr, monkeypatch):
    """sample_summaries (the eval_validation.csv that judge.py reads) on 3 rows in batches of 2: each summary is the
    sampled ids up to its first EOS (junk after it dropped), the rows in split order, the padding row not kept;
    implicit_rewards' rows too, however gather_object joins the ranks' lists (here: reversed)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BASE)
    monkeypatch.setattr(dpo, "generate", sampler_with_junk_after_eos(tokenizer))
    monkeypatch.setattr(dpo, "gather_object", lambda rows: list(reversed(rows)))
    queries = datasets.load_from_disk(str(tiny_tldr / "sft"))["validation"].select(range(3))
    queries = queries.with_format("torch", columns=list(dpo.QUERY_COLUMNS))
    rows = dpo.sample_summaries(Accumulating(), tiny_model().eval(), queries, tokenizer, None, 2)
    assert [row["response"] for row in rows] == ["a cat sat"] * 3
    assert [row["reference"] for row in rows] == [r.strip() for r in tokenizer.batch_decode(
        queries[:]["reference_response_token"], skip_special_tokens=True)]
    assert [row["query"] for row in rows] == [q.strip() for q in tokenizer.batch_decode(
        queries[:]["query_token"], skip_special_tokens=True)]
    train = datasets.load_from_disk(str(tiny_tldr / "preference"))["train"]
    pairs = train.select(range(5)).with_format("torch", columns=list(dpo.PAIR_COLUMNS))
    reference, policy = tiny_model().eval(), tiny_model(seed=1).eval()
    with torch.no_grad():
        rewards = dpo.implicit_rewards(Accumulating(), policy, reference, pairs, PAD, 0.05, 3)
        chosen, rejected = dpo.pair_logprobs(policy, pairs[:], PAD)
        ref_chosen, ref_rejected = dpo.pair_logprobs(reference, pairs[:], PAD)
    np.testing.assert_allclose(rewards["chosen"], (0.05 * (chosen - ref_chosen)).numpy(), atol=1e-5)
    np.testing.assert_allclose(rewards["rejected"], (0.05 * (rejected - ref_rejected)).numpy(), atol=1e-5)


def two_rows_a_pair(model, batch):
    """The plain form of pair_logprobs: sequence_logprobs of the chosen rows and of the rejected rows, one forward."""
    rows = dpo.trim_right_padding(torch.cat((batch["query_chosen_token"], batch["query_rejected_token"])), PAD)
    labels = torch.cat((batch["query_chosen_token_response_label"],
                        batch["query_rejected_token_response_label"]))[:, :rows.shape[1]]
    return dpo.sequence_logprobs(model, rows, labels, PAD).split(len(rows) // 2)


def hand_pairs(pairs_of_ids, width):
    """[(query, chosen, rejected)] id lists -> dpo.PAIR_COLUMNS tensors, right-padded to `width`."""
    pad = lambda row: row + [PAD] * (width - len(row))  # noqa: E731
    columns = {name: [] for name in dpo.PAIR_COLUMNS}
    for query, chosen, rejected in pairs_of_ids:
        for side, summary in (("chosen", chosen), ("rejected", rejected)):
            columns[f"query_{side}_token"].append(pad(query + summary))
            columns[f"query_{side}_token_response_label"].append(pad([PAD] * len(query) + summary))
    return {name: torch.tensor(rows) for name, rows in columns.items()}


class BigramTable(torch.nn.Module):
    """A bf16 "language model" whose logits at a position depend on that position's token only (a table row): the
    log-probs of a summary are then known by hand, whichever layout (two rows a pair, or one) reads it."""

    def __init__(self, vocab_size: int, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter((8 * torch.randn(vocab_size, vocab_size, generator=generator)).bfloat16())

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, return_dict=True):
        logits = self.table[input_ids]  # (B, T, V) bf16
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_log_probs_of_a_bf16_policy_are_read_in_fp32():
    """Under DeepSpeed bf16 the policy's logits are bf16: DPO's log-probs must be the fp32 log-softmax of those
    logits (a bf16 log-softmax is off by up to ~0.3 nats a summary at these logit scales), in both layouts."""
    model = BigramTable(64)
    triples = [([5, 6, 7, 8, 9, 10], [20, 21, EOS], [30, 31, 32, 33, EOS]),
               ([11, 12, 17], [22, EOS], [34, 35, 36, 37, 38, 39, 40, EOS]),
               ([13, 14, 15], [23, 24, 25, 26, EOS], [41, EOS])]
    batch = hand_pairs(triples, width=11)
    table = model.table.detach().float().log_softmax(-1)  # (V, V): log p(next | this token), in fp32
    by_hand = lambda query, summary: sum(table[prev, token] for prev, token in  # noqa: E731
                                         zip([query[-1]] + summary[:-1], summary)).item()
    expected = torch.tensor([[by_hand(q, c) for q, c, _ in triples], [by_hand(q, r) for q, _, r in triples]])
    with torch.no_grad():
        packed = torch.stack(dpo.packed_pair_logprobs(model, batch, PAD))
        plain = torch.stack(two_rows_a_pair(model, batch))
    assert torch.allclose(packed, expected, atol=1e-4) and torch.allclose(plain, expected, atol=1e-4), (packed, plain)
    in_bf16 = model.table.detach().log_softmax(-1).float()  # what a log-softmax before the cast would read
    assert (in_bf16 - table).abs().max() > 0.01  # the test can tell the two apart

def test_pair_row_mask_gives_every_position_something_to_read():
    """packed_pair_logprobs' (B, 1, T, T) attention mask: every position, a pad included, reads at least one column
    (the row's first query token, and a pad itself): a row with nothing to read is NaN in CUDA's memory-efficient
    attention (0 on a CPU)."""
    class Recording(BigramTable):
        def forward(self, input_ids, attention_mask=None, **options):
            self.mask = attention_mask
            return super().forward(input_ids, attention_mask, **options)

    model = Recording(64)
    batch = hand_pairs([([5, 6, 7], [20, EOS], [30, EOS]), ([11, 12, 17, 18], [22, 23, EOS], [34, 35, 36, EOS])], 11)
    dpo.packed_pair_logprobs(model, batch, PAD)
    assert model.mask.shape == (2, 1, 11, 11) and model.mask.any(-1).all()  # row 0 ends in 4 pads

def test_one_row_a_pair_equals_two_rows_a_pair(tiny_tldr):
    """packed_pair_logprobs (query ++ chosen ++ rejected in one row) == its docstring's plain form, two rows a pair,
    log-probs and gradients: the tiny world's pairs, and hand-made ones with queries of different lengths, a
    rejected summary longer than the chosen one, a row without pads. In float64 (the log-softmax runs in float32 in
    both, as in training): a rejected token reading the chosen summary, or a wrong position, moves a log-prob by
    ~1e-2. Pairs whose queries differ, and attentions other than SDPA, take the two rows."""
    model = tiny_model(seed=3).double().train()
    hand = hand_pairs([([5, 6, 7, 8, 9, 10], [20, 21, EOS], [30, 31, 32, 33, EOS]),
                       ([11, 12, 17], [22, EOS], [34, 35, 36, 37, 38, 39, 40, EOS]),  # fills the width: no pad
                       ([13, 14, 15], [23, 24, 25, 26, EOS], [41, EOS])], width=11)
    for batch in (pairs(tiny_tldr, 8), hand):
        assert dpo.shared_queries(model, batch, PAD)
        packed, plain = dpo.packed_pair_logprobs(model, batch, PAD), two_rows_a_pair(model, batch)
        assert torch.allclose(torch.cat(packed), torch.cat(plain), rtol=0, atol=1e-5), (packed, plain)
        assert torch.cat(plain).std() > 0.5  # distinct log-probs: a mix-up of rows or sides would show
        weights = torch.linspace(-1, 2, 2 * len(packed[0]), dtype=torch.float32)  # any loss of both sides
        grads = [torch.autograd.grad((torch.cat(logps) * weights).sum(), list(model.parameters()))
                 for logps in (packed, plain)]
        for got, expected in zip(*grads):
            assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6)
        assert torch.equal(torch.cat(dpo.pair_logprobs(model, batch, PAD)), torch.cat(packed))
    differing = {name: value.clone() for name, value in hand.items()}
    differing["query_rejected_token"][1, 0] = 16  # the second pair's rejected row reads another query
    assert not dpo.shared_queries(model, differing, PAD)
    assert torch.equal(torch.cat(dpo.pair_logprobs(model, differing, PAD)), torch.cat(two_rows_a_pair(model, differing)))
    model.set_attn_implementation("eager")
    assert not dpo.shared_queries(model, hand, PAD)


def test_h_is_exactly_zero_at_step_0(tiny_tldr):
    """Detail 7: the policy (train mode) and the reference (eval mode), same weights, dropout off: h = 0 exactly."""
    batch = pairs(tiny_tldr, 8)
    policy, reference = tiny_model().train(), tiny_model().eval()
    with torch.no_grad():
        chosen, rejected = dpo.pair_logprobs(policy, batch, PAD)
        ref_chosen, ref_rejected = dpo.pair_logprobs(reference, batch, PAD)
        losses, chosen_rewards, rejected_rewards = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 0.05)
        assert torch.equal((chosen - ref_chosen) - (rejected - ref_rejected), torch.zeros(8))
        assert torch.equal(chosen_rewards, torch.zeros(8)) and torch.equal(rejected_rewards, torch.zeros(8))
        assert torch.allclose(losses, torch.full((8,), math.log(2)))
        torch.manual_seed(0)
        with_dropout = AutoModelForCausalLM.from_pretrained(BASE).train()  # the tiny model's dropout is 0.1
        assert not torch.equal(dpo.pair_logprobs(with_dropout, batch, PAD)[0], ref_chosen)


def test_dpo_pair_rows_benchmark_compares_then_times_both_layouts(tiny_tldr, tmp_path):
    """benchmark/dpo_pair_rows.py (one row a pair against two, side by side): on the tiny world's pairs and on its
    synthetic TL;DR-length pairs, the packed layout's log-probs and gradients are the two rows', then both are timed."""
    for flags in (["--sft_model_path", str(BASE), "--label_dataset", str(tiny_tldr / "preference"), "--batch_size", "4"],
                  ["--synthetic", "--vocab_size", "256", "--batch_size", "1"]):
        out = tmp_path / "dpo_pair_rows.md"
        result = run_python([sys.executable, str(REPO / "benchmark" / "dpo_pair_rows.py"), *flags, "--rounds", "1",
                             "--updates", "1", "--out", str(out)], timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = {line.split(" | ")[0]: line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ")}
        assert float(rows["| two rows"][1]) > 0 and float(rows["| one row"][1]) > 0
        differences = [float(value) for value in rows["| one row"][3].rstrip(" |").split(" / ")]
        assert all(value < 1e-4 for value in differences), rows["| one row"]


# ---------------------------------------------------------------------------------------------
# Real runs on a small slice of the tiny world
# ---------------------------------------------------------------------------------------------

TRAIN_PAIRS, BATCH, EPOCHS = 32, 8, 2  # 8 updates of 8 pairs: each pair twice, once per epoch
RUN = ["--sft_model_path", str(BASE), "--lr", "1e-3", "--batch_size", str(BATCH), "--num_train_epochs", str(EPOCHS),
       "--response_length", "8", "--local_eval_batch_size", "8"]


@pytest.fixture(scope="module")
def small_world(tiny_tldr, tmp_path_factory):
    """Slices of the preprocessed tiny world: 32 train pairs, 15 + 7 eval pairs, 9 SFT validation queries (odd:
    over 2 processes, one rank's last batch repeats a row)."""
    root = tmp_path_factory.mktemp("small_world")
    slice_tiny_tldr(tiny_tldr, root, TRAIN_PAIRS, "validation", 9)
    return root


def run_dpo(small_world, output_dir, *extra, processes=1):
    """Run dpo.py on the small world (1 process, or 2 CPU processes with accelerate launch); its output."""
    flags = [*RUN, "--label_dataset", str(small_world / "preference"), "--query_dataset", str(small_world / "sft"),
             "--output_dir", str(output_dir), *extra]
    env = dict(ENV)
    env.pop("ACCELERATE_USE_CPU", None)
    if processes == 1:
        cmd = [sys.executable, str(REPO / "dpo.py"), *flags]
    else:
        with socket.socket() as sock:  # a free port: other test sessions may launch at the same time
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(port), str(REPO / "dpo.py"), *flags]
        env["ACCELERATE_USE_CPU"] = "1"  # ENV_NOTES: CPU DDP needs --multi_gpu with ACCELERATE_USE_CPU
    with multi_process_slot(processes):
        result = run_python(cmd, cwd=output_dir.parent, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def resumed_run(small_world, tmp_path_factory):
    """1 process, micro-batch 4 x 2 accumulation steps; stopped after 3 of 8 updates, then resumed."""
    output_dir = tmp_path_factory.mktemp("resumed") / "dpo"
    first = run_dpo(small_world, output_dir, "--local_micro_batch_size", "4", "--stop_after_updates", "3",
                    "--gold_judge", str(WORLD))
    assert "stopped after update 3 of 8" in first
    assert (output_dir / "checkpoints" / "update_3" / "trainer_state.json").is_file()
    assert not (output_dir / "model.safetensors").exists()
    second = run_dpo(small_world, output_dir, "--local_micro_batch_size", "4", "--resume", "--gold_judge", str(WORLD))
    assert "resumed from" in second and "at update 3" in second
    return output_dir


def test_resumed_run_is_the_uninterrupted_run_bit_for_bit(resumed_run, small_world, tmp_path):
    """The same run, never stopped: the same policy to the bit and the same samples, byte for byte."""
    out = tmp_path / "dpo"
    run_dpo(small_world, out, "--local_micro_batch_size", "4", "--gold_judge", str(WORLD))
    whole, resumed = load_file(out / "model.safetensors"), load_file(resumed_run / "model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[key], resumed[key]) for key in whole)
    assert (out / "eval_validation.csv").read_bytes() == (resumed_run / "eval_validation.csv").read_bytes()


def test_run_interrupted_and_resumed_writes_policy_tables_and_samples(resumed_run):
    out = resumed_run
    for name in ("model.safetensors", "config.json", "tokenizer.json", "args.json", "eval_validation.csv",
                 "eval_pairs_validation.csv", "eval_pairs_validation_cnndm.csv", "accuracy_validation.md",
                 "accuracy_validation_cnndm.md", "calibration.png", "eval_metrics.json"):
        assert (out / name).is_file(), name
    assert not (out / "checkpoints").exists()  # removed when the run ends
    args = json.loads((out / "args.json").read_text())
    assert (args["num_updates"], args["gradient_accumulation_steps"], args["local_micro_batch_size"]) == (8, 2, 4)
    assert args["git_commit"] and (args["pad_token_id"], args["eos_token_id"]) == (PAD, EOS)
    # Detail 6 / 16: the RM's metrics and tables, under eval/dpo/
    metrics = json.loads((out / "eval_metrics.json").read_text())
    for key in ("eval/dpo/validation/accuracy", "eval/dpo/validation_cnndm/accuracy", "eval/dpo/validation/gold_accuracy",
                "eval/dpo/validation/accuracy/split/valid1", "eval/dpo/validation/accuracy/confidence/9"):
        assert 0 <= metrics[key] <= 1, key
    pairs_table = pd.read_csv(out / "eval_pairs_validation.csv")
    assert len(pairs_table) == 15 and {"chosen_reward", "rejected_reward", "accuracy", "gold_prefers_chosen",
                                       "batch", "confidence", "chosen_policy"} <= set(pairs_table.columns)
    assert pairs_table["accuracy"].mean() == pytest.approx(metrics["eval/dpo/validation/accuracy"])
    assert (pairs_table["chosen_reward"] != 0).all()  # trained: the policy left the reference
    assert "| group | value | accuracy | pairs |" in (out / "accuracy_validation.md").read_text()
    # The samples, in the format judge.py reads (as sft.py writes them)
    samples = pd.read_csv(out / "eval_validation.csv", keep_default_na=False)
    assert list(samples.columns) == ["query", "response", "reference"] and len(samples) == 9
    assert samples["query"].str.endswith("TL;DR:").all() and "[PAD]" not in samples["query"][0]
    # The saved policy loads, dropout off, and differs from the initial model
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.attention_dropout == 0.0 and model.generation_config.eos_token_id == EOS
    start = load_file(str(BASE / "model.safetensors"))
    assert max((load_file(str(out / "model.safetensors"))[k] - start[k]).abs().max() for k in start) > 1e-3


def test_an_untrained_policy_ranks_every_pair_as_a_coin_flip(small_world, tmp_path):
    """0 updates: the policy is its reference, every implicit reward is exactly 0, and each pair counts 1/2 (a tie
    is a coin flip here, where the RM's evaluation counts one as wrong)."""
    out = tmp_path / "dpo0"
    run_dpo(small_world, out, "--local_micro_batch_size", "4", "--total_episodes", "0")
    metrics = json.loads((out / "eval_metrics.json").read_text())
    for split, pairs in (("validation", 15), ("validation_cnndm", 7)):
        table = pd.read_csv(out / f"eval_pairs_{split}.csv")
        assert len(table) == pairs and (table["chosen_reward"] == 0).all() and (table["rejected_reward"] == 0).all()
        assert metrics[f"eval/dpo/{split}/accuracy"] == 0.5, split


def test_two_processes_match_one_process(resumed_run, small_world, tmp_path):
    """2 CPU processes x micro-batch 2 x 2 accumulation steps: one shared shuffle, the 1-process updates."""
    out = tmp_path / "dpo2"
    run_dpo(small_world, out, "--local_micro_batch_size", "2", "--gold_judge", str(WORLD), processes=2)
    assert json.loads((out / "args.json").read_text())["world_size"] == 2
    two, one = load_file(str(out / "model.safetensors")), load_file(str(resumed_run / "model.safetensors"))
    # Same pairs per update, mean loss per micro-batch, gradients averaged over ranks: the same updates up to
    # float rounding. AdamW divides by sqrt(v), so rounding in a near-zero gradient becomes a step of up to lr
    # (1e-3): on an AMD EPYC family 26 (2026-11-30) one process at micro-batch 8 and at 4 already differ by 3.1e-5,
    # and 2 processes differ from 1 by 1.2e-5. Pairs in another order (--seed 2) move every tensor by 4e-3 or more.
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-4), key
    # Eval rows of both ranks come back in the split's order, with the same implicit rewards
    for name in ("eval_pairs_validation.csv", "eval_validation.csv"):
        a, b = pd.read_csv(out / name), pd.read_csv(resumed_run / name)
        assert a["query"].equals(b["query"]), name
    a, b = (pd.read_csv(folder / "eval_pairs_validation.csv") for folder in (out, resumed_run))
    assert (a["chosen_reward"] - b["chosen_reward"]).abs().max() < 1e-4


def test_bad_inputs_fail_before_any_model_is_loaded(small_world, tmp_path):
    """A dataset without the pair columns, an occupied output folder, a bad beta, other token ids (Detail 3)."""
    base = ["--sft_model_path", str(BASE), "--query_dataset", str(small_world / "sft"), "--batch_size", "8"]
    cases = [(["--label_dataset", str(small_world / "sft"), "--output_dir", str(tmp_path / "a")], "lacks ['train'"),
             (["--label_dataset", str(small_world / "preference"), "--output_dir", str(tmp_path / "b")],
              "holds a different run"),
             (["--label_dataset", str(small_world / "preference"), "--output_dir", str(tmp_path / "c"), "--beta", "0"],
              "--beta 0.0: want a finite number > 0")]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "args.json").write_text(json.dumps({"lr": 0.5}))
    (tmp_path / "b" / "eval_metrics.json").write_text("{}")  # that run's work (an args.json alone is a failed start)
    other_ids = tmp_path / "other_ids"  # Detail 3: data tokenized with other pad / eos ids than the model's
    shutil.copytree(small_world, other_ids)
    (other_ids / "args.json").write_text(json.dumps({"pad_token_id": 5, "eos_token_id": EOS}))
    cases.append((["--label_dataset", str(other_ids / "preference"), "--output_dir", str(tmp_path / "d")],
                  "was tokenized with {'eos_token_id': 0, 'pad_token_id': 5}"))
    # One pass over the pairs in batches larger than the split: no update at all, so the run asks for episodes.
    pairs = len(datasets.load_from_disk(str(small_world / "preference"))["train"])
    cases.append((["--label_dataset", str(small_world / "preference"), "--output_dir", str(tmp_path / "e"),
                   "--num_train_epochs", "1", "--batch_size", str(8 * pairs)],  # the last --batch_size counts
                  f"its train split ({pairs} pairs) x --num_train_epochs 1 is less than one batch of {8 * pairs}: "
                  "pass --total_episodes"))
    # A column only the evaluation after the last update reads: refused at the start, not after training
    no_policy = datasets.load_from_disk(str(small_world / "preference"))
    no_policy["validation"] = no_policy["validation"].remove_columns("chosen_policy")
    no_policy.save_to_disk(str(tmp_path / "no_policy"))
    cases.append((["--label_dataset", str(tmp_path / "no_policy"), "--output_dir", str(tmp_path / "f")],
                  f"--label_dataset {tmp_path / 'no_policy'} lacks ['validation.chosen_policy'], which the evaluation "
                  "after training reads"))
    results = early_exits([(tmp_path, REPO / "dpo.py", base + flags) for flags, _ in cases], env=ENV)
    for (_, message), result in zip(cases, results):
        assert result.returncode != 0 and "SetupError" in result.stderr and message in result.stderr, result.stderr[-2000:]
        assert "Loading weights" not in result.stdout + result.stderr
    assert not any((tmp_path / name).exists() for name in "acdef")
    assert sorted(os.listdir(tmp_path / "b")) == ["args.json", "eval_metrics.json"] and not (tmp_path / "runs").exists()


def test_dpo_pair_rows_two_rows_layout_does_not_pack_and_the_table_takes_median_rounds(monkeypatch, capsys):
    """dpo_pair_rows.py: the "two rows" layout never runs the packed forward (the one-row layout does), and its table
    gives pairs / s from each layout's median round (the timer faked: made-up rounds) and one row against two rows."""
    sys.path.insert(0, str(REPO / "benchmark"))
    import dpo_pair_rows

    packed = []
    real = dpo.packed_pair_logprobs
    monkeypatch.setattr(dpo, "packed_pair_logprobs", lambda *args: packed.append(1) or real(*args))
    rounds = {"two rows": [4.0, 1.0, 2.0], "one row": [1.0, 1.0, 4.0]}  # medians 2 and 1 s (means 2.33 and 2)
    monkeypatch.setattr(dpo_pair_rows, "time_layouts", lambda layouts, *args: rounds)
    monkeypatch.setattr(sys, "argv", ["dpo_pair_rows.py", "--synthetic", "--vocab_size", "256", "--batch_size", "1",
                                      "--updates", "1", "--rounds", "3"])
    batch = dpo_pair_rows.synthetic_pairs(2, PAD, EOS, 256, torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(BASE)
    dpo_pair_rows.layout_logprobs(model, batch, "two rows", PAD)
    assert packed == []
    dpo_pair_rows.layout_logprobs(model, batch, "one row", PAD)
    assert packed == [1]
    dpo_pair_rows.main()
    out = capsys.readouterr().out
    assert "| two rows | 0.50 | 1.00x |  |" in out and "| one row | 1.00 | 2.00x | " in out

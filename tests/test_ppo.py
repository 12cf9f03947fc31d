"""Tests of ppo.py: its pure helpers against naive loops and hand computation, the first PPO ratio
on the tiny model, and a subprocess smoke run on the tiny world (whole file: well under 3 min on CPU).
"""

import ast
import csv
import json
import os
import sys

import pytest
import torch

import ppo
import reward
from conftest import REPO, WORLD, early_exits, generate_with_scores, multi_process_slot, one_process, run_python
from ppo import (PolicyAndValueWrapper, ScalarModel, compute_gae, compute_rewards, disable_dropout, eos_trick,
                 first_true_indices, gather_logprobs, get_reward, get_score, get_values, masked_mean,
                 ppo_batch_sizes, response_outputs,
                 mask_logits, ppo_losses, prefill_by_length, response_logits, response_logits_and_values, response_masks,
                 response_window, sample_rollout, truncate_response, unsampled_token_ids, whiten, SetupError,
                 StaticSampler, draw_tokens)
from sft import generate  # HF generate, as sft.py's and dpo.py's evaluations call it

EOS, PAD = 0, 1  # the tiny world's ids (data/tiny_tldr/args.json)


def unsampled_ids(policy):
    """ppo.py's masked ids for the tiny policy: [PAD] and the embedding rows past the tokenizer."""
    from transformers import AutoTokenizer

    return torch.tensor(unsampled_token_ids(AutoTokenizer.from_pretrained(WORLD / "pythia-tiny"),
                                            policy.get_output_embeddings().weight.size(0)))


def naive_gae(rewards, values, gamma, lam):
    """Per-row python loop of the GAE definition: A_t = sum_k (gamma lam)^k delta_{t+k}."""
    advantages = []
    for r, v in zip(rewards.tolist(), values.tolist()):
        T = len(r)
        v_next = v[1:] + [0.0]
        delta = [r[t] + gamma * v_next[t] - v[t] for t in range(T)]
        advantages.append([sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, T)) for t in range(T)])
    return torch.tensor(advantages)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5)])
def test_gae_matches_naive_loop(gamma, lam):
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    advantages, returns = compute_gae(rewards, values, gamma, lam)
    expected = naive_gae(rewards, values, gamma, lam).double()
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected + values)


def test_gae_single_score_at_eos_by_hand():
    # gamma 1, lambda 0.95, zero values: the score at the EOS (index 2) reaches index t as 0.95^(2-t)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    advantages, _ = compute_gae(rewards, torch.zeros_like(rewards), 1.0, 0.95)
    torch.testing.assert_close(advantages, torch.tensor([[0.95 ** 2, 0.95, 1.0, 0.0]]))


def test_whiten_masked_shift_mean_true_and_false():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0], [5.0, 7.0, -50.0, -50.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    valid = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0], dtype=torch.float64)
    mean, std = valid.mean(), valid.var(unbiased=False).add(1e-8).sqrt()  # biased variance, as the paper's whiten
    out = whiten(values, mask, shift_mean=True)
    torch.testing.assert_close(out[mask], (valid - mean) / std)
    assert (out[~mask] == 0).all()  # padded positions: excluded from the statistics, zero in the result
    out = whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(out[mask], (valid - mean) / std + mean)
    assert (out[~mask] == 0).all()
    # Equal values (one valid token, or every reward the same): the 1e-8 keeps the result finite, (x - mean) = 0.
    constant = torch.full((2, 3), 5.0)
    assert (whiten(constant, mask[:, :3], shift_mean=True) == 0).all()
    assert whiten(constant, mask[:, :3], shift_mean=False).tolist() == [[5.0, 5.0, 5.0], [5.0, 5.0, 0.0]]


def test_whiten_statistics_are_global_over_processes():
    # Two "processes", each holding half the batch: a fake all_reduce adds the other half's sums.
    torch.manual_seed(0)
    values, mask = torch.randn(4, 6, dtype=torch.float64), torch.rand(4, 6) > 0.3
    mine, other = (values[:2], mask[:2]), (values[2:], mask[2:])
    state = {}

    def all_reduce(tensor):
        if tensor.dim() == 1:  # (sum, count)
            total = tensor + torch.stack([(other[0] * other[1]).sum(), other[1].sum().double()])
            state["mean"] = total[0] / total[1]
            return total
        return tensor + ((other[0] - state["mean"]) ** 2 * other[1]).sum()  # sum of squared deviations

    torch.testing.assert_close(whiten(*mine, shift_mean=True, all_reduce=all_reduce),
                               whiten(values, mask, shift_mean=True)[:2])


def hand_built_responses():
    """(5, 6) raw responses with EOS at 1, at 5 (last), none, at 0, and at 2 with junk after it."""
    return torch.tensor([[5, EOS, 7, 8, 9, 10],
                         [5, 6, 7, 8, 9, EOS],
                         [5, 6, 7, 8, 9, 10],
                         [EOS, 6, 7, EOS, 9, 10],
                         [5, 6, EOS, 8, EOS, 10]])


def test_truncation_and_masks_hand_built():
    post = truncate_response(hand_built_responses(), EOS, PAD)
    assert post.tolist() == [[5, EOS, PAD, PAD, PAD, PAD], [5, 6, 7, 8, 9, EOS], [5, 6, 7, 8, 9, 10],
                             [EOS, PAD, PAD, PAD, PAD, PAD], [5, 6, EOS, PAD, PAD, PAD]]
    expected_lengths = [1, 5, 5, 0, 2]  # EOS index; the last index without EOS
    for score_after_eos in (False, True):
        lengths, padding_mask, value_padding_mask = response_masks(post, PAD, score_after_eos)
        assert lengths.tolist() == expected_lengths
        for row, length in enumerate(expected_lengths):
            assert padding_mask[row].tolist() == [t > length for t in range(6)]
            last_value = length + int(score_after_eos)  # the value of the scored token is still trained
            assert value_padding_mask[row].tolist() == [t > last_value for t in range(6)]


@pytest.mark.parametrize("score_after_eos", [False, True])
def test_score_placement_and_kl_rewards(score_after_eos):
    post = truncate_response(hand_built_responses(), EOS, PAD)
    lengths, padding_mask, _ = response_masks(post, PAD, score_after_eos)
    torch.manual_seed(0)
    logprobs, ref_logprobs = -torch.rand(5, 6), -torch.rand(5, 6)
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    rewards, kl, non_score = compute_rewards(logprobs, ref_logprobs, scores, lengths, padding_mask, 0.05,
                                             score_after_eos)
    for row, length in enumerate([1, 5, 5, 0, 2]):
        for t in range(6):
            expected_kl = 0.0 if t > length else (logprobs[row, t] - ref_logprobs[row, t]).item()
            assert kl[row, t].item() == pytest.approx(expected_kl)
            assert non_score[row, t].item() == pytest.approx(-0.05 * expected_kl)  # zero on padded slots
        # Paper: on the EOS. Reference code: one token later when there is room (rows 0, 3, 4).
        where = length + 1 if score_after_eos and length + 1 < 6 else length
        expected = non_score[row].clone()
        expected[where] += scores[row]
        torch.testing.assert_close(rewards[row], expected)
    # An EOS at T - 2: one token later is the last one, still in the response
    rewards, _, _ = compute_rewards(torch.zeros(1, 6), torch.zeros(1, 6), torch.tensor([9.0]), torch.tensor([4]),
                                    torch.zeros(1, 6, dtype=torch.bool), 0.05, score_after_eos)
    assert rewards[0].tolist() == ([0.0] * 5 + [9.0] if score_after_eos else [0.0] * 4 + [9.0, 0.0])


def test_eos_trick_replaces_only_where_no_eos():
    post = truncate_response(hand_built_responses(), EOS, PAD)
    contains_eos = (post == EOS).any(1)
    assert contains_eos.tolist() == [True, True, False, True, True]
    out = eos_trick(torch.tensor([0.5, -2.0, 3.0, 0.0, 7.0]), contains_eos, -1.0)
    assert out.tolist() == [0.5, -2.0, -1.0, 0.0, 7.0]  # replaced, not added (3 - 1 would be 2)


def test_ppo_losses_by_hand():
    new = torch.tensor([[0.0, -1.0, -2.0]])
    old = torch.tensor([[-0.5, -1.0, -1.0]])  # ratios e^0.5 = 1.65 (clipped to 1.2), 1, e^-1 = 0.37 (to 0.8)
    advantages = torch.tensor([[1.0, 2.0, -1.0]])
    token_mask = torch.tensor([[True, True, False]])  # the third token is after the EOS
    vpred, old_values, returns = torch.tensor([[1.0, 0.0, 5.0]]), torch.tensor([[0.5, 0.1, 0.0]]), torch.tensor([[2.0, 0.0, 1.0]])
    value_mask = torch.tensor([[True, True, True]])
    out = ppo_losses(new, old, advantages, vpred, old_values, returns, token_mask, value_mask, 0.2, 0.2)
    r0 = torch.exp(torch.tensor(0.5)).item()
    # token 0: max(-1 * 1.65, -1 * 1.2) = -1.2 (clipped); token 1: -2; token 2 masked out
    assert out["pg_loss"].item() == pytest.approx((-1.2 + -2.0) / 2)
    assert out["pg_clipfrac"].item() == pytest.approx(0.5)
    assert out["ratio"].item() == pytest.approx((r0 + 1.0) / 2)
    assert out["approxkl"].item() == pytest.approx(0.5 * (0.25 + 0.0) / 2)
    # values: clipped to [0.3, 0.7] / [-0.1, 0.3] / [-0.2, 0.2] -> 0.7, 0.0, 0.2
    unclipped, clipped = [1.0, 0.0, 16.0], [1.69, 0.0, 0.64]
    assert out["vf_loss"].item() == pytest.approx(0.5 * sum(max(a, b) for a, b in zip(unclipped, clipped)) / 3)
    assert out["vf_clipfrac"].item() == pytest.approx(1 / 3)
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool)).item() == 0.0
    # The lower bound too: token 2 unmasked (ratio 0.37 below 0.8, advantage -1): max(-(-1) 0.37, -(-1) 0.8) = 0.8
    out = ppo_losses(new, old, advantages, vpred, old_values, returns, torch.ones_like(token_mask), value_mask, 0.2, 0.2)
    assert out["pg_loss"].item() == pytest.approx((-1.2 - 2.0 + 0.8) / 3)
    assert out["pg_clipfrac"].item() == pytest.approx(2 / 3)
    # Each clip range clips its own term: the ratio at 1 +- cliprange (0.2), the values at old +- cliprange_value (0.5).
    out = ppo_losses(new, old, advantages, vpred, old_values, returns, token_mask, value_mask, 0.2, 0.5)
    assert out["pg_loss"].item() == pytest.approx((-1.2 + -2.0) / 2)  # 1.65 clipped to 1.2, not to 1.5
    # values: clipped to [0.0, 1.0] / [-0.4, 0.6] / [-0.5, 0.5] -> 1.0, 0.0, 0.5: squared errors 1, 0, 0.25
    assert out["vf_loss"].item() == pytest.approx(0.5 * (1.0 + 0.0 + 16.0) / 3)
    assert out["vf_clipfrac"].item() == 0.0
    # The largest |ratio - 1| over valid tokens only: token 1's ratio is 1, token 0's 1.65 is masked out here.
    only_token_1 = torch.tensor([[False, True, False]])
    out = ppo_losses(new, old, advantages, vpred, old_values, returns, only_token_1, value_mask, 0.2, 0.2)
    assert out["ratio_max_deviation"].item() == 0.0


@pytest.mark.parametrize("score_after_eos, length_groups", [(False, 1), (True, 2)])
def test_ppo_epochs_equal_a_naive_ppo_update_from_the_definitions(tiny_tldr, score_after_eos, length_groups):
    """ppo_epochs (the shuffle into minibatches and micro-batches, the forward cut to the trained width and grouped
    by query length, the rollout's log-probs and values past it, the masks, vf_coef, accumulation through accelerate)
    against a naive update written from the definitions: full-width forwards (logits[:, T_q - 1 : -1]), the clipped
    losses as masked means per micro-batch, their mean over a minibatch's micro-batches, one step per minibatch.
    2 epochs x 2 minibatches x 2 micro-batches of left-padded queries whose samples end early, late or not at all;
    SGD, so that the weights after the update compare what the two took the gradients of."""
    import copy
    import types

    from accelerate import Accelerator
    from ppo import ppo_epochs, scaled_logits

    policy, critic = tiny_models()
    torch.nn.init.normal_(critic.head.weight, std=0.5)  # values that differ per token
    unsampled, temperature = unsampled_ids(policy), 0.7 + 1e-7
    queries = padded_queries(tiny_tldr, 8)
    context_length = queries.shape[1]
    def early_eos(module, inputs, output):  # the EOS logit 1.5 below the largest while sampling: samples end early
        output[..., EOS] = output.max(-1).values - 1.5
        return output

    hook = policy.get_output_embeddings().register_forward_hook(early_eos)
    with torch.no_grad():
        torch.manual_seed(5)
        query_responses, sample_scores = sample_rollout(policy, queries, PAD, EOS, 10, temperature, unsampled)
    hook.remove()
    responses = query_responses[:, context_length:]
    eos_index, padding_mask, value_padding_mask = response_masks(truncate_response(responses, EOS, PAD), PAD,
                                                                        score_after_eos)
    assert 0 < (eos_index < responses.shape[1] - 1).sum() < 8 and 0 in eos_index  # early, late, at once
    with torch.no_grad():
        logprobs = gather_logprobs(sample_scores, responses)
        values = get_values(critic, query_responses, PAD, context_length).masked_fill(value_padding_mask, 0)
    rewards = torch.randn(responses.shape, generator=torch.Generator().manual_seed(1)).masked_fill(value_padding_mask, 0)
    advantages, returns = compute_gae(rewards, values, 1.0, 0.95)
    advantages = whiten(advantages, ~padding_mask)
    batch = dict(query_responses=query_responses, responses=responses, logprobs=logprobs, values=values,
                 advantages=advantages, returns=returns, padding_mask=padding_mask,
                 value_padding_mask=value_padding_mask, eos_index=eos_index)
    args = types.SimpleNamespace(num_ppo_epochs=2, local_batch_size=8, local_mini_batch_size=4, local_micro_batch_size=2,
                                 score_after_eos=score_after_eos, length_groups=length_groups, cliprange=0.2,
                                 cliprange_value=0.2, vf_coef=0.1)

    accelerator = Accelerator(cpu=True)
    accelerator.gradient_accumulation_steps = 2
    model = PolicyAndValueWrapper(copy.deepcopy(policy), copy.deepcopy(critic)).train()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    torch.manual_seed(7)  # the minibatches' shuffle
    stats, _ = ppo_epochs(accelerator, model, optimizer, args, batch, context_length, PAD, temperature, unsampled)
    trained = accelerator.unwrap_model(model)

    naive_policy, naive_critic = copy.deepcopy(policy).train(), copy.deepcopy(critic).train()
    naive_parameters = list(naive_policy.parameters()) + list(naive_critic.parameters())
    naive_optimizer = torch.optim.SGD(naive_parameters, lr=0.05)
    torch.manual_seed(7)
    naive_stats = {key: [] for key in ("policy/loss", "value/loss", "policy/clipfrac", "value/clipfrac",
                                       "policy/approxkl", "policy/ratio")}
    for epoch in range(2):
        permutation = torch.randperm(8)
        for minibatch in permutation.view(2, 4):
            naive_optimizer.zero_grad()
            loss = 0.0
            for mb in minibatch.view(2, 2):
                ids = query_responses[mb]
                mask = ids != PAD
                logits = naive_policy(input_ids=ids.masked_fill(~mask, 0), attention_mask=mask).logits
                new_logprobs = gather_logprobs(scaled_logits(logits[:, context_length - 1:-1], temperature, unsampled),
                                               responses[mb])
                vpred = get_reward(naive_critic, ids, PAD, context_length)[0][:, context_length - 1:-1]
                token_mask, value_mask = ~padding_mask[mb], ~value_padding_mask[mb]
                ratio = torch.exp(new_logprobs - logprobs[mb])
                pg = torch.max(-advantages[mb] * ratio, -advantages[mb] * ratio.clamp(0.8, 1.2))
                pg_loss = (pg * token_mask).sum() / token_mask.sum()
                vclipped = values[mb] + (vpred - values[mb]).clamp(-0.2, 0.2)
                vf = 0.5 * torch.max((vpred - returns[mb]) ** 2, (vclipped - returns[mb]) ** 2)
                vf_loss = (vf * value_mask).sum() / value_mask.sum()
                log_ratio = new_logprobs - logprobs[mb]
                token_mean = lambda x: ((x * token_mask).sum() / token_mask.sum()).item()  # noqa: E731
                clipped = (-advantages[mb] * ratio.clamp(0.8, 1.2) > -advantages[mb] * ratio).float()
                value_clipped = ((vclipped - returns[mb]) ** 2 > (vpred - returns[mb]) ** 2).float()
                for key, value in (("policy/loss", pg_loss.item()), ("value/loss", vf_loss.item()),
                                   ("policy/clipfrac", token_mean(clipped)),
                                   ("value/clipfrac", ((value_clipped * value_mask).sum() / value_mask.sum()).item()),
                                   ("policy/approxkl", token_mean(0.5 * log_ratio ** 2)),
                                   ("policy/ratio", token_mean(ratio))):
                    naive_stats[key].append(value)
                loss = loss + (pg_loss + 0.1 * vf_loss) / 2  # the mean over the minibatch's 2 micro-batches
            loss.backward()
            naive_optimizer.step()

    trained_parameters = list(trained.policy.parameters()) + list(trained.critic.parameters())
    start = list(policy.parameters()) + list(critic.parameters())
    moved = max((a - b).abs().max().item() for a, b in zip(naive_parameters, start))
    difference = max((a - b).abs().max().item() for a, b in zip(naive_parameters, trained_parameters))
    assert moved > 0.1 and difference < 1e-5 * moved, (moved, difference)
    # Each logged statistic: the mean over every micro-batch of all epochs of its masked mean.
    assert {key: stats[key].item() for key in naive_stats} == pytest.approx(
        {key: sum(values) / len(values) for key, values in naive_stats.items()}, rel=1e-5, abs=1e-5)
    assert 0 < stats["policy/clipfrac"] < 1 and 0 < stats["value/clipfrac"] < 1  # both clips act in some tokens


def test_batch_sizes_and_exact_division():
    assert ppo_batch_sizes(512, 8, 1, 1) == {"local_batch_size": 64, "mini_batch_size": 512, "local_mini_batch_size": 64,
                                             "gradient_accumulation_steps": 64, "micro_batch_size": 8}
    assert ppo_batch_sizes(64, 2, 2, 4)["gradient_accumulation_steps"] == 4
    for bad in ((512, 3, 1, 1), (64, 1, 3, 1), (64, 1, 2, 5)):
        with pytest.raises(SetupError):
            ppo_batch_sizes(*bad)
    # The message names the flags and the --batch_size that fits, not a derived size alone.
    with pytest.raises(SetupError, match=r"^--batch_size 16 / world size 1 / --num_minibatches 2 = 8 episodes per rank and "
                                         r"minibatch is not a positive multiple of --local_micro_batch_size 16: pass a "
                                         r"--batch_size that is a multiple of world size 1 x --num_minibatches 2 x "
                                         r"--local_micro_batch_size 16 = 32$"):
        ppo_batch_sizes(16, 1, 2, 16)
    with pytest.raises(SetupError, match="multiple of --num_minibatches 0: pass --num_minibatches and --local_micro_batch"):
        ppo_batch_sizes(64, 1, 0, 1)


def tiny_models(early_eos=False):
    """The tiny base as policy (dropout off) and a ScalarModel critic on the same backbone with a random head (built
    by reward.py's class: ppo.py's copy only loads a trained RM).
    early_eos: a hook on the LM head sets the EOS logit 1 below the largest one, so samples end early."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(WORLD / "pythia-tiny")
    assert policy.config.attention_dropout > 0  # the tiny base ships with dropout: these tests see it go
    disable_dropout(policy)
    base_config = {k: v for k, v in policy.base_model.config.to_dict().items() if k != "_name_or_path"}
    critic = reward.ScalarModel(reward.ScalarModelConfig(base_config=base_config))
    critic.backbone.load_state_dict(policy.base_model.state_dict())
    disable_dropout(critic)
    if early_eos:
        def boost(module, inputs, output):
            output[..., EOS] = output.max(-1).values - 1.0
            return output
        policy.get_output_embeddings().register_forward_hook(boost)
    return policy, critic


def padded_queries(tiny_tldr, n):
    """n validation queries, the most left-padded first (so a micro-batch shares leading pads)."""
    import datasets

    queries = datasets.load_from_disk(tiny_tldr / "sft")["validation"].with_format("torch")[:]["query_token"]
    return queries[(queries == PAD).sum(1).argsort(descending=True)[:n]]


def scored_batch(tiny_tldr, seed):
    """5 left-padded validation queries ++ 10 random response tokens each, row 0 truncated at an EOS (the others
    untruncated) -> (query_responses, context_length)."""
    queries = padded_queries(tiny_tldr, 5)
    torch.manual_seed(seed)
    responses = torch.randint(2, 200, (5, 10))
    responses[0, 4], responses[0, 5:] = EOS, PAD  # a truncated row beside untruncated ones
    return torch.cat((queries, responses), 1), queries.shape[1]


def test_sample_rollout_draws_what_generate_draws(tiny_tldr):
    """The rollout's KV-cache loop = generate()'s temperature sampling: the same tokens up to each row's EOS,
    the same scores (logits / T), pads after the last row's EOS, and the random stream left where generate leaves it."""
    from transformers import GenerationConfig

    policy, _ = tiny_models(early_eos=True)
    queries, length, temperature = padded_queries(tiny_tldr, 8), 30, 0.7 + 1e-7
    unsampled = unsampled_ids(policy)
    config = GenerationConfig(max_new_tokens=length, min_new_tokens=length, temperature=temperature, top_k=0,
                              top_p=1.0, do_sample=True, return_dict_in_generate=True,
                              suppress_tokens=unsampled.tolist())
    with torch.no_grad():
        torch.manual_seed(1)
        reference, reference_scores = generate_with_scores(policy.eval(), queries, PAD, config)
        after_reference = torch.rand(4)
        torch.manual_seed(1)
        assert torch.equal(generate(policy, queries, PAD, config), reference)  # the evaluations' sampler: the same ids
        torch.manual_seed(1)
        fast, fast_scores = sample_rollout(policy, queries, PAD, EOS, length, temperature, unsampled)
        after_fast = torch.rand(4)
    context = queries.shape[1]
    assert fast.shape == reference.shape and torch.equal(fast[:, :context], queries)
    responses, fast_responses = reference[:, context:], fast[:, context:]
    eos_at = first_true_indices(responses == EOS)  # (B,): length when a row has none
    assert (eos_at < length - 1).all()  # every row ended early, so the loop stopped before `length` steps
    assert (fast_responses[:, -1] == EOS).all()  # ... and filled the steps it skipped (EOS: a valid id)
    used = torch.arange(length)[None] <= eos_at[:, None]  # (B, T_resp): up to and with each row's EOS
    assert torch.equal(fast_responses[used], responses[used])
    allowed = torch.ones(fast_scores.shape[-1], dtype=torch.bool).index_fill(0, unsampled, False)
    # the same logits / T; generate() masks with -inf, the loop with the lowest float (both: probability 0)
    torch.testing.assert_close(fast_scores[used][:, allowed], reference_scores[used][:, allowed], rtol=1e-5, atol=1e-5)
    assert (reference_scores[used][:, ~allowed] == -torch.inf).all()
    assert (fast_scores[used][:, ~allowed] == torch.finfo(torch.float32).min).all()
    assert torch.equal(truncate_response(fast_responses, EOS, PAD), truncate_response(responses, EOS, PAD))
    assert torch.equal(after_fast, after_reference)  # later samples are what the full-length loop gives


def test_draw_tokens_is_multinomial():
    """The fast path's draw = torch.multinomial's one-sample draw: the same ids, the random stream left at the same place
    (zero-probability ids never drawn, a one-hot row always gives its id)."""
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(16, 500) * 3, -1).index_fill(-1, torch.tensor([1, 7, 499]), 0.0)
    probs[5] = torch.nn.functional.one_hot(torch.tensor(42), 500).float()
    for seed in range(3):
        torch.manual_seed(seed)
        expected, expected_after = torch.multinomial(probs, num_samples=1).squeeze(1), torch.rand(3)
        torch.manual_seed(seed)
        drawn, drawn_after = draw_tokens(probs), torch.rand(3)
        assert torch.equal(drawn, expected) and torch.equal(drawn_after, expected_after)
        assert drawn[5] == 42 and not torch.isin(drawn, torch.tensor([1, 7, 499])).any()


def assert_same_samples(sampler, policy, queries, length, temperature, unsampled, seed):
    """sampler(...) = sample_rollout(...) with the same seed: ids, scores (masked ids at the lowest float), the random
    stream afterwards."""
    with torch.no_grad():
        torch.manual_seed(seed)
        expected, expected_scores = sample_rollout(policy, queries, PAD, EOS, length, temperature, unsampled)
        expected_after = torch.rand(4)
        torch.manual_seed(seed)
        sampled, scores = sampler(policy, queries, PAD, EOS, length, temperature, unsampled)
        after = torch.rand(4)
    assert torch.equal(sampled, expected) and torch.equal(after, expected_after)
    # Float rounding grows with the logits' size (the compiled step sums in another order): the tolerance is ~16
    # fp32 epsilons (1.2e-7) of the largest score, 7.5e-5 for the committed base model's largest, 37.5.
    scale = expected_scores[expected_scores > torch.finfo(torch.float32).min].abs().max()
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=2e-6 * float(scale))
    sampled_steps = scores.ne(0).any(-1)  # (B, T_resp): False at the zero scores of the steps skipped after every EOS
    assert (scores[sampled_steps][:, unsampled] == torch.finfo(torch.float32).min).all()
    assert not torch.isin(sampled[:, queries.shape[1]:], unsampled).any()
    return sampled


@pytest.mark.parametrize("fast", [False, True])
def test_evaluation_refuses_a_policy_whose_logits_overflow_at_its_temperature(fast, tiny_tldr, tmp_path, monkeypatch):
    """Finite weights whose logits / T_eval (0.01) pass the float range: the evaluation stops with a
    FloatingPointError that says so (how many prompts, the temperature, --lr) and writes no sample table. Before, HF
    generate's multinomial crashed on it ("probability tensor contains either inf, nan ...") and the fast path
    drew those rows uniformly and scored them as the policy's summaries. A sound policy is sampled as before."""
    import types

    import datasets
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    make_reward_model(tmp_path / "rm")
    reward_model = ppo.ScalarModel.from_pretrained(tmp_path / "rm").eval()
    policy, _ = tiny_models()
    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    ppo.add_pad_token(tokenizer)
    unsampled, temperature = unsampled_ids(policy), 0.01 + 1e-7
    args = types.SimpleNamespace(num_eval_samples=6, local_eval_batch_size=4, eval_temperature=0.01, track=False,
                                 output_dir=str(tmp_path / "out"))  # the flags evaluate_and_log reads
    sample = StaticSampler(4, backend=None) if fast else sample_rollout  # (the fast path's step run eagerly)
    sampler = lambda model, queries: sample(model, queries, PAD, EOS, 8, temperature, unsampled)  # noqa: E731
    dataset = {"validation": datasets.load_from_disk(tiny_tldr / "sft")["validation"]}
    evaluate = lambda: ppo.evaluate_and_log(Accelerator(cpu=True), args, dataset, policy, reward_model,  # noqa: E731
                                            tokenizer, sampler, None, "overflow", ("validation",), 64)
    eval_set = dataset["validation"].with_format("torch", columns=["query_token", "reference_response_token"])
    metrics, rows, nonfinite = ppo.ppo_evaluate(Accelerator(cpu=True), policy, reward_model,
                                                eval_set.select(range(6)), tokenizer, sampler, 4)
    assert nonfinite == 0 and len(rows) == 6 and 0 <= metrics["eos_fraction"] <= 1  # the sound policy
    with torch.no_grad():
        policy.get_output_embeddings().weight.mul_(1e36)
        logits = policy(input_ids=eval_set[:2]["query_token"].masked_fill(eval_set[:2]["query_token"] == PAD, 0)).logits
    assert all(torch.isfinite(parameter).all() for parameter in policy.parameters())
    assert not torch.isfinite(logits[:, -1] / temperature).all()  # the overflow is at the temperature's division
    with pytest.raises(FloatingPointError) as error:
        evaluate()
    message = str(error.value)
    assert "evaluation of validation after 64 episodes" in message and "temperature (0.01)" in message
    assert "of 6 prompts" in message and "weights are finite" in message and "--lr" in message
    assert "no checkpoint was written before it" in message
    assert not (tmp_path / "runs").exists()  # no sample table of this evaluation


def test_evaluation_scores_each_summary_at_its_eos_and_counts_its_real_tokens(tiny_tldr, tmp_path, monkeypatch):
    """ppo_evaluate on samples that end mid-way with junk after the EOS, at the last token, or never, on 3 prompts
    in batches of 2: each row's score is the RM's output at its EOS (the last
    token without one), read by a naive loop on the row alone without pads; its length counts the tokens up to
    the EOS; the table holds each prompt once; the metrics are their means."""
    import datasets
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    make_reward_model(tmp_path / "rm")
    reward_model = ppo.ScalarModel.from_pretrained(tmp_path / "rm").eval()
    torch.nn.init.normal_(reward_model.head.weight, std=1.0)  # scores that differ token by token
    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    ppo.add_pad_token(tokenizer)
    eval_set = datasets.load_from_disk(tiny_tldr / "sft")["validation"].with_format(
        "torch", columns=["query_token", "reference_response_token"]).select(range(3))
    junk, width = 7, 6
    ends = {0: 2, 1: None, 2: width - 1}  # the EOS index of each prompt's sample: mid-way, none, the last token
    row_of = {tuple(eval_set[i]["query_token"].tolist()): i for i in range(3)}

    def sampler(policy, queries):
        responses = torch.full((queries.shape[0], width), junk)
        for row, query in enumerate(queries):
            end = ends[row_of[tuple(query.tolist())]]
            if end is not None:
                responses[row, end] = EOS
        return torch.cat((queries, responses), 1), torch.zeros(queries.shape[0], width, 4)

    # the rows come back in split order however gather_object joins the ranks' lists (here: reversed)
    monkeypatch.setattr(ppo, "gather_object", lambda rows: list(reversed(rows)))
    with torch.no_grad():
        metrics, rows, nonfinite = ppo.ppo_evaluate(Accelerator(cpu=True), torch.nn.Module(),
                                                    reward_model, eval_set, tokenizer, sampler, 2)
    assert nonfinite == 0 and [row["index"] for row in rows] == [0, 1, 2]
    for row in rows:
        end = ends[row["index"]]
        response = [junk] * width if end is None else [junk] * end + [EOS]
        query = [t for t in eval_set[row["index"]]["query_token"].tolist() if t != PAD]
        with torch.no_grad():
            expected = reward_model(input_ids=torch.tensor([query + response]),
                                    attention_mask=torch.ones(1, len(query) + len(response)))[0, -1].item()
        assert row["score"] == pytest.approx(expected, abs=1e-4), row["index"]
        assert row["length"] == len(response) and row["eos"] == (end is not None)
        # the human reference beside it, scored the same way (at its EOS)
        reference = [t for t in eval_set[row["index"]]["reference_response_token"].tolist() if t != PAD]
        with torch.no_grad():
            expected = reward_model(input_ids=torch.tensor([query + reference]),
                                    attention_mask=torch.ones(1, len(query) + len(reference)))[0, -1].item()
        assert reference[-1] == EOS and row["reference_score"] == pytest.approx(expected, abs=1e-4), row["index"]
    assert metrics["score"] == pytest.approx(sum(row["score"] for row in rows) / 3)
    assert metrics["reference_score"] == pytest.approx(sum(row["reference_score"] for row in rows) / 3)
    assert abs(metrics["reference_score"] - metrics["score"]) > 1e-3  # the two are told apart
    assert metrics["response_length"] == pytest.approx((3 + 6 + 6) / 3) and metrics["eos_fraction"] == pytest.approx(2 / 3)

def test_static_sampler_draws_what_the_plain_loop_draws(tiny_tldr):
    """StaticSampler (the --fast_sampling path, its step run eagerly here) = sample_rollout token for token: batches
    smaller than the sampler (padding rows), rows ending early (the loop stops, EOS fillers), a run of every step,
    [PAD] and the unowned rows masked, a second call on the same sampler (another model of the same shape)."""
    policy, _ = tiny_models(early_eos=True)
    policy.eval()
    unsampled = unsampled_ids(policy)
    sampler = StaticSampler(8, backend=None)
    queries = padded_queries(tiny_tldr, 8)
    sampled = assert_same_samples(sampler, policy, queries[:5], 20, 0.7 + 1e-7, unsampled, seed=1)
    assert (sampled[:, -1] == EOS).all()  # every row ended early: the EOS fillers of the skipped steps
    plain, _ = tiny_models()
    sampled = assert_same_samples(sampler, plain.eval(), queries, 20, 1.0, unsampled, seed=2)  # the same sampler
    assert not (sampled[:, queries.shape[1]:] == EOS).any(1).all()  # a row without EOS: all 20 steps sampled


def test_static_sampler_compiled_step_draws_what_the_plain_loop_draws(tiny_tldr):
    """The same through torch.compile (backend aot_eager: dynamo's graph of the step, the static cache updated in
    place inside it; inductor's code generation of that graph takes 20-40 s and is checked by benchmark/sampling.py)."""
    policy, _ = tiny_models(early_eos=True)
    policy.eval()
    queries = padded_queries(tiny_tldr, 4)
    assert_same_samples(StaticSampler(4, backend="aot_eager"), policy, queries[:3], 12, 0.7 + 1e-7,
                        unsampled_ids(policy), seed=4)


def test_static_sampler_under_bf16_autocast_draws_what_the_plain_loop_draws(tiny_tldr):
    """accelerate's mixed precision without DeepSpeed (the one-GPU launch) runs the rollout under bf16 autocast, where
    GPT-NeoX's keys come out fp32 and its values bf16: the static cache takes both (it refused the bf16 values with
    the step run eagerly or through aot_eager) and samples what sample_rollout samples under the same autocast."""
    policy, _ = tiny_models(early_eos=True)
    policy.eval()
    queries, unsampled = padded_queries(tiny_tldr, 4)[:3], unsampled_ids(policy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(5)
        expected, expected_scores = sample_rollout(policy, queries, PAD, EOS, 12, 0.7 + 1e-7, unsampled)
        for backend in (None, "aot_eager"):
            torch.manual_seed(5)
            sampled, scores = StaticSampler(4, backend=backend)(policy, queries, PAD, EOS, 12, 0.7 + 1e-7, unsampled)
            assert torch.equal(sampled, expected), backend
            # bf16 logits summed in another order (the prefill by length groups, the eager attention of the step):
            # a few bf16 epsilons (2^-8) of the largest score
            scale = expected_scores[expected_scores > torch.finfo(torch.float32).min].abs().max()
            torch.testing.assert_close(scores, expected_scores, rtol=0, atol=4 * 2 ** -8 * float(scale))


def test_static_sampler_frees_its_cache_after_compiling(tiny_tldr):
    """A call that compiles the step leaves no static cache alive once it returns, even where Python's cyclic
    collector has not run (dynamo's tracing objects hold the call's cache in reference cycles); a call of a new
    shape compiles again and frees its cache too."""
    import gc

    from transformers import StaticCache

    policy, _ = tiny_models(early_eos=True)
    policy.eval()
    queries = padded_queries(tiny_tldr, 4)
    sampler = StaticSampler(4, backend="aot_eager")
    gc.collect()
    gc.disable()  # what a long run sees between two runs of the collector
    try:
        for length in (12, 12, 7):  # compiles, reuses the compiled step, compiles for a new cache length
            with torch.no_grad():
                sampler(policy, queries[:3], PAD, EOS, length, 0.7 + 1e-7, unsampled_ids(policy))
            # type(o), not isinstance: isinstance reads some objects' __class__, which warns (torch.distributed.reduce_op)
            alive = [o for o in gc.get_objects() if issubclass(type(o), StaticCache)]
            assert alive == [], f"{len(alive)} static cache(s) alive after a call of {length} steps"
    finally:
        gc.enable()
    assert sampler.shapes == {(queries.shape[1], 12), (queries.shape[1], 7)}


@pytest.mark.parametrize("groups", [1, 3, 8])  # one forward, groups of 2-3 rows, one row a forward
def test_prefill_by_length_equals_one_forward(tiny_tldr, groups):
    """StaticSampler's prefill (rows sorted by length, each group cut to its longest row) = sample_rollout's one
    forward: the last position's logits and every layer's keys and values at the real tokens, 0 at dropped pads."""
    from transformers import DynamicCache

    policy, _ = tiny_models()
    policy.eval()
    queries = padded_queries(tiny_tldr, 8)[torch.tensor([3, 0, 7, 5, 1, 6, 2, 4])]  # lengths out of order
    attention_mask = queries != PAD
    position_ids = (attention_mask.long().cumsum(1) - 1).masked_fill(~attention_mask, 0)
    input_ids = torch.masked_fill(queries, ~attention_mask, 0)
    assert (~attention_mask).sum(1).min() > 0 and len(set((~attention_mask).sum(1).tolist())) > 4  # pads everywhere
    with torch.no_grad():
        cache = DynamicCache(config=policy.config)
        expected = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        logits, keys_values = prefill_by_length(policy, input_ids, attention_mask, position_ids, groups)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert len(keys_values) == len(cache.layers)
    real = attention_mask[:, None, :, None].expand_as(cache.layers[0].keys)  # (B, heads, T_q, head_size)
    for (keys, values), layer in zip(keys_values, cache.layers):
        for ours, theirs in ((keys, layer.keys), (values, layer.values)):
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)
    # A group drops the pad columns its rows share: only pads, and at least those of the longest row (every row's).
    longest = attention_mask.sum(1).argmax()
    dropped = keys_values[0][0][:, 0].eq(0).all(-1)  # (B, T_q): columns left at 0
    assert not (dropped & attention_mask).any() and (dropped >= ~attention_mask[longest]).all()
    if groups == 8:  # one row a forward: each row's own pads
        assert torch.equal(dropped, ~attention_mask)
    if groups == 1:  # one forward: only the pads every row has
        assert torch.equal(dropped, (~attention_mask[longest]).expand_as(dropped))


@pytest.mark.parametrize("parallel_residual", [True, False])  # Pythia's layers, and GPT-NeoX's other kind
@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # the last-layer shortcut, and the plain fallback
def test_windowed_training_forward_equals_full_forward(tiny_tldr, attention, parallel_residual):
    """PPO's training forward (response_logits_and_values: response_window + PolicyAndValueWrapper, only the columns
    used, logits and values only at the trained positions) gives the full forward's logits and values there."""
    policy, critic = tiny_models()
    for model in (policy, critic.backbone):
        model.set_attn_implementation(attention)
        assert model.config._attn_implementation == attention
        for layer in model.base_model.layers:  # read at every forward: x + attn(ln1(x)), then + mlp(ln2(that))
            assert layer.use_parallel_residual
            layer.use_parallel_residual = parallel_residual
    queries = padded_queries(tiny_tldr, 6)
    context, length, n = queries.shape[1], 12, 9  # train response positions 0 ... 8 of 12
    torch.manual_seed(2)
    responses = torch.randint(2, 200, (6, length))
    responses[0, 3:], responses[1, 8] = PAD, EOS  # a short, an EOS-ended and untruncated rows
    responses[0, 2] = EOS
    query_responses = torch.cat((queries, responses), 1)
    ids, mask, positions = response_window(query_responses, PAD, context, n)
    assert ids.shape[1] < context + n - 1  # the window really drops the shared left pads
    with torch.no_grad():
        # (6, n, V), (6, n)
        logits, values = response_logits_and_values(PolicyAndValueWrapper(policy, critic), query_responses, PAD, context, n)
        attention_mask = query_responses != PAD
        full_logits = policy(input_ids=query_responses.masked_fill(~attention_mask, 0),
                             attention_mask=attention_mask).logits[:, context - 1:context - 1 + n]
        full_values = get_reward(critic, query_responses, PAD, context)[0][:, context - 1:context - 1 + n]
    torch.testing.assert_close(logits, full_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, full_values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [2, 3, 8])
def test_training_forward_by_length_equals_one_forward(tiny_tldr, monkeypatch, groups):
    """response_logits_and_values_by_length (--length_groups: the micro-batch's rows sorted by query length, in
    `groups` forwards of unequal sizes, more groups than rows) gives every row the logits and value, and the loss
    the gradient, of one forward (response_logits_and_values), from forwards narrower than the one."""
    import ppo

    policy, critic = tiny_models()
    model = PolicyAndValueWrapper(policy, critic)
    queries = padded_queries(tiny_tldr, 40)[torch.tensor([20, 0, 39, 10, 30, 5])]  # the shortest second, the longest third
    lengths = (queries != PAD).sum(1)
    assert not torch.equal(lengths.sort().values, lengths)  # the rows move when sorted
    context, n = queries.shape[1], 7  # response positions 0 ... 6 of 9 trained
    torch.manual_seed(4)
    responses = torch.randint(2, 200, (6, 9))
    responses[2, 3], responses[2, 4:] = EOS, PAD
    query_responses = torch.cat((queries, responses), 1)
    widths = []
    one_forward = ppo.response_logits_and_values

    def recorded(model, query_responses, *args):
        widths.append(response_window(query_responses, PAD, context, n)[0].shape[1])
        return one_forward(model, query_responses, *args)

    def outputs_and_gradient(logits, values):
        loss = torch.log_softmax(logits, -1)[..., 5].mean() + values.square().mean()
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        return logits.detach(), values.detach(), torch.cat([g.flatten() for g in grads])

    one = outputs_and_gradient(*one_forward(model, query_responses, PAD, context, n))  # (6, n, V), (6, n), (P,)
    monkeypatch.setattr(ppo, "response_logits_and_values", recorded)
    grouped = outputs_and_gradient(*ppo.response_logits_and_values_by_length(model, query_responses, PAD, context, n,
                                                                             groups))
    full_width = response_window(query_responses, PAD, context, n)[0].shape[1]
    assert len(widths) == min(groups, 6) and max(widths) == full_width and min(widths) < full_width
    assert one[1].std(0).min() > 1e-3  # every position's values differ between rows: a row out of place would show
    torch.testing.assert_close(grouped[0], one[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped[1], one[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped[2], one[2], rtol=1e-4, atol=1e-5)


def test_by_query_length_by_hand():
    """by_query_length (--length_groups): the rows sorted by query length (stable) go to `groups` calls and come back
    in their order; a tuple of outputs comes back as a tuple; more groups than rows give a call a row; one group is
    one call on the rows as they are."""
    import ppo

    P = 0  # the pad id here
    query_responses = torch.tensor([[P, 8, 8, 8, 5, 5],   # 3 query tokens; response 5 5
                                    [P, P, P, 3, 4, 4],   # 1
                                    [9, 9, 9, 9, 1, 2],   # 4
                                    [P, P, 5, 6, 7, 8],   # 2
                                    [P, P, P, 6, 1, 1]])  # 1
    calls = []

    def forward(rows):  # each row's query tokens counted; its response plus 10 x its query's last token
        calls.append(rows.tolist())
        return (rows[:, :4] != P).sum(1), rows[:, 4:] + 10 * rows[:, 3:4]

    # sorted: rows 1 4 3 0 2, a permutation that is not its own inverse (putting rows back by it would show)
    counts, responses = ppo.by_query_length(forward, query_responses, P, 4, groups=2)
    assert counts.tolist() == [3, 1, 4, 2, 1]
    assert responses.tolist() == [[85, 85], [34, 34], [91, 92], [67, 68], [61, 61]]
    assert calls == [query_responses[[1, 4, 3]].tolist(), query_responses[[0, 2]].tolist()]  # lengths 1 1 2 | 3 4
    calls.clear()
    alone = ppo.by_query_length(lambda rows: forward(rows)[1], query_responses, P, 4, groups=9)
    assert torch.equal(alone, responses) and calls == [query_responses[[i]].tolist() for i in (1, 4, 3, 0, 2)]
    calls.clear()
    assert torch.equal(ppo.by_query_length(forward, query_responses, P, 4, groups=1)[1], responses)
    assert calls == [query_responses.tolist()]


@pytest.mark.parametrize("groups", [2, 5])
def test_scoring_forwards_by_length_equal_one_forward(tiny_tldr, monkeypatch, groups):
    """The rollout's scoring forwards with --length_groups (the reference's logits, the critic's values, the RM's
    score: rows sorted by query length, each group's forward from its longest query's first token on, at the
    full row's positions) give every row what one forward gives, up to float rounding."""
    import ppo

    policy, critic = tiny_models()
    query_responses, context = scored_batch(tiny_tldr, seed=5)
    query_responses = query_responses[torch.tensor([2, 0, 4, 1, 3])]  # not sorted by query length: sorting moves them
    lengths = (query_responses[:, :context] != PAD).sum(1)
    assert not torch.equal(lengths.argsort(stable=True), lengths.argsort(stable=True).argsort())
    with torch.no_grad():
        one = (response_logits(policy, query_responses, PAD, context), get_values(critic, query_responses, PAD, context),
               get_score(critic, query_responses, PAD, context))
        widths, plain_window = [], ppo.response_window

        def recorded(*args):
            window = plain_window(*args)
            widths.append(window[0].shape[1])
            return window

        monkeypatch.setattr(ppo, "response_window", recorded)
        grouped = (response_logits(policy, query_responses, PAD, context, groups),
                   get_values(critic, query_responses, PAD, context, groups),
                   get_score(critic, query_responses, PAD, context, groups))
    assert one[1].std(0).min() > 1e-3 and one[2].std() > 1e-3  # rows differ: a row out of place would show
    full = [plain_window(query_responses, PAD, context, n)[0].shape[1] for n in (10, 11)]  # logits', outputs' widths
    assert len(widths) == 3 * len(torch.arange(5).chunk(groups))  # a windowed forward a group, in each of the three
    assert max(widths) <= max(full) and min(widths) < min(full)  # narrower than one forward's window
    # The logits (|logit| up to 23 here) round as the window's own against the full forward's, ~2e-5 apart.
    torch.testing.assert_close(grouped[0], one[0], rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(grouped[1], one[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped[2], one[2], rtol=1e-5, atol=1e-5)


def test_last_layer_at_copies_agree(tiny_tldr):
    """ppo.py's last_layer_at (which may run compiled layers in place of the eager ones) and reward.py's (cut to the
    eager layers, all it runs) give the same hidden states, bit for bit, on the inputs they share."""
    import ppo

    policy, _ = tiny_models()
    query_responses, context = scored_batch(tiny_tldr, seed=6)
    ids, mask, positions = response_window(query_responses, PAD, context, 10)
    with torch.no_grad():
        ours, theirs = (module.last_layer_at(policy.base_model, ids, mask, positions, lambda x: x[:, -10:])
                        for module in (ppo, reward))
    assert ours.shape == (5, 10, policy.config.hidden_size) and ours.abs().max() > 0.1
    assert torch.equal(ours, theirs)


def test_scoring_forwards_of_deepspeed_engines_are_not_grouped(tiny_tldr):
    """--offload's reference policy and RM are DeepSpeed engines, whose every forward gathers the weights anew (from
    the CPU): with --length_groups their scoring runs as one forward a chunk, as without."""
    from types import SimpleNamespace

    import ppo

    calls = []

    class Engine(torch.nn.Module):  # not a PreTrainedModel: ppo.py calls it as it calls a DeepSpeed engine
        def forward(self, input_ids, attention_mask, position_ids=None, logits_to_keep=None, return_dict=None):
            calls.append(input_ids.shape[0])
            if logits_to_keep is None:  # the RM's per-token outputs
                return torch.zeros(input_ids.shape)
            return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], logits_to_keep, 3))

    query_responses, context = scored_batch(tiny_tldr, seed=5)
    with torch.no_grad():
        ppo.response_logits(Engine(), query_responses, PAD, context, 3)
        ppo.get_values(Engine(), query_responses, PAD, context, 3)
        ppo.get_score(Engine(), query_responses, PAD, context, 3)
    assert calls == [5, 5, 5]


def outputs_and_gradients(model, query_responses: torch.Tensor, context_length: int) -> tuple:
    """The PPO epochs' forward of `model` on 9 response tokens: its logits, values, and the gradients of a stand-in loss
    over every trainable parameter, flattened into one vector."""
    logits, values = response_logits_and_values(model, query_responses, PAD, context_length, 9)
    loss = torch.log_softmax(logits, -1)[..., 5].mean() + values.square().mean()
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return logits.detach(), values.detach(), torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])  # dynamo's graph run eagerly; the compiler's own code
def test_compiled_layers_give_the_eager_outputs_and_gradients(tiny_tldr, backend):
    """--compile_training (compiled_layers: each layer but the last wrapped by torch.compile, used by the PPO epochs'
    forward only) gives the eager forward's logits, values and gradients, over micro-batches of three window widths
    and row counts; the first call compiles a graph for any shape, so the later ones compile nothing."""
    from torch._dynamo.utils import counters

    policy, critic = tiny_models()
    eager = PolicyAndValueWrapper(policy, critic).train()
    compiled = PolicyAndValueWrapper(policy, critic, compile_layers=True, backend=backend).train()  # the same modules
    assert len(compiled.compiled[0]) == len(policy.base_model.layers) - 1
    assert sorted(dict(compiled.named_parameters())) == sorted(dict(eager.named_parameters()))  # none added
    queries = padded_queries(tiny_tldr, 40)
    torch.manual_seed(5)
    torch._dynamo.reset()
    graphs = [counters["stats"]["unique_graphs"]]
    widths = []
    # Widths 91, 103, 117 (none the hidden size, 96: a width equal to a weight's size would be compiled as that size).
    for rows in ([0, 1, 2, 3, 4], [10, 11, 12, 13], [30, 31, 32, 33, 34, 35]):  # ever fewer left pads
        query_responses = torch.cat((queries[rows], torch.randint(2, 200, (len(rows), 12))), 1)
        widths.append(response_window(query_responses, PAD, queries.shape[1], 9)[0].shape[1])
        outputs = [outputs_and_gradients(model, query_responses, queries.shape[1]) for model in (eager, compiled)]
        graphs.append(counters["stats"]["unique_graphs"])
        for ours, theirs in zip(outputs[1], outputs[0]):
            if backend == "aot_eager":  # the same kernels in the same order
                assert torch.equal(ours, theirs)
            else:  # inductor fuses the elementwise work: its own float rounding
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert widths == [91, 103, 117]
    assert graphs[1] - graphs[0] == 1 and graphs[3] == graphs[2] == graphs[1], graphs


def test_compiled_layers_compose_with_recomputed_activations(tiny_tldr):
    """--compile_training with --gradient_checkpointing (the SLURM launchers compile by default; a larger model may
    add checkpointing for memory): each compiled layer recomputes its activations in the backward, and the logits,
    values and gradients are the eager forward's (aot_eager: the same kernels in the same order), from one graph."""
    import copy

    from torch._dynamo.utils import counters

    policy, critic = tiny_models()
    eager = PolicyAndValueWrapper(policy, critic).train()
    both = PolicyAndValueWrapper(copy.deepcopy(policy), copy.deepcopy(critic), compile_layers=True,
                                 checkpoint_activations=True, backend="aot_eager").train()
    assert both.policy.base_model.gradient_checkpointing and both.critic.backbone.gradient_checkpointing
    queries = padded_queries(tiny_tldr, 40)[:6]
    torch.manual_seed(5)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    query_responses = torch.cat((queries, torch.randint(2, 200, (len(queries), 12))), 1)
    outputs = [outputs_and_gradients(model, query_responses, queries.shape[1]) for model in (eager, both)]
    for ours, theirs in zip(outputs[1], outputs[0]):
        assert torch.equal(ours, theirs)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # compiled, not run eagerly: one graph for every layer


@pytest.mark.parametrize("missing", ["C compiler", "Triton"])
def test_a_compiler_failure_names_the_flag_that_asked_for_it(tiny_tldr, missing):
    """torch.compile's backend failing (a node without a C compiler, or without Triton on a GPU) at the first compiled
    call of --compile_training's layers or --fast_sampling's step: the error names the flag and the launchers' knob
    that turn it off, with the compiler's own error as its cause (a C compiler's error arrives wrapped in
    BackendCompilerFailed; inductor's TritonMissing as it is)."""
    import inspect

    from torch._dynamo.exc import BackendCompilerFailed, ShortenTraceback
    from torch._inductor.exc import TritonMissing

    expected = BackendCompilerFailed if missing == "C compiler" else TritonMissing

    def failing_backend(graph, example_inputs):  # what inductor does without the toolchain
        if missing == "Triton":
            raise TritonMissing(inspect.currentframe())
        raise OSError("no C compiler")

    policy, critic = tiny_models()
    queries = padded_queries(tiny_tldr, 4)
    query_responses = torch.cat((queries, torch.randint(2, 200, (len(queries), 12))), 1)
    torch._dynamo.reset()
    model = PolicyAndValueWrapper(policy, critic, compile_layers=True, backend=failing_backend).train()
    with pytest.raises(RuntimeError, match=rf"^--compile_training: torch.compile could not build its code here "
                                           rf"\({expected.__name__}, above\). --compile_training changes speed only: "
                                           r"run without it \(the SLURM launchers: COMPILE_TRAINING=0; a run with "
                                           r"checkpoints continues from them with --resume\)") as raised:
        response_logits_and_values(model, query_responses, PAD, queries.shape[1], 9)
    assert type(raised.value.__cause__) is expected and issubclass(expected, ShortenTraceback)
    torch._dynamo.reset()
    policy.eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"^--fast_sampling: .*the SLURM launchers: "
                                                            r"FAST_SAMPLING=0; ") as raised:
        StaticSampler(4, backend=failing_backend)(policy, queries[:3], PAD, EOS, 12, 0.7 + 1e-7, unsampled_ids(policy))
    assert type(raised.value.__cause__) is expected
    # anything else passes through as it is: a result, and an error that is not the compiler's
    from ppo import explain_compile_errors

    assert explain_compile_errors(lambda x, y=1: x + y, "--flag", "KNOB=0")(2, y=3) == 5
    with pytest.raises(ValueError, match="^a bad input$"):
        explain_compile_errors(lambda: (_ for _ in ()).throw(ValueError("a bad input")), "--flag", "KNOB=0")()


def test_compiled_training_refuses_what_it_cannot_compile():
    """model_problems: --compile_training on a backbone without SDPA attention names the model and the fix; without
    the flag the same models pass."""
    from types import SimpleNamespace

    import ppo
    from transformers import AutoTokenizer

    policy, critic = tiny_models()
    critic.backbone.set_attn_implementation("eager")
    tokenizer = AutoTokenizer.from_pretrained(WORLD / "pythia-tiny")
    args = SimpleNamespace(compile_training=True, sft_model_path="sft", reward_model_path="rm")
    assert ppo.model_problems(args, tokenizer, policy, critic) == (
        "--compile_training compiles GPT-NeoX layers run by SDPA; --reward_model_path rm is GPTNeoXModel with 'eager' "
        "attention: drop --compile_training")
    assert ppo.model_problems(SimpleNamespace(**{**vars(args), "compile_training": False}), tokenizer, policy, critic) is None


def test_reference_forward_and_values_equal_the_full_forward(tiny_tldr):
    """The rollout's reference forward (response_logits: the response window only) = the full forward's
    logits[:, context_length - 1 : -1]; get_values = the critic's per-token outputs at the same positions."""
    policy, critic = tiny_models()
    query_responses, context = scored_batch(tiny_tldr, seed=3)
    attention_mask = query_responses != PAD
    with torch.no_grad():
        logits = response_logits(policy, query_responses, PAD, context)  # (5, 10, V)
        full = policy(input_ids=query_responses.masked_fill(~attention_mask, 0), attention_mask=attention_mask).logits
        values = get_values(critic, query_responses, PAD, context)  # (5, 10)
        full_values = critic(query_responses.masked_fill(~attention_mask, 0), attention_mask)
    assert logits.shape == (5, 10, full.shape[-1]) and values.shape == (5, 10)
    torch.testing.assert_close(logits, full[:, context - 1:-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, full_values[:, context - 1:-1])


def test_rollout_scoring_runs_the_last_layer_at_the_response_only_and_changes_no_bit(tiny_tldr, monkeypatch):
    """get_score / response_outputs / get_values (the RM's and critic's last layer at the response positions only)
    and response_logits (the reference's) equal, bit for bit, the plain forwards they stand for."""
    import ppo

    policy, critic = tiny_models()
    query_responses, context = scored_batch(tiny_tldr, seed=4)
    query_responses[1, context:] = PAD  # an empty response: the score is read at the last query token
    with torch.no_grad():
        per_token, scores = get_reward(critic, query_responses, PAD, context)
        ids, mask, positions = response_window(query_responses, PAD, context, 10)
        plain = policy(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=10).logits
        monkeypatch.setattr(ppo, "get_reward", None)  # the fast paths must not fall back to the plain forward
        monkeypatch.setattr(policy, "forward", None)
        assert torch.equal(get_score(critic, query_responses, PAD, context), scores)
        assert torch.equal(response_outputs(critic, query_responses, PAD, context), per_token[:, context - 1:])
        assert torch.equal(get_values(critic, query_responses, PAD, context), per_token[:, context - 1:-1])
        assert torch.equal(response_logits(policy, query_responses, PAD, context), plain)


def test_scalar_model_copies_agree(tmp_path):
    """ppo.py's ScalarModel (cut to loading and scoring with a (B, T) padding mask) and reward.py's (which also
    builds new heads and reads 4-D masks) load the same folder into the same weights and give the same outputs."""
    torch.manual_seed(0)
    make_reward_model(tmp_path / "rm")
    ours, theirs = ScalarModel.from_pretrained(tmp_path / "rm"), reward.ScalarModel.from_pretrained(tmp_path / "rm")
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert all(torch.equal(value, theirs.state_dict()[key]) for key, value in ours.state_dict().items())
    ids = torch.randint(2, 200, (3, 12))
    ids[0, :4], ids[1, 9:] = PAD, PAD  # left- and right-padded rows, as PPO and reward.py score them
    mask = ids != PAD
    with torch.no_grad():
        torch.testing.assert_close(ours(ids.masked_fill(~mask, 0), mask), theirs(ids.masked_fill(~mask, 0), mask),
                                   rtol=0, atol=0)
        assert torch.equal(get_reward(ours, ids, PAD, 4)[1], reward.get_reward(theirs, ids, PAD, 4)[1])


CHECKPOINT_HELPERS = ("check_and_checkpoint", "resume", "save_checkpoint", "load_checkpoint")


def without_scheduler(node):
    """A helper's syntax tree as it reads when its `scheduler` is always None (PPO anneals its lr by hand): no
    `scheduler` parameter or argument, no `if scheduler is not None:` block, no "scheduler" entry in a dict."""
    class Fold(ast.NodeTransformer):
        def visit_arguments(self, node):
            node.args = [a for a in node.args if a.arg != "scheduler"]
            return node

        def visit_Call(self, node):
            self.generic_visit(node)
            node.args = [a for a in node.args if not (isinstance(a, ast.Name) and a.id == "scheduler")]
            return node

        def visit_If(self, node):
            if ast.unparse(node.test) == "scheduler is not None" and not node.orelse:
                return None
            return self.generic_visit(node)

        def visit_Dict(self, node):
            self.generic_visit(node)
            kept = [(k, v) for k, v in zip(node.keys, node.values)
                    if not (isinstance(k, ast.Constant) and k.value == "scheduler")]
            node.keys, node.values = [k for k, _ in kept], [v for _, v in kept]
            return node

    return Fold().visit(node)


def test_checkpoint_copies_agree():
    """ppo.py's checkpoint helpers are the other stages' copies with their scheduler (always None in PPO) folded
    away, and the other stages' copies are the same code: listed in AGREEING_COPIES (tests/test_conventions.py)."""
    def helpers(script: str, fold: bool = False) -> dict:
        tree = ast.parse((REPO / script).read_text())
        found = {node.name: node for node in tree.body
                 if isinstance(node, ast.FunctionDef) and node.name in CHECKPOINT_HELPERS}
        assert sorted(found) == sorted(CHECKPOINT_HELPERS), script
        for node in found.values():
            if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
                node.body = node.body[1:]  # docstrings may differ
        return {name: ast.dump(without_scheduler(node) if fold else node) for name, node in found.items()}

    ppo_copies = helpers("ppo.py")
    assert helpers("ppo.py", fold=True) == ppo_copies  # nothing about a scheduler is left in PPO's copies
    shared = helpers("sft.py")
    for script in ("reward.py", "dpo.py"):
        assert helpers(script) == shared, script
    folded = helpers("sft.py", fold=True)
    for name in CHECKPOINT_HELPERS:
        assert shared[name] != folded[name], name  # each shared copy does use its scheduler ...
        assert ppo_copies[name] == folded[name], name  # ... and PPO's is that copy without it


def test_first_epoch_ratio_is_one_on_tiny_model(tiny_tldr):
    """Behaviour log-probs from the rollout's scores = the training forward's (train mode), so the first ratio is 1."""
    policy, critic = tiny_models(early_eos=True)
    queries, length, temperature = padded_queries(tiny_tldr, 6), 16, 0.7 + 1e-7
    unsampled = unsampled_ids(policy)
    with torch.no_grad():
        query_responses, scores = sample_rollout(policy.eval(), queries, PAD, EOS, length, temperature, unsampled)
        context = queries.shape[1]
        responses = query_responses[:, context:]
        logprobs = gather_logprobs(scores, responses)
        model = PolicyAndValueWrapper(policy, critic).train()  # as in the PPO epochs: only dropout would differ
        logits, _ = model(*response_window(query_responses, PAD, context, length), length)
        new_logprobs = gather_logprobs(mask_logits(logits / temperature, unsampled), responses)
    valid = truncate_response(responses, EOS, PAD) != PAD  # up to each row's EOS: what PPO trains
    ratio = torch.exp(new_logprobs - logprobs)[valid]
    assert valid.sum() > 20 and (ratio - 1).abs().max().item() < 1e-4, ratio


def make_reward_model(path, head_bias: float = 0.0):
    """A reward-model folder as reward.py writes it: ScalarModel on the tiny base, random head (its bias
    `head_bias`: reward.py's normalisation shifts it, Detail 15)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backbone = AutoModelForCausalLM.from_pretrained(WORLD / "pythia-tiny").base_model
    disable_dropout(backbone)
    base_config = {k: v for k, v in backbone.config.to_dict().items() if k != "_name_or_path"}
    torch.manual_seed(0)
    model = reward.ScalarModel(reward.ScalarModelConfig(base_config=base_config))
    model.backbone.load_state_dict(backbone.state_dict())
    torch.nn.init.constant_(model.head.bias, head_bias)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(WORLD / "pythia-tiny").save_pretrained(path)


def test_runs_interrupted_resumed_fast_and_checkpointed_equal_the_plain_run(tiny_tldr, tmp_path):
    """Two full PPO updates (2 minibatches of 2 micro-batches of 4) on the tiny world, four ways, each evaluated after
    update 1 and at the end. The plain run: HF generate, stored activations, uninterrupted. The resumed run: stopped
    after update 1 (as a time-limited job) and resumed from its checkpoint by a start that names no run (as the SLURM
    launchers requeue): the plain run bit for bit, samples included, and it saves a standard policy folder. The fast
    run: ppo.py --fast_sampling (StaticSampler for the rollouts and the evaluation, its step compiled, as the SLURM
    launchers run it, its evaluation's sampler wider than its rollouts') with --gradient_checkpointing (activations
    recomputed in the backward), stopped after its first update and its evaluation and resumed without
    --fast_sampling, as after a requeue onto a node that cannot compile (the speed-only flags, --compile_training
    too, may change on --resume): the same evaluation samples, the same logged statistics and final weights as the
    plain run up to float rounding (the forwards sum in other orders)."""
    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    make_reward_model(tmp_path / "rm")
    # One thread: on a 2-core machine shared with other jobs, 2 threads per process run ~10x slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs, steps, outputs = {}, {}, {}
    # Both starts of a resumed run carry --resume, as every start of a SLURM task does (benchmark/slurm/): the first
    # finds no checkpoint and starts at 0.
    resumed = [["--save_every", "1", "--stop_after_updates", "1", "--resume"], ["--save_every", "1", "--resume"]]
    fast = [resumed[0] + ["--fast_sampling", "--gradient_checkpointing"], resumed[1] + ["--gradient_checkpointing"]]
    for name, starts in (("plain", [[]]), ("resumed", resumed), ("fast", fast)):
        out = tmp_path / name
        cmd = [sys.executable, str(REPO / "ppo.py"), "--base_model", str(WORLD / "pythia-tiny"),
               "--query_dataset", str(tiny_tldr / "sft"), "--sft_model_path", str(WORLD / "pythia-tiny"),
               "--reward_model_path", str(tmp_path / "rm"), "--output_dir", str(out), "--run_name", name,
               "--total_episodes", "32", "--batch_size", "16", "--num_minibatches", "2", "--local_micro_batch_size", "4",
               "--local_rollout_forward_batch_size", "8", "--response_length", "20", "--lr", "1e-4",
               "--eval_every", "1", "--num_eval_samples", "12", "--local_eval_batch_size", "12"]  # > the rollout's 8
        outputs[name] = []
        for start, extra in enumerate(starts):
            # The requeued start names no run (as the launchers): it takes the checkpoint's, and logs on under
            # runs/<name>.
            named = cmd if start == 0 else cmd[: cmd.index("--run_name")] + cmd[cmd.index("--run_name") + 2 :]
            result = run_python(named + extra, cwd=tmp_path, env=env, timeout=900)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            outputs[name].append(result.stdout + result.stderr)
            if start == 0 and len(starts) == 2:
                assert [p.name for p in (out / "checkpoints").iterdir()] == ["update_1"], name
        events = EventAccumulator(str(tmp_path / "runs" / name))
        events.Reload()
        runs[name] = {tag: [event.value for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]
                      if not tag.startswith("time/")}
        steps[name] = {tag: [event.step for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == ["fast", "plain", "resumed"]

    # The resumed run's two starts, and what it saved.
    first, second = outputs["resumed"]
    out = tmp_path / "resumed"
    assert f"--resume: no checkpoint in {out / 'checkpoints'}, starting at update 0" in first
    assert "2 updates of 16 episodes" in first and "stopped after update 1 of 2" in first
    assert "model of type `scalar_model`" not in first + second  # the RM folder's tokenizer loads quietly
    assert "at update 1" in second
    policy = AutoModelForCausalLM.from_pretrained(out)  # a standard causal-LM folder
    assert policy.config.attention_dropout == 0.0
    assert (out / "tokenizer.json").is_file() and not (out / "checkpoints").exists()
    saved = json.loads((out / "args.json").read_text())
    assert saved["num_updates"] == 2 and saved["gradient_accumulation_steps"] == 2 and "git_commit" in saved
    with open(out / "eval_validation.csv") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 12 and list(rows[0]) == ["query", "response", "reference", "score", "reference_score"]
    assert "[PAD]" not in rows[0]["query"] and "<|endoftext|>" not in rows[0]["reference"]
    scalars = runs["resumed"]
    for tag in ("objective/kl", "objective/scores", "policy/clipfrac", "value/loss", "time/generation"):
        assert len(steps["resumed"][tag]) == 2, tag
    assert scalars["policy/lr"] == pytest.approx([1e-4, 5e-5])  # lr (1 - update / num_updates): linear decay
    assert all(abs(r - 1) < 1e-4 for r in scalars["policy/ratio_first_epoch"]), scalars["policy/ratio_first_epoch"]
    assert scalars["objective/kl"][0] == pytest.approx(0.0, abs=1e-4)  # policy = reference before any step
    assert len(scalars["objective/validation_score"]) == 2  # after update 1 (eval_every) and at the end
    # x = episodes seen (16 a update); the last validation score is the final evaluation's, in eval_metrics.json
    for tag in ("objective/kl", "objective/validation_score", "eval/ppo/validation/score"):
        assert steps["resumed"][tag] == [16, 32], tag
    final = json.loads((out / "eval_metrics.json").read_text())["validation"]
    assert scalars["objective/validation_score"][-1] == pytest.approx(final["score"])
    assert scalars["eval/ppo/validation/reference_score"][-1] == pytest.approx(final["reference_score"])

    # Against the plain run.
    plain = (tmp_path / "plain" / "eval_validation.csv").read_text()
    assert len(plain.splitlines()) > 12 and len(runs["plain"]["objective/kl"]) == 2
    start = load_file(WORLD / "pythia-tiny" / "model.safetensors")
    weights = load_file(tmp_path / "plain" / "model.safetensors")
    assert max((weights[key] - start[key]).abs().max().item() for key in weights) > 1e-5  # the runs trained: their
    assert ppo.SPEED_ONLY_FLAGS == ("fast_sampling", "compile_training")  # what the compile errors tell to drop
    fast_samples = (tmp_path / "runs" / "fast" / "samples_validation_16.csv").read_text()  # the fast path's
    assert fast_samples == (tmp_path / "runs" / "plain" / "samples_validation_16.csv").read_text()  # evaluation
    # agreement is not that of untouched weights
    assert (tmp_path / "fast" / "eval_validation.csv").read_text() == plain  # the same 12 samples, word for word
    assert sorted(runs["fast"]) == sorted(runs["plain"])
    for tag, values in runs["plain"].items():
        assert runs["fast"][tag] == pytest.approx(values, rel=1e-4, abs=1e-4), tag
    other = load_file(tmp_path / "fast" / "model.safetensors")
    assert max((weights[key] - other[key]).abs().max().item() for key in weights) < 1e-5
    # The resumed run: its evaluation after update 1 came before its checkpoint, so update 2 drew from the random
    # state the uninterrupted run had there (with the checkpoint before the evaluation, the final samples differed).
    assert (tmp_path / "resumed" / "eval_validation.csv").read_text() == plain
    assert (tmp_path / "runs" / "resumed" / "samples_validation_16.csv").read_text() == (
        tmp_path / "runs" / "plain" / "samples_validation_16.csv").read_text()
    assert runs["resumed"] == runs["plain"]  # every logged statistic, to the bit
    resumed_weights = load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(weights[key], resumed_weights[key]) for key in weights)


def test_data_without_a_column_or_a_foreign_output_folder_is_refused_before_loading(tiny_tldr, tmp_path):
    """ppo.py's own inputs: SFT data without the references it scores against, and an output folder of other
    files; each start names the problem and the fix, and loads no model."""
    import datasets

    data = datasets.load_from_disk(tiny_tldr / "sft")
    data["validation"] = data["validation"].remove_columns("reference_response_token")
    data.save_to_disk(tmp_path / "data" / "sft")
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("not a run")
    make_reward_model(tmp_path / "rm")  # the right kinds of model: ppo.py checks both before anything else loads
    base = ["--sft_model_path", WORLD / "pythia-tiny", "--reward_model_path", tmp_path / "rm"]
    cases = {f"{tmp_path / 'data' / 'sft'} lacks ['validation.reference_response_token']: build it with "
             "preprocess_tldr.py": ["--query_dataset", tmp_path / "data" / "sft", "--output_dir", tmp_path / "out"],
             f"--output_dir {tmp_path / 'occupied'} is not empty and has no args.json: choose an empty or new folder":
                 ["--query_dataset", tiny_tldr / "sft", "--output_dir", tmp_path / "occupied"]}
    results = early_exits([(tmp_path, REPO / "ppo.py", base + flags) for flags in cases.values()],
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    for message, result in zip(cases, results):
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
        assert "Loading weights" not in result.stdout + result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "occupied", "rm"]


ZERO_HEAD_PROBE = """
import sys

import torch

sys.path.insert(0, sys.argv.pop(1))
import ppo

first, rollout = {}, ppo.rollout


def recording(args, policy, ref_policy, critic, reward_model, queries, sample, pad_token_id, *rest):
    batch, seconds = rollout(args, policy, ref_policy, critic, reward_model, queries, sample, pad_token_id, *rest)
    if not first:  # the first rollout: values of the critic and, for the same rows, of the RM it was copied from
        first["values"] = batch["values"]
        first["rm"] = ppo.get_values(reward_model, batch["query_responses"], pad_token_id, queries.shape[1])
        first["same_backbone"] = all(torch.equal(a, b) for a, b in zip(critic.backbone.parameters(),
                                                                       reward_model.backbone.parameters()))
    return batch, seconds


ppo.rollout = recording
sys.argv = ["ppo.py", *sys.argv[1:]]
ppo.main()
print("probe", first["values"].abs().max().item(), first["rm"].abs().max().item(), first["same_backbone"])
"""


@pytest.mark.parametrize("zero_head", [False, True])
def test_zero_critic_head_starts_every_value_at_zero(tiny_tldr, tmp_path, zero_head):
    """--zero_critic_head: the first rollout's values are all 0 where the RM's own are not, the backbone still the
    RM's; without it (Detail 22) the critic's first values are the RM's. The RM's head has a bias, as a normalised
    RM's has: the flag zeroes it too."""
    make_reward_model(tmp_path / "rm", head_bias=0.5)
    (tmp_path / "probe.py").write_text(ZERO_HEAD_PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(tmp_path / "probe.py"), str(REPO), "--base_model", str(WORLD / "pythia-tiny"),
           "--query_dataset", str(tiny_tldr / "sft"), "--sft_model_path", str(WORLD / "pythia-tiny"),
           "--reward_model_path", str(tmp_path / "rm"), "--output_dir", str(tmp_path / "ppo"), "--run_name", "zero",
           "--total_episodes", "8", "--batch_size", "8", "--local_micro_batch_size", "8", "--response_length", "8",
           "--num_eval_samples", "0"] + (["--zero_critic_head"] if zero_head else [])
    result = run_python(cmd, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    values, rm, same_backbone = result.stdout.split("probe ")[-1].split()
    assert float(rm) > 1e-3 and same_backbone == "True"
    assert float(values) == 0.0 if zero_head else float(values) == pytest.approx(float(rm), abs=1e-6)
    assert json.loads((tmp_path / "ppo" / "args.json").read_text())["zero_critic_head"] is zero_head


def test_prompt_order_reshuffles_at_each_pass():
    """Prompts without replacement within a pass, a fresh order for the next pass, alike on every rank."""
    from ppo import episode_order

    order = episode_order(10, 25, seed=3)
    passes = [order[:10], order[10:20], order[20:]]
    assert sorted(passes[0].tolist()) == sorted(passes[1].tolist()) == list(range(10))
    assert len(set(passes[2].tolist())) == 5  # the last, partial pass repeats no prompt either
    assert passes[0].tolist() != passes[1].tolist()
    assert torch.equal(order, episode_order(10, 25, seed=3))  # same seed on every rank: one shared order
    # update u, rank r reads slice [u, r]: 2 ranks x 5 prompts per update cover the pass exactly once
    local = order[:20].view(2, 2, 5)
    assert sorted(local[0].flatten().tolist()) == list(range(10))


WHITEN_RECORDER = """
import os, sys
import torch
sys.path.insert(0, sys.argv[1])
import ppo

calls = []
real_whiten = ppo.whiten
def whiten(values, mask, shift_mean=True, all_reduce=None):  # main's two calls: what each rank gave and got
    values = values + int(os.environ["RANK"])  # rank 1's tokens shifted by 1: the ranks' statistics differ for sure
    out = real_whiten(values, mask, shift_mean, all_reduce)
    calls.append({"values": values.clone(), "mask": mask.clone(), "shift_mean": shift_mean, "out": out.clone()})
    return out

ppo.whiten = whiten
out = sys.argv[2]
sys.argv = ["ppo.py"] + sys.argv[3:]
ppo.main()
torch.save(calls, f"{out}.{os.environ['RANK']}.pt")
ppo.leave_process_group(True)
"""


def test_two_processes_run_and_gather_in_order(tiny_tldr, tmp_path):
    """2 CPU processes (DDP, gloo): global whitening, one shared prompt order, eval rows back in split order, and
    --length_groups (2 forwards of a micro-batch before its backward). Whitening: the rewards' (--whiten_rewards) and
    the advantages' statistics are those of both ranks' tokens together (the reference code whitens per GPU), seen
    through main's own calls (a recorder wraps ppo.whiten and shifts rank 1's inputs: in this short run every
    response lacks an EOS, so both ranks' rewards would have one mean and variance)."""
    import socket

    import datasets
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    make_reward_model(tmp_path / "rm")
    with socket.socket() as sock:  # a free port: other test sessions may launch at the same time
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
           str(tmp_path / "recorder.py"), str(REPO), str(tmp_path / "whiten"),  # runs ppo.main() with these flags:
           "--base_model", str(WORLD / "pythia-tiny"), "--query_dataset", str(tiny_tldr / "sft"),
           "--sft_model_path", str(WORLD / "pythia-tiny"), "--reward_model_path", str(tmp_path / "rm"),
           "--output_dir", str(tmp_path / "ppo"), "--run_name", "ppo_two", "--total_episodes", "32",
           "--batch_size", "16", "--local_micro_batch_size", "4", "--local_rollout_forward_batch_size", "8",
           "--response_length", "16", "--num_eval_samples", "10", "--local_eval_batch_size", "4", "--whiten_rewards",
           "--length_groups", "2"]  # 2 forwards of a micro-batch before its one backward, under DDP
    (tmp_path / "recorder.py").write_text(WHITEN_RECORDER)
    with multi_process_slot(2):
        result = run_python(cmd, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    saved = json.loads((tmp_path / "ppo" / "args.json").read_text())
    assert (saved["world_size"], saved["local_batch_size"], saved["gradient_accumulation_steps"]) == (2, 8, 2)
    ranks = [torch.load(tmp_path / f"whiten.{rank}.pt") for rank in (0, 1)]
    assert [[call["shift_mean"] for call in calls] for calls in ranks] == [[False, True] * 2] * 2  # 2 updates
    for first, second in zip(*ranks):
        both_in, both_out = (torch.cat((first[key][first["mask"]], second[key][second["mask"]])).double()
                             for key in ("values", "out"))
        mean, var = both_in.mean(), both_in.var(unbiased=False)
        expected = (both_in - mean) / (var + 1e-8).sqrt() + (0 if first["shift_mean"] else mean)
        torch.testing.assert_close(both_out, expected, atol=1e-5, rtol=1e-5)
        # Each rank alone has other statistics: whitening per rank would have given other numbers
        assert min((whiten(call["values"], call["mask"], call["shift_mean"]) - call["out"]).abs().max()
                   for call in (first, second)) > 0.1
    assert saved["num_updates"] == 2  # 32 episodes in batches of 16 over both ranks, not of 8 per rank
    with open(tmp_path / "ppo" / "eval_validation.csv") as file:
        queries = [row["query"] for row in csv.DictReader(file)]
    expected = datasets.load_from_disk(tiny_tldr / "sft")["validation"]["query"][:10]
    assert queries == [query.strip() for query in expected]  # rank 0 rows 0, 2, ...; rank 1 rows 1, 3, ...
    events = EventAccumulator(str(tmp_path / "runs" / "ppo_two"))
    events.Reload()
    assert all(abs(e.value - 1) < 1e-4 for e in events.Scalars("policy/ratio_first_epoch"))


ROW_SEEDED_SAMPLING = """
import hashlib, sys
import torch
sys.path.insert(0, sys.argv[1])
import ppo

plain = ppo.sample_rollout
def sample_rollout(model, queries, *rest):  # each row from a generator seeded by its tokens: any rank draws alike
    state = torch.get_rng_state()
    rows = []
    for row in queries.split(1):
        torch.manual_seed(int(hashlib.sha256(row.numpy().tobytes()).hexdigest()[:8], 16))
        rows.append(plain(model, row, *rest))
    torch.set_rng_state(state)
    return tuple(torch.cat(parts) for parts in zip(*rows))

ppo.sample_rollout = sample_rollout
sys.argv = ["ppo.py"] + sys.argv[2:]
ppo.main()
ppo.leave_process_group(True)
"""


def test_two_processes_train_what_one_process_trains(tiny_tldr, tmp_path):
    """DDP on 2 CPU processes makes the update one process makes, given the same samples (each row drawn from a
    generator seeded by its own tokens, as the ranks' generators differ): whitening, the loss and its accumulation,
    the gradient average, the lr schedule and the logged means are global, so the weights agree to float rounding and
    the logs to print precision. One sequence a micro-batch: a token mean over the same rows on every launch."""
    import socket

    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    make_reward_model(tmp_path / "rm")
    (tmp_path / "row_seeded.py").write_text(ROW_SEEDED_SAMPLING)
    flags = ["--base_model", str(WORLD / "pythia-tiny"), "--query_dataset", str(tiny_tldr / "sft"),
             "--sft_model_path", str(WORLD / "pythia-tiny"), "--reward_model_path", str(tmp_path / "rm"),
             "--total_episodes", "32", "--batch_size", "8", "--local_micro_batch_size", "1", "--lr", "1e-3",
             "--response_length", "12", "--num_eval_samples", "0", "--whiten_rewards",
             "--no_non_eos_penalty"]  # the RM's scores, not the penalty every response without an EOS gets
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = run_python([sys.executable, str(tmp_path / "row_seeded.py"), str(REPO), *flags, "--output_dir",
                      str(tmp_path / "one"), "--run_name", "one"], cwd=tmp_path, env=env, timeout=600)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-5000:]
    with socket.socket() as sock:  # a free port: other test sessions may launch at the same time
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]
    with multi_process_slot(2):
        two = run_python([*launch, str(tmp_path / "row_seeded.py"), str(REPO), *flags, "--output_dir",
                          str(tmp_path / "two"), "--run_name", "two"], cwd=tmp_path,
                         env={**env, "ACCELERATE_USE_CPU": "1"}, timeout=600)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-5000:]
    start = load_file(str(WORLD / "pythia-tiny" / "model.safetensors"))
    ours, theirs = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("one", "two"))
    moved = max((ours[k] - start[k]).abs().max().item() for k in ours)
    apart = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    assert moved > 1e-3 and apart < 1e-3 * moved, (moved, apart)  # 4 updates of 4 PPO epochs each moved it
    logs = {}
    for run in ("one", "two"):
        events = EventAccumulator(str(tmp_path / "runs" / run))
        events.Reload()
        logs[run] = {tag: [event.value for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert logs["one"].keys() == logs["two"].keys() and len(set(logs["one"]["objective/scores"])) == 4
    for tag, values in logs["one"].items():
        if not tag.startswith("time/") and not tag.endswith("max_deviation"):  # clocks; the float rounding itself
            assert values == pytest.approx(logs["two"][tag], rel=1e-4, abs=1e-5), tag


def test_swapped_model_folders_are_refused_before_any_model_loads(tiny_tldr, tmp_path, monkeypatch):
    """The SFT model as --reward_model_path (or an RM as --sft_model_path) is refused at the start, with what each
    folder holds: main loaded the policy and its reference (minutes at 6.9B) before the critic's load refused it."""
    make_reward_model(tmp_path / "rm")
    monkeypatch.setattr(ppo, "load_fp32", lambda *args: pytest.fail("a model was loaded"))
    common = dict(base_model=str(WORLD / "pythia-tiny"), query_dataset=str(tiny_tldr / "sft"))
    for sft, rm, message in ((WORLD / "pythia-tiny", WORLD / "pythia-tiny", r"--reward_model_path .* holds a causal LM"),
                             (tmp_path / "rm", tmp_path / "rm", r"--sft_model_path .* holds a reward model")):
        args = ppo.Args(**common, sft_model_path=str(sft), reward_model_path=str(rm), output_dir=str(tmp_path / "out"))
        with pytest.raises(ppo.SetupError, match=message):
            ppo.ppo_inputs(args, one_process())
    assert not (tmp_path / "out").exists()


def test_the_final_save_gathers_the_policy_alone(tmp_path, monkeypatch):
    """save_ppo asks DeepSpeed for the fp32 master weights of the policy's parameters only (every rank, the same
    order) and saves them: the critic, which is not saved, is never gathered (its fp32 copy: ~41 GB on rank 0 at
    6.9B). DeepSpeed's masters are faked (DeepSpeed on a CPU trains in fp32), each one distinct from the module's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from types import SimpleNamespace

    import deepspeed.utils

    policy, critic = tiny_models()
    model = PolicyAndValueWrapper(policy, critic)
    masters = {id(param): param.detach().float() + 1.0 for param in model.parameters()}
    requested, gathered = [], []
    monkeypatch.setattr(deepspeed.utils, "safe_get_full_fp32_param",
                        lambda param: requested.append(param) or masters[id(param)].clone())
    accelerator = SimpleNamespace(
        wait_for_everyone=lambda: None, unwrap_model=lambda module: module, is_main_process=True,
        get_state_dict=lambda module: gathered.append(module) or dict(module.state_dict()),
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    output_dir = tmp_path / "ppo"
    output_dir.mkdir()
    args = SimpleNamespace(output_dir=str(output_dir), num_updates=1, batch_size=1, push_to_hub=False, track=False)
    tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD, save_pretrained=lambda folder: None)
    ppo.save_ppo(accelerator, args, "run", SimpleNamespace(close=lambda: None), model, tokenizer, {})
    assert gathered == [policy]
    assert [id(param) for param in requested] == [id(param) for param in policy.parameters()]
    assert len(load_file(output_dir / "model.safetensors")) == len(policy.state_dict())  # the policy's tensors alone
    saved = dict(AutoModelForCausalLM.from_pretrained(output_dir, dtype="auto").named_parameters())
    for name, param in policy.named_parameters():
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], masters[id(param)]), name


def run_deepspeed_ppo(tiny_tldr, tmp_path, name, *extra, config=REPO / "benchmark/accelerate/deepspeed_zero2.yaml"):
    """ppo.py as the paper launches it (accelerate `config`), on 2 CPU processes of DeepSpeed ZeRO-2 (fp32), one
    update of 16 episodes from the tiny base and tmp_path/rm, into tmp_path/name (its run: tmp_path/runs/name), 5
    evaluation rows; returns its output (stdout + stderr). Inductor's own log on (TORCH_LOGS): a graph it compiles
    or loads from its cache prints "fx graph cache miss" or "hit"."""
    import socket

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_LOGS": "inductor"}
    env.pop("ACCELERATE_USE_CPU", None)  # ENV_NOTES: CPU DeepSpeed must not set it (it would drop DeepSpeed)
    with socket.socket() as sock:  # a free port: other test sessions may launch at the same time
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(config), "--num_processes", "2", "--mixed_precision", "no",
           "--main_process_port", str(port), str(REPO / "ppo.py"), "--base_model", str(WORLD / "pythia-tiny"),
           "--query_dataset", str(tiny_tldr / "sft"), "--sft_model_path", str(WORLD / "pythia-tiny"),
           "--reward_model_path", str(tmp_path / "rm"), "--output_dir", str(tmp_path / name), "--run_name", name,
           "--total_episodes", "16", "--batch_size", "16", "--local_micro_batch_size", "4",
           "--local_rollout_forward_batch_size", "8", "--response_length", "16", "--local_eval_batch_size", "2",
           # 5 eval rows on 2 ranks in batches of 2: rank 0 has 3 rows (2 batches), rank 1 two (1 batch). --offload's
           # ZeRO-3 engines gather parameters in every forward, so unequal batch counts would hang there.
           "--num_eval_samples", "5", "--lr", "1e-3", "--length_groups", "2", *extra]  # 2 forwards, 1 backward
    with multi_process_slot(2):
        result = run_python(cmd, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def deepspeed_plain(tiny_tldr, tmp_path_factory):
    """(folder, output): the plain DeepSpeed launch (run_deepspeed_ppo) that the launches below are compared with,
    run once for them all. The folder holds its RM (rm/), its outputs (plain/) and run (runs/plain); the tests add
    their own launches there under other names."""
    root = tmp_path_factory.mktemp("deepspeed")
    make_reward_model(root / "rm")
    return root, run_deepspeed_ppo(tiny_tldr, root, "plain")


def moved_and_apart(root, name, other):
    """(how far run `name`'s weights moved from the tiny base, how far they are from run `other`'s): the largest
    change of any weight."""
    from safetensors.torch import load_file

    ours, theirs = (load_file(str(root / run / "model.safetensors")) for run in (name, other))
    start = load_file(str(WORLD / "pythia-tiny" / "model.safetensors"))
    return (max((ours[k] - start[k]).abs().max().item() for k in ours),
            max((ours[k] - theirs[k]).abs().max().item() for k in ours))


def test_compiled_training_under_deepspeed_matches_eager(tiny_tldr, deepspeed_plain):
    """--compile_training inside the DeepSpeed ZeRO-2 engine (2 CPU processes; its gradient hooks after the compiled
    backward): the layers really went through inductor (its log names each graph it compiled or took from its
    cache: one written by test_compiled_layers_give_the_eager_outputs_and_gradients[inductor] if it ran before, the
    same layers), and the update ends where the eager one does, up to float rounding (inductor fuses the
    elementwise work)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, eager_output = deepspeed_plain
    compiled_output = run_deepspeed_ppo(tiny_tldr, root, "compiled", "--compile_training")
    assert "fx graph cache" not in eager_output  # the eager run compiles nothing
    assert compiled_output.count("fx graph cache hit") + compiled_output.count("fx graph cache miss") >= 2, (
        compiled_output[-3000:])  # at least a forward and a backward graph
    stats = {}
    for name in ("plain", "compiled"):
        events = EventAccumulator(str(root / "runs" / name))
        events.Reload()
        stats[name] = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"] if not tag.startswith("time/")}
    assert json.loads((root / "compiled" / "args.json").read_text())["compile_training"] is True
    assert sorted(stats["compiled"]) == sorted(stats["plain"]) and "policy/approxkl" in stats["plain"]
    for tag, value in stats["plain"].items():
        assert stats["compiled"][tag] == pytest.approx(value, rel=1e-3, abs=1e-5), tag
    moved, apart = moved_and_apart(root, "plain", "compiled")
    assert moved > 1e-4 and apart < 0.01 * moved, (moved, apart)


def test_deepspeed_keeps_the_scripts_accumulation_over_the_configs(tiny_tldr, deepspeed_plain, tmp_path):
    """An accelerate config that names an accumulation (`accelerate config` writes 1) leaves the update as it is:
    ppo.py accumulates its 2 micro-batches a rank into one optimizer step, and ends where the shipped config does
    (accelerate would take the config's 1 over the script's and step after every micro-batch: 2 steps, not 1)."""
    import yaml

    root, _ = deepspeed_plain
    config = yaml.safe_load((REPO / "benchmark/accelerate/deepspeed_zero2.yaml").read_text())
    config["deepspeed_config"]["gradient_accumulation_steps"] = 1
    (tmp_path / "accumulation_1.yaml").write_text(yaml.safe_dump(config))
    run_deepspeed_ppo(tiny_tldr, root, "accumulation_1", config=tmp_path / "accumulation_1.yaml")
    moved, apart = moved_and_apart(root, "plain", "accumulation_1")
    assert moved > 1e-4 and apart < 0.01 * moved, (moved, apart)


def test_zero_stage_3_is_refused_for_the_trained_models():
    """ZeRO-3 would hang the ranks in sampling (each stops at its own last EOS); stages 0-2 and no DeepSpeed start."""
    from types import SimpleNamespace

    from ppo import zero3_problem

    assert zero3_problem(None) is None
    assert all(zero3_problem(SimpleNamespace(zero_stage=stage)) is None for stage in (0, 1, 2))
    problem = zero3_problem(SimpleNamespace(zero_stage=3))
    assert "ZeRO stage 3" in problem and "would hang" in problem and "deepspeed_zero2.yaml" in problem


def test_compiled_training_is_refused_in_bf16_on_a_cpu(tmp_path):
    """Inductor cannot build the layers' bf16 backward for a CPU (torch 2.13): a bf16 launch with --compile_training
    on a CPU stops before loading anything, naming the flag."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_MIXED_PRECISION": "bf16",
           "ACCELERATE_USE_CPU": "true"}  # a CPU rehearsal on purpose (accelerate launch --cpu --mixed_precision bf16)
    result, = early_exits([(tmp_path, REPO / "ppo.py", ["--compile_training", "--output_dir", tmp_path / "out"])], env=env)
    assert result.returncode != 0
    assert "--compile_training with bf16 on a CPU" in result.stderr and "drop --compile_training" in result.stderr
    assert "Loading weights" not in result.stdout + result.stderr and not (tmp_path / "out").exists()


def test_deepspeed_offload_matches_deepspeed(tiny_tldr, deepspeed_plain):
    """--offload (reference policy and RM as ZeRO-3 engines, parameters on the CPU; the paper's 6.9B setting)
    trains like the plain DeepSpeed ZeRO-2 launch: 2 CPU processes each, same weights, same samples."""
    root, _ = deepspeed_plain
    run_deepspeed_ppo(tiny_tldr, root, "offload", "--offload")
    assert json.loads((root / "offload" / "args.json").read_text())["offload"] is True
    moved, apart = moved_and_apart(root, "plain", "offload")
    # An update happened, and the two launches end within float rounding of each other: the ZeRO-3 engines sum
    # in another order, and Adam's normalised steps carry that to the weights (1.0e-5 apart after a 4.0e-3 move).
    assert moved > 1e-4 and apart < 0.01 * moved, (moved, apart)
    rows = []
    for name in ("plain", "offload"):
        with open(root / name / "eval_validation.csv") as file:
            rows.append(list(csv.DictReader(file)))
    assert len(rows[0]) == len(rows[1]) == 5  # every row once: the repeated one filling rank 1's batch is dropped
    assert [(r["query"], r["response"]) for r in rows[0]] == [(r["query"], r["response"]) for r in rows[1]]
    for key in ("score", "reference_score"):  # the offloaded RM scores them alike (ZeRO-3: float rounding)
        assert max(abs(float(a[key]) - float(b[key])) for a, b in zip(*rows)) < 1e-5


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_offloaded_frozen_models_run_in_the_policys_precision(precision, monkeypatch):
    """--offload's ZeRO-3 engines (reference policy and RM) take the launch's bf16, as frozen_like_trained does for
    the models it keeps: in fp32 beside a bf16 policy, the KL would start away from 0 by rounding alone. The test
    above runs fp32 only (bf16 DeepSpeed is too slow on a CPU), so the config is read here."""
    import types

    import deepspeed

    import ppo

    configs = []
    monkeypatch.setattr(deepspeed, "initialize", lambda model, config: configs.append(config) or (torch.nn.Linear(1, 1),))
    accelerator = types.SimpleNamespace(mixed_precision=precision)
    ppo.offload_frozen_models(accelerator, types.SimpleNamespace(local_micro_batch_size=4), torch.nn.Linear(1, 1),
                              torch.nn.Linear(1, 1))
    assert len(configs) == 2 and all(config["bf16"] == {"enabled": precision == "bf16"} for config in configs)
    assert all(config["zero_optimization"]["stage"] == 3 and config["zero_optimization"]["offload_param"] ==
               {"device": "cpu"} for config in configs)

@pytest.mark.parametrize("length_groups", [1, 2])
def test_rollout_scores_the_truncated_response(tiny_tldr, monkeypatch, length_groups):
    """Details 12 and 23: rollout() scores query ++ the response truncated after its first EOS (pads after it), so
    the reward is read at the EOS, not at the last of the untruncated tokens; the behaviour log-probs and entropy come
    from the sampler's scores, the values from the critic (with --length_groups 2 too: speed only)."""
    from types import SimpleNamespace

    import ppo

    policy, critic = tiny_models()
    queries = padded_queries(tiny_tldr, 3)
    responses = torch.tensor([[5, 6, EOS, 8, 9, 10], [5, 6, 7, 8, 9, 10], [EOS, 6, 7, 8, 9, 10]])
    torch.manual_seed(0)
    sample_scores = torch.randn(3, 6, policy.config.vocab_size)

    drawn = []  # rows handed out so far: rollout() samples in chunks

    def sample(model, query, pad, eos, length, temperature, unsampled):  # a sampler that drew `responses`
        rows = slice(len(drawn), len(drawn) + len(query))
        drawn.extend(range(len(query)))
        return torch.cat((query, responses[rows]), 1), sample_scores[rows]

    args = SimpleNamespace(local_rollout_forward_batch_size=2, response_length=6, length_groups=length_groups)
    grouped, by_query_length = [], ppo.by_query_length
    monkeypatch.setattr(ppo, "by_query_length", lambda *args: grouped.append(args[-1]) or by_query_length(*args))
    with torch.no_grad():
        out, _ = ppo.rollout(args, policy, policy, critic, critic, queries, sample, PAD, EOS, 0.7, torch.tensor([PAD]))
    assert grouped == ([2] * 6 if length_groups == 2 else [])  # the reference, critic and RM forwards of 2 chunks
    monkeypatch.undo()
    with torch.no_grad():
        context = queries.shape[1]
        truncated = torch.cat((queries, truncate_response(responses, EOS, PAD)), 1)
        torch.testing.assert_close(out["scores"], get_score(critic, truncated, PAD, context))
        untruncated = get_score(critic, torch.cat((queries, responses), 1), PAD, context)
        assert (out["scores"][[0, 2]] - untruncated[[0, 2]]).abs().min() > 1e-3  # the junk after the EOS would move it
        torch.testing.assert_close(out["values"], get_values(critic, torch.cat((queries, responses), 1), PAD, context))
        ref_logits = response_logits(policy, torch.cat((queries, responses), 1), PAD, context)  # the untruncated rows'
        ref_logprobs = gather_logprobs(ppo.scaled_logits(ref_logits, 0.7, torch.tensor([PAD])), responses)
        torch.testing.assert_close(out["ref_logprobs"], ref_logprobs, rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(out["logprobs"], gather_logprobs(sample_scores, responses))
    assert torch.equal(out["query_responses"], torch.cat((queries, responses), 1))


def naive_ppo_targets(responses, logprobs, ref_logprobs, values, scores, kl_coef, gamma, lam, whiten_rewards,
                      score_after_eos):
    """Steps 2-5 of an update written out a row and a token at a time, from the paper's definitions: the EOS trick
    (-1 without an EOS), KL rewards with the score on the EOS (or one token later), values zeroed after the scored
    token, rewards whitened without a shift (optional), GAE, advantages whitened over the response's tokens."""
    rows, width = responses.shape
    rewards, masked_values = torch.zeros(rows, width, dtype=torch.float64), torch.zeros(rows, width, dtype=torch.float64)
    token_valid, value_valid = [], []
    for i in range(rows):
        eos = [t for t in range(width) if responses[i, t] == EOS]
        last = eos[0] if eos else width - 1
        score = scores[i].item() if eos else -1.0
        scored = last + 1 if score_after_eos and last + 1 < width else last
        for t in range(width):
            if t <= last:
                rewards[i, t] = -kl_coef * (logprobs[i, t] - ref_logprobs[i, t]).item()
                token_valid.append((i, t))
            if t <= last + int(score_after_eos):
                masked_values[i, t] = values[i, t].item()
                value_valid.append((i, t))
        rewards[i, scored] += score

    def whitened(x, valid, shift_mean):
        picked = torch.tensor([x[i, t].item() for i, t in valid], dtype=torch.float64)
        mean, variance = picked.mean(), ((picked - picked.mean()) ** 2).mean()
        out = torch.zeros_like(x)
        for i, t in valid:
            out[i, t] = (x[i, t] - mean) / torch.sqrt(variance + 1e-8) + (0.0 if shift_mean else mean)
        return out

    if whiten_rewards:
        rewards = whitened(rewards, value_valid, shift_mean=False)
    advantages = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        running = 0.0
        for t in reversed(range(width)):
            next_value = masked_values[i, t + 1] if t + 1 < width else 0.0
            running = rewards[i, t] + gamma * next_value - masked_values[i, t] + gamma * lam * running
            advantages[i, t] = running
    returns = advantages + masked_values
    return whitened(advantages, token_valid, shift_mean=True), returns, masked_values


def naive_logged_objectives(responses, logprobs, ref_logprobs, entropy, scores, kl_coef):
    """The objective/* statistics of one update as ppo.py's docstring defines them, a row and a token at a time: sums
    over each response's tokens up to its EOS (all of them without one), means over the responses."""
    rows, width = responses.shape
    kl, entropies, lengths, final_scores, has_eos = [], [], [], [], []
    for i in range(rows):
        eos = [t for t in range(width) if responses[i, t] == EOS]
        last = eos[0] if eos else width - 1
        kl.append(sum((logprobs[i, t] - ref_logprobs[i, t]).item() for t in range(last + 1)))
        entropies.append(sum(entropy[i, t].item() for t in range(last + 1)))
        lengths.append(last + 1)
        final_scores.append(scores[i].item() if eos else -1.0)  # the EOS trick
        has_eos.append(1.0 if eos else 0.0)
    kl_mean, score_mean = sum(kl) / rows, sum(final_scores) / rows
    return {"objective/kl": kl_mean, "objective/non_score_reward": -kl_coef * kl_mean,
            "objective/entropy": sum(entropies) / rows, "objective/scores": score_mean,
            "objective/rlhf_reward": score_mean - kl_coef * kl_mean, "objective/response_length": sum(lengths) / rows,
            "objective/eos_fraction": sum(has_eos) / rows}


PPO_MAIN_DRIVER = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import ppo

responses = torch.tensor([[5, 6, 0, 8, 9, 10], [5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 9, 10], [0, 6, 7, 8, 9, 10]])
generator = torch.Generator().manual_seed(0)
given = {"logprobs": -torch.rand(4, 6, generator=generator) * 3, "ref_logprobs": -torch.rand(4, 6, generator=generator) * 3,
         "entropy": torch.rand(4, 6, generator=generator), "values": torch.randn(4, 6, generator=generator),
         "scores": torch.randn(4, generator=generator)}
captured = {}

def rollout(args, policy, ref_policy, critic, reward_model, queries, sample, pad, eos, temperature, unsampled):
    captured["rollout_training"] = (policy.training, critic.training)  # the hand-built rollout
    captured["rollout_temperature"] = temperature
    captured.setdefault("queries", []).append(queries.clone())
    return {"query_responses": torch.cat((queries, responses), 1), **{k: v.clone() for k, v in given.items()}}, 0.0

real_summary_sampler = ppo.summary_sampler
def summary_sampler(args, pad, eos, temperature, unsampled):  # the evaluation's sampler
    captured["eval_temperature"] = temperature
    return real_summary_sampler(args, pad, eos, temperature, unsampled)

real_log_update = ppo.log_update
def log_update(writer, progress, episode, logged):  # what the update logs
    captured.setdefault("logged", []).append(dict(logged))
    return real_log_update(writer, progress, episode, logged)

real_ppo_epochs = ppo.ppo_epochs
def ppo_epochs(accelerator, model, optimizer, args, batch, *rest):  # what steps 2-5 hand to the PPO epochs
    captured.update({key: batch[key].clone() for key in ("advantages", "returns", "values")})
    trained = accelerator.unwrap_model(model)
    captured["epochs_training"] = (trained.policy.training, trained.critic.training)
    return real_ppo_epochs(accelerator, model, optimizer, args, batch, *rest)

ppo.rollout, ppo.ppo_epochs, ppo.summary_sampler, ppo.log_update = rollout, ppo_epochs, summary_sampler, log_update
out = sys.argv[2]
sys.argv = ["ppo.py"] + sys.argv[3:]
ppo.main()
torch.save({"given": given, "responses": responses, **captured}, out)
"""


@pytest.mark.parametrize("whiten_rewards, score_after_eos", [(False, False), (True, True)])
def test_an_update_hands_the_ppo_epochs_the_advantages_of_the_papers_definitions(tiny_tldr, tmp_path, whiten_rewards,
                                                                                  score_after_eos):
    """ppo.py's main loop, steps 2-5 (the EOS trick, masks, values zeroed after the scored token, KL rewards,
    optional reward whitening, GAE, advantage whitening), on a hand-built rollout whose responses end at an EOS
    mid-way (junk after it), at the last token, nowhere (score -1) and at once: the advantages, returns and values
    the PPO epochs receive equal naive_ppo_targets'. Also each update's prompts, logged objectives and sampling
    temperatures. A subprocess runs ppo.main() (2 updates) with rollout() replaced."""
    make_reward_model(tmp_path / "rm")
    driver = tmp_path / "driver.py"
    driver.write_text(PPO_MAIN_DRIVER)
    flags = ["--base_model", str(WORLD / "pythia-tiny"), "--query_dataset", str(tiny_tldr / "sft"),
             "--sft_model_path", str(WORLD / "pythia-tiny"), "--reward_model_path", str(tmp_path / "rm"),
             "--output_dir", str(tmp_path / "out"), "--total_episodes", "8", "--batch_size", "4",
             "--local_micro_batch_size", "2", "--local_rollout_forward_batch_size", "4", "--response_length", "6",
             "--num_eval_samples", "0", "--kl_coef", "0.3", "--temperature", "0.9", "--eval_temperature", "0.05"]
    flags += (["--whiten_rewards"] if whiten_rewards else []) + (["--score_after_eos"] if score_after_eos else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_python([sys.executable, str(driver), str(REPO), str(tmp_path / "captured.pt"), *flags], cwd=tmp_path,
                        env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = torch.load(tmp_path / "captured.pt")
    given = out["given"]
    advantages, returns, values = naive_ppo_targets(out["responses"], given["logprobs"], given["ref_logprobs"],
                                                    given["values"], given["scores"], 0.3, 1.0, 0.95, whiten_rewards,
                                                    score_after_eos)
    torch.testing.assert_close(out["values"].double(), values, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out["returns"].double(), returns, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["advantages"].double(), advantages, atol=1e-5, rtol=1e-5)
    # Policy and critic sample and score in eval mode and train in train mode: a layer recomputes its activations
    # under --gradient_checkpointing only in train mode (from_pretrained leaves a model in eval mode)
    assert out["rollout_training"] == (False, False) and out["epochs_training"] == (True, True)
    # Each sampler at its own temperature (+ 1e-7, the reference code's guard of T = 0): rollouts at --temperature,
    # the evaluation at --eval_temperature.
    assert out["rollout_temperature"] == 0.9 + 1e-7 and out["eval_temperature"] == 0.05 + 1e-7
    # Each update's logged objectives, by their definitions (the module docstring's "Logged" table).
    expected = naive_logged_objectives(out["responses"], given["logprobs"], given["ref_logprobs"], given["entropy"],
                                       given["scores"], 0.3)
    assert len(out["logged"]) == 2
    for logged in out["logged"]:
        assert {key: logged[key] for key in expected} == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # Update u samples from the prompts u * batch ... (u + 1) * batch - 1 of the shuffled order (Detail 21).
    import datasets

    train = datasets.load_from_disk(str(tiny_tldr / "sft"))["train"]
    order = ppo.episode_order(len(train), 8, 1)  # 8 episodes, --seed's default 1
    for update, queries in enumerate(out["queries"]):
        expected_queries = torch.tensor(train[order[4 * update:4 * update + 4].tolist()]["query_token"])
        assert torch.equal(queries, expected_queries), update

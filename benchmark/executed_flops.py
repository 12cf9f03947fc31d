"""The FLOPs each side of benchmark/ppo_vs_trl.py executes in one PPO update, counted rather than computed.

ppo_vs_trl.phase_flops is the plain algorithm's nominal count: the same number for every side, pads and every
response position included. Neither side executes exactly that: ppo.py skips the pad columns every row of a
micro-batch shares, runs its last layer at the response positions only and trains each micro-batch only up to
its last EOS; TRL computes logits at every position, the query's included. So a phase's nominal FLOP/s is not
its hardware efficiency. This module counts what each side's code executes, with
torch.utils.flop_counter.FlopCounterMode, on one batch of the benchmark's own prompts (the second batch of
ppo.py's prompt order: the first timed update's) with responses sampled from the SFT policy:

- ppo.py: its sampler (StaticSampler, its compiled step run eagerly: the same matmuls; or sample_rollout) and
  the log-probs and entropy of the rollout's generation phase; rollout()'s scoring calls (response_logits,
  get_values, get_score); ppo_epochs()'s forward and backward per micro-batch (trained_width, length groups),
  every epoch, each with its own shuffle.
- TRL 1.12's PPOTrainer, as its code computes it, with the same models: HF generate at TRL's settings (it stops
  once every row has an EOS); full-row forwards of the reference policy (logits at every position), the value
  model and the reward model; the training forward of policy and critic over full rows, then its backward.
  (Counted here in the project's venv with TRL's steps written out; ppo_vs_trl_trl.py times TRL itself.)

The counts are matmul-like ops only (what FlopCounterMode counts); on a CPU, torch's SDPA computes the whole
query x key rectangle with its mask: 4 b h Lq Lk d FLOPs forward, twice that backward. One batch stands in for
every update: the responses of a run's later updates differ in length, so a count is approximate (a few percent).

Standalone: python benchmark/executed_flops.py --config tiny (the models and prompts of ppo_vs_trl.py's --config).
"""

import argparse
import os
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)


def _attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """CPU SDPA forward: QK^T and AV over the whole rectangle (b, h, Lq, d) x (b, h, Lk, d)."""
    batch, heads, query_length, head_dim = query
    return 4 * batch * heads * query_length * key[-2] * head_dim


def _attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """CPU SDPA backward: twice its forward."""
    batch, heads, query_length, head_dim = query
    return 8 * batch * heads * query_length * key[-2] * head_dim


def counter() -> FlopCounterMode:
    """FlopCounterMode that also counts the CPU's SDPA kernels (torch's table lists only the GPU ones)."""
    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops})


def count(function) -> int:
    """FLOPs executed by function()."""
    with counter() as mode:
        function()
    return mode.get_total_flops()


def trl_full_row_forward(model, query_responses: torch.Tensor, pad_token_id: int):
    """TRL's forward(): the model over whole rows, pads masked, positions counted from each row's first token."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = query_responses.masked_fill(~attention_mask, 0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def trl_scalar(scalar_model, query_responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """TRL's get_reward(): the backbone over whole rows and the scalar head at every position, (b, T)."""
    hidden = trl_full_row_forward(scalar_model.backbone, query_responses, pad_token_id).last_hidden_state
    return scalar_model.head(hidden).squeeze(-1)


def executed_flops(base_model: str, sft_model_path: str, reward_model_path: str, query_dataset: str, batch_size: int,
                   micro_batch_size: int, rollout_batch_size: int, response_length: int, temperature: float,
                   epochs: int, length_groups: int, seed: int) -> dict:
    """{side: {generation, scoring, training: FLOPs of one update}} for ours (fast sampling), ours_plain and trl."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import ppo
    from sft import generate

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    policy = AutoModelForCausalLM.from_pretrained(sft_model_path, dtype=torch.float32)
    critic = ppo.ScalarModel.from_pretrained(reward_model_path)  # the reward model has the same shape: reused
    for model in (policy, critic):
        ppo.disable_dropout(model)
        model.eval()
    train = datasets.load_from_disk(query_dataset)["train"]
    order = ppo.episode_order(len(train), 2 * batch_size, seed)[batch_size:]  # the first timed update's prompts
    queries = torch.tensor(train[order.tolist()]["query_token"])
    context_length = queries.shape[1]
    unsampled = torch.tensor(ppo.unsampled_token_ids(tokenizer, policy.get_output_embeddings().weight.size(0)))
    temperature = temperature + 1e-7  # ppo.py's and TRL's
    chunks = [queries[start:start + rollout_batch_size] for start in range(0, batch_size, rollout_batch_size)]
    flops = {side: {} for side in ("ours", "ours_plain", "trl")}

    def ours_generation(sampler):
        def run():
            for query in chunks:
                query_response, scores = sampler(policy, query, pad, eos, response_length, temperature, unsampled)
                ppo.gather_logprobs(scores, query_response[:, context_length:])
                ppo.entropy_from_logits(scores)
        return run

    with torch.no_grad():
        torch.manual_seed(seed)
        flops["ours"]["generation"] = count(ours_generation(ppo.StaticSampler(rollout_batch_size, backend=None)))
        torch.manual_seed(seed)
        flops["ours_plain"]["generation"] = count(ours_generation(ppo.sample_rollout))
        # the samples the scoring and training counts see (the plain loop's: the same tokens as the fast path's)
        torch.manual_seed(seed)
        query_responses = torch.cat([ppo.sample_rollout(policy, query, pad, eos, response_length, temperature,
                                                        unsampled)[0] for query in chunks])
        postprocessed = ppo.truncate_response(query_responses[:, context_length:], eos, pad)
        scored_rows = torch.cat((queries, postprocessed), 1)

        def ours_scoring():
            for start in range(0, batch_size, rollout_batch_size):
                rows = slice(start, start + rollout_batch_size)
                logits = ppo.response_logits(policy, query_responses[rows], pad, context_length, length_groups)
                ppo.gather_logprobs(ppo.scaled_logits(logits, temperature, unsampled),
                                    query_responses[rows, context_length:])
                ppo.get_values(critic, query_responses[rows], pad, context_length, length_groups)
                ppo.get_score(critic, scored_rows[rows], pad, context_length, length_groups)

        def trl_scoring():
            for start in range(0, batch_size, rollout_batch_size):
                rows = slice(start, start + rollout_batch_size)
                trl_full_row_forward(policy, query_responses[rows], pad)  # the reference policy's logits
                trl_scalar(critic, query_responses[rows], pad)  # values
                trl_scalar(critic, scored_rows[rows], pad)  # scores

        flops["ours"]["scoring"] = flops["ours_plain"]["scoring"] = count(ours_scoring)
        flops["trl"]["scoring"] = count(trl_scoring)
        generation_config = GenerationConfig(max_new_tokens=response_length, temperature=temperature, top_k=0,
                                             top_p=1.0, do_sample=True, return_dict_in_generate=True,
                                             output_scores=True, eos_token_id=eos, pad_token_id=pad)
        torch.manual_seed(seed)
        flops["trl"]["generation"] = count(lambda: [generate(policy, query, pad, generation_config) for query in chunks])

    eos_index = ppo.response_masks(postprocessed, pad, False)[0]
    wrapper = ppo.PolicyAndValueWrapper(policy, critic)
    generator = torch.Generator().manual_seed(seed)
    permutations = [torch.randperm(batch_size, generator=generator) for _ in range(epochs)]

    def ours_training():
        for permutation in permutations:
            for start in range(0, batch_size, micro_batch_size):
                rows = permutation[start:start + micro_batch_size]
                width = ppo.trained_width(eos_index[rows], response_length, False)
                logits, values = ppo.response_logits_and_values_by_length(
                    wrapper, query_responses[rows], pad, context_length, width, length_groups)
                logprobs = ppo.gather_logprobs(ppo.scaled_logits(logits, temperature, unsampled),
                                               query_responses[rows, context_length:context_length + width])
                (logprobs.sum() + values.sum()).backward()

    def trl_training():
        for permutation in permutations:
            for start in range(0, batch_size, micro_batch_size):
                rows = permutation[start:start + micro_batch_size]
                logits = trl_full_row_forward(policy, query_responses[rows], pad).logits[:, context_length - 1:-1]
                values = trl_scalar(critic, query_responses[rows], pad)[:, context_length - 1:-1]
                logprobs = ppo.gather_logprobs(logits / temperature, query_responses[rows, context_length:])
                (logprobs.sum() + values.sum()).backward()

    flops["ours"]["training"] = flops["ours_plain"]["training"] = count(ours_training)
    wrapper.zero_grad(set_to_none=True)
    flops["trl"]["training"] = count(trl_training)
    return flops


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=("tiny", "5m"), default="tiny")
    parser.add_argument("--length_groups", type=int, default=1)
    args = parser.parse_args()
    import ppo_vs_trl

    run = ppo_vs_trl.parse_args([f"--config={args.config}", f"--length_groups={args.length_groups}"])[0]
    _, nominal = ppo_vs_trl.configure(run)
    counted = executed_flops(run.base_model, run.sft_model_path, run.reward_model_path, run.query_dataset,
                             run.batch_size, run.local_micro_batch_size, run.local_rollout_forward_batch_size,
                             run.response_length, run.temperature, run.num_ppo_epochs, run.length_groups, run.seed)
    print("| side | " + " | ".join(f"{phase} GFLOP (of nominal)" for phase in nominal) + " |")
    for side, phases in counted.items():
        print(f"| {side} | " + " | ".join(f"{phases[p] / 1e9:.1f} ({phases[p] / nominal[p]:.0%})" for p in nominal) + " |")


if __name__ == "__main__":
    main()

"""Side-by-side DPO training speed: one row per pair (dpo.py's packed_pair_logprobs) vs two rows per pair.

    python benchmark/dpo_pair_rows.py                      # tiny world, after benchmark/tiny.sh
    python benchmark/dpo_pair_rows.py --rounds 4 --updates 10 --out benchmark/results/dpo_pair_rows.md
    python benchmark/dpo_pair_rows.py --synthetic --batch_size 4 --updates 3   # TL;DR's lengths, a random 5M model

Both layouts train the same policy (the SFT model, dropout off) against the same frozen reference on the same
batches of pairs: "two rows" is query+chosen and query+rejected right-padded (sequence_logprobs, dpo.py's plain
form), "one row" is query ++ chosen ++ rejected with the rejected summary masked from the chosen one. An update =
the reference's forward, the policy's forward, the DPO loss (beta 0.05), backward, AdamW step: what dpo_update
does per micro-batch. The layouts alternate, `--rounds` times each, `--updates` timed updates per round after one
untimed warm-up update. Before timing, both layouts' log-probs and gradients on the first batch are compared.

--synthetic: TL;DR's shape at the paper's scale instead of the tiny world's: queries of 400-512 tokens and
summaries of 20-53 (EOS included) of random ids, on a random-init GPT-NeoX of hidden size 256 and 4 layers (issue
17's 5M configuration). With Pythia's vocabulary (50,304 rows) its LM head costs 4x its layers per token; in
Pythia 1B it costs 0.13x (50,304 x 2,048 against 16 layers x 12 x 2,048^2): --vocab_size 1536 keeps that ratio.
"""

import argparse
import os
import statistics
import sys
from unittest import mock

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]  # the stage scripts, and reward_pair_rows.py
import dpo  # noqa: E402  (the stage script's helpers, imported from the repository root)
from reward_pair_rows import time_layouts  # noqa: E402  (the same alternating timer as the RM's layouts)

LAYOUTS = ("two rows", "one row")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft_model_path", default=os.path.join(ROOT, "models/tiny/sft_1"))
    parser.add_argument("--label_dataset", default=os.path.join(ROOT, "data/tiny_tldr/preference"))
    parser.add_argument("--synthetic", action="store_true", help="TL;DR's lengths on a random-init 5M GPT-NeoX")
    parser.add_argument("--vocab_size", type=int, default=50304,
                        help="--synthetic's vocabulary: Pythia's 50,304, or 1,536 for Pythia 1B's LM-head-to-layers ratio")
    parser.add_argument("--batch_size", type=int, default=32, help="pairs per update (tiny.sh's DPO micro-batch)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per layout, alternating")
    parser.add_argument("--updates", type=int, default=10, help="timed updates per round")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    return parser.parse_args()


def synthetic_pairs(count: int, pad_id: int, eos_id: int, vocab_size: int, generator: torch.Generator) -> dict:
    """`count` pairs of random ids in dpo.PAIR_COLUMNS' layout, TL;DR's lengths: query 400-512, summaries 20-53."""
    rows = {name: [] for name in dpo.PAIR_COLUMNS}
    width = 512 + 53
    for _ in range(count):
        query = torch.randint(2, vocab_size, (int(torch.randint(400, 513, (1,), generator=generator)),), generator=generator)
        for side in ("chosen", "rejected"):
            length = int(torch.randint(19, 53, (1,), generator=generator))
            summary = torch.cat((torch.randint(2, vocab_size, (length,), generator=generator), torch.tensor([eos_id])))
            padding = torch.full((width - len(query) - len(summary),), pad_id)
            rows[f"query_{side}_token"].append(torch.cat((query, summary, padding)))
            rows[f"query_{side}_token_response_label"].append(
                torch.cat((torch.full((len(query),), pad_id), summary, padding)))
    return {name: torch.stack(values) for name, values in rows.items()}


def layout_logprobs(model, batch: dict, layout: str, pad_id: int) -> tuple:
    """((B,) chosen, (B,) rejected) summed log-probs: dpo.pair_logprobs, which packs, or its two rows a pair."""
    if layout == "two rows":
        with mock.patch.object(dpo, "shared_queries", lambda *_: False):
            return dpo.pair_logprobs(model, batch, pad_id)
    assert dpo.shared_queries(model, batch, pad_id), "these pairs cannot be packed: the timing would be of two rows"
    return dpo.pair_logprobs(model, batch, pad_id)


def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.synthetic:
        pad_id, eos_id = 1, 0
        config = GPTNeoXConfig(vocab_size=args.vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                               intermediate_size=1024, rotary_pct=0.25, max_position_embeddings=2048,
                               hidden_dropout=0.0, attention_dropout=0.0, attn_implementation="sdpa")

        def fresh_model():
            torch.manual_seed(0)
            return GPTNeoXForCausalLM(config).to(device)
        generator = torch.Generator().manual_seed(0)
        batches = [synthetic_pairs(args.batch_size, pad_id, eos_id, args.vocab_size, generator) for _ in range(args.updates + 1)]
        source = f"random-init GPT-NeoX h256 L4 (3.2M parameters in its layers, vocabulary {args.vocab_size:,}), " \
                 "synthetic pairs: queries 400-512 tokens, summaries 20-53"
    else:
        pad_id = AutoTokenizer.from_pretrained(args.sft_model_path).pad_token_id

        def fresh_model():
            model = AutoModelForCausalLM.from_pretrained(args.sft_model_path).to(device)
            dpo.disable_dropout(model)
            return model
        pairs = datasets.load_from_disk(args.label_dataset)["train"].with_format("torch", columns=list(dpo.PAIR_COLUMNS))
        batches = [pairs[list(range(start, start + args.batch_size))]
                   for start in range(0, (args.updates + 1) * args.batch_size, args.batch_size)]
        shown = lambda path: os.path.relpath(path, ROOT) if path.startswith(ROOT) else path  # noqa: E731
        source = f"{shown(args.sft_model_path)} and {shown(args.label_dataset)}"
    batches = [{name: value.to(device) for name, value in batch.items()} for batch in batches]
    reference = fresh_model().eval().requires_grad_(False)

    def loss(model, batch: dict, layout: str) -> torch.Tensor:  # dpo_update's per micro-batch
        with torch.no_grad():
            reference_logps = layout_logprobs(reference, batch, layout, pad_id)
        return dpo.dpo_loss(*layout_logprobs(model, batch, layout, pad_id), *reference_logps, beta=0.05)[0].mean()

    # A fast wrong layout is worth nothing: both layouts' log-probs and gradients on the first batch, side by side.
    model, compared = fresh_model().train(), {}
    with torch.no_grad():  # the policy moved off the reference, so that the loss has a gradient
        for parameter in model.parameters():
            parameter.add_(1e-3 * torch.randn_like(parameter))
    for layout in LAYOUTS:
        logps = torch.cat(layout_logprobs(model, batches[0], layout, pad_id))
        grads = torch.autograd.grad(loss(model, batches[0], layout), list(model.parameters()))
        compared[layout] = (logps.detach(), torch.cat([g.flatten() for g in grads]))
    logp_diff, grad_diff = (float((a - b).abs().max()) for a, b in zip(compared["one row"], compared["two rows"]))
    print(f"first batch: max |log-prob difference| {logp_diff:.2e}, max |gradient difference| {grad_diff:.2e}")
    del model

    seconds = time_layouts(list(LAYOUTS), args.rounds, batches, lambda: fresh_model().train(), loss, 1e-4, device)
    speed = {layout: args.updates * args.batch_size / statistics.median(values) for layout, values in seconds.items()}
    command = "python benchmark/dpo_pair_rows.py" + (f" --synthetic --vocab_size {args.vocab_size}" if args.synthetic else "") + \
        f" --batch_size {args.batch_size} --rounds {args.rounds} --updates {args.updates}"
    table = "\n".join([
        f"# DPO training: one row per pair vs two rows ({device}, {torch.get_num_threads()} threads)", "",
        f"`{command}`: {source}; batch {args.batch_size}, median of {args.rounds} alternating rounds of "
        f"{args.updates} updates each (reference forward, policy forward and backward, AdamW step).", "",
        "| layout | pairs / s | vs two rows | first batch vs two rows: max abs log-prob / gradient difference |",
        "|---|---|---|---|",
        f"| two rows | {speed['two rows']:.2f} | 1.00x |  |",
        f"| one row | {speed['one row']:.2f} | {speed['one row'] / speed['two rows']:.2f}x | "
        f"{logp_diff:.1e} / {grad_diff:.1e} |", ""])
    print(table)
    if args.out:
        with open(args.out, "w") as file:
            file.write(table)


if __name__ == "__main__":
    main()

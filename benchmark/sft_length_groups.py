"""Side-by-side SFT training speed: one forward over the dataset's full width vs sft.py's nll_by_length (each
micro-batch cut to its longest row, or sorted by length into --length_groups forwards).

    python benchmark/sft_length_groups.py                      # tiny world, after benchmark/tiny.sh
    python benchmark/sft_length_groups.py --rounds 5 --updates 20 --out benchmark/results/sft_length_groups.md

Every layout trains the same model (the base model, dropout off as sft.py runs it) from the same weights on
the same micro-batches of the SFT train split: "full width" is next_token_nll(forward(model, rows)) on rows
as the dataset stores them (right-padded to its longest row), "G length groups" is nll_by_length(model, rows,
pad, G) (G = 1: the rows cut to the micro-batch's longest; G > 1: sorted by length into G forwards).
An update = forward, token-mean loss, backward, AdamW step. The layouts alternate, `--rounds` times each,
`--updates` timed updates per round after one untimed warm-up update. Before timing, every layout's loss
and gradients on the first micro-batch are compared with the full-width ones.
"""

import argparse
import os
import statistics
import sys

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]  # the stage scripts, and reward_pair_rows.py
import sft  # noqa: E402  (the stage script's helpers, imported from the repository root)
from reward_pair_rows import time_layouts  # noqa: E402  (the same alternating timer as the RM's layouts)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base_model", default=os.path.join(ROOT, "assets/tiny_world/pythia-tiny"))
    parser.add_argument("--query_dataset", default=os.path.join(ROOT, "data/tiny_tldr/sft"))
    parser.add_argument("--batch_size", type=int, default=16, help="rows per update, one micro-batch (tiny.sh's SFT)")
    parser.add_argument("--length_groups", type=int, nargs="*", default=[1, 2, 4, 8], help="sft.py --length_groups to time")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per layout, alternating")
    parser.add_argument("--updates", type=int, default=20, help="timed updates per round")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    return parser.parse_args()


def fresh_model(base_model: str, device: str):
    """sft.py's starting point: the base model in fp32, dropout off, in train mode."""
    model = sft.load_fp32(AutoModelForCausalLM, base_model, "--base_model").to(device)
    sft.disable_dropout(model)
    return model.train()


def batch_nll(model, rows: torch.Tensor, layout: str, pad_id: int) -> tuple:
    """(nll sum, target count) of one micro-batch in the given layout ("full width", "1 length group", "G length groups")."""
    if layout == "full width":
        return sft.next_token_nll(sft.forward(model, rows, pad_id).logits, rows, pad_id)
    return sft.nll_by_length(model, rows, pad_id, int(layout.split()[0]))


def compare_first_batch(args, rows: torch.Tensor, layouts: list, pad_id: int, device: str) -> dict:
    """{layout: (|loss difference|, max |gradient difference|)} against full width on one micro-batch."""
    model = fresh_model(args.base_model, device)
    compared = {}
    for layout in layouts:
        nll, count = batch_nll(model, rows, layout, pad_id)
        grads = torch.autograd.grad(nll / count, list(model.parameters()))
        compared[layout] = ((nll / count).detach(), torch.cat([g.flatten() for g in grads]))
    return {layout: tuple((value - base).abs().max().item() for value, base in zip(compared[layout], compared["full width"]))
            for layout in layouts if layout != "full width"}


def render_table(args, device: str, seconds: dict, differences: dict, batches: list, pad_id: int) -> str:
    speed = {layout: args.updates * args.batch_size / statistics.median(values) for layout, values in seconds.items()}
    tokens = sum(int((rows != pad_id).sum()) for rows in batches[1:])
    longest = sum(int((rows != pad_id).sum(1).max()) * len(rows) for rows in batches[1:])
    groups = " ".join(str(groups) for groups in args.length_groups)
    return "\n".join([
        f"# SFT training: full-width rows vs rows cut and grouped by length ({device}, {torch.get_num_threads()} threads)",
        "", f"`python benchmark/sft_length_groups.py --rounds {args.rounds} --updates {args.updates} --length_groups "
        f"{groups}`: {os.path.relpath(args.base_model, ROOT)}, micro-batch {args.batch_size} (one per update), rows "
        f"{batches[0].shape[1]} columns wide as stored; the timed micro-batches hold {tokens / (len(batches) - 1):.0f} "
        f"tokens each, {longest / (len(batches) - 1):.0f} cells when cut to their longest row; median of {args.rounds} "
        f"alternating rounds of {args.updates} updates each.", "",
        "| layout | rows / s | vs full width | first micro-batch vs full width: abs loss / max abs gradient difference |",
        "|---|---|---|---|",
        *[f"| {layout} | {value:.1f} | {value / speed['full width']:.2f}x | "
          + (" / ".join(f"{x:.1e}" for x in differences[layout]) if layout in differences else "") + " |"
          for layout, value in speed.items()], ""])


def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    sft.add_pad_token(tokenizer)  # as preprocess_tldr.py did (Detail 3); the tiny world's tokenizer has its [PAD]
    pad_id = tokenizer.pad_token_id
    rows = datasets.load_from_disk(args.query_dataset)["train"].with_format("torch", columns=["query_reference_response_token"])
    batches = [rows[list(range(start, start + args.batch_size))]["query_reference_response_token"].to(device)
               for start in range(0, (args.updates + 1) * args.batch_size, args.batch_size)]
    layouts = ["full width", *[f"{groups} length group{'s' if groups > 1 else ''}" for groups in args.length_groups]]
    differences = compare_first_batch(args, batches[0], layouts, pad_id, device)
    for layout, (loss_diff, grad_diff) in differences.items():
        print(f"first micro-batch, {layout}: |loss difference| {loss_diff:.2e}, max |gradient difference| {grad_diff:.2e}")
    def loss(model, rows: torch.Tensor, layout: str) -> torch.Tensor:  # the mean over the micro-batch's tokens
        nll, count = batch_nll(model, rows, layout, pad_id)
        return nll / count

    seconds = time_layouts(layouts, args.rounds, batches, lambda: fresh_model(args.base_model, device), loss, 2e-3, device)
    table = render_table(args, device, seconds, differences, batches, pad_id)
    print(table)
    if args.out:
        with open(args.out, "w") as file:
            file.write(table)


if __name__ == "__main__":
    main()

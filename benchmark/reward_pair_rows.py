"""Side-by-side RM training speed: one row per pair (reward.py's pair_rewards), the same sorted into length groups
(--length_groups), and two rows per pair.

    python benchmark/reward_pair_rows.py                      # tiny world, after benchmark/tiny.sh
    python benchmark/reward_pair_rows.py --rounds 5 --updates 20 --out benchmark/results/reward_pair_rows.md

Every layout trains the same fresh RM (the SFT model + reward.py's head) on the same batches of the
preference dataset: "two rows" is query+chosen and query+rejected right-padded (get_reward), "one row"
is query ++ chosen ++ rejected with the rejected summary masked from the chosen one (pair_rewards), and
"one row, G length groups" the same in G forwards of pairs sorted by length (pair_rewards_by_length). Each row
layout runs its model's last layer at the two summaries' EOS columns only (reward.hidden_states_at); the same
layout "..., last layer at every column" runs the plain forward that it equals instead.
An update = forward, Bradley-Terry loss, backward, AdamW step. The layouts alternate, `--rounds`
times each, `--updates` timed updates per round after one untimed warm-up update. Before timing,
every layout's rewards and gradients on the first batch are compared with the two-row layout's.
With --query_dataset it also times the RM's scoring (evaluation and normalisation: reward.score_dataset) with the
last layer at each row's EOS only (reward.rewards_at_eos) against the plain get_reward it equals.
"""

import argparse
import os
import statistics
import sys
import time
from unittest import mock

import datasets
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
import reward  # noqa: E402  (the stage script's helpers, imported from the repository root)

EVERY_COLUMN = ", last layer at every column"  # a row layout with reward.hidden_states_at's plain form


def fresh_rm(sft_model_path: str, device: str) -> reward.ScalarModel:
    """reward.py's starting point (the SFT backbone, dropout off, the Detail 11 head), seeded alike each time."""
    torch.manual_seed(0)
    return reward.reward_model_from_sft(sft_model_path).to(device).train()


def plain_hidden_states_at(backbone, input_ids, attention_mask, position_ids, positions):
    """What reward.hidden_states_at equals: the backbone's full forward (the last layer at every column), read at
    `positions`."""
    rows = torch.arange(input_ids.size(0), device=input_ids.device)[:, None]
    return backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
                    ).last_hidden_state[rows, positions]


def batch_rewards(model, batch: dict, layout: str, pad_id: int, device: str) -> tuple:
    """((B,) chosen, (B,) rejected) rewards of a batch of pairs in the given layout: "two rows", "one row" or
    "one row, G length groups", the row layouts also as "..., last layer at every column"."""
    if layout.endswith(EVERY_COLUMN):
        with mock.patch.object(reward, "hidden_states_at", plain_hidden_states_at):
            return batch_rewards(model, batch, layout[:-len(EVERY_COLUMN)], pad_id, device)
    size = len(batch["query_token"])
    if layout == "two rows":
        rows = reward.trim_right_padding(torch.cat((batch["query_chosen_token"], batch["query_rejected_token"])), pad_id)
        return reward.get_reward(model, rows.to(device), pad_id, context_length=0)[1].split(size)
    queries, chosen, rejected = (batch[column].to(device) for column in reward.TRAIN_PAIR_COLUMNS)  # as rm_update
    if layout == "one row":
        return reward.pair_rewards(model, queries, chosen, rejected, pad_id)
    groups = int(layout.split(", ")[1].split()[0])  # "one row, G length groups"
    return reward.pair_rewards_by_length(model, queries, chosen, rejected, pad_id, groups)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft_model_path", default=os.path.join(ROOT, "models/tiny/sft_1"))
    parser.add_argument("--label_dataset", default=os.path.join(ROOT, "data/tiny_tldr/preference"))
    parser.add_argument("--batch_size", type=int, default=32, help="pairs per update (reward.py's tiny setting)")
    parser.add_argument("--length_groups", type=int, nargs="*", default=[2, 4],
                        help="also time one row per pair in this many forwards by length (reward.py --length_groups)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per layout, alternating")
    parser.add_argument("--updates", type=int, default=20, help="timed updates per round")
    parser.add_argument("--query_dataset", default=None,
                        help="also time the RM's scoring (reward.score_dataset) on this SFT dataset's train references")
    parser.add_argument("--scoring_rows", type=int, default=1024, help="references scored per round (--query_dataset)")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    return parser.parse_args()


def compare_first_batch(args, batch: dict, layouts: list, pad_id: int, device: str) -> dict:
    """{layout: (max |reward difference|, max |gradient difference|)} against two rows, on one batch: a fast wrong
    layout is worth nothing."""
    model = fresh_rm(args.sft_model_path, device)
    compared = {}
    for layout in layouts:
        chosen, rejected = batch_rewards(model, batch, layout, pad_id, device)
        loss = -F.logsigmoid(chosen - rejected).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        compared[layout] = (torch.cat((chosen, rejected)).detach(), torch.cat([g.flatten() for g in grads]))
    return {layout: tuple((value - base).abs().max().item() for value, base in zip(compared[layout], compared["two rows"]))
            for layout in layouts if layout != "two rows"}


def time_layouts(layouts: list, rounds: int, batches: list, fresh_model, loss, lr: float, device: str) -> dict:
    """{layout: [seconds of the timed updates, one per round]}, the layouts alternating (also sft_length_groups.py's).

    Per round and layout: `fresh_model()`, AdamW at `lr`, one untimed warm-up update on batches[0], then one timed
    update (forward, `loss(model, batch, layout).backward()`, AdamW step) per later batch."""
    seconds = {layout: [] for layout in layouts}
    rows = sum(len(next(iter(batch.values())) if isinstance(batch, dict) else batch) for batch in batches[1:])  # timed
    for round_index in range(rounds):
        for layout in layouts:
            model = fresh_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-5, weight_decay=0.01)
            for index, batch in enumerate(batches):
                if index == 1:  # update 0 is the warm-up
                    if device == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                loss(model, batch, layout).backward()
                optimizer.step()
                optimizer.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds[layout].append(time.perf_counter() - start)
            print(f"round {round_index + 1} {layout}: {rows / seconds[layout][-1]:.1f} rows/s "
                  f"(load {os.getloadavg()[0]:.2f})")
    return seconds


def render_table(args, device: str, seconds: dict, differences: dict) -> str:
    speed = {layout: args.updates * args.batch_size / statistics.median(values) for layout, values in seconds.items()}
    groups = " ".join(str(groups) for groups in args.length_groups)
    return "\n".join([
        f"# RM training: one row per pair vs two rows ({device}, {torch.get_num_threads()} threads)", "",
        f"`python benchmark/reward_pair_rows.py --rounds {args.rounds} --updates {args.updates} --length_groups {groups}"
        + (f" --query_dataset {args.query_dataset} --scoring_rows {args.scoring_rows}" if args.query_dataset else "") + "`: "
        f"{os.path.relpath(args.sft_model_path, ROOT)}, batch {args.batch_size}, median of {args.rounds} alternating rounds of "
        f"{args.updates} updates each.", "",
        "| layout | pairs / s | vs two rows | vs one row | vs its last layer at every column | first batch vs two rows: "
        "max abs reward / gradient difference |",
        "|---|---|---|---|---|---|",
        *[f"| {layout} | {value:.1f} | {value / speed['two rows']:.2f}x | {value / speed['one row']:.2f}x | "
          + (f"{value / speed[layout + EVERY_COLUMN]:.2f}x" if layout + EVERY_COLUMN in speed else "") + " | "
          + (" / ".join(f"{x:.1e}" for x in differences[layout]) if layout in differences else "") + " |"
          for layout, value in speed.items()], ""])


def time_scoring(args, pad_id: int) -> str:
    """The normalisation's scoring (reward.score_dataset, both layouts of the SFT references) with
    reward.rewards_at_eos against the plain get_reward(...)[1] it equals, alternating --rounds times: a table."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = fresh_rm(args.sft_model_path, accelerator.device)
    references = reward.first_rows(datasets.load_from_disk(args.query_dataset)["train"], args.scoring_rows)
    references = references.with_format("torch", columns=list(reward.REFERENCE_COLUMNS))
    layouts = {"right": ("query_reference_response_token",), "left": ("query_token", "reference_response_token")}
    plain = lambda model, rows, pad, context_length: reward.get_reward(model, rows, pad, context_length)[1]  # noqa: E731
    scorers = {"plain (get_reward)": plain, "last layer at the EOS (rewards_at_eos)": reward.rewards_at_eos}
    seconds, scores = {name: [] for name in scorers}, {}
    with torch.no_grad():  # as the stage scores
        for _ in range(args.rounds):
            for name in seconds:
                start = time.perf_counter()
                with mock.patch.object(reward, "rewards_at_eos", scorers[name]):  # what score_dataset calls
                    scores[name] = reward.score_dataset(accelerator, model, references, layouts, pad_id, 64)
                seconds[name].append(time.perf_counter() - start)
                print(f"scoring, {name}: {seconds[name][-1]:.2f} s")
    difference = max(float(abs(a - b).max()) for a, b in zip(*(scores[name].values() for name in seconds)))
    base = statistics.median(seconds["plain (get_reward)"])
    return "\n".join([
        f"## RM scoring: {len(references)} SFT references in both of the normalisation's layouts (batches of 64, no "
        f"gradients), median of {args.rounds} alternating rounds", "",
        "| scoring | seconds (each round) | vs plain | max abs reward difference |", "|---|---|---|---|",
        *[f"| {name} | {statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)}) | "
          f"{base / statistics.median(values):.2f}x | " + ("" if name.startswith("plain") else f"{difference:.1e}") + " |"
          for name, values in seconds.items()], ""])


def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pad_id = AutoTokenizer.from_pretrained(args.sft_model_path).pad_token_id
    pairs = datasets.load_from_disk(args.label_dataset)["train"].with_format(
        "torch", columns=list(reward.TRAIN_PAIR_COLUMNS + reward.PAIR_COLUMNS))
    batches = [pairs[list(range(start, start + args.batch_size))]
               for start in range(0, (args.updates + 1) * args.batch_size, args.batch_size)]
    layouts = ["two rows"] + [layout + last for layout in ["one row"] + [f"one row, {groups} length groups"
                                                                      for groups in args.length_groups]
                              for last in ("", EVERY_COLUMN)]
    differences = compare_first_batch(args, batches[0], layouts, pad_id, device)
    for layout, (reward_diff, grad_diff) in differences.items():
        print(f"first batch, {layout}: max |reward difference| {reward_diff:.2e}, max |gradient difference| {grad_diff:.2e}")
    def loss(model, batch: dict, layout: str) -> torch.Tensor:  # Bradley-Terry
        chosen, rejected = batch_rewards(model, batch, layout, pad_id, device)
        return -F.logsigmoid(chosen - rejected).mean()

    seconds = time_layouts(layouts, args.rounds, batches, lambda: fresh_rm(args.sft_model_path, device), loss, 1e-3, device)
    table = render_table(args, device, seconds, differences)
    if args.query_dataset:
        table += "\n" + time_scoring(args, pad_id)
    print(table)
    if args.out:
        with open(args.out, "w") as file:
            file.write(table)


if __name__ == "__main__":
    main()

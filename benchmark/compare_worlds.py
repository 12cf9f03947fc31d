"""Do the paper's findings hold on every world? One table from the findings.json of several benchmark/tiny.sh runs.

Each run's report (benchmark/tiny_report.py) writes {models}/findings.json: every finding of the paper against its
bar in miniature. This puts them side by side, one column per run, and counts the worlds where each holds.

    WORLD=/tmp/w2 SEED=2 MODELS=/tmp/m2 DATA=/tmp/d2 bash benchmark/tiny.sh   # another world, built and run
    python benchmark/compare_worlds.py models/tiny /tmp/m2                    # its findings beside seed 1's
    python benchmark/compare_worlds.py models/tiny /tmp/m2 --out /tmp/worlds.md
"""

import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

import tyro

VERDICT = {True: "yes", False: "**no**", None: "n/a"}


@dataclass
class Args:
    models: tyro.conf.Positional[tuple[str, ...]]
    """Folders of tiny.sh runs ($MODELS), each holding the findings.json its report wrote"""
    out: Optional[str] = None
    """Also write the markdown table here"""


def load_runs(folders: tuple) -> list:
    """[(column name, findings.json)] of each folder; exits naming the folder and the command when one has none."""
    if not folders:
        sys.exit("name the folders of the runs to compare, e.g. `python benchmark/compare_worlds.py models/tiny /tmp/m2`")
    runs = []
    for folder in folders:
        path = os.path.join(folder, "findings.json")
        if not os.path.isfile(path):
            sys.exit(f"{path}: not found. Write it with `python benchmark/tiny_report.py --models {folder} --seed S "
                     "--world W` (tiny.sh does at its end).")
        with open(path) as file:
            card = json.load(file)
        runs.append((f"seed {card['seed']} ({folder})", card))
    return runs


def comparison_table(runs: list) -> str:
    """Markdown: one row per finding (in the first run's order), one column per run: the verdict and what was measured,
    then how many runs it holds in (of those where it was judged)."""
    names = [row["finding"] for row in runs[0][1]["findings"]]
    for _, card in runs[1:]:  # a finding only some reports have (an older report) still gets its row
        names += [row["finding"] for row in card["findings"] if row["finding"] not in names]
    lines = ["| finding | bar | " + " | ".join(name for name, _ in runs) + " | holds in |",
             "|---|---|" + "---|" * len(runs) + "---|"]
    for finding in names:
        rows = [next((row for row in card["findings"] if row["finding"] == finding), None) for _, card in runs]
        bar = next(row["bar"] for row in rows if row is not None)
        cells = ["not in this report" if row is None else f"{VERDICT[row['holds']]}: {row['measured']}" for row in rows]
        judged = [row["holds"] for row in rows if row is not None and row["holds"] is not None]
        count = f"{sum(judged)} of {len(judged)}" if judged else "n/a"
        lines.append(f"| {finding} | {bar} | " + " | ".join(cells) + f" | {count} |")
    # Where each run ran: the thread count and the CPU change the numbers, so runs compare best on one machine.
    lines.append("| where it ran (threads; CPU) | shown, no bar | " + " | ".join(
        environment_cell(card.get("environment")) for _, card in runs) + " | n/a |")
    return "\n".join(lines) + "\n"


def environment_cell(env: Optional[dict]) -> str:
    """'2 threads; AMD EPYC (family 25, model 17), AVX512', or why it is unknown."""
    if not env:
        return "not recorded"
    cpu = f"{env['cpu']}, {env.get('cpu_capability')}" if env.get("cpu") else "CPU not recorded"
    return f"{env.get('torch_threads')} threads; {cpu}"


if __name__ == "__main__":
    args = tyro.cli(Args)
    table = "# The paper's findings on each world\n\n" + comparison_table(load_runs(args.models))
    if args.out:
        with open(args.out, "w") as file:
            file.write(table)
    print(table)

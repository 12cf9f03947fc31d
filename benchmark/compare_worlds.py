"""Do the paper's findings hold on every world? One table from the findings.json of several benchmark/tiny.sh runs.

Each run's report (benchmark/tiny_report.py) writes {models}/findings.json: every finding of the paper against its
bar in miniature. This puts them side by side, one column per run, and counts the worlds where each holds; --plot
draws the Fig. 1 findings of every run (win rates against the references, and PPO - SFT) against their bars.

    WORLD=/tmp/w2 SEED=2 MODELS=/tmp/m2 DATA=/tmp/d2 bash benchmark/tiny.sh   # another world, built and run
    python benchmark/compare_worlds.py models/tiny /tmp/m2                    # its findings beside seed 1's
    python benchmark/compare_worlds.py models/tiny /tmp/m2 --out /tmp/worlds.md
    # every world of the notebook (each seed's last column), drawn: the README's picture
    python benchmark/compare_worlds.py benchmark/results/compare_worlds_rebuilt.md --plot docs/worlds.png
"""

import itertools
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

import tyro

VERDICT = {True: "yes", False: "**no**", None: "n/a"}


@dataclass
class Args:
    models: tyro.conf.Positional[tuple[str, ...]]
    """Folders of tiny.sh runs ($MODELS), each holding the findings.json its report wrote; or markdown files that
    this script wrote (--out), read back: each seed's last column in the file (later runs of a seed replace earlier)"""
    out: Optional[str] = None
    """Also write the markdown table here"""
    plot: Optional[str] = None
    """Also draw a PNG here: each world's win rates against the references (SFT, PPO, DPO, 95% CIs) and PPO - SFT,
    each against its bar"""


def load_runs(folders: tuple) -> list:
    """[(column name, findings.json)] of each folder, one per seed (a later one replaces an earlier); exits naming the
    folder and the command when one has none."""
    if not folders:
        sys.exit("name the folders of the runs to compare, e.g. `python benchmark/compare_worlds.py models/tiny /tmp/m2`")
    runs = []
    for folder in folders:
        if folder.endswith(".md"):  # a table this script wrote (--out), read back
            if not os.path.isfile(folder):
                sys.exit(f"{folder}: not found (a markdown file of compare_worlds.py --out, or a folder of tiny.sh's)")
            runs += read_markdown(folder)
            continue
        path = os.path.join(folder, "findings.json")
        if not os.path.isfile(path):
            sys.exit(f"{path}: not found. Write it with `python benchmark/tiny_report.py --models {folder} --seed S "
                     "--world W` (tiny.sh does at its end).")
        with open(path) as file:
            card = json.load(file)
        runs.append((f"seed {card['seed']} ({folder})", card))
    # One column per world: a seed named twice (a folder and a table holding it, say) would count its bars twice.
    by_seed = {}
    for name, card in runs:
        if card["seed"] in by_seed:
            print(f"seed {card['seed']}: {name} replaces {by_seed[card['seed']][0]} (a later run of a seed replaces "
                  "an earlier one)", file=sys.stderr)
        by_seed[card["seed"]] = (name, card)
    return list(by_seed.values())


def read_markdown(path: str) -> list:
    """[(column name, findings)] of the tables this script wrote into `path`, one per seed (its last column in the
    file), by seed; exits naming the file when it holds no such table."""
    verdicts = {text: holds for holds, text in VERDICT.items()}
    by_seed = {}
    with open(path) as file:
        lines = file.read().splitlines()
    for start, header in enumerate(lines):
        if not header.startswith("| finding | bar | ") or not header.endswith(" | holds in |"):
            continue
        names = cells(header)[2:-1]
        rows = [cells(line) for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2:])]
        for column, name in enumerate(names, start=2):
            seed = re.match(r"seed (-?\d+)", name)
            if seed is None:
                sys.exit(f"{path}:{start + 1}: column '{name}' names no seed ('seed S (folder)' expected)")
            findings, where = [], None
            for row in rows:
                if row[0] == "where it ran (threads; CPU)":
                    where = row[column]
                elif row[column] != "not in this report":
                    verdict, _, measured = row[column].partition(": ")
                    findings.append({"finding": row[0], "bar": row[1], "measured": measured,
                                     "holds": verdicts.get(verdict)})
            by_seed[int(seed.group(1))] = (name, {"seed": int(seed.group(1)), "findings": findings, "where": where})
    if not by_seed:
        sys.exit(f"{path}: no table of compare_worlds.py in it (a line '| finding | bar | seed S (...) | ... | holds "
                 "in |' expected)")
    return [by_seed[seed] for seed in sorted(by_seed)]


def cells(line: str) -> list:
    """The cells of a markdown table row, stripped."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


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
        card.get("where") or environment_cell(card.get("environment")) for _, card in runs) + " | n/a |")
    return "\n".join(lines) + "\n"


def environment_cell(env: Optional[dict]) -> str:
    """'2 threads; AMD EPYC (family 25, model 17), AVX512', or why it is unknown."""
    if not env:
        return "not recorded"
    cpu = f"{env['cpu']}, {env.get('cpu_capability')}" if env.get("cpu") else "CPU not recorded"
    return f"{env.get('torch_threads')} threads; {cpu}"


# The findings the picture draws, by their names in tiny_report.py's findings.json.
SFT, PPO, GAIN, DPO = ("Fig. 1: SFT loses to the references", "Fig. 1: PPO is at least even with the references",
                       "Fig. 1: RLHF (PPO) beats SFT", "Fig. 1: DPO beats SFT")
CI = re.compile(r"(-?\d+\.\d+) \[(-?\d+\.\d+), (-?\d+\.\d+)\]")  # "0.336 [0.280, 0.397]"
NUMBER = re.compile(r"[-+]?\d+\.\d+")


def world_points(runs: list) -> dict:
    """What the picture draws: {seeds, sft / ppo / dpo: [(win rate, low, high) or None], gain: [PPO - SFT or None],
    gain_holds, bars: {sft: (low, high), ppo: 0.50, gain: 0.20}} from the runs' findings (None: not run)."""
    points = {"seeds": [], "sft": [], "ppo": [], "dpo": [], "gain": [], "gain_holds": [], "bars": {}}
    for _, card in runs:
        found = {row["finding"]: row for row in card["findings"]}
        points["seeds"].append(card["seed"])
        for key, name in (("sft", SFT), ("ppo", PPO), ("dpo", DPO)):
            match = CI.search(found[name]["measured"]) if name in found else None
            points[key].append(tuple(float(x) for x in match.groups()) if match else None)
        gain = NUMBER.search(found[GAIN]["measured"]) if GAIN in found else None
        points["gain"].append(float(gain.group()) if gain else None)
        points["gain_holds"].append(found[GAIN]["holds"] if gain else None)
        for key, name in (("sft", SFT), ("ppo", PPO), ("gain", GAIN)):
            if name in found and key not in points["bars"]:
                bar = [float(x) for x in NUMBER.findall(found[name]["bar"])]
                points["bars"][key] = tuple(bar) if key == "sft" else bar[0]
    return points


def plot_worlds(runs: list, path: str) -> None:
    """Two panels, one x position per world: win rates against the references with their CIs and bars; PPO - SFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = world_points(runs)
    x = range(len(points["seeds"]))
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.0, 0.55 * len(x) + 3), 7.5), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 2]})
    for offset, key, label, colour in ((-0.2, "sft", "SFT", "tab:blue"), (0.0, "ppo", "PPO", "tab:orange"),
                                       (0.2, "dpo", "DPO", "tab:green")):
        shown = [(i, p) for i, p in zip(x, points[key]) if p is not None]
        if shown:
            top.errorbar([i + offset for i, _ in shown], [p[0] for _, p in shown],
                         yerr=[[p[0] - p[1] for _, p in shown], [p[2] - p[0] for _, p in shown]],
                         fmt="o", ms=4, capsize=2, color=colour, label=label)
    bars = points["bars"]
    if "sft" in bars:
        top.axhspan(*bars["sft"], color="tab:blue", alpha=0.08, label=f"SFT's band [{bars['sft'][0]:.2f}, "
                    f"{bars['sft'][1]:.2f}]")
    if "ppo" in bars:
        top.axhline(bars["ppo"], color="tab:orange", ls="--", lw=1, label=f"PPO's bar {bars['ppo']:.2f}")
    highs = [p[2] for key in ("sft", "ppo", "dpo") for p in points[key] if p is not None]
    if highs:  # room above the highest CI for the legend
        top.set_ylim(top=max(highs) + 0.12)
    top.set_ylabel("gold win rate against the references")
    top.set_title("The main job on each world: win rates against the references (95% Wilson CIs)")
    top.legend(fontsize=8, ncol=5, loc="upper left")
    gains = [(i, g, h) for i, g, h in zip(x, points["gain"], points["gain_holds"]) if g is not None]
    bottom.bar([i for i, _, _ in gains], [g for _, g, _ in gains],
               color=["tab:orange" if h else "lightgray" for _, _, h in gains], edgecolor="tab:orange")
    if "gain" in bars:
        bottom.axhline(bars["gain"], color="black", ls="--", lw=1, label=f"the bar: SFT + {bars['gain']:.2f}")
    if gains:
        mean = sum(g for _, g, _ in gains) / len(gains)
        bottom.axhline(mean, color="tab:red", lw=1, label=f"mean {mean:+.3f}")
        held = sum(bool(h) for _, _, h in gains)
        bottom.set_title(f"PPO - SFT: at the bar on {held} of {len(gains)} worlds (filled)", fontsize=10)
    bottom.set_ylabel("PPO - SFT")
    bottom.set_xticks(list(x), [str(seed) for seed in points["seeds"]])
    bottom.set_xlabel("world seed")
    bottom.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)  # --help shows --flag_name as the docs write it; --flag-name works too
    runs = load_runs(args.models)
    table = "# The paper's findings on each world\n\n" + comparison_table(runs)
    if args.out:
        with open(args.out, "w") as file:
            file.write(table)
    if args.plot:
        plot_worlds(runs, args.plot)
    print(table)

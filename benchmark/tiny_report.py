"""The report of a benchmark/tiny.sh run: one markdown page and one figure from the stages' artifacts.

Off the training path: it only reads what the stages wrote. A stage whose artifact is missing is
reported as "not run" (so the report also works on a partial run).

    {models}/base_{seed}/eval_metrics.json, sft_{seed}/...  ROUGE of the sampled summaries (sft.py)
    {models}/reward_{seed}/eval_metrics.json   eval/rm/{split}/accuracy, .../gold_accuracy (reward.py)
    {models}/dpo_{seed}/eval_metrics.json      eval/dpo/{split}/accuracy, .../gold_accuracy (dpo.py)
    {models}/ppo_{seed}/eval_metrics.json      RM score of the samples and of the references, EOS fraction
    {models}/judge_{seed}/results.json         win rates vs the references, and of PPO / DPO vs SFT, with
                                               Wilson 95% CIs (judge.py)
    {models}/timings.tsv                       `stage<TAB>seconds` rows, appended by tiny.sh's `stage`
    {world}/world.json                         the noise ceiling: the best accuracy any RM can reach on the labels

Writes {models}/report.md and {models}/report.png (win rates with CIs, RM and DPO accuracies beside
the noise ceiling, time per stage), and prints the markdown.

    python benchmark/tiny_report.py --models models/tiny --seed 1
"""

import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import tyro

# Methods in pipeline order, as judge.py labels them (`<method>__seed<seed>`), with display names.
METHODS = {"base": "base model", "sft": "SFT", "ppo": "PPO", "dpo": "DPO"}
# Preference splits of the RM and DPO evaluations (validation is out of distribution: Detail 6).
PREF_SPLITS = {"validation": "TL;DR validation", "validation_cnndm": "CNN/DM"}


@dataclass
class Args:
    models: str = "models/tiny"
    """Folder of the tiny run (tiny.sh's $MODELS): stage folders, timings.tsv; report.md/png are written here"""
    seed: int = 1
    """Seed of the run (its folders are named <stage>_<seed>)"""
    world: Optional[str] = "assets/tiny_world"
    """Tiny world folder whose world.json holds the labels' noise ceiling (None: not shown)"""


def read_json(path: str) -> Optional[dict]:
    """The JSON object at `path`, or None when the file does not exist (a stage that did not run)."""
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        return json.load(file)


def read_timings(path: str) -> list:
    """[(stage, seconds)] of a timings.tsv (a `stage<TAB>seconds` header is skipped); [] if absent."""
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as file:
        for line in file:
            name, _, seconds = line.rstrip("\n").rpartition("\t")
            if name and seconds.replace(".", "", 1).isdigit():
                rows.append((name, float(seconds)))
    return rows


def load_artifacts(models: str, seed: int, world: Optional[str]) -> dict:
    """Everything the report shows, read from a tiny run's folders; a missing stage is None."""
    stage = lambda name, file="eval_metrics.json": read_json(os.path.join(models, f"{name}_{seed}", file))  # noqa: E731
    judge = stage("judge", "results.json")
    runs, head_to_head = {}, {}
    for label, run in (judge or {}).get("runs", {}).items():
        if run.get("vs", "reference") == "reference" and label in (f"{m}__seed{seed}" for m in METHODS):
            runs[label.split("__")[0]] = run
        elif run.get("vs") == f"sft__seed{seed}" and label.split("__")[0] in ("ppo", "dpo"):
            head_to_head[label.split("__")[0]] = run
    world_card = read_json(os.path.join(world, "world.json")) if world else None
    return {"models": models, "seed": seed,
            "rouge": {method: (stage(method) or {}).get("validation") for method in ("base", "sft")},
            "rm": stage("reward"), "dpo": stage("dpo"), "ppo": (stage("ppo") or {}).get("validation"),
            "judge": runs if judge is not None else None, "judge_name": (judge or {}).get("model"),
            "head_to_head": head_to_head,
            "noise_ceiling": (world_card or {}).get("noise_ceiling"),
            "timings": read_timings(os.path.join(models, "timings.tsv"))}


def preference_accuracies(metrics: Optional[dict], prefix: str) -> dict:
    """{(split, kind): accuracy} of a reward.py / dpo.py eval_metrics.json; kind 'labels' or 'gold'."""
    out = {}
    for split in PREF_SPLITS:
        for kind, suffix in (("labels", "accuracy"), ("gold", "gold_accuracy")):
            value = (metrics or {}).get(f"{prefix}/{split}/{suffix}")
            if value is not None:
                out[(split, kind)] = value
    return out


def fmt(value: Optional[float], digits: int = 3) -> str:
    """A number with `digits` decimals, or 'n/a'."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def render_markdown(art: dict) -> str:
    """The report page: results per stage, win rates with CIs, time per stage."""
    ceiling = art["noise_ceiling"] or {}
    lines = [f"# Tiny-world pipeline report (seed {art['seed']})", "",
             f"From the artifacts in `{art['models']}` (benchmark/tiny.sh), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             "All numbers are on the validation splits.", "", "![report](report.png)", "",
             "## Results", "", "| stage | measure | value |", "|---|---|---|"]
    for method in ("base", "sft"):
        rouge = art["rouge"][method]
        value = "not run" if rouge is None else " / ".join(fmt(rouge.get(k)) for k in ("rouge1", "rouge2", "rougeL"))
        lines.append(f"| {'base model (no training)' if method == 'base' else 'SFT'} | ROUGE-1 / 2 / L | {value} |")
    for name, metrics, prefix in (("reward model", art["rm"], "eval/rm"), ("DPO (implicit reward)", art["dpo"], "eval/dpo")):
        if metrics is None:
            lines.append(f"| {name} | accuracy | not run |")
            continue
        accuracies = preference_accuracies(metrics, prefix)
        for split, split_name in PREF_SPLITS.items():
            ceiling_note = f" (noise ceiling {fmt(ceiling[split])})" if split in ceiling else ""
            lines.append(f"| {name} | {split_name} accuracy vs the labels{ceiling_note} | {fmt(accuracies.get((split, 'labels')))} |")
            if (split, "gold") in accuracies:
                lines.append(f"| {name} | {split_name} accuracy vs the gold judge | {fmt(accuracies[(split, 'gold')])} |")
    ppo = art["ppo"]
    if ppo is None:
        lines.append("| PPO | RM score of its samples | not run |")
    else:
        lines.append(f"| PPO | RM score: its samples / the references | {fmt(ppo.get('score'))} / {fmt(ppo.get('reference_score'))} |")
        lines.append(f"| PPO | samples with an EOS | {fmt(ppo.get('eos_fraction'))} |")

    lines += ["", f"## Win rate against the human reference summaries ({art['judge_name'] or 'judge'}, Wilson 95% CI)", "",
              "| policy | win rate | 95% CI | wins / judged | ties | mean words (reference) |", "|---|---|---|---|---|---|"]
    for method, name in METHODS.items():
        run = (art["judge"] or {}).get(method)
        if run is None:
            lines.append(f"| {name} | not run | | | | |")
        else:
            lines.append(f"| {name} | {fmt(run['win_rate'])} | [{fmt(run['ci_low'])}, {fmt(run['ci_high'])}] | "
                         f"{run['wins']} / {run['n']} | {run.get('ties', 0)} | "
                         f"{fmt(run.get('mean_words'), 1)} ({fmt(run.get('mean_other_words'), 1)}) |")

    if art["head_to_head"]:
        # Against the references every policy of the tiny world nearly always loses, so the
        # comparison with SFT is where a gain (or an over-optimised loss) shows.
        lines += ["", f"## Head to head against SFT ({art['judge_name'] or 'judge'}, Wilson 95% CI)", "",
                  "| policy | win rate vs SFT | 95% CI | wins / judged | ties | mean words (SFT) |", "|---|---|---|---|---|---|"]
        for method, run in sorted(art["head_to_head"].items(), key=lambda item: list(METHODS).index(item[0])):
            lines.append(f"| {METHODS[method]} | {fmt(run['win_rate'])} | [{fmt(run['ci_low'])}, {fmt(run['ci_high'])}] | "
                         f"{run['wins']} / {run['n']} | {run.get('ties', 0)} | "
                         f"{fmt(run.get('mean_words'), 1)} ({fmt(run.get('mean_other_words'), 1)}) |")

    lines += ["", "## Time per stage (2 CPU cores)", "", "| stage | time |", "|---|---|"]
    for name, seconds in art["timings"]:
        lines.append(f"| {name} | {seconds:.0f} s |")
    total = sum(seconds for _, seconds in art["timings"])
    lines.append(f"| **total** | **{total // 60:.0f} min {total % 60:.0f} s** |" if art["timings"] else "| (no timings.tsv) | |")
    return "\n".join(lines) + "\n"


def plot_report(art: dict, path: str) -> None:
    """One figure, three panels: win rates with CI error bars, RM / DPO accuracies, time per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ax_win, ax_acc, ax_time) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [1, 1.4, 1.2]})

    names = [name.replace(" ", "\n") for name in METHODS.values()] + [f"{METHODS[m]}\nvs SFT" for m in ("ppo", "dpo") if m in art["head_to_head"]]
    runs = [(art["judge"] or {}).get(method) for method in METHODS] + [
        art["head_to_head"][m] for m in ("ppo", "dpo") if m in art["head_to_head"]]
    rates = [run["win_rate"] if run else 0.0 for run in runs]
    errors = [[max(0.0, run["win_rate"] - run["ci_low"]) if run else 0.0 for run in runs],  # max: rounding
              [max(0.0, run["ci_high"] - run["win_rate"]) if run else 0.0 for run in runs]]
    ax_win.bar(names, rates, yerr=errors, capsize=6,
               color=["tab:blue"] * len(METHODS) + ["tab:cyan"] * (len(names) - len(METHODS)))
    for x, run in enumerate(runs):
        label = "not run" if run is None else f"{run['win_rate']:.3f}"
        ax_win.text(x, (run["ci_high"] if run else 0.0) + 0.01, label, ha="center", va="bottom", fontsize=9)
    ax_win.set_ylim(0, max(0.1, max((run["ci_high"] for run in runs if run), default=0.0) * 1.3))
    if len(names) > len(METHODS):
        ax_win.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    ax_win.set_ylabel("win rate vs the references (blue) / vs SFT (cyan)")
    ax_win.set_title(f"{art['judge_name'] or 'judge'} (Wilson 95% CI)")

    groups = [("RM", preference_accuracies(art["rm"], "eval/rm"), art["rm"] is not None),
              ("DPO", preference_accuracies(art["dpo"], "eval/dpo"), art["dpo"] is not None)]
    bars = [(f"{model}\n{PREF_SPLITS[split].split()[0]}\n{kind}", accuracies.get((split, kind)))
            for model, accuracies, ran in groups if ran for split in PREF_SPLITS for kind in ("labels", "gold")]
    colors = {"labels": "tab:orange", "gold": "tab:green"}
    for x, (label, value) in enumerate(bars):
        ax_acc.bar(x, value or 0.0, color=colors[label.rsplit("\n", 1)[1]])
        ax_acc.text(x, (value or 0.0) + 0.01, fmt(value), ha="center", va="bottom", fontsize=8)
    ax_acc.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    not_run = [model for model, _, ran in groups if not ran]
    if not_run:
        ax_acc.text(0.02, 0.97, f"not run: {', '.join(not_run)}", transform=ax_acc.transAxes, ha="left", va="top")
    ax_acc.axhline(0.5, color="grey", linewidth=0.8, linestyle=":", label="chance")
    if art["noise_ceiling"] and "validation" in art["noise_ceiling"]:
        ax_acc.axhline(art["noise_ceiling"]["validation"], color="black", linewidth=0.8, linestyle="--",
                       label=f"noise ceiling of the labels ({art['noise_ceiling']['validation']:.2f})")
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_ylabel("accuracy on preference pairs")
    ax_acc.set_title("RM and DPO implicit-reward accuracy (vs labels / gold judge)")
    ax_acc.legend(loc="upper right", fontsize=7)

    timings = art["timings"]
    ax_time.barh([name for name, _ in timings][::-1], [seconds for _, seconds in timings][::-1], color="tab:purple")
    for y, (_, seconds) in enumerate(timings[::-1]):
        ax_time.text(seconds, y, f" {seconds:.0f} s", va="center", fontsize=8)
    total = sum(seconds for _, seconds in timings)
    ax_time.set_xlabel("seconds")
    ax_time.set_title(f"time per stage (total {total / 60:.1f} min)" if timings else "time per stage (no timings.tsv)")
    ax_time.margins(x=0.2)

    figure.suptitle(f"benchmark/tiny.sh, seed {art['seed']}: {art['models']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    args = tyro.cli(Args)
    artifacts = load_artifacts(args.models, args.seed, args.world)
    markdown = render_markdown(artifacts)
    with open(os.path.join(args.models, "report.md"), "w") as file:
        file.write(markdown)
    plot_report(artifacts, os.path.join(args.models, "report.png"))
    print(markdown)
    print(f"saved {args.models}/report.md, {args.models}/report.png")

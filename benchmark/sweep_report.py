"""The paper's sweep at a glance: Figure 1 (win rate against the references by model size) from the folders that
benchmark/launch.sh fills, with each stage's own metrics beside it.

Reads every model folder below --out_root (a folder holding runs named `{sft,reward,dpo,ppo,judge}_<seed>`, as the
SLURM sweep writes `models/<model>/<stage>_<seed>`): each judge's results.json (judge.py: SFT's, PPO's and DPO's win
rates against the references, PPO and DPO head to head against SFT) and each stage's eval_metrics.json (SFT's
ROUGE, the RM's and DPO's accuracy against the labels and on CNN/DM, PPO's RM score). Writes:

    {out}.md     per model and method: the mean win rate over seeds, its sample std and every seed's; the stages'
                 metrics; every run started but not complete (a model or seed with no folder yet is not known here)
    {out}.png    Figure 1 (win rate against the references by model size, the mean over seeds and each seed), PPO
                 and DPO head to head against SFT, and the RM's and DPO's accuracy against the labels (Fig. 6)

    python benchmark/sweep_report.py                       # models/ -> runs/sweep_report.md and .png
    python benchmark/sweep_report.py --out_root /scratch/tldr/models --out runs/sweep_1b
    python benchmark/sweep_report.py --out_root models --out runs/tiny_sweep   # the tiny run (models/tiny/*_1) too

Runs still training or judging are left out of the means and listed as such, so the report can be drawn at any time
of a sweep; so are a judge's verdicts on a run that is training again, or finished again after it was judged. Win
rates of different judge models are not comparable: with more than one among the judge folders, --judge_model says
which to report.
"""

import datetime
import json
import os
import re
import statistics
import struct
import sys
from dataclasses import dataclass
from typing import Optional

import tyro

RUN = re.compile(r"^(sft|reward|dpo|ppo|judge)_(\d+)$")
METHODS = ("sft", "ppo", "dpo")  # Figure 1's lines, in the paper's order; others the judge has (base) follow


@dataclass
class Args:
    out_root: str = "models"
    """The sweep's output root (OUT_ROOT in benchmark/knobs.sh): model folders below it hold <stage>_<seed> runs"""
    out: str = "runs/sweep_report"
    """Write {out}.md and {out}.png"""
    judge_model: Optional[str] = None
    """Report only the judge folders of this judge model (results.json's `model`); needed when they differ"""


def find_runs(out_root: str) -> dict:
    """{model: {seed: {stage: run folder}}} of every folder below out_root that holds `<stage>_<seed>` runs; the
    model is its path below out_root."""
    found: dict = {}
    for folder, children, _ in os.walk(out_root, followlinks=True):  # a model folder linked to scratch space too
        runs = [name for name in children if RUN.match(name)]
        for name in runs:
            stage, seed = RUN.match(name).groups()
            model = os.path.relpath(folder, out_root)
            found.setdefault(model, {}).setdefault(seed, {})[stage] = os.path.join(folder, name)
        children[:] = [name for name in children if not RUN.match(name)]  # never walk into a run (checkpoints)
    return found


def load_json(path: str) -> Optional[dict]:
    """The JSON object at `path`, None when there is no file; exits naming the file when it is not JSON."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        sys.exit(f"sweep_report.py: {path} is not JSON ({error}); the stage that writes it rewrites it when run again")


def flat(metrics: dict, prefix: str = "") -> dict:
    """{'validation.rougeL': 0.42, 'eval/rm/validation/accuracy': 0.70, ...}: nested dicts joined with dots."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# The stages' metrics in the report: (column, stage, key in its flattened eval_metrics.json).
STAGE_METRICS = (
    ("SFT ROUGE-L", "sft", "validation.rougeL"),
    ("RM accuracy", "reward", "eval/rm/validation/accuracy"),
    ("RM on CNN/DM", "reward", "eval/rm/validation_cnndm/accuracy"),
    ("DPO implicit accuracy", "dpo", "eval/dpo/validation/accuracy"),
    ("DPO on CNN/DM", "dpo", "eval/dpo/validation_cnndm/accuracy"),
    ("PPO RM score", "ppo", "validation.score"),
    ("references' RM score", "ppo", "validation.reference_score"),
    ("PPO EOS fraction", "ppo", "validation.eos_fraction"),
)


def judge_problem(results: dict) -> Optional[str]:
    """Why a judge folder is not complete (judge.sbatch's test of a finished run), None when it is."""
    stopped = results.get("this_run", {}).get("stopped")
    again = [f for f in results.get("failures", []) if f.get("asked_by_rerun")]
    if stopped is not None:
        return f"its last run stopped ({stopped})"
    if again:
        return f"{len(again)} failed rows that a rerun asks again"
    return None


def judge_config(results: dict) -> str:
    return (f"`{results.get('model')}` ({results.get('judge')}), prompt `{results.get('prompt_version')}`, "
            f"temperature {results.get('temperature') if results.get('temperature') is not None else '-'}")


def collect(found: dict, judge_model: Optional[str]) -> tuple:
    """(rows, metrics, notes, config): rows {(model, method, vs): {seed: win rate}} of complete judge folders,
    metrics {(model, column): {seed: value}} of complete stages, notes [what is missing or left out], and the judge
    configuration reported. Exits when judge folders of several judge models are found and --judge_model is unset."""
    judged = {}
    for model, seeds in found.items():
        for seed, stages in seeds.items():
            if "judge" in stages:
                judged[(model, seed)] = load_json(os.path.join(stages["judge"], "results.json"))
    models_seen = sorted({r.get("model") for r in judged.values() if r is not None}, key=str)
    if judge_model is None and len(models_seen) > 1:
        sys.exit(f"sweep_report.py: the judge folders hold verdicts of {len(models_seen)} judge models "
                 f"({', '.join(map(str, models_seen))}), whose win rates are not comparable: choose one with "
                 f"--judge_model {models_seen[0]}")
    rows: dict = {}
    metrics: dict = {}
    notes: list = []
    config = None
    for model, seeds in sorted(found.items()):
        for seed, stages in sorted(seeds.items()):
            for stage in ("sft", "reward", "dpo", "ppo", "judge"):
                folder = stages.get(stage)
                if folder is None:
                    notes.append(f"{model} seed {seed}: no {stage}_{seed} folder")
                    continue
                if stage != "judge":
                    values = load_json(os.path.join(folder, "eval_metrics.json"))
                    if values is None:
                        notes.append(f"{folder}: not complete (no eval_metrics.json)")
                        continue
                    values = flat(values)
                    for column, metric_stage, key in STAGE_METRICS:
                        if metric_stage == stage and isinstance(values.get(key), (int, float)):
                            metrics.setdefault((model, column), {})[seed] = float(values[key])
                    continue
                results = judged[(model, seed)]
                if results is None:
                    notes.append(f"{folder}: not judged yet (no results.json)")
                    continue
                if judge_model is not None and results.get("model") != judge_model:
                    notes.append(f"{folder}: left out, judged by `{results.get('model')}`, not `{judge_model}`")
                    continue
                problem = judge_problem(results)
                if problem:
                    notes.append(f"{folder}: left out, not complete: {problem}")
                    continue
                config = config or judge_config(results)
                for label, run in results.get("runs", {}).items():
                    if run.get("n"):  # n = wins + ties + losses: a run with nothing judged has no win rate
                        vs = "reference" if run["vs"] == "reference" else re.sub(r"__seed.*$", "", run["vs"])
                        stale = judged_stale(folder, stages, {run["method"], vs} - {"reference"})
                        if stale:
                            notes.append(f"{folder}: {label} left out: {stale}")
                            continue
                        rows.setdefault((model, run["method"], vs), {})[seed] = float(run["win_rate"])
    return rows, metrics, notes, config


def judged_stale(judge_folder: str, stages: dict, methods: set) -> Optional[str]:
    """Why a judged run's verdicts no longer describe the runs of `methods` (a stage of this seed not complete now,
    trained again after the judge wrote results.json, or of a stage this sweep does not know); None if they do."""
    judged_at = os.path.getmtime(os.path.join(judge_folder, "results.json"))
    for method in sorted(methods):
        if method not in stages:
            return f"no {method} run of this seed in the sweep" if method in ("sft", "ppo", "dpo") else None
        metrics = os.path.join(stages[method], "eval_metrics.json")
        if not os.path.isfile(metrics):
            return f"{os.path.basename(stages[method])} is not complete (training again?)"
        if os.path.getmtime(metrics) > judged_at:
            return f"{os.path.basename(stages[method])} finished after it was judged: judge it again"
    return None


def safetensors_parameters(folder: str) -> Optional[int]:
    """The number of parameters in a saved model folder, from its safetensors headers alone (no weights are read);
    None without safetensors files."""
    index = load_json(os.path.join(folder, "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    total = 0
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, tensor in header.items():
            if key != "__metadata__":
                count = 1
                for size in tensor["shape"]:
                    count *= size
                total += count
    return total


def model_size(model: str, seeds: dict) -> Optional[float]:
    """Parameters of a model: counted in one of its SFT models' files, else read from its name (pythia-2.8b)."""
    for stages in seeds.values():
        if "sft" in stages:
            counted = safetensors_parameters(stages["sft"])
            if counted:
                return float(counted)
    match = re.search(r"(\d+(?:\.\d+)?)([mb])(?![a-z])", model.lower())
    if match:
        return float(match.group(1)) * (1e6 if match.group(2) == "m" else 1e9)
    return None


def size_label(size: Optional[float]) -> str:
    if size is None:
        return "-"
    return f"{size / 1e9:.2f}B" if size >= 1e8 else f"{size / 1e6:.2f}M"


def summary(values: dict) -> tuple:
    """(mean, sample std or None, 'seed: value, ...') of {seed: value}."""
    numbers = list(values.values())
    std = statistics.stdev(numbers) if len(numbers) > 1 else None
    per_seed = ", ".join(f"{seed}: {value:.3f}" for seed, value in sorted(values.items()))
    return statistics.mean(numbers), std, per_seed


def fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def method_order(methods) -> list:
    return sorted(set(methods), key=lambda m: (METHODS.index(m) if m in METHODS else len(METHODS), m))


def report(args: Args, found: dict, sizes: dict, rows: dict, metrics: dict, notes: list, config: Optional[str]) -> str:
    models = sorted(found, key=lambda m: (sizes[m] is None, sizes[m] or 0, m))
    lines = [f"# The sweep in {args.out_root} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"Judge: {config or 'no complete judge folder yet'}. Win rate = (wins + ties / 2) / (wins + ties + "
             "losses) over the validation posts of one run (malformed and failed verdicts count for neither side); mean and "
             "sample std over the seeds whose judge folder is complete. Command: `python benchmark/sweep_report.py "
             f"--out_root {args.out_root} --out {args.out}`.", ""]
    for title, against in (("Figure 1: win rate against the references", "reference"),
                           ("Head to head against SFT", "sft")):
        lines += [f"## {title}", "", "| model | parameters | method | seeds | mean | std | each seed |",
                  "|---|---|---|---|---|---|---|"]
        for model in models:
            for method in method_order(m for (mm, m, vs) in rows if mm == model and vs == against):
                mean, std, per_seed = summary(rows[(model, method, against)])
                lines.append(f"| {model} | {size_label(sizes[model])} | {method} | {len(rows[(model, method, against)])} "
                             f"| {fmt(mean)} | {fmt(std)} | {per_seed} |")
        lines.append("")
    columns = [column for column, _, _ in STAGE_METRICS if any((m, column) in metrics for m in models)]
    lines += ["## The stages' own metrics (eval_metrics.json), mean over seeds (seeds)", "",
              "| model | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for model in models:
        cells = []
        for column in columns:
            values = metrics.get((model, column))
            cells.append(f"{fmt(statistics.mean(values.values()))} ({len(values)})" if values else "-")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines += ["", "## Missing or not complete", ""] + ([f"- {note}" for note in notes] or ["- nothing"])
    return "\n".join(lines) + "\n"


def plot(path: str, found: dict, sizes: dict, rows: dict, metrics: dict) -> None:
    """Three panels by model size: win rate against the references (Figure 1), head to head against SFT, and the
    RM's and DPO's accuracy against the labels (Fig. 6). Lines are means over seeds, dots single seeds."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    models = sorted(found, key=lambda m: (sizes[m] is None, sizes[m] or 0, m))
    known = all(sizes[m] for m in models)
    x = {m: (sizes[m] if known else i) for i, m in enumerate(models)}
    colours = {method: f"C{i}" for i, method in enumerate(method_order(m for (_, m, _) in rows))}  # one per method
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = ((axes[0], "reference", "win rate against the references", "Figure 1"),
              (axes[1], "sft", "win rate against SFT, head to head", "PPO and DPO against SFT"))
    for ax, against, ylabel, title in panels:
        for method in method_order(m for (_, m, vs) in rows if vs == against):
            points = [(x[m], rows[(m, method, against)]) for m in models if (m, method, against) in rows]
            ax.plot([p[0] for p in points], [statistics.mean(p[1].values()) for p in points], marker="o",
                    color=colours[method], label=method)
            for position, values in points:
                ax.scatter([position] * len(values), list(values.values()), color=colours[method], alpha=0.35, s=14)
        ax.axhline(0.5, color="gray", linestyle="--", linewidth=1)
        ax.set(ylabel=ylabel, ylim=(-0.02, 1.02), title=title)
    for column, style, colour in (("RM accuracy", "-", "C7"), ("RM on CNN/DM", ":", "C7"),
                                  ("DPO implicit accuracy", "-", colours.get("dpo", "C2")),
                                  ("DPO on CNN/DM", ":", colours.get("dpo", "C2"))):
        points = [(x[m], metrics[(m, column)]) for m in models if (m, column) in metrics]
        if points:
            axes[2].plot([p[0] for p in points], [statistics.mean(p[1].values()) for p in points], marker="o",
                         linestyle=style, color=colour, label=column)
    axes[2].axhline(0.5, color="gray", linestyle="--", linewidth=1)
    axes[2].set(ylabel="accuracy against the labels", ylim=(0.4, 0.85), title="RM and DPO (Fig. 6)")
    for ax in axes:
        if known:
            ax.set_xscale("log")
            ax.set_xticks([x[m] for m in models], [size_label(sizes[m]) for m in models])
            ax.minorticks_off()
        else:
            ax.set_xticks([x[m] for m in models], models, rotation=20)
        ax.set_xlabel("parameters" if known else "model")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)  # --help shows --flag_name as the docs write it
    if not os.path.isdir(args.out_root):
        sys.exit(f"sweep_report.py: --out_root {args.out_root} is not a folder (the sweep writes OUT_ROOT, "
                 "models/ by default: run it from the repository root, or name the folder)")
    found = find_runs(args.out_root)
    if not found:
        sys.exit(f"sweep_report.py: no <stage>_<seed> run folder below {args.out_root}: nothing to report yet "
                 "(bash benchmark/launch.sh writes them)")
    rows, metrics, notes, config = collect(found, args.judge_model)
    sizes = {model: model_size(model, seeds) for model, seeds in found.items()}
    text = report(args, found, sizes, rows, metrics, notes, config)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(f"{args.out}.partial.md", "w") as f:
        f.write(text)
    plot(f"{args.out}.partial.png", found, sizes, rows, metrics)
    for suffix in (".md", ".png"):  # each file whole or absent
        os.replace(f"{args.out}.partial{suffix}", args.out + suffix)
    print(text)
    print(f"wrote {args.out}.md and {args.out}.png")

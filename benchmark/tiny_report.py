"""The report of a benchmark/tiny.sh run: the paper's findings in miniature, from the stages' artifacts.

Off the training path: it reads what the stages wrote and, for the token view (paper Table 8),
loads the saved SFT and PPO models to compute per-token probabilities. A stage whose artifact is
missing is reported as "not run" (so the report also works on a partial run).

    {models}/environment.json                  threads and versions of the run (tiny.sh writes it)
    {models}/base_{seed}/eval_metrics.json, sft_{seed}/...  ROUGE of the sampled summaries (sft.py)
    {models}/reward_{seed}/eval_metrics.json   eval/rm/{split}/accuracy, .../gold_accuracy (reward.py)
    {models}/reward_{seed}/eval_{split}.csv    one row per pair: batch, confidence, rewards (reward.py)
    {models}/dpo_{seed}/eval_metrics.json      eval/dpo/{split}/accuracy, .../gold_accuracy (dpo.py)
    {models}/ppo_{seed}/eval_metrics.json      RM score of the samples and of the references, EOS fraction
    {models}/ppo_{seed}/args.json              run_name: runs/{run_name}/samples_validation_{episode}.csv
                                               are the periodic evaluations (ppo.py --eval_every)
    {models}/<stage>_{seed}/eval_validation.csv  each stage's validation summaries (query, response, reference):
                                               what they get wrong, term by term of the gold judge
    {models}/judge_{seed}/results.json         win rates vs the references and vs SFT, Wilson 95% CIs (judge.py)
    {models}/judge_{seed}/judged/<run>.csv     every gold comparison with both lengths in words (judge.py)
    {models}/timings.tsv                       `stage<TAB>seconds` rows, appended by tiny.sh's `stage`
    {world}/world.json                         the noise ceiling: the best accuracy any RM can reach on the labels

Writes {models}/report.md, {models}/report.png (one panel per finding) and {models}/report_tokens.png
(the token view), and prints the markdown.

    python benchmark/tiny_report.py --models models/tiny --seed 1
"""

import csv
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import tyro

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Methods in pipeline order, as judge.py labels them (`<method>__seed<seed>`), with display names.
METHODS = {"base": "base model", "sft": "SFT", "ppo": "PPO", "dpo": "DPO"}
# Preference splits of the RM and DPO evaluations (validation is out of distribution: Detail 6).
PREF_SPLITS = {"validation": "TL;DR validation", "validation_cnndm": "CNN/DM"}
# Figure 8's buckets of log(summary words / reference words): 0.3 wide around 0, open at both ends.
LENGTH_EDGES = (-math.inf, -0.75, -0.45, -0.15, 0.15, 0.45, 0.75, math.inf)
Z_95 = 1.959963984540054  # the two-sided 95% quantile of the standard normal
TOKEN_POSTS = 3  # validation posts shown in the token view (Table 8)
# The bars each finding must clear in miniature (the project's, for the tiny world; the paper's own numbers are for
# 1B-6.9B models): Fig. 1, Fig. 4, Fig. 8's smallest bucket, and the main job's time on 2 CPU cores.
SFT_WIN_RATE_RANGE = (0.10, 0.45)  # SFT loses to the references, but not always
PPO_MIN_WIN_RATE, PPO_MIN_GAIN = 0.50, 0.20  # PPO at least even with the references, and well above SFT
RM_MIN_ACCURACY, CNNDM_MIN_ACCURACY = 0.70, 0.60  # against the labels; on news the RM never trained on
MIN_BUCKET = 30  # Figure 8 compares a length bucket only where each policy has this many judged summaries
MIN_POSTS = 256  # Figure 1's win rates rest on at least this many judged posts (ties count 1/2, as judge.py counts)
TIME_BUDGET_S = 12 * 60
RESUMED = "(resumed)"  # tiny.sh's mark on a stage that continued from the checkpoint of an interrupted start
WORLD_STAGE = "tiny world"  # tiny.sh's stage that builds a world that is not committed (not part of the main job)
JOB_STAGES = ("preprocess", "sft: base model", "sft", "reward", "dpo", "ppo", "judge (gold)")  # tiny.sh's, in order


@dataclass
class Args:
    models: str = "models/tiny"
    """Folder of the tiny run (tiny.sh's $MODELS): stage folders, timings.tsv; report.md/png are written here"""
    seed: int = 1
    """Seed of the run (its folders are named <stage>_<seed>)"""
    world: Optional[str] = "assets/tiny_world"
    """Tiny world folder whose world.json holds the labels' noise ceiling (None: not shown)"""
    runs_dir: str = "runs"
    """Where ppo.py wrote runs/{run_name}/samples_validation_{episode}.csv (its working directory's runs/)"""
    tokens: bool = True
    """Compute the token view (Table 8) from the saved SFT and PPO models (loads torch and transformers)"""


# ------------------------------------------------------------------------------------------------
# Pure helpers (tested against hand-computed values in tests/test_tiny_report.py)
# ------------------------------------------------------------------------------------------------
def wilson_interval(wins: float, n: int, z: float = Z_95) -> tuple:
    """Wilson score interval of wins / n ((nan, nan) when n is 0)."""
    if n == 0:
        return (math.nan, math.nan)
    p = wins / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (center - half, center + half)


def win_credit(margin: float) -> float:
    """A comparison's share of a win from its gold margin (ours - theirs; 0, equal up to float rounding, is a tie):
    1, 1/2 or 0, as judge.py counts a verdict."""
    return 1.0 if margin > 0 else 0.5 if margin == 0 else 0.0


def length_buckets(judged: list, edges: tuple = LENGTH_EDGES) -> list:
    """Figure 8: [{low, high, wins, n, win_rate}] per bucket of log(ours / other words): `n` judged summaries,
    `wins` of them, a tie counting 1/2 (as judge.py counts it).

    `judged`: rows of judge.py's judged/<run>.csv (preferred, ours_words, other_words); malformed and
    unjudged rows count in no bucket. Bucket k holds edges[k] <= x < edges[k + 1]."""
    buckets = [{"low": lo, "high": hi, "wins": 0.0, "n": 0} for lo, hi in zip(edges[:-1], edges[1:])]
    for row in judged:
        if row["preferred"] not in ("ours", "reference", "other", "tie"):
            continue
        x = math.log(max(1, int(row["ours_words"])) / max(1, int(row["other_words"])))
        bucket = next(b for b in buckets if b["low"] <= x < b["high"])
        bucket["n"] += 1
        bucket["wins"] += 1.0 if row["preferred"] == "ours" else 0.5 if row["preferred"] == "tie" else 0.0
    for bucket in buckets:
        bucket["win_rate"] = bucket["wins"] / bucket["n"] if bucket["n"] else None
    return buckets


def grouped_accuracy(rows: list, key: str) -> list:
    """Detail 16: [(value, accuracy, pairs)] of reward.py eval rows grouped by `key` (batch, confidence).

    A row is right when its `accuracy` is 1 (chosen reward above rejected); groups in sorted order,
    numbers numerically; rows without a value (no confidence in early batches) are left out."""
    groups = {}
    for row in rows:
        value = row[key]
        if value in ("", None) or (isinstance(value, float) and math.isnan(value)):
            continue
        groups.setdefault(str(value).removesuffix(".0"), []).append(float(row["accuracy"]))
    natural = lambda v: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", v)]  # noqa: E731
    order = sorted(groups, key=natural)  # batch3 before batch10, confidence 9 before 10
    return [(value, sum(groups[value]) / len(groups[value]), len(groups[value])) for value in order]


def length_reliance(rows: list, eos: str = "<|endoftext|>") -> Optional[dict]:
    """How far a reward model's choices follow length, over the pairs whose two summaries differ in words (None: no such
    pair): {pairs, labels_shorter, model_shorter, chosen_shorter: (accuracy, pairs), chosen_longer: (accuracy, pairs)}.

    `rows`: reward.py's eval_<split>.csv (or dpo.py's eval_pairs_<split>.csv): chosen, rejected, accuracy (1 when the
    model scores the chosen summary above the rejected one). labels_shorter is the share where the labels chose the
    shorter summary, model_shorter the share where the model prefers it."""
    words = lambda text: len(text.replace(eos, " ").split())  # noqa: E731
    shorter, longer = [], []  # the model's right / wrong, where the chosen summary is the shorter / the longer one
    for row in rows:
        chosen, rejected = words(row["chosen"]), words(row["rejected"])
        if chosen != rejected:
            (shorter if chosen < rejected else longer).append(float(row["accuracy"]) == 1.0)
    pairs = len(shorter) + len(longer)
    if not pairs:
        return None
    mean = lambda flags: (sum(flags) / len(flags), len(flags)) if flags else (None, 0)  # noqa: E731
    return {"pairs": pairs, "labels_shorter": len(shorter) / pairs,
            "model_shorter": (sum(shorter) + len(longer) - sum(longer)) / pairs,
            "chosen_shorter": mean(shorter), "chosen_longer": mean(longer)}


def calibration_bins(rows: list, width: float = 0.5) -> list:
    """Figure 5 (right): [(low, high, pairs, accuracy, ideal)] per bin of |r_chosen - r_rejected| of the pairs
    `rows` (a stage's eval CSV rows: chosen_reward, rejected_reward, accuracy).

    accuracy = the mean of the bin's `accuracy` column, as the stage counted each pair (ties and
    identical summaries included); ideal = sigmoid(bin centre), what a calibrated RM would reach
    (Bai et al. 2022). Empty bins are skipped."""
    bins = {}
    for row in rows:
        margin = float(row["chosen_reward"]) - float(row["rejected_reward"])
        bins.setdefault(int(abs(margin) // width), []).append(float(row["accuracy"]))
    return [(k * width, (k + 1) * width, len(bins[k]), sum(bins[k]) / len(bins[k]),
             1 / (1 + math.exp(-(k + 0.5) * width))) for k in sorted(bins)]


def overoptimisation_curve(tables: dict, batch_size: int, gold: Callable[[str, str], float]) -> list:
    """Gao et al. (2023) in miniature: one point per PPO evaluation, the proxy (RM) beside the truth (gold).

    tables: {episode: rows of a samples_validation_{episode}.csv (query, response, reference, score,
    reference_score)}. Returns [{update, episode, rm, rm_reference, gold, gold_reference, gold_win_rate, n}]
    by episode; the post the gold judge reads is the query, as judge.py gives it."""
    points = []
    for episode in sorted(tables):
        rows = tables[episode]
        ours = [gold(row["query"].strip(), row["response"].strip()) for row in rows]
        theirs = [gold(row["query"].strip(), row["reference"].strip()) for row in rows]
        # scores equal up to float rounding are a tie, as judge.py counts them
        margins = [tiny_world_module().gold_difference(a, b) for a, b in zip(ours, theirs)]
        wins = sum(win_credit(margin) for margin in margins)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        points.append({"update": episode // batch_size, "episode": episode,
                       "rm": mean([float(row["score"]) for row in rows]),
                       "rm_reference": mean([float(row["reference_score"]) for row in rows]),
                       "gold": mean(ours), "gold_reference": mean(theirs),
                       "gold_win_rate": wins / len(rows) if rows else None, "n": len(rows)})
    return points


FLOAT_ROUNDING = 1e-9  # win rates differ by at least 1 / judged^2 (~4e-6); below this, two numbers are the same


def digits_apart(value: float, *others: float, digits: int = 3) -> int:
    """The fewest decimals, from `digits` up to 6, at which `value` prints unlike each of `others` it differs from
    (by more than FLOAT_ROUNDING).

    A finding's number beside its bar: 104 wins of 231 (0.4502) printed as 0.450 would seem to meet a bar of
    0.45 that it misses, so it is printed as 0.4502."""
    decimals = digits
    while decimals < 6 and any(abs(value - other) > FLOAT_ROUNDING
                               and f"{value:.{decimals}f}" == f"{other:.{decimals}f}" for other in others):
        decimals += 1
    return decimals


def findings(art: dict) -> list:
    """The paper's findings, each against its bar in miniature: [{finding, bar, measured, holds}], holds None where a
    stage did not run (or, for the over-optimisation curve, where there is no bar: it is shown, not judged).
    A number that would print as its bar or as the number it is compared with gets the decimals that tell them apart."""
    runs, rows = art["judge"] or {}, []
    add = lambda finding, bar, measured, holds: rows.append(  # noqa: E731
        {"finding": finding, "bar": bar, "measured": measured, "holds": holds})

    def ci(run: dict, decimals: int = 3) -> str:
        return f"{run['win_rate']:.{decimals}f} [{run['ci_low']:.3f}, {run['ci_high']:.3f}]"

    def add_fig1(finding, bar, measured, holds, methods: tuple) -> None:
        # The "at least 256 posts": a bar whose win rates rest on fewer judged posts does not hold, and says why.
        short = [f"{METHODS[m]} judged on {runs[m]['n']}" for m in methods if runs.get(m) and runs[m]["n"] < MIN_POSTS]
        if short and holds is not None:
            measured, holds = f"{measured}; {', '.join(short)} posts, fewer than {MIN_POSTS}", False
        add(finding, bar, measured, holds)

    sft, ppo, dpo = runs.get("sft"), runs.get("ppo"), runs.get("dpo")
    low, high = SFT_WIN_RATE_RANGE
    add_fig1("Fig. 1: SFT loses to the references", f"SFT's win rate in [{low:.2f}, {high:.2f}]",
        ci(sft, digits_apart(sft["win_rate"], low, high)) if sft else "not run",
        low <= sft["win_rate"] <= high if sft else None, ("sft",))
    add_fig1("Fig. 1: PPO is at least even with the references", f"PPO's win rate >= {PPO_MIN_WIN_RATE:.2f}",
        ci(ppo, digits_apart(ppo["win_rate"], PPO_MIN_WIN_RATE)) if ppo else "not run",
        ppo["win_rate"] >= PPO_MIN_WIN_RATE if ppo else None, ("ppo",))
    both = sft is not None and ppo is not None
    gain = ppo["win_rate"] - sft["win_rate"] if both else None
    # A gain of exactly 0.20 (0.6 against 0.4) is 0.19999999999999996 in floating point, and meets the bar.
    add_fig1("Fig. 1: RLHF (PPO) beats SFT", f"PPO >= SFT + {PPO_MIN_GAIN:.2f}",
        f"PPO - SFT = {gain:+.{digits_apart(gain, PPO_MIN_GAIN)}f}" if both else "not run",
        gain >= PPO_MIN_GAIN - FLOAT_ROUNDING if both else None, ("sft", "ppo"))
    apart = digits_apart(ppo["ci_low"], sft["ci_high"]) if both else 3
    add_fig1("Fig. 1: ... beyond the noise", "PPO's CI above SFT's",
        f"PPO's lower bound {ppo['ci_low']:.{apart}f}, SFT's upper bound {sft['ci_high']:.{apart}f}" if both
        else "not run", ppo["ci_low"] > sft["ci_high"] if both else None, ("sft", "ppo"))
    apart = digits_apart(dpo["win_rate"], sft["win_rate"]) if dpo and sft else 3
    add_fig1("Fig. 1: DPO beats SFT", "DPO's win rate > SFT's",
        (f"DPO {ci(dpo, apart)}" + (f" (SFT {sft['win_rate']:.{apart}f})" if apart > 3 else ""))
        if dpo and sft else "not run", dpo["win_rate"] > sft["win_rate"] if dpo and sft else None, ("dpo", "sft"))
    for method in ("ppo", "dpo"):  # the bars are against the references; the direct comparison is shown
        run = art["head_to_head"].get(method)
        add(f"{method.upper()} against SFT, head to head (the gold judge)", "shown, no bar",
            ci(run) if run else "not run", None)
    rm, implicit = preference_accuracies(art["rm"], "eval/rm"), preference_accuracies(art["dpo"], "eval/dpo")
    for split, bar, finding in (("validation", RM_MIN_ACCURACY, "Fig. 4: the RM learns the labels"),
                                ("validation_cnndm", CNNDM_MIN_ACCURACY, "Fig. 4: the RM transfers to news (CNN/DM)")):
        value = rm.get((split, "labels"))
        add(finding, f"accuracy >= {bar:.2f}", "not run" if value is None else f"{value:.{digits_apart(value, bar)}f}",
            value >= bar if value is not None else None)
    reliance = length_reliance(art["rm_rows"].get("validation") or [])
    add("The RM and length: how often it prefers the shorter summary (TL;DR validation)", "shown, no bar",
        f"RM {reliance['model_shorter']:.3f}, labels {reliance['labels_shorter']:.3f}; right {fmt(reliance['chosen_longer'][0])} "
        f"of the time where the chosen is the longer" if reliance else "not run", None)
    value, theirs = rm.get(("validation", "labels")), implicit.get(("validation", "labels"))
    known = value is not None and theirs is not None
    apart = digits_apart(theirs, value) if known else 3
    add("Fig. 6: DPO's implicit reward is the weaker RM", "its accuracy < the RM's (TL;DR validation)",
        f"DPO {theirs:.{apart}f}, RM {value:.{apart}f}" if known else "not run", theirs < value if known else None)
    fig8 = fig8_comparison(art["judged"].get("sft"), art["judged"].get("ppo"))
    if fig8 is None:
        measured = "not run"
    elif not fig8["compared"]:
        measured = f"no bucket has {MIN_BUCKET} of each"
    else:
        compared, below = fig8["compared"], fig8["below"]
        measured = (f"PPO above in {len(compared) - len(below)} of {len(compared)} ({', '.join(compared)})"
                    + (f"; not above in {', '.join(below)}" if below else "")
                    + (f"; with {MIN_BUCKET} of one policy only, not above in {', '.join(fig8['one_sided_below'])}"
                       if fig8["one_sided_below"] else ""))
    add("Fig. 8: PPO's gain is not its length", f"PPO above SFT in every length bucket with >= {MIN_BUCKET} of each",
        measured, None if not fig8 or not fig8["compared"] else not fig8["below"])
    curve = [point for point in art["curve"] if point["gold"] is not None]
    if curve:
        peak = max(curve, key=lambda point: point["gold"])
        last = curve[-1]
        add("Over-optimisation (Gao et al. 2023): where the RM's score and the gold score part", "shown, no bar",
            f"gold peaks at update {peak['update']} ({peak['gold']:.3f}); at the last, update {last['update']}: "
            f"gold {last['gold']:.3f}, RM score {fmt(last['rm'])}", None)
    stages = [seconds for name, seconds in art["timings"] if name != WORLD_STAGE]  # a world built first is not the job
    total = sum(stages)
    # A stage resumed from a checkpoint (tiny.sh after an interruption) timed only what was left of it.
    resumed = [name for name, _ in art["timings"] if RESUMED in name]
    # A report of a partial run (stopped after the RM, say) times only the stages that ran: no verdict on the job.
    missing = [stage for stage in JOB_STAGES
               if not any(name == stage or name.startswith(stage + " (") for name, _ in art["timings"])]
    measured = f"{total // 60:.0f} min {total % 60:.0f} s" if stages else "no timings.tsv"
    if resumed:
        measured += f" (not judged: {'; '.join(resumed)}: continued from a checkpoint, so timed only in part)"
    elif stages and missing:
        measured += f" (not judged: no time for {', '.join(missing)}: the job did not run whole)"
    add("Time: the main job on 2 CPU cores", f"<= {TIME_BUDGET_S // 60} min of stages (a world's build apart)",
        measured, total <= TIME_BUDGET_S if stages and not resumed and not missing else None)
    return rows


def fig8_comparison(sft_judged: Optional[list], ppo_judged: Optional[list]) -> Optional[dict]:
    """Figure 8's check, buckets named "[low, high)": {"compared": buckets where SFT and PPO each have >= MIN_BUCKET
    judged summaries (a tie counts 1/2 in the rates), "below": those where PPO's win rate is
    not above SFT's, "one_sided_below": the same in the buckets where only one of them has that many (shown, not
    judged: the other's rate rests on few comparisons), with both rates and counts}; None when either did not run."""
    if not sft_judged or not ppo_judged:
        return None
    name = lambda bucket: f"[{bucket['low']:+.2f}, {bucket['high']:+.2f})"  # noqa: E731
    out = {"compared": [], "below": [], "one_sided_below": []}
    for a, b in zip(length_buckets(sft_judged), length_buckets(ppo_judged)):
        enough = (a["n"] >= MIN_BUCKET) + (b["n"] >= MIN_BUCKET)  # the "30 samples"
        below = a["n"] and b["n"] and not b["win_rate"] > a["win_rate"]
        if enough == 2:
            out["compared"].append(name(a))
            out["below"] += [name(a)] if below else []
        elif enough == 1 and below:
            out["one_sided_below"].append(f"{name(a)} (PPO {b['win_rate']:.3f} of {b['n']}, SFT {a['win_rate']:.3f} of {a['n']})")
    return out


def mistake_profile(pairs: list, world) -> dict:
    """(post, summary) pairs -> the gold judge's terms per summary, averaged: coverage, invented key words (and those
    of them that are feelings the post never states), irrelevant, repetition, rambling, words ({} for no pairs).
    `world`: the tiny_world module (gold_breakdown, words, FEELINGS)."""
    if not pairs:
        return {}
    rows = []
    for post, summary in pairs:
        terms = world.gold_breakdown(post, summary)
        guessed = {w for w in world.words(summary) if w in world.FEELINGS} - set(world.words(post))
        rows.append({**{k: terms[k] for k in ("coverage", "invented", "irrelevant", "repetition", "rambling")},
                     "invented_feelings": len(guessed), "words": terms["n_words"]})
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def token_shift(before_logits, after_logits, tokens) -> list:
    """Table 8: per token of a summary, its probability before (SFT) and after (PPO) and its rank before.

    before_logits, after_logits: (T, V) logits of the positions that predict `tokens` (T,). Rank 1 =
    the token the SFT model would pick greedily ("unshifted"), 2-3 "marginal", beyond 3 "shifted"
    (Lin et al. 2024, with SFT as the model before RLHF)."""
    import torch

    before, after = torch.softmax(before_logits.float(), -1), torch.softmax(after_logits.float(), -1)  # (T, V)
    index = tokens.view(-1, 1)
    p_before, p_after = before.gather(1, index)[:, 0], after.gather(1, index)[:, 0]  # (T,)
    ranks = (before > p_before[:, None]).sum(1) + 1  # (T,): 1 + tokens strictly more likely
    return [{"p_before": float(pb), "p_after": float(pa), "rank_before": int(r),
             "shift": "unshifted" if r == 1 else "marginal" if r <= 3 else "shifted"}
            for pb, pa, r in zip(p_before, p_after, ranks)]


# ------------------------------------------------------------------------------------------------
# Reading the run
# ------------------------------------------------------------------------------------------------
def read_json(path: str) -> Optional[dict]:
    """The JSON object at `path`, or None when the file does not exist (a stage that did not run)."""
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        try:
            return json.load(file)
        except json.JSONDecodeError as error:  # cut short or edited: name the file, not only the parser's position
            sys.exit(f"{path}: not valid JSON ({error}). Write it again: `bash benchmark/tiny.sh` rewrites "
                     "environment.json at every start and reruns a stage whose output folder is gone (rm -r it first).")


def read_csv(path: str) -> Optional[list]:
    """Rows of a CSV file as dicts (empty cells stay empty strings), or None when it does not exist."""
    if not os.path.isfile(path):
        return None
    with open(path, newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


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


def ppo_sample_tables(models: str, seed: int, runs_dir: str) -> tuple:
    """({episode: rows} of the PPO run's periodic evaluations, its batch size); ({}, None) if absent, or if the
    run's folder holds another run's tables (its last one is not ppo_{seed}/eval_validation.csv)."""
    args = read_json(os.path.join(models, f"ppo_{seed}", "args.json"))
    if args is None:
        return {}, None
    folder = os.path.join(runs_dir, args["run_name"])
    tables = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("samples_validation_") and name.endswith(".csv"):
            tables[int(name[len("samples_validation_"):-4])] = read_csv(os.path.join(folder, name))
    # Another run under the same run name rewrites the folder: its last table is then not this run's final one.
    final = read_csv(os.path.join(models, f"ppo_{seed}", "eval_validation.csv"))
    if tables and final is not None and tables[max(tables)] != final:
        print(f"note: {folder} holds another PPO run's samples (its last table is not ppo_{seed}/eval_validation.csv): "
              "the curve over PPO updates is left out", file=sys.stderr)
        return {}, None
    return tables, args["batch_size"]


def gold_judge():
    """tiny_world.gold_score (the report runs from anywhere; the module sits at the repository root)."""
    return tiny_world_module().gold_score


def tiny_world_module():
    """The tiny_world module (the gold judge and its lexicon), imported from the repository root."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import tiny_world

    return tiny_world


def load_artifacts(models: str, seed: int, world: Optional[str], runs_dir: str = "runs") -> dict:
    """Everything the report shows, read from a tiny run's folders; a missing stage is None."""
    stage = lambda name, file="eval_metrics.json": read_json(os.path.join(models, f"{name}_{seed}", file))  # noqa: E731
    judge = stage("judge", "results.json")
    runs, head_to_head, judged = {}, {}, {}
    for label, run in (judge or {}).get("runs", {}).items():
        if run.get("win_rate") is None:  # judged, but nothing decided (every row a tie, malformed or unjudged)
            continue
        if run.get("vs", "reference") == "reference" and label in (f"{m}__seed{seed}" for m in METHODS):
            runs[label.split("__")[0]] = run
            judged[label.split("__")[0]] = read_csv(os.path.join(models, f"judge_{seed}", "judged", f"{label}.csv"))
        elif run.get("vs") == f"sft__seed{seed}" and label.split("__")[0] in ("ppo", "dpo"):
            head_to_head[label.split("__")[0]] = run
    world_card = read_json(os.path.join(world, "world.json")) if world else None
    tables, batch_size = ppo_sample_tables(models, seed, runs_dir)
    curve = overoptimisation_curve(tables, batch_size, gold_judge()) if tables else []
    sft_samples = read_csv(os.path.join(models, f"sft_{seed}", "eval_validation.csv"))
    if curve and sft_samples:  # update 0: the SFT policy's samples (same prompts, same temperature 0.01)
        start = overoptimisation_curve({0: [dict(r, score="nan", reference_score="nan") for r in sft_samples]},
                                       batch_size, gold_judge())[0]
        curve.insert(0, dict(start, rm=None, rm_reference=None))
    world_module, mistakes = tiny_world_module(), {}
    for method in METHODS:  # each stage's validation summaries (and, from SFT's table, the references)
        rows = sft_samples if method == "sft" else read_csv(os.path.join(models, f"{method}_{seed}", "eval_validation.csv"))
        if rows:
            pairs = [(r["query"], r["response"]) for r in rows]
            mistakes[method] = mistake_profile(pairs, world_module)
            if method == "sft":
                mistakes["reference"] = mistake_profile([(r["query"], r["reference"]) for r in rows], world_module)
    return {"models": models, "seed": seed, "mistakes": mistakes,
            "environment": read_json(os.path.join(models, "environment.json")),
            "rouge": {method: (stage(method) or {}).get("validation") for method in ("base", "sft")},
            "rm": stage("reward"), "dpo": stage("dpo"), "ppo": (stage("ppo") or {}).get("validation"),
            "rm_rows": {split: read_csv(os.path.join(models, f"reward_{seed}", f"eval_{split}.csv")) for split in PREF_SPLITS},
            "dpo_rows": {split: read_csv(os.path.join(models, f"dpo_{seed}", f"eval_pairs_{split}.csv")) for split in PREF_SPLITS},
            "judge": runs if judge is not None else None, "judge_name": (judge or {}).get("model"),
            "judged": judged, "head_to_head": head_to_head, "curve": curve,
            "noise_ceiling": (world_card or {}).get("noise_ceiling"), "world_card": world_card,
            "timings": read_timings(os.path.join(models, "timings.tsv")), "tokens": None}


def compute_token_view(models: str, seed: int, n_posts: int = TOKEN_POSTS) -> Optional[list]:
    """Table 8: the first n validation posts where PPO's summary differs from SFT's, with token_shift per token.

    Probabilities at temperature 1 over the vocabulary the models can sample: [PAD] and the rows of
    the embedding beyond the tokenizer are masked, as in sampling. None when SFT or PPO did not run."""
    sft_dir, ppo_dir = os.path.join(models, f"sft_{seed}"), os.path.join(models, f"ppo_{seed}")
    ppo_rows, sft_rows = read_csv(os.path.join(ppo_dir, "eval_validation.csv")), read_csv(os.path.join(sft_dir, "eval_validation.csv"))
    if not ppo_rows or not sft_rows or not os.path.isfile(os.path.join(ppo_dir, "config.json")):
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ppo_dir)
    sft_model, ppo_model = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (sft_dir, ppo_dir))
    sft_by_query = {row["query"]: row["response"] for row in sft_rows}
    view = []
    for row in ppo_rows:
        if len(view) == n_posts:
            break
        sft_summary = sft_by_query.get(row["query"])
        if sft_summary is None or sft_summary == row["response"]:
            continue
        query = tokenizer(row["query"]).input_ids
        summary = tokenizer(" " + row["response"]).input_ids + [tokenizer.eos_token_id]
        ids = torch.tensor([query + summary])  # (1, T_q + T_s)
        with torch.no_grad():
            # (T_s, V): logits at position t predict token t + 1, so the summary is predicted by T_q - 1 ... T - 2
            logits = [m(input_ids=ids).logits[0, len(query) - 1:-1].float() for m in (sft_model, ppo_model)]
        unusable = torch.ones(logits[0].shape[1], dtype=torch.bool)
        unusable[: len(tokenizer)] = False
        unusable[tokenizer.pad_token_id] = True
        logits = [lg.masked_fill(unusable, -math.inf) for lg in logits]
        shifts = token_shift(logits[0], logits[1], torch.tensor(summary))
        texts = [tokenizer.decode([t]) for t in summary]
        view.append({"query": row["query"], "ppo": row["response"], "sft": sft_summary, "reference": row["reference"],
                     "tokens": [dict(s, token=t) for s, t in zip(shifts, texts)]})
    return view


# ------------------------------------------------------------------------------------------------
# The markdown page
# ------------------------------------------------------------------------------------------------
def fmt(value: Optional[float], digits: int = 3) -> str:
    """A number with `digits` decimals, or 'n/a'."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def preference_accuracies(metrics: Optional[dict], prefix: str) -> dict:
    """{(split, kind): accuracy} of a reward.py / dpo.py eval_metrics.json; kind 'labels' or 'gold'."""
    out = {}
    for split in PREF_SPLITS:
        for kind, suffix in (("labels", "accuracy"), ("gold", "gold_accuracy")):
            value = (metrics or {}).get(f"{prefix}/{split}/{suffix}")
            if value is not None:
                out[(split, kind)] = value
    return out


def environment_line(env: Optional[dict]) -> str:
    """One line: threads, versions, cores (or why they are unknown)."""
    if env is None:
        return "Environment: not recorded (no environment.json)."
    versions = ", ".join(f"{name} {version}" for name, version in env.get("versions", {}).items())
    # The CPU too: torch picks its kernels by the CPU's vector instructions (AVX2, AVX512, ...), and the same
    # run gives other numbers on another CPU (recorded since 2026-11-27; older runs have no "cpu").
    cpu = f" ({env['cpu']}; torch kernels for {env.get('cpu_capability')})" if env.get("cpu") else ""
    return (f"Environment: **{env.get('torch_threads')} torch threads** (OMP_NUM_THREADS="
            f"{env.get('omp_num_threads') or 'unset'}), {env.get('cpu_count')} CPU cores{cpu}, {versions}. "
            "The thread count and the CPU change the numbers (floating-point sums in another order), not only the time.")


def render_markdown(art: dict) -> str:
    """The report page: one section per finding of the paper, then the stages' other results and times."""
    lines = [f"# Tiny-world pipeline report (seed {art['seed']})", "",
             f"From the artifacts in `{art['models']}` (benchmark/tiny.sh), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             "All numbers are on the validation splits.", "", environment_line(art["environment"]), "",
             "![report](report.png)", ""]

    for section in (section_findings, section_win_rates, section_mistakes, section_lengths, section_overoptimisation,
                    section_rm_accuracy, section_calibration, section_dpo_as_rm, section_token_view,
                    section_other_results, section_time):
        lines += section(art)
    return "\n".join(lines) + "\n"


def section_findings(art: dict) -> list:
    """The paper's findings at a glance: each against its bar in miniature, measured here (the sections below)."""
    lines = ["## The paper's findings here", "",
             "Each finding of the paper against the bar it must clear in this tiny world (the paper's own numbers "
             "are for 1B-6.9B models); the sections below show the numbers in full.", "",
             "| finding | bar | measured | holds |", "|---|---|---|---|"]
    verdict = {True: "yes", False: "**no**", None: "n/a"}
    lines += [f"| {row['finding']} | {row['bar']} | {row['measured']} | {verdict[row['holds']]} |" for row in findings(art)]
    return lines + [""]


def section_win_rates(art: dict) -> list:
    """Figure 1: win rates against the references, and head to head against SFT."""
    judge_name = art["judge_name"] or "judge"
    lines = [f"## Figure 1: win rate against the human reference summaries ({judge_name}, Wilson 95% CI)", "",
             "Win rate = (wins + ties / 2) / judged: two summaries of equal gold score are a tie, which a judge made to "
             "pick one (the paper's) picks either way about half the time.", "",
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
        lines += ["", f"Head to head against SFT ({judge_name}, Wilson 95% CI):", "",
                  "| policy | win rate vs SFT | 95% CI | wins / judged | ties | mean words (SFT) |", "|---|---|---|---|---|---|"]
        for method, run in sorted(art["head_to_head"].items(), key=lambda item: list(METHODS).index(item[0])):
            lines.append(f"| {METHODS[method]} | {fmt(run['win_rate'])} | [{fmt(run['ci_low'])}, {fmt(run['ci_high'])}] | "
                         f"{run['wins']} / {run['n']} | {run.get('ties', 0)} | "
                         f"{fmt(run.get('mean_words'), 1)} ({fmt(run.get('mean_other_words'), 1)}) |")

    return lines


def section_mistakes(art: dict) -> list:
    """The gold judge's terms per summary of each policy and of the references."""
    lines = ["", "## What the summaries get wrong (the gold judge's terms, per summary)", "",
             "The gold score is 3 x coverage - 0.8 x invented - 0.4 x irrelevant - 0.3 x repetition - 0.1 x rambling "
             "(- 2 for an empty summary). "
             "Invented key words are words of the world's lexicon the post does not contain (a wrong name, a fact out "
             "of nowhere, a feeling the post never states: the tiny base model never learned to restate a post's "
             "feeling, so the models trained from it guess one; "
             "benchmark/results/tiny_main_job_notebook.md).", ""]
    shown = [m for m in (*METHODS, "reference") if art.get("mistakes", {}).get(m)]
    if shown:
        lines += ["| summaries | coverage | invented key words | of which guessed feelings | irrelevant | "
                  "repetition | rambling words | words |", "|---|---|---|---|---|---|---|---|"]
        for m in shown:
            p = art["mistakes"][m]
            lines.append(f"| {METHODS.get(m, 'the references')} | {fmt(p['coverage'])} | {fmt(p['invented'], 2)} | "
                         f"{fmt(p['invented_feelings'], 2)} | {fmt(p['irrelevant'], 2)} | "
                         f"{fmt(p['repetition'], 2)} | {fmt(p['rambling'], 2)} | {fmt(p['words'], 1)} |")
    else:
        lines.append("not run (no <stage>_<seed>/eval_validation.csv)")

    return lines


def section_lengths(art: dict) -> list:
    """Figure 8: win rate against the references by log(summary length / reference length)."""
    lines = ["", "## Figure 8: win rate against the references by log(summary length / reference length)", "",
             "Lengths in words; a bucket's win rate is over its n judged summaries, a tie counting 1/2 (the bar "
             f"compares the buckets with >= {MIN_BUCKET} of each). The paper's finding: "
             "PPO above SFT at every length, so its gain is not just longer summaries.", ""]
    buckets = {m: length_buckets(rows) for m, rows in art["judged"].items() if rows is not None and m != "base"}
    if buckets:
        shown = [m for m in ("sft", "ppo", "dpo") if m in buckets]
        lines += ["| log length ratio | " + " | ".join(f"{METHODS[m]} win rate (judged)" for m in shown) + " |",
                  "|---|" + "---|" * len(shown)]
        for k, (lo, hi) in enumerate(zip(LENGTH_EDGES[:-1], LENGTH_EDGES[1:])):
            cells = [f"{fmt(buckets[m][k]['win_rate'])} ({buckets[m][k]['n']})"
                     for m in shown]
            lines.append(f"| [{lo:+.2f}, {hi:+.2f}) | " + " | ".join(cells) + " |")
    else:
        lines.append("not run (no judged/<run>.csv)")

    return lines


def section_overoptimisation(art: dict) -> list:
    """The RM's score and the gold score over PPO updates (Gao et al. 2023)."""
    lines = ["", "## Over-optimisation: the RM's score and the gold score over PPO updates (Gao et al. 2023)", "",
             "Each row is a PPO evaluation of the validation posts (temperature 0.01; update 0 = the SFT model's "
             "samples, which the RM did not score). The RM's score is the proxy PPO maximises; the gold score is "
             "the truth. Where the RM keeps rising while gold falls, PPO exploits the RM.", ""]
    if art["curve"]:
        lines += ["| PPO update | RM score (references) | gold score (references) | gold win rate vs references |", "|---|---|---|---|"]
        for p in art["curve"]:
            lines.append(f"| {p['update']} | {fmt(p['rm'])} ({fmt(p['rm_reference'])}) | {fmt(p['gold'])} ({fmt(p['gold_reference'])}) "
                         f"| {fmt(p['gold_win_rate'])} |")
    else:
        lines.append("not run (no runs/<run_name>/samples_validation_*.csv)")

    return lines


def section_rm_accuracy(art: dict) -> list:
    """Figure 4: RM and DPO accuracy against the labels and the gold judge; Detail 16's batches and confidences."""
    ceiling = art["noise_ceiling"] or {}
    lines = ["", "## Figure 4: reward model accuracy", ""]
    if art["rm"] is None:
        lines.append("not run")
    else:
        lines += ["| model | split | accuracy vs the labels | noise ceiling | accuracy vs the gold judge |", "|---|---|---|---|---|"]
        for name, metrics, prefix in (("RM", art["rm"], "eval/rm"), ("DPO (implicit reward)", art["dpo"], "eval/dpo")):
            if metrics is None:
                lines.append(f"| {name} | | not run | | |")
                continue
            accuracies = preference_accuracies(metrics, prefix)
            for split, split_name in PREF_SPLITS.items():
                lines.append(f"| {name} | {split_name} | {fmt(accuracies.get((split, 'labels')))} | {fmt(ceiling.get(split))} "
                             f"| {fmt(accuracies.get((split, 'gold')))} |")
        rows = art["rm_rows"].get("validation")
        if rows:
            lines += ["", "Detail 16: the RM's accuracy on TL;DR validation differs by labeling batch (each adds "
                      "policies train never showed) and by the labeler's confidence (1-9; low confidence is near a coin flip).", "",
                      "| batch | accuracy (pairs) |", "|---|---|"]
            lines += [f"| {v} | {fmt(a)} ({n}) |" for v, a, n in grouped_accuracy(rows, "batch")]
            lines += ["", "| confidence | accuracy (pairs) |", "|---|---|"]
            lines += [f"| {v} | {fmt(a)} ({n}) |" for v, a, n in grouped_accuracy(rows, "confidence")]
        lines += section_length_reliance(art)

    return lines


def section_length_reliance(art: dict) -> list:
    """The RM's and DPO's choices against the summaries' lengths, on TL;DR validation (`length_reliance`)."""
    sources = (("RM", art["rm_rows"].get("validation")), ("DPO (implicit reward)", art["dpo_rows"].get("validation")))
    shown = [(name, reliance) for name, rows in sources if rows and (reliance := length_reliance(rows))]
    if not shown:
        return []
    lines = ["", "Length: over the validation pairs whose summaries differ in words, how often the labels and the model "
             "prefer the shorter one, and the model's accuracy split by which one the labels chose. In this world most "
             "mistakes add words, so the labels mostly prefer the shorter summary (the real data's chosen summary is "
             "slightly the longer one). A model that prefers the shorter more often than the labels do is wrong on "
             "many pairs where the chosen is the longer, and PPO learns its taste (Figure 8; words in Figure 1).", "",
             "| model | pairs | labels prefer the shorter | model prefers the shorter | accuracy, chosen the shorter "
             "(pairs) | accuracy, chosen the longer (pairs) |", "|---|---|---|---|---|---|"]
    for name, r in shown:
        (short_acc, short_n), (long_acc, long_n) = r["chosen_shorter"], r["chosen_longer"]
        lines.append(f"| {name} | {r['pairs']} | {fmt(r['labels_shorter'])} | {fmt(r['model_shorter'])} | "
                     f"{fmt(short_acc)} ({short_n}) | {fmt(long_acc)} ({long_n}) |")
    return lines


def section_calibration(art: dict) -> list:
    """Figure 5 (right): the RM's calibration on TL;DR validation."""
    lines = ["", "## Figure 5 (right): reward model calibration on TL;DR validation", "",
             "Accuracy against the labels per bin of |r_chosen - r_rejected|, beside sigmoid(margin): a calibrated "
             "RM lies on it (Bai et al. 2022).", ""]
    rows = art["rm_rows"].get("validation")
    if rows:
        lines += ["| \\|margin\\| | pairs | accuracy | calibrated |", "|---|---|---|---|"]
        for lo, hi, n, acc, ideal in calibration_bins(rows):
            lines.append(f"| [{lo:.1f}, {hi:.1f}) | {n} | {fmt(acc)} | {fmt(ideal)} |")
    else:
        lines.append("not run")

    return lines


def section_dpo_as_rm(art: dict) -> list:
    """Figure 6: DPO's implicit reward as a reward model beside the RM (Detail 19)."""
    rm_acc, dpo_acc = preference_accuracies(art["rm"], "eval/rm"), preference_accuracies(art["dpo"], "eval/dpo")
    lines = ["", "## Figure 6: DPO's implicit reward as a reward model (Detail 19)", ""]
    if art["rm"] is None or art["dpo"] is None:
        lines.append("not run")
    else:
        lines += ["| split | RM accuracy | DPO implicit-reward accuracy |", "|---|---|---|"]
        for split, split_name in PREF_SPLITS.items():
            lines.append(f"| {split_name} | {fmt(rm_acc.get((split, 'labels')))} | {fmt(dpo_acc.get((split, 'labels')))} |")

    return lines


def section_token_view(art: dict) -> list:
    """Table 8: PPO's summaries token by token, their probabilities under SFT and PPO."""
    lines = ["", "## Table 8: what PPO changed, token by token", ""]
    if not art["tokens"]:
        lines.append("not computed (no SFT or PPO model, or --no_tokens)")
    else:
        lines += ["For validation posts where PPO's summary differs from SFT's: each token of PPO's summary with its "
                  "probability under SFT and under PPO (temperature 1). Rank = its rank under SFT: 1 unshifted, "
                  "2-3 marginal, beyond 3 **shifted** (bold): where RLHF moved the policy (paper Table 8, Lin et al. 2024).", ""]
        for i, post in enumerate(art["tokens"], 1):
            body = post["query"].split("POST:")[-1].replace("TL;DR:", "").strip().replace("\n", " ")
            lines += [f"**Post {i}**: {body[:300]}{' ...' if len(body) > 300 else ''}", "",
                      f"- reference: {post['reference']}", f"- SFT: {post['sft']}", f"- PPO: {post['ppo']}", "",
                      "| token | p(SFT) | p(PPO) | rank under SFT |", "|---|---|---|---|"]
            for t in post["tokens"]:
                token = repr(t["token"])[1:-1].replace("|", "\\|")
                token = f"**{token}**" if t["shift"] == "shifted" else token
                lines.append(f"| {token} | {fmt(t['p_before'])} | {fmt(t['p_after'])} | {t['rank_before']} |")
            lines.append("")

    return lines


def section_other_results(art: dict) -> list:
    """ROUGE of the base and SFT models, PPO's RM scores and EOS rate."""
    lines = ["", "## Other results", "", "| stage | measure | value |", "|---|---|---|"]
    for method in ("base", "sft"):
        rouge = art["rouge"][method]
        value = "not run" if rouge is None else " / ".join(fmt(rouge.get(k)) for k in ("rouge1", "rouge2", "rougeL"))
        lines.append(f"| {'base model (no training)' if method == 'base' else 'SFT'} | ROUGE-1 / 2 / L | {value} |")
    ppo = art["ppo"]
    if ppo is None:
        lines.append("| PPO | RM score of its samples | not run |")
    else:
        lines.append(f"| PPO | RM score: its samples / the references | {fmt(ppo.get('score'))} / {fmt(ppo.get('reference_score'))} |")
        lines.append(f"| PPO | samples with an EOS | {fmt(ppo.get('eos_fraction'))} |")

    return lines


def section_time(art: dict) -> list:
    """Time per stage, with the environment."""
    lines = ["", "## Time per stage", "", environment_line(art["environment"]), "", "| stage | time |", "|---|---|"]
    for name, seconds in art["timings"]:
        lines.append(f"| {name} | {seconds:.0f} s |")
    total = sum(seconds for _, seconds in art["timings"])
    lines.append(f"| **total** | **{total // 60:.0f} min {total % 60:.0f} s** |" if art["timings"] else "| (no timings.tsv) | |")
    return lines


# ------------------------------------------------------------------------------------------------
# The figures
# ------------------------------------------------------------------------------------------------
def plot_report(art: dict, path: str) -> None:
    """One figure, one panel per finding: Figures 1, 8, over-optimisation, 4, 5, 6 and the time per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 4, figsize=(22, 10))  # filled row by row, in the order below
    for panel, ax in zip((panel_win_rates, panel_lengths, panel_overoptimisation, panel_rm_accuracy,
                          panel_accuracy_groups, panel_calibration, panel_dpo_as_rm, panel_time), axes.flat):
        panel(ax, art)

    figure.suptitle(f"benchmark/tiny.sh, seed {art['seed']}: {art['models']}")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def panel_win_rates(ax, art: dict) -> None:
    """Figure 1: win rates against the references (blue) and against SFT (cyan), with Wilson CIs."""
    names = [name.replace(" ", "\n") for name in METHODS.values()] + [f"{METHODS[m]}\nvs SFT" for m in ("ppo", "dpo") if m in art["head_to_head"]]
    runs = [(art["judge"] or {}).get(method) for method in METHODS] + [
        art["head_to_head"][m] for m in ("ppo", "dpo") if m in art["head_to_head"]]
    rates = [run["win_rate"] if run else 0.0 for run in runs]
    errors = [[max(0.0, run["win_rate"] - run["ci_low"]) if run else 0.0 for run in runs],  # max: rounding
              [max(0.0, run["ci_high"] - run["win_rate"]) if run else 0.0 for run in runs]]
    ax.bar(names, rates, yerr=errors, capsize=6,
               color=["tab:blue"] * len(METHODS) + ["tab:cyan"] * (len(names) - len(METHODS)))
    for x, run in enumerate(runs):
        ax.text(x, (run["ci_high"] if run else 0.0) + 0.01, "not run" if run is None else f"{run['win_rate']:.3f}",
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.05)
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    ax.set_ylabel("win rate vs the references (blue) / vs SFT (cyan)")
    ax.set_title(f"Fig. 1: win rate ({art['judge_name'] or 'judge'}, Wilson 95% CI)")


def panel_lengths(ax, art: dict) -> None:
    """Figure 8: win rate against the references by length bucket (buckets with >= 10 comparisons)."""
    for method, color in (("sft", "tab:orange"), ("ppo", "tab:green"), ("dpo", "tab:red")):
        rows = art["judged"].get(method)
        if not rows:
            continue
        points = [b for b in length_buckets(rows) if b["n"] >= 10]
        centers = [(max(b["low"], -1.05) + min(b["high"], 1.05)) / 2 for b in points]
        low_high = [wilson_interval(b["wins"], b["n"]) for b in points]
        ax.errorbar(centers, [b["win_rate"] for b in points], capsize=3, marker="o", color=color, label=METHODS[method],
                        yerr=[[max(0.0, b["win_rate"] - lo) for b, (lo, _) in zip(points, low_high)],  # max: rounding
                              [max(0.0, hi - b["win_rate"]) for b, (_, hi) in zip(points, low_high)]])
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    ax.set(xlabel="log(summary words / reference words)", ylabel="win rate vs the references", ylim=(-0.02, 1.02),
               title="Fig. 8: win rate by length (buckets with n >= 10)")
    if art["judged"]:
        ax.legend(fontsize=8)


def panel_overoptimisation(ax, art: dict) -> None:
    """Over-optimisation: RM score (proxy, left axis) and gold score (truth, right axis) over PPO updates."""
    curve = art["curve"]
    if curve:
        rm_points = [p for p in curve if p["rm"] is not None]
        ax.plot([p["update"] for p in rm_points], [p["rm"] for p in rm_points], "o-", color="tab:purple", label="RM score (proxy)")
        ax.set_ylabel("RM score of the samples", color="tab:purple")
        gold_axis = ax.twinx()
        gold_axis.plot([p["update"] for p in curve], [p["gold"] for p in curve], "s-", color="tab:green", label="gold score (truth)")
        gold_axis.axhline(curve[0]["gold_reference"], color="tab:green", linestyle=":", linewidth=1, label="gold score of the references")
        gold_axis.set_ylabel("gold score of the samples", color="tab:green")
        handles = ax.get_legend_handles_labels()[0] + gold_axis.get_legend_handles_labels()[0]
        ax.legend(handles=handles, fontsize=7, loc="lower right")
    else:
        ax.text(0.5, 0.5, "not run", transform=ax.transAxes, ha="center")
    ax.set(xlabel="PPO update (0 = SFT)", title="over-optimisation: proxy vs gold (Gao et al. 2023)")


def panel_rm_accuracy(ax, art: dict) -> None:
    """Figure 4 (bottom right): RM accuracy per split, against the labels and the gold judge."""
    groups = [("RM", preference_accuracies(art["rm"], "eval/rm"), art["rm"] is not None)]
    bars = [(f"{model}\n{PREF_SPLITS[split].split()[0]}\n{kind}", accuracies.get((split, kind)))
            for model, accuracies, ran in groups if ran for split in PREF_SPLITS for kind in ("labels", "gold")]
    colors = {"labels": "tab:orange", "gold": "tab:green"}
    for x, (label, value) in enumerate(bars):
        ax.bar(x, value or 0.0, color=colors[label.rsplit("\n", 1)[1]])
        ax.text(x, (value or 0.0) + 0.01, fmt(value), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    if not bars:
        ax.text(0.5, 0.5, "not run", transform=ax.transAxes, ha="center")
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":", label="chance")
    # Each split's own ceiling, over its bar against the labels (the gold judge's verdicts carry no label noise).
    ceilings = art["noise_ceiling"] or {}
    label_bars = [x for x, (label, _) in enumerate(bars) if label.endswith("\nlabels")]  # one a split, in order
    drawn = [(x, ceilings[split]) for x, split in zip(label_bars, PREF_SPLITS) if split in ceilings]
    for n, (x, ceiling) in enumerate(drawn):
        ax.hlines(ceiling, x - 0.45, x + 0.45, color="black", linewidth=0.8, linestyle="--",
                  label="noise ceiling of the labels" if n == 0 else None)
        ax.text(x - 0.45, ceiling + 0.01, f"{ceiling:.2f}", ha="left", va="bottom", fontsize=7)
    ax.set(ylim=(0, 1.05), ylabel="accuracy on preference pairs", title="Fig. 4: RM accuracy\n(TL;DR; CNN/DM, never trained on)")
    ax.legend(loc="lower right", fontsize=7)


def panel_accuracy_groups(ax, art: dict) -> None:
    """The per-batch and per-confidence accuracy of Detail 16 (the paper plots both)."""
    rows = art["rm_rows"].get("validation")
    if rows:
        by_batch, by_confidence = grouped_accuracy(rows, "batch"), grouped_accuracy(rows, "confidence")
        labels = [v.replace("batch", "b") for v, _, _ in by_batch] + [f"c{v}" for v, _, _ in by_confidence]
        values = [a for _, a, _ in by_batch] + [a for _, a, _ in by_confidence]
        ax.bar(range(len(values)), values, color=["tab:blue"] * len(by_batch) + ["tab:olive"] * len(by_confidence))
        ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=7)
    else:
        ax.text(0.5, 0.5, "not run", transform=ax.transAxes, ha="center")
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    ax.set(ylim=(0, 1.05), ylabel="RM accuracy vs the labels", title="Detail 16: per batch (blue), per confidence (olive)")


def panel_calibration(ax, art: dict) -> None:
    """Figure 5 (right): calibration of the RM (and of DPO's implicit reward) beside sigmoid(margin)."""
    for name, table, color in (("RM", art["rm_rows"].get("validation"), "tab:orange"), ("DPO", art["dpo_rows"].get("validation"), "tab:red")):
        if table:
            bins = [b for b in calibration_bins(table) if b[2] >= 5]
            ax.plot([(lo + hi) / 2 for lo, hi, *_ in bins], [acc for _, _, _, acc, _ in bins], "o-", color=color, label=name)
    grid = [i / 20 for i in range(0, 101)]
    ax.plot(grid, [1 / (1 + math.exp(-x)) for x in grid], color="black", linewidth=1, label="calibrated: sigmoid")
    ax.set(xlabel="|r_chosen - r_rejected| (bins of 0.5 with >= 5 pairs)", ylabel="accuracy vs the labels",
               ylim=(0.3, 1.02), title="Fig. 5 (right): calibration, TL;DR validation")
    ax.legend(fontsize=8)


def panel_dpo_as_rm(ax, art: dict) -> None:
    """Figure 6: RM vs DPO's implicit reward, accuracy on the labels."""
    rm_acc, dpo_acc = preference_accuracies(art["rm"], "eval/rm"), preference_accuracies(art["dpo"], "eval/dpo")
    for offset, (name, accuracies, color) in enumerate((("RM", rm_acc, "tab:orange"), ("DPO", dpo_acc, "tab:red"))):
        xs = [i + 0.38 * offset for i in range(len(PREF_SPLITS))]
        values = [accuracies.get((split, "labels")) or 0.0 for split in PREF_SPLITS]
        ax.bar(xs, values, width=0.36, color=color, label=name)
        for x, v in zip(xs, values):
            ax.text(x, v + 0.01, fmt(v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks([i + 0.19 for i in range(len(PREF_SPLITS))], list(PREF_SPLITS.values()))
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    ax.set(ylim=(0, 1.05), ylabel="accuracy vs the labels", title="Fig. 6: RM vs DPO implicit reward (Detail 19)")
    ax.legend(fontsize=8)


def panel_time(ax, art: dict) -> None:
    """The time per stage, with the thread count."""
    timings = art["timings"]
    ax.barh([name for name, _ in timings][::-1], [seconds for _, seconds in timings][::-1], color="tab:purple")
    for y, (_, seconds) in enumerate(timings[::-1]):
        ax.text(seconds, y, f" {seconds:.0f} s", va="center", fontsize=8)
    total = sum(seconds for _, seconds in timings)
    env = art["environment"] or {}
    ax.set_xlabel(f"seconds ({env.get('torch_threads', '?')} torch threads)")
    ax.set_title(f"time per stage (total {total / 60:.1f} min)" if timings else "time per stage (no timings.tsv)")
    ax.margins(x=0.25)


def plot_tokens(view: list, path: str) -> None:
    """Table 8 as bars: per token of PPO's summary, its probability under SFT and under PPO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(view), 1, figsize=(max(8, 0.42 * max(len(p["tokens"]) for p in view)), 3.2 * len(view)),
                                squeeze=False)
    colors = {"unshifted": "tab:blue", "marginal": "gold", "shifted": "tab:red"}
    for ax, (i, post) in zip(axes[:, 0], enumerate(view, 1)):
        xs = range(len(post["tokens"]))
        ax.bar([x - 0.2 for x in xs], [t["p_before"] for t in post["tokens"]], width=0.4, color="lightgrey", label="p(SFT)")
        ax.bar([x + 0.2 for x in xs], [t["p_after"] for t in post["tokens"]], width=0.4,
               color=[colors[t["shift"]] for t in post["tokens"]], label="p(PPO), colour = rank under SFT")
        ax.set_xticks(list(xs), [repr(t["token"])[1:-1] for t in post["tokens"]], rotation=60, fontsize=8)
        ax.set(ylim=(0, 1.05), ylabel="probability", title=f"post {i}: PPO's summary (blue: SFT's top token, "
               "yellow: SFT's 2nd-3rd, red: beyond SFT's top 3)")
        ax.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)  # --help shows --flag_name as the docs write it; --flag-name works too
    artifacts = load_artifacts(args.models, args.seed, args.world, args.runs_dir)
    if args.tokens:
        artifacts["tokens"] = compute_token_view(args.models, args.seed)
    markdown = render_markdown(artifacts)
    with open(os.path.join(args.models, "report.md"), "w") as file:
        file.write(markdown)
    with open(os.path.join(args.models, "findings.json"), "w") as file:  # the checklist, to compare worlds
        json.dump({"seed": args.seed, "world": args.world, "environment": artifacts["environment"],
                   "findings": findings(artifacts)}, file, indent=1)
    plot_report(artifacts, os.path.join(args.models, "report.png"))
    if artifacts["tokens"]:
        plot_tokens(artifacts["tokens"], os.path.join(args.models, "report_tokens.png"))
    print(markdown)
    print(f"saved {args.models}/report.md, report.png" + (", report_tokens.png" if artifacts["tokens"] else ""))

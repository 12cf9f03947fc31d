"""Does PPO work, and is the reward model what holds it back? ppo.py with the gold judge as its reward.

The main job's PPO beats SFT by less than issue 15 asks, and on some worlds not at all (README). Two things
could be at fault: PPO itself (the implementation, or the main job's budget of 20 updates), or the reward model
PPO climbs. This script tells them apart, after benchmark/tiny.sh, on the tiny world, where the gold judge
is the truth:

- the gold reward: ppo.py, unchanged but for one function. The score of a query and its response
  (`ppo.get_score`: the RM's output at the EOS, Detail 14) becomes `tiny_world.gold_score` of the decoded post
  and summary: the gold reward model of Gao et al. (2023). Everything else is ppo.py's: the critic still
  starts from the RM (Detail 22), the KL penalty, the EOS trick, GAE, whitening and the PPO epochs;
- beside it, ppo.py with the RM, for as many updates;
- the gold reward normalised as the RM is (Detail 15): less the mean gold score of the train split's reference
  summaries, so that the references score 0 on average, as they do by the RM (--normalised_gold_updates);
- with --zero_critic_head, every run's critic starts with its head zeroed (its first values 0) instead of as the RM
  (Detail 22), whose outputs before the EOS were never trained (Detail 13): does the critic's start steer PPO's
  first updates? (`rm_diagnostics.py` measures that start: the first TD errors of the EOS token and the others.)
  The main job zeroes it too since 2026-11-28 (tiny.sh passes ppo.py's --zero_critic_head, and every run here
  repeats the main job's flags); `--ppo_flags=--no_zero_critic_head` starts every run from the RM's head.

Every run uses the main job's PPO settings (read from {models}/ppo_{seed}/args.json); only the number of
updates and the output folders differ. This is a diagnostic, not RLHF: it reads the gold judge, which nothing on
the pipeline's path does.

    python benchmark/ppo_gold_reward.py          # after tiny.sh: gold reward at 20 and 80 updates, RM at 80 (~12 min)
    python benchmark/ppo_gold_reward.py --models /tmp/m --seed 2 --gold_updates 20 --rm_updates 40
    python benchmark/ppo_gold_reward.py --gold_updates --normalised_gold_updates 20 40 --rm_updates   # ~4 min
    python benchmark/ppo_gold_reward.py --gold_updates --normalised_gold_updates 20 --rm_updates 20 --zero_critic_head
    python benchmark/ppo_gold_reward.py --gold_updates --normalised_gold_updates 20 --rm_updates 20 \
        --ppo_flags "--cliprange_value 1e6"     # any ppo.py flags on top of the main job's (here: no value clipping)

Writes {models}/ppo_gold_reward/: report.md (and prints it), curves.png, a folder per run with its ppo.log (follow
a run with `tail -f`). Each call starts its runs afresh. The other mode,

    python benchmark/ppo_gold_reward.py ppo <ppo.py's flags>

is ppo.py itself with the gold reward (what the runs above call); `ppo --normalised ...` with the normalised one,
and `ppo --rm ...` with the RM (ppo.py's own flags follow, --zero_critic_head among them).
"""

import argparse
import itertools
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmark"))

# The main job's PPO settings that every run here repeats (paths, seed, scale knobs, every algorithm setting).
# The rest of args.json is either what this script sets (updates, folders, evaluations) or derived by ppo.py.
SAME_AS_MAIN_JOB = ("base_model", "query_dataset", "sft_model_path", "reward_model_path", "seed", "response_length",
                    "temperature", "eval_temperature", "num_eval_samples", "lr", "eps", "weight_decay", "batch_size",
                    "num_minibatches", "local_micro_batch_size", "local_rollout_forward_batch_size",
                    "local_eval_batch_size", "num_ppo_epochs", "kl_coef", "gamma", "lam", "cliprange",
                    "cliprange_value", "vf_coef", "whiten_rewards", "non_eos_penalty", "penalty_reward_value",
                    "score_after_eos", "zero_critic_head")


def gold_scores(tokenizer, query_responses, pad_token_id: int, context_length: int) -> list:
    """(B, T) left-padded query ++ response ids -> [B] tiny_world.gold_score(decoded query, decoded response).

    The judge reads what judge.py reads: the whole query (SUBREDDIT, TITLE, POST, TL;DR:) and the summary without
    its pads and EOS."""
    import tiny_world

    scores = []
    for row in query_responses.tolist():
        query = tokenizer.decode([t for t in row[:context_length] if t != pad_token_id], skip_special_tokens=True)
        response = tokenizer.decode([t for t in row[context_length:] if t != pad_token_id], skip_special_tokens=True)
        scores.append(tiny_world.gold_score(query.strip(), response.strip()))
    return scores


def reference_mean_gold(tokenizer, train) -> float:
    """The mean gold score of the reference summaries of `train` (ppo.py's query dataset split), decoded as
    gold_scores decodes PPO's samples: the shift that Detail 15 takes off the RM, for the gold judge."""
    import torch

    queries, references = (torch.tensor(train[column]) for column in ("query_token", "reference_response_token"))
    scores = gold_scores(tokenizer, torch.cat((queries, references), 1), tokenizer.pad_token_id, queries.shape[1])
    return sum(scores) / len(scores)


def ppo_variant(ppo_argv: list, reward: str = "gold") -> None:
    """Run ppo.py's main() with `reward`: "gold" (`get_score` replaced by the gold judge, decoding with ppo.py's own
    tokenizer), "normalised gold" (the same less the references' mean gold score, so that they score 0 on average, as
    the RM's do: Detail 15) or "RM" (ppo.py's own)."""
    import torch

    import ppo

    tokenizers, shift = [], [0.0]
    ppo_inputs = ppo.ppo_inputs

    def inputs_keeping_the_tokenizer(args, accelerator):
        loaded = ppo_inputs(args, accelerator)  # (dataset, eval splits, tokenizer, recorded)
        tokenizers.append(loaded[2])
        if reward == "normalised gold":
            shift[0] = reference_mean_gold(loaded[2], loaded[0]["train"])
            accelerator.print(f"gold reward less the train references' mean gold score, {shift[0]:.4f}")
        return loaded

    def gold_score(model, query_responses, pad_token_id: int, context_length: int, groups: int = 1):
        # groups: ppo.get_score's length groups (speed only), which the gold judge has no use for
        scores = gold_scores(tokenizers[0], query_responses, pad_token_id, context_length)
        return torch.tensor(scores, dtype=torch.float32, device=query_responses.device) - shift[0]

    if reward != "RM":
        ppo.ppo_inputs, ppo.get_score = inputs_keeping_the_tokenizer, gold_score
    sys.argv = ["ppo.py", *ppo_argv]
    finished = False
    try:  # as ppo.py's own __main__
        ppo.main()
        finished = True
    finally:
        ppo.leave_process_group(finished)


def job_root(models: str, main_job: dict) -> str:
    """The folder the main job ran in, against which its args.json's relative paths resolve. tiny.sh runs at the
    root of its checkout and writes $MODELS/ppo_{seed}: `models` less the relative $MODELS the args.json's
    output_dir names (/clone/models/tiny and models/tiny/ppo_1 -> /clone); else this checkout's root."""
    output_dir = str(main_job.get("output_dir") or "")
    relative = os.path.dirname(os.path.normpath(output_dir))
    absolute = os.path.abspath(models)
    if output_dir and relative and not os.path.isabs(output_dir) and absolute.endswith(os.sep + relative):
        return absolute[: -len(relative) - 1]
    return ROOT


def ppo_flags(main_job: dict, updates: int, output_dir: str, run_name: str, eval_every: int, root: str = ROOT) -> list:
    """ppo.py's flags for a run like the main job's (its args.json), with `updates` updates; `root`: job_root."""
    flags = []
    for key in SAME_AS_MAIN_JOB:
        value = main_job.get(key)  # None: a flag the main job's ppo.py did not have yet (it ran at the default)
        if isinstance(value, bool):
            flags.append(f"--{'' if value else 'no-'}{key.replace('_', '-')}")
        elif value is not None:
            # A path relative to where tiny.sh ran (its checkout's root); a Hub id stays as it is.
            at_root = os.path.join(root, str(value))
            flags += [f"--{key}", at_root if not os.path.isabs(str(value)) and os.path.exists(at_root) else str(value)]
    return flags + ["--total_episodes", str(updates * main_job["batch_size"]), "--output_dir", output_dir,
                    "--run_name", run_name, "--eval_every", str(eval_every)]


def judge(rows: list, other_rows: list = None) -> dict:
    """Gold win rate of `rows` (query, response, reference) against their references, or against `other_rows`
    matched by query: {wins (a tie 1/2, as judge.py counts it), judged, win_rate, ci, gold, words, mistakes}, where
    mistakes is tiny_report.mistake_profile of the rows (the gold judge's terms per summary)."""
    import tiny_world
    from tiny_report import mistake_profile, wilson_interval, win_credit

    others = {row["query"].strip(): row["response"] for row in other_rows} if other_rows is not None else None
    wins, judged = 0.0, 0
    gold = []
    for row in rows:
        post = row["query"].strip()
        ours = tiny_world.gold_score(post, row["response"].strip())
        gold.append(ours)
        if others is not None and post not in others:
            continue
        theirs = tiny_world.gold_score(post, (others[post] if others is not None else row["reference"]).strip())
        margin = tiny_world.gold_difference(ours, theirs)
        wins += win_credit(margin)
        judged += 1
    mistakes = mistake_profile([(row["query"].strip(), row["response"].strip()) for row in rows], tiny_world)
    return {"wins": wins, "judged": judged, "win_rate": wins / judged if judged else float("nan"),
            "ci": wilson_interval(wins, judged), "gold": sum(gold) / len(gold), "words": mistakes["words"],
            "mistakes": mistakes}


def run_curve(folder: str, batch_size: int) -> list:
    """The main job report's over-optimisation curve (tiny_report.overoptimisation_curve: update, rm = the run's
    reward, gold, gold_win_rate ...) of a run's periodic evaluations (samples_validation_*.csv), with the mean words."""
    import tiny_world
    from tiny_report import gold_judge, overoptimisation_curve, read_csv

    names = os.listdir(folder) if os.path.isdir(folder) else []
    tables = {int(name[len("samples_validation_"):-4]): read_csv(os.path.join(folder, name)) for name in names
              if name.startswith("samples_validation_") and name.endswith(".csv")}
    points = overoptimisation_curve(tables, batch_size, gold_judge())
    for point in points:
        rows = tables[point["episode"]]
        point["words"] = sum(len(tiny_world.words(row["response"])) for row in rows) / len(rows)
    return points


def run_note(zero_critic_head: bool, extra_flags) -> str:
    """What sets a run apart from the main job's settings, for its labels: ", critic head zeroed, --flag value"."""
    return (", critic head zeroed" if zero_critic_head else "") + (f", {' '.join(extra_flags)}" if extra_flags else "")


def updates_text(updates: int) -> str:
    """'1 update', '20 updates'."""
    return f"{updates} update{'' if updates == 1 else 's'}"


def render(entries: list, curves: dict, header: str) -> str:
    """The report: a row per policy (final evaluation), then each run's curve."""
    fmt_ci = lambda ci: f"[{ci[0]:.3f}, {ci[1]:.3f}]"  # noqa: E731
    lines = [header, "",
             "| policy | reward | updates | win rate vs the references [95% CI] | win rate vs SFT [95% CI] | mean gold score | "
             "coverage | invented key words (guessed feelings) | words |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        ref, sft = e["vs_references"], e.get("vs_sft")
        vs_sft = f"{sft['win_rate']:.3f} {fmt_ci(sft['ci'])}" if sft else "-"
        lines.append(f"| {e['label']} | {e['reward']} | {e['updates']} | {ref['win_rate']:.3f} {fmt_ci(ref['ci'])} | "
                     f"{vs_sft} | {ref['gold']:.3f} | {ref['mistakes']['coverage']:.3f} | {ref['mistakes']['invented']:.2f} "
                     f"({ref['mistakes']['invented_feelings']:.2f}) | {ref['words']:.1f} |")
    for label, curve in curves.items():
        lines += ["", f"**{label}**: each periodic evaluation of the validation posts (the score is the run's reward: "
                  "the RM's or the gold judge's).", "",
                  "| update | reward score | mean gold score | gold win rate vs the references | words |", "|---|---|---|---|---|"]
        lines += [f"| {p['update']} | {p['rm']:.3f} | {p['gold']:.3f} | "
                  f"{'-' if p['gold_win_rate'] is None else format(p['gold_win_rate'], '.3f')} | {p['words']:.1f} |"
                  for p in curve]
    return "\n".join(lines) + "\n"


def plot(curves: dict, start: float, path: str) -> None:
    """Gold win rate against the references over PPO updates, a line per run, from SFT's (update 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    for label, curve in curves.items():
        win_rates = [math.nan if p["gold_win_rate"] is None else p["gold_win_rate"] for p in curve]  # None: all ties
        axis.plot([0] + [p["update"] for p in curve], [start] + win_rates, marker="o", markersize=3, label=label)
    axis.axhline(0.5, color="grey", linewidth=0.8, linestyle="--")
    axis.set_xlabel("PPO update")
    axis.set_ylabel("gold win rate vs the references")
    axis.set_title("PPO with a perfect reward and with the RM (tiny world)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="models/tiny", help="tiny.sh's $MODELS: sft_{seed}, reward_{seed}, ppo_{seed}")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gold_updates", type=int, nargs="*", default=[20, 80],
                        help="a gold-reward run of each length (20: the main job's)")
    parser.add_argument("--normalised_gold_updates", type=int, nargs="*", default=[],
                        help="a run of each length with the gold reward less the references' mean gold score "
                             "(Detail 15's shift, which the RM has: the references score 0 on average)")
    parser.add_argument("--rm_updates", type=int, nargs="*", default=[80],
                        help="an RM-reward run of each length (the main job's own PPO run is shown too)")
    parser.add_argument("--zero_critic_head", action="store_true",
                        help="every run's critic starts from the RM with its head zeroed (first values 0), not the RM "
                             "itself (Detail 22): does the critic's start steer PPO's first updates?")
    parser.add_argument("--ppo_flags", type=shlex.split, default=[],
                        help="ppo.py flags added to every run after the main job's, as one quoted string (a "
                             "diagnostic: \"--cliprange_value 1e6\" turns value clipping off); its runs' folders end "
                             "in _flags")
    parser.add_argument("--eval_every", type=int, default=5, help="updates between the evaluations of a run's curve")
    parser.add_argument("--runs_dir", default=None,
                        help="where the main job's ppo.py wrote <run_name>/ (default: runs/ of the checkout the main "
                             "job ran in, see job_root)")
    return parser.parse_args()


def run_ppo(reward: str, updates: int, main_job: dict, out: str, eval_every: int, started: float,
            zero_critic_head: bool = False, extra_flags: tuple = (), root: str = ROOT) -> tuple:
    """One PPO run with the main job's settings and `extra_flags` after them, the gold judge's or the RM's reward
    (ppo_variant), in out/<reward>_<updates>[_zero_critic][_flags]: (its validation samples, its evaluation curve);
    exits with the log's tail when the run fails. `started`: when the first run began (for the progress line)."""
    from tiny_report import read_csv

    name = (f"{reward.lower().replace(' ', '_')}_{updates}" + ("_zero_critic" if zero_critic_head else "")
            + ("_flags" if extra_flags else ""))
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run starts afresh (ppo.py refuses a used output folder)
    os.makedirs(run_dir)
    flags = ppo_flags(main_job, updates, os.path.abspath(os.path.join(run_dir, "ppo")), f"ppo_{name}", eval_every, root)
    flags += ["--zero_critic_head"] if zero_critic_head else []  # ppo.py's own flag
    flags += list(extra_flags)  # after the main job's: ppo.py takes a flag's last value
    variant = {"gold": [], "normalised gold": ["--normalised"], "RM": ["--rm"]}[reward]
    command = ([sys.executable, os.path.abspath(__file__), "ppo", *variant] if variant != ["--rm"]
               else [sys.executable, os.path.join(ROOT, "ppo.py")]) + flags  # ppo.py itself for the plain RM run
    print(f"=== PPO, {reward} reward{run_note(zero_critic_head, extra_flags)}, {updates_text(updates)} "
          f"({time.time() - started:.0f} s so far; "
          f"log: {run_dir}/ppo.log)", flush=True)
    with open(os.path.join(run_dir, "ppo.log"), "w") as log:  # its runs/ folder lands in run_dir
        if zero_critic_head:
            log.write("the critic's head zeroed: every first value is 0\n")
            log.flush()
        failed = subprocess.run(command, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT).returncode != 0
    if failed:
        with open(os.path.join(run_dir, "ppo.log")) as log:
            tail = "".join(log.readlines()[-15:])
        sys.exit(f"{tail}\nppo_gold_reward.py: the run failed (its last lines above); its log: {run_dir}/ppo.log")
    return (read_csv(os.path.join(run_dir, "ppo", "eval_validation.csv")),
            run_curve(os.path.join(run_dir, "runs", f"ppo_{name}"), main_job["batch_size"]))


def main() -> None:
    args = parse_args()

    from tiny_report import read_csv

    main_dir, sft_dir = os.path.join(args.models, f"ppo_{args.seed}"), os.path.join(args.models, f"sft_{args.seed}")
    main_job = None
    if os.path.isfile(os.path.join(main_dir, "args.json")):
        with open(os.path.join(main_dir, "args.json")) as file:
            main_job = json.load(file)
    sft_rows = read_csv(os.path.join(sft_dir, "eval_validation.csv"))
    if main_job is None or sft_rows is None:
        sys.exit(f"ppo_gold_reward.py: {main_dir}/args.json or {sft_dir}/eval_validation.csv is missing: "
                 "run `bash benchmark/tiny.sh` first (or pass --models and --seed of such a run)")
    out = os.path.join(args.models, "ppo_gold_reward")
    os.makedirs(out, exist_ok=True)

    entries = [{"label": "SFT", "reward": "-", "updates": 0, "vs_references": judge(sft_rows)}]
    main_rows = read_csv(os.path.join(main_dir, "eval_validation.csv"))
    if main_rows is not None:
        entries.append({"label": "PPO, the main job", "reward": "RM", "updates": main_job["num_updates"],
                        "vs_references": judge(main_rows), "vs_sft": judge(main_rows, sft_rows)})
    curves, started = {}, time.time()
    root = job_root(args.models, main_job)  # the main job's relative paths (models, data, world) resolve there
    runs_dir = args.runs_dir or os.path.join(root, "runs")
    main_curve = run_curve(os.path.join(runs_dir, main_job["run_name"]), main_job["batch_size"])
    if main_curve:
        curves[f"RM reward, {updates_text(main_job['num_updates'])} (the main job)"] = main_curve
    runs = ([("gold", u) for u in args.gold_updates] + [("normalised gold", u) for u in args.normalised_gold_updates]
            + [("RM", u) for u in args.rm_updates])
    note = run_note(args.zero_critic_head, args.ppo_flags)
    for reward, updates in runs:
        rows, curve = run_ppo(reward, updates, main_job, out, args.eval_every, started, args.zero_critic_head,
                              args.ppo_flags, root)
        entries.append({"label": f"PPO, {reward} reward{note}", "reward": reward, "updates": updates,
                        "vs_references": judge(rows), "vs_sft": judge(rows, sft_rows)})
        curves[f"{reward} reward{note}, {updates_text(updates)}"] = curve

    import torch

    header = (f"# PPO with the gold judge as its reward, beside the RM ({args.models}, seed {args.seed})\n\n"
              f"Every run uses the main job's PPO settings (batch {main_job['batch_size']}, lr {main_job['lr']}, "
              f"KL coefficient {main_job['kl_coef']}, {main_job['response_length']} response tokens), evaluated on "
              f"the validation posts at temperature {main_job['eval_temperature']}; win rates by the gold judge "
              f"(a tie counts 1/2), Wilson 95% CIs. {torch.get_num_threads()} torch threads; "
              f"{time.time() - started:.0f} s of PPO runs.")
    report = render(entries, curves, header)
    with open(os.path.join(out, "report.md"), "w") as file:
        file.write(report)
    if curves:
        plot(curves, entries[0]["vs_references"]["win_rate"], os.path.join(out, "curves.png"))
    print(report)


if __name__ == "__main__":
    if sys.argv[1:2] == ["ppo"]:
        options = list(itertools.takewhile(lambda word: word in ("--normalised", "--rm"), sys.argv[2:]))
        reward = "normalised gold" if "--normalised" in options else "RM" if "--rm" in options else "gold"
        ppo_variant(sys.argv[2 + len(options):], reward)
    else:
        main()

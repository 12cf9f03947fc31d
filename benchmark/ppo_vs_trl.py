"""Side-by-side PPO throughput: ppo.py against TRL 1.12.0's PPOTrainer on the same tiny run.

Started by benchmark/ppo_vs_trl.sh (which builds the TRL venv). Runs ppo.py (project venv) and
benchmark/ppo_vs_trl_trl.py (TRL venv) alternately, `--rounds` times each, with the same models,
prompts, batch, micro batch, rollout chunk, response length, PPO epochs, minibatches and thread
count. Every run does `--updates` updates; the first (warm-up: lazy inits, allocator growth) is
left out of the timing. Episodes per second = timed episodes / timed wall time of the updates
(process start, model loading and saving are not counted). Prints and writes a markdown table.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def load_average() -> str:
    """The 1-minute load average (other processes share the cores: report it beside every number)."""
    return f"{os.getloadavg()[0]:.2f}"


def execute(command: list, workdir: str) -> str:
    """Run `command` in `workdir`; its stdout, or exit with the tail of its output if it failed."""
    result = subprocess.run(command, cwd=workdir, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
    return result.stdout


def run_ours(args, workdir: str, index: int) -> list:
    """Run ppo.py for args.updates updates; [{total, generation, scoring, training}] per update."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_name = f"ours_{index}"
    command = [args.ours_python, os.path.join(ROOT, "ppo.py"), "--base_model", args.base_model,
               "--query_dataset", args.query_dataset, "--sft_model_path", args.sft_model_path,
               "--reward_model_path", args.reward_model_path, "--output_dir", os.path.join(workdir, run_name),
               "--run_name", run_name, "--seed", str(args.seed), "--total_episodes", str(args.updates * args.batch_size),
               "--batch_size", str(args.batch_size), "--local_micro_batch_size", str(args.local_micro_batch_size),
               "--local_rollout_forward_batch_size", str(args.local_rollout_forward_batch_size),
               "--num_minibatches", str(args.num_minibatches), "--num_ppo_epochs", str(args.num_ppo_epochs),
               "--response_length", str(args.response_length), "--temperature", str(args.temperature),
               "--kl_coef", str(args.kl_coef), "--lr", str(args.lr), "--num_eval_samples", "0"]
    execute(command, workdir)
    events = EventAccumulator(os.path.join(workdir, "runs", run_name))
    events.Reload()
    scalars = {tag: [event.value for event in events.Scalars(f"time/{tag}")]
               for tag in ("generation", "scoring", "training", "episodes_per_second")}
    # time/episodes_per_second = episodes so far / seconds since the loop started: the clock at
    # the end of update k is k * batch / eps_k, and an update's wall time is the difference.
    clock = [0.0] + [(k + 1) * args.batch_size / eps for k, eps in enumerate(scalars["episodes_per_second"])]
    return [{"total": clock[k + 1] - clock[k], "generation": scalars["generation"][k],
             "scoring": scalars["scoring"][k], "training": scalars["training"][k]} for k in range(args.updates)]


def run_trl(args, workdir: str, index: int) -> list:
    """Run TRL's PPOTrainer (in the TRL venv) for args.updates updates; the same dicts as run_ours."""
    command = [args.trl_python, os.path.join(ROOT, "benchmark", "ppo_vs_trl_trl.py"), "--base_model", args.base_model,
               "--query_dataset", args.query_dataset, "--sft_model_path", args.sft_model_path,
               "--reward_model_path", args.reward_model_path, "--output_dir", os.path.join(workdir, f"trl_{index}"),
               "--updates", str(args.updates), "--seed", str(args.seed), "--batch_size", str(args.batch_size),
               "--local_micro_batch_size", str(args.local_micro_batch_size),
               "--local_rollout_forward_batch_size", str(args.local_rollout_forward_batch_size),
               "--num_minibatches", str(args.num_minibatches), "--num_ppo_epochs", str(args.num_ppo_epochs),
               "--response_length", str(args.response_length), "--temperature", str(args.temperature),
               "--kl_coef", str(args.kl_coef), "--lr", str(args.lr)]
    line = [line for line in execute(command, workdir).splitlines() if line.startswith("TIMINGS ")][-1]
    return json.loads(line[len("TIMINGS "):])["updates"]


def summarize(runs: list, batch_size: int) -> dict:
    """Per-update dicts of several runs, warm-up update dropped -> episodes/s and mean seconds per update."""
    timed = [update for updates in runs for update in updates[1:]]
    total = sum(update["total"] for update in timed)
    out = {"episodes_per_second": len(timed) * batch_size / total}
    for key in ("total", "generation", "scoring", "training"):
        out[key] = sum(update[key] for update in timed) / len(timed)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ours_python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    parser.add_argument("--trl_python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    parser.add_argument("--base_model", default=os.path.join(ROOT, "assets/tiny_world/pythia-tiny"))
    parser.add_argument("--query_dataset", default=os.path.join(ROOT, "data/tiny_tldr/sft"))
    parser.add_argument("--sft_model_path", default=os.path.join(ROOT, "models/tiny/sft_1"))
    parser.add_argument("--reward_model_path", default=os.path.join(ROOT, "models/tiny/reward_1"))
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, alternating ours, TRL, ours, TRL, ...")
    parser.add_argument("--updates", type=int, default=4, help="updates per run; the first is warm-up, not timed")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--local_micro_batch_size", type=int, default=16)
    parser.add_argument("--local_rollout_forward_batch_size", type=int, default=64)
    parser.add_argument("--num_minibatches", type=int, default=1)
    parser.add_argument("--num_ppo_epochs", type=int, default=4)
    parser.add_argument("--response_length", type=int, default=44)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--kl_coef", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results", "ppo_vs_trl.md"))
    args = parser.parse_args()
    args.ours_python, args.trl_python = os.path.abspath(args.ours_python), os.path.abspath(args.trl_python)
    flags = sys.argv[1:]  # for the report: the flags given, less the interpreters the .sh passes
    for name in ("--ours_python", "--trl_python"):
        if name in flags:
            del flags[flags.index(name):flags.index(name) + 2]
    for path in (args.query_dataset, args.sft_model_path, args.reward_model_path):
        if not os.path.exists(path):
            sys.exit(f"{path} is missing: build the tiny world with benchmark/tiny.sh first")

    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    started, loads = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), [load_average()]
    results = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory() as workdir:
        for index in range(args.rounds):
            for name, run in (("ours", run_ours), ("trl", run_trl)):
                clock = time.time()
                results[name].append(run(args, workdir, index))
                loads.append(load_average())
                seconds = [round(update["total"], 2) for update in results[name][-1]]
                print(f"round {index + 1}, {name}: {time.time() - clock:.0f} s in all; seconds per update "
                      f"{seconds} (first not timed); load {loads[-1]}", flush=True)
    ours, trl = summarize(results["ours"], args.batch_size), summarize(results["trl"], args.batch_size)
    rows = []
    for label, stats in (("ppo.py (ours)", ours), ("TRL 1.12.0 PPOTrainer", trl)):
        rows.append(f"| {label} | {stats['episodes_per_second']:.2f} | {stats['total']:.2f} | "
                    f"{stats['generation']:.2f} | {stats['scoring']:.2f} | {stats['training']:.2f} |")
    per_round = [summarize([o], args.batch_size)["episodes_per_second"]
                 / summarize([t], args.batch_size)["episodes_per_second"]
                 for o, t in zip(results["ours"], results["trl"])]
    ratio = ours["episodes_per_second"] / trl["episodes_per_second"]
    report = "\n".join([
        f"# PPO throughput: ppo.py vs TRL 1.12.0 PPOTrainer ({started})",
        "",
        f"Tiny world (pythia-tiny SFT policy, ScalarModel RM/critic), fp32 on CPU, OMP_NUM_THREADS={threads}; "
        f"batch {args.batch_size}, micro batch {args.local_micro_batch_size}, rollout chunk "
        f"{args.local_rollout_forward_batch_size}, {args.num_minibatches} minibatch(es), {args.num_ppo_epochs} PPO "
        f"epochs, {args.response_length} response tokens, T {args.temperature}, kl coef {args.kl_coef}. "
        f"{args.rounds} alternating runs of each, {args.updates} updates per run, the first not timed. "
        f"Load average (1 min) before and after each run: {', '.join(loads)}.",
        "",
        "| implementation | episodes/s | s/update | generation s | scoring s | training s |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"**ratio (ours / TRL): {ratio:.2f}x** (per round: {', '.join(f'{r:.2f}x' for r in per_round)})",
        "",
        "generation = sampling (both stop once every row has an EOS: TRL through HF generate's stop token, ppo.py "
        "in its own KV-cache loop, token-identical to HF generate); scoring = no-grad reference / value / reward "
        "forwards (ppo.py: the rest of the rollout); training = the PPO epochs (TRL: the rest of the update, GAE "
        "included). Seconds are means per timed update.",
        "",
        f"Command: `OMP_NUM_THREADS={threads} bash benchmark/ppo_vs_trl.sh {' '.join(flags)}`",
    ])
    print("\n" + report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as file:
        file.write(report + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()

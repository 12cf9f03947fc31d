"""Side-by-side PPO throughput: ppo.py against TRL 1.12.0's PPOTrainer on the same run.

Started by benchmark/ppo_vs_trl.sh (which builds the TRL venv). Runs ppo.py with its fast sampling
path, ppo.py with its plain sampling loop (both in the project venv) and benchmark/ppo_vs_trl_trl.py
(TRL venv) in turn, `--rounds` times each, with the same models, prompts, batch, micro batch,
rollout chunk, response length, PPO epochs, minibatches and thread count. Every run does
`--updates` updates; the first (warm-up: lazy inits, allocator growth, ppo.py's compile of its
decode step) is left out of the timing. Episodes per second = timed episodes / timed wall time of
the updates (process start, model loading and saving are not counted). Peak memory = the maximum
resident set size of each run's process, and of ppo.py's timed updates alone (see execute). Roofline:
each phase's FLOPs per second against the best fp32 matmul timed by this process at the same thread
count, before and after the runs, twice: the nominal count (the same for every side: the work of the
algorithm, pads included, see phase_flops) and the FLOPs each side's code executes (counted before the
runs by benchmark/executed_flops.py: the hardware efficiency).
Prints and writes a markdown table.

Configurations (--config): tiny, the tiny world's SFT policy and reward model (0.58M parameters,
192-token queries, 44 response tokens); 5m, a random-init GPT-NeoX of 5.3M parameters on 128-token
queries with 53 response tokens (benchmark/random_world.py builds both on first use).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from executed_flops import executed_flops  # noqa: E402
from sampling import matmul_peak  # noqa: E402  (the roofline's peak: the same measure as sampling.py's)

SIDES = {"ours": "ppo.py, fast sampling (StaticSampler)", "ours_plain": "ppo.py, plain sampling loop",
         "trl": "TRL 1.12.0 PPOTrainer"}


def load_average() -> str:
    """The 1-minute load average (other processes share the cores: report it beside every number)."""
    return f"{os.getloadavg()[0]:.2f}"


def execute(command: list, workdir: str, updates: int = 0) -> tuple:
    """Run `command` in `workdir` -> (its output, its peak resident memory in GiB, the peak during updates 2 ...
    `updates` in GiB and the resident memory when they began, or None, None); exits with the tail of its output if
    it failed. Memory is the kernel's high-water mark of the process (VmHWM, read every 10 ms); the window is read
    off ppo.py's progress bar ("ppo: ... | k/N"): after the first update the mark is reset (/proc/PID/clear_refs),
    and read again once the last update is done."""
    process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: process.stdout.read1(1 << 16), b"")))
    reader.start()
    status_file, window, done, peak = f"/proc/{process.pid}/status", [None, None], 0, 0
    while True:
        pid, status, _ = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        found = re.findall(rb"ppo: +\d+%\|[^|]*\| (\d+)/\d+", b"".join(chunks[-8:]))
        done = max([done] + [int(count) for count in found])
        try:
            peak = max(peak, memory_kib(status_file, "VmHWM") / 2 ** 20)
            if updates and done >= 1 and window[0] is None:
                with open(f"/proc/{process.pid}/clear_refs", "w") as file:
                    file.write("5")  # resets VmHWM to the current VmRSS
                window[0] = memory_kib(status_file, "VmRSS") / 2 ** 20
            if updates and done >= updates and window[1] is None:
                window[1] = memory_kib(status_file, "VmHWM") / 2 ** 20
        except (OSError, StopIteration):  # it has just exited (a zombie has no memory lines)
            pass
        time.sleep(0.01)
    reader.join()
    text = b"".join(chunks).decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(command)} failed ({os.waitstatus_to_exitcode(status)}):\n{text[-3000:]}")
    return text, peak, window[1], window[0]


def memory_kib(status_file: str, field: str) -> int:
    """A `field:   N kB` line of /proc/PID/status -> N."""
    with open(status_file) as file:
        return int(next(line for line in file if line.startswith(field + ":")).split()[1])


def update_memory(runs: list) -> str:
    """[(process peak, timed-updates peak, memory at their start)] per run -> "peak (+rise)" GiB, or n/a (TRL)."""
    if runs[0][1] is None:
        return "n/a"
    return f"{max(m[1] for m in runs):.3f} (+{max(m[1] - m[2] for m in runs):.3f})"


def phase_flops(config: dict, batch: int, query_length: int, response_length: int, epochs: int) -> dict:
    """FLOPs of one update per phase, policy, reference, critic and reward model all of `config`'s shape:
    generation = a prefill of the queries and response_length - 1 one-token steps (logits of one position each);
    scoring = reference, critic and reward forwards over query + response (logits for the response only);
    training = `epochs` x forward and backward (3x a forward) of policy and critic over query + response.
    Nominal: the plain algorithm's count, pads and every response token included, the same for every side. No side
    executes exactly that: ppo.py skips the pad columns every row shares, the last layer at query positions and the
    positions after a micro-batch's last EOS; TRL computes logits at every position, so a phase's share of the
    peak here is not its hardware efficiency: executed_flops.py counts what each side computes."""
    hidden, layers, inner, vocab = (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"],
                                    config["vocab_size"])
    per_token = 2 * layers * (4 * hidden * hidden + 2 * hidden * inner)  # QKV + output projections, MLP
    unembed = 2 * hidden * vocab
    causal = lambda length: 2 * 2 * layers * hidden * length * (length + 1) / 2  # QK^T and AV over a causal row
    total = query_length + response_length
    generation = batch * (query_length * per_token + causal(query_length) + response_length * unembed
                          + sum(per_token + 2 * 2 * layers * hidden * (query_length + t + 1)
                                for t in range(response_length - 1)))
    backbone = batch * (total * per_token + causal(total))
    scoring = 3 * backbone + batch * response_length * unembed
    training = epochs * 3 * (2 * backbone + batch * response_length * unembed)
    return {"generation": generation, "scoring": scoring, "training": training}


def run_ours(args, workdir: str, index: int, fast: bool = True) -> tuple:
    """Run ppo.py for args.updates updates, its fast or plain sampling path -> ([{total, generation, scoring,
    training}] per update, peak memory GiB)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_name = f"ours_{'fast' if fast else 'plain'}_{index}"
    command = [args.ours_python, os.path.join(ROOT, "ppo.py"), "--base_model", args.base_model,
               "--query_dataset", args.query_dataset, "--sft_model_path", args.sft_model_path,
               "--reward_model_path", args.reward_model_path, "--output_dir", os.path.join(workdir, run_name),
               "--run_name", run_name, "--seed", str(args.seed), "--total_episodes", str(args.updates * args.batch_size),
               "--batch_size", str(args.batch_size), "--local_micro_batch_size", str(args.local_micro_batch_size),
               "--local_rollout_forward_batch_size", str(args.local_rollout_forward_batch_size),
               "--num_minibatches", str(args.num_minibatches), "--num_ppo_epochs", str(args.num_ppo_epochs),
               "--response_length", str(args.response_length), "--temperature", str(args.temperature),
               "--kl_coef", str(args.kl_coef), "--lr", str(args.lr), "--num_eval_samples", "0",
               "--length_groups", str(args.length_groups), "--fast_sampling" if fast else "--no_fast_sampling"]
    _, memory, update_peak, update_start = execute(command, workdir, args.updates)
    events = EventAccumulator(os.path.join(workdir, "runs", run_name))
    events.Reload()
    scalars = {tag: [event.value for event in events.Scalars(f"time/{tag}")]
               for tag in ("generation", "scoring", "training", "episodes_per_second")}
    totals = update_seconds(scalars["episodes_per_second"], args.batch_size)
    return [{"total": totals[k], "generation": scalars["generation"][k],
             "scoring": scalars["scoring"][k], "training": scalars["training"][k]} for k in range(args.updates)], \
        (memory, update_peak, update_start)


def update_seconds(episodes_per_second: list, batch_size: int) -> list:
    """ppo.py's time/episodes_per_second of each update -> each update's wall time in seconds."""
    # time/episodes_per_second = episodes so far / seconds since the loop started: the clock at
    # the end of update k is (k + 1) * batch / eps_k, and an update's wall time is the difference.
    clock = [0.0] + [(k + 1) * batch_size / eps for k, eps in enumerate(episodes_per_second)]
    return [clock[k + 1] - clock[k] for k in range(len(episodes_per_second))]


def run_trl(args, workdir: str, index: int) -> tuple:
    """Run TRL's PPOTrainer (in the TRL venv) for args.updates updates; the same as run_ours."""
    command = [args.trl_python, os.path.join(ROOT, "benchmark", "ppo_vs_trl_trl.py"), "--base_model", args.base_model,
               "--query_dataset", args.query_dataset, "--sft_model_path", args.sft_model_path,
               "--reward_model_path", args.reward_model_path, "--output_dir", os.path.join(workdir, f"trl_{index}"),
               "--updates", str(args.updates), "--seed", str(args.seed), "--batch_size", str(args.batch_size),
               "--local_micro_batch_size", str(args.local_micro_batch_size),
               "--local_rollout_forward_batch_size", str(args.local_rollout_forward_batch_size),
               "--num_minibatches", str(args.num_minibatches), "--num_ppo_epochs", str(args.num_ppo_epochs),
               "--response_length", str(args.response_length), "--temperature", str(args.temperature),
               "--kl_coef", str(args.kl_coef), "--lr", str(args.lr)]
    text, memory, _, _ = execute(command, workdir)
    line = [line for line in text.splitlines() if line.startswith("TIMINGS ")][-1]
    return json.loads(line[len("TIMINGS "):])["updates"], (memory, None, None)


def summarize(runs: list, batch_size: int) -> dict:
    """Per-update dicts of several runs, warm-up update dropped -> episodes/s and mean seconds per update."""
    timed = [update for updates in runs for update in updates[1:]]
    total = sum(update["total"] for update in timed)
    out = {"episodes_per_second": len(timed) * batch_size / total}
    for key in ("total", "generation", "scoring", "training"):
        out[key] = sum(update[key] for update in timed) / len(timed)
    return out


def parse_args(argv: list = None) -> tuple:
    """(the flags parsed, the flags as given less the interpreters the .sh passes, for the report)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=("tiny", "5m"), default="tiny", help="the models and queries (docstring)")
    parser.add_argument("--ours_python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    parser.add_argument("--trl_python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    parser.add_argument("--sides", nargs="+", choices=sorted(SIDES), default=["ours", "ours_plain", "trl"],
                        help="what runs, in this order each round")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, in turn: ours, plain, TRL, ours, ...")
    parser.add_argument("--updates", type=int, default=4, help="updates per run; the first is warm-up, not timed")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--local_micro_batch_size", type=int, default=16)
    parser.add_argument("--length_groups", type=int, default=1,
                        help="ppo.py's --length_groups on both of its sides (speed only; TRL has no such option)")
    parser.add_argument("--local_rollout_forward_batch_size", type=int, default=64)
    parser.add_argument("--num_minibatches", type=int, default=1,
                        help="1 only: ppo_vs_trl_trl.py sets TRL's accumulation for one minibatch")
    parser.add_argument("--num_ppo_epochs", type=int, default=4)
    parser.add_argument("--response_length", type=int, default=None, help="default: tiny 44, 5m 53")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--kl_coef", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: benchmark/results/ppo_vs_trl[_5m].md")
    args = parser.parse_args(argv)
    if args.num_minibatches != 1:  # TRL's minibatch is local_batch / num_mini_batches, stepped every accumulation
        parser.error("--num_minibatches 1 only: ppo_vs_trl_trl.py sets TRL's accumulation to batch / micro-batch, "
                     "so with more minibatches TRL would step its optimizer fewer times than ppo.py")
    args.ours_python, args.trl_python = os.path.abspath(args.ours_python), os.path.abspath(args.trl_python)
    flags = list(sys.argv[1:] if argv is None else argv)  # for the report: the flags given, less the interpreters the .sh passes
    for name in ("--ours_python", "--trl_python"):
        if name in flags:
            del flags[flags.index(name):flags.index(name) + 2]
    return args, flags


def configure(args: argparse.Namespace) -> tuple:
    """Fill in the models, queries and output of --config; (the report's description of them, FLOPs per phase)."""
    import random_world

    if args.config == "tiny":
        args.base_model = os.path.join(ROOT, "assets/tiny_world/pythia-tiny")
        args.query_dataset = os.path.join(ROOT, "data/tiny_tldr/sft")
        args.sft_model_path = os.path.join(ROOT, "models/tiny/sft_1")
        for path in (args.query_dataset, args.sft_model_path):
            if not os.path.exists(path):
                sys.exit(f"{path} is missing: build the tiny world with benchmark/tiny.sh first")
        args.reward_model_path = os.path.join(ROOT, "models/tiny/reward_1")
        reward_note = "the tiny world's reward model (models/tiny/reward_1)"
        if not os.path.exists(os.path.join(args.reward_model_path, "config.json")):
            args.reward_model_path = random_world.tiny_reward_model()
            reward_note = "models/tiny/reward_1 missing: the SFT backbone with a random scalar head as reward model"
        args.response_length = args.response_length or 44
        label = (f"Tiny world (pythia-tiny SFT policy, {{shape}}, 192-token queries; {reward_note}; "
                 f"ScalarModel RM/critic)")
    else:
        args.sft_model_path, args.reward_model_path = random_world.random_models()
        args.base_model, args.query_dataset = args.sft_model_path, random_world.query128_data(args.ours_python)
        args.response_length = args.response_length or 53
        label = ("Random-init GPT-NeoX, hidden 256, 4 layers, 4096 embedding rows (5.3M parameters; "
                 "benchmark/random_world.py), ScalarModel RM/critic of the same shape, 128-token queries")
    args.out = args.out or os.path.join(ROOT, "benchmark", "results",
                                        "ppo_vs_trl.md" if args.config == "tiny" else "ppo_vs_trl_5m.md")
    config = json.load(open(os.path.join(args.sft_model_path, "config.json")))
    label = label.replace("{shape}", f"hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
                                     f"{config['vocab_size']} embedding rows")
    query_length = len(__import__("datasets").load_from_disk(args.query_dataset)["train"][0]["query_token"])
    flops = phase_flops(config, args.batch_size, query_length, args.response_length, args.num_ppo_epochs)

    return label, flops


def run_rounds(args: argparse.Namespace) -> tuple:
    """Each side in turn, --rounds times: (per side its runs' updates and peak memory, load averages, matmul peaks,
    when it started)."""
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    started, loads = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), [load_average()]
    peaks = [matmul_peak()]
    runners = {"ours": lambda i: run_ours(args, workdir, i, fast=True),
               "ours_plain": lambda i: run_ours(args, workdir, i, fast=False), "trl": lambda i: run_trl(args, workdir, i)}
    results, memory = {name: [] for name in args.sides}, {name: [] for name in args.sides}
    with tempfile.TemporaryDirectory() as workdir:
        for index in range(args.rounds):
            for name in args.sides:
                clock = time.time()
                updates, peak_memory = runners[name](index)
                results[name].append(updates)
                memory[name].append(peak_memory)
                loads.append(load_average())
                seconds = [round(update["total"], 2) for update in updates]
                print(f"round {index + 1}, {name}: {time.time() - clock:.0f} s in all; seconds per update "
                      f"{seconds} (first not timed); peak memory (process, timed updates, at their start) "
                      f"{peak_memory}; load {loads[-1]}", flush=True)
    peaks.append(matmul_peak())
    return results, memory, loads, peaks, started, threads


def ratio_lines(args: argparse.Namespace, stats: dict, results: dict, memory: dict) -> list:
    """Each side of ours against TRL (overall and per round), and the fast against the plain sampling loop."""
    ratios = []
    if "trl" in args.sides:
        for name in [n for n in args.sides if n != "trl"]:
            per_round = [summarize([o], args.batch_size)["episodes_per_second"]
                         / summarize([t], args.batch_size)["episodes_per_second"]
                         for o, t in zip(results[name], results["trl"])]
            ratio = stats[name]["episodes_per_second"] / stats["trl"]["episodes_per_second"]
            ratios.append(f"**{SIDES[name]} / TRL: {ratio:.2f}x** (per round: "
                          f"{', '.join(f'{r:.2f}x' for r in per_round)})")
    if "ours" in args.sides and "ours_plain" in args.sides:
        fast, plain = (max(m[1] for m in memory[name]) for name in ("ours", "ours_plain"))
        fast_rise, plain_rise = (max(m[1] - m[2] for m in memory[name]) for name in ("ours", "ours_plain"))
        ratios.append(f"fast / plain sampling, generation phase: "
                      f"{stats['ours_plain']['generation'] / stats['ours']['generation']:.2f}x; peak memory of the "
                      f"timed updates {fast:.3f} vs {plain:.3f} GiB ({fast / plain - 1:+.1%}); their rise above the "
                      f"memory held when they began {fast_rise:.3f} vs {plain_rise:.3f} GiB")
    return ratios


def render_report(args: argparse.Namespace, flags: list, label: str, flops: dict, executed: dict, results: dict,
                  memory: dict, loads: list, peaks: list, started: str, threads: str) -> str:
    """The markdown report: throughput, time split and memory per side, the ratios, the rooflines (nominal and
    executed FLOPs), the command."""
    peak = max(peaks)
    stats = {name: summarize(runs, args.batch_size) for name, runs in results.items()}
    rows, roofline, executed_roofline = [], [], []
    for name in args.sides:
        s = stats[name]
        rows.append(f"| {SIDES[name]} | {s['episodes_per_second']:.2f} | {s['total']:.2f} | {s['generation']:.2f} | "
                    f"{s['scoring']:.2f} | {s['training']:.2f} | {max(m[0] for m in memory[name]):.3f} | "
                    f"{update_memory(memory[name])} |")
        roofline.append(f"| {SIDES[name]} | " + " | ".join(
            f"{flops[phase] / s[phase] / 1e9:.1f} ({flops[phase] / s[phase] / peak:.0%})"
            for phase in ("generation", "scoring", "training")) + " |")
        executed_roofline.append(f"| {SIDES[name]} | " + " | ".join(
            f"{executed[name][phase] / 1e9:.1f} G ({executed[name][phase] / flops[phase]:.0%}) | "
            f"{executed[name][phase] / s[phase] / 1e9:.1f} ({executed[name][phase] / s[phase] / peak:.0%})"
            for phase in ("generation", "scoring", "training")) + " |")
    ratios = ratio_lines(args, stats, results, memory)
    return "\n".join([
        f"# PPO throughput: ppo.py vs TRL 1.12.0 PPOTrainer, {args.config} ({started})",
        "",
        f"{label}, fp32 on CPU, OMP_NUM_THREADS={threads} on both sides; "
        f"batch {args.batch_size}, micro batch {args.local_micro_batch_size} (ppo.py in {args.length_groups} length "
        f"group(s) a micro-batch), rollout chunk "
        f"{args.local_rollout_forward_batch_size}, {args.num_minibatches} minibatch(es), {args.num_ppo_epochs} PPO "
        f"epochs, {args.response_length} response tokens, T {args.temperature}, kl coef {args.kl_coef}. "
        f"{args.rounds} rounds of {', '.join(args.sides)} in turn, {args.updates} updates per run, the first not "
        f"timed. Load average (1 min; 2 cores shared with other jobs) before and after each run: {', '.join(loads)}.",
        "",
        "| implementation | episodes/s | s/update | generation s | scoring s | training s | peak memory GiB, "
        "whole process | peak memory GiB, timed updates (rise over their start) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *[line for ratio in ratios for line in (ratio, "")],
        f"Roofline, GFLOP/s per phase (share of the fp32 matmul peak, {peak / 1e9:.1f} GFLOP/s: the best 2048^3 "
        f"matmul of this process at the same thread count; {', '.join(f'{p / 1e9:.1f}' for p in peaks)} before / "
        f"after the runs). FLOPs per update: generation {flops['generation'] / 1e9:.1f} G, scoring "
        f"{flops['scoring'] / 1e9:.1f} G, training {flops['training'] / 1e9:.1f} G (phase_flops: the plain algorithm's nominal count, pads and every "
        f"response step included, the same for every side; ppo.py executes less of it, TRL more).",
        "",
        "| implementation | generation | scoring | training |",
        "|---|---|---|---|",
        *roofline,
        "",
        "The same in executed FLOPs: what each side's code computes in an update (benchmark/executed_flops.py: "
        "torch's FlopCounterMode over one batch of these prompts, responses sampled from the SFT policy; TRL's steps "
        "as its PPOTrainer computes them, with the same models), its share of the nominal count, and per second "
        "(share of the matmul peak: the hardware efficiency).",
        "",
        "| implementation | generation FLOPs | GFLOP/s | scoring FLOPs | GFLOP/s | training FLOPs | GFLOP/s |",
        "|---|---|---|---|---|---|---|",
        *executed_roofline,
        "",
        "generation = sampling (every side stops once every row has an EOS: TRL through HF generate's stop token, "
        "ppo.py in its own loop, token-identical to HF generate; ppo.py's generation also computes the behaviour "
        "log-probs and entropy); scoring = no-grad reference / value / reward forwards (ppo.py: the rest of the "
        "rollout); training = the PPO epochs (TRL: the rest of the update, GAE included). Seconds are means per "
        "timed update, from ppo.py's time/* scalars and TRL's wrapped functions. Peak memory: resident set "
        "size (CPU, the kernel's VmHWM read every 10 ms); whole process = its maximum over the run (model loading "
        "and, for the fast path, the compiler included); timed updates = the kernel's high-water mark reset after the first update and read "
        "after the last (ppo.py only; the largest over the rounds).",
        "",
        f"Command: `OMP_NUM_THREADS={threads} bash benchmark/ppo_vs_trl.sh {' '.join(flags)}`",
    ])


def main():
    args, flags = parse_args()
    label, flops = configure(args)
    print("counting the FLOPs each side executes (benchmark/executed_flops.py) ...", flush=True)
    executed = executed_flops(args.base_model, args.sft_model_path, args.reward_model_path, args.query_dataset,
                              args.batch_size, args.local_micro_batch_size, args.local_rollout_forward_batch_size,
                              args.response_length, args.temperature, args.num_ppo_epochs, args.length_groups,
                              args.seed)
    report = render_report(args, flags, label, flops, executed, *run_rounds(args))
    print("\n" + report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as file:
        file.write(report + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()

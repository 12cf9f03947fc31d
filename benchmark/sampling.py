"""Sampling speed side by side: ppo.py's fast path (StaticSampler) against HF generate and the plain KV-cache loop.

Four sides: HF generate as sft.py's and dpo.py's evaluations call it (ppo.py's did until it sampled its evaluations
with the rollout's samplers), here keeping its per-step scores, which a rollout needs (the evaluations keep ids only
since f8b6db1); HF generate with transformers' own fast path (a static cache and its compiled forward:
cache_implementation="static", a CompileConfig allowed on every device); ppo.py's plain loop (sample_rollout);
ppo.py's fast path (StaticSampler).

Same model, same 64 queries, same seed, temperature 0.7, [PAD] and the unowned embedding rows masked, every one of
the response tokens sampled on every side (no stop at EOS), fp32, no grad, one process. Each round runs every side
once, the order rotated from round to round (alternating); each call is timed alone with time.perf_counter (the
fast path's first call, which compiles its step, is timed apart and not counted). The sides must sample the very
same tokens: the script stops if they do not. Configurations:

- tiny: the tiny world's SFT policy (models/tiny/sft_1, 581k parameters) on its first 64 training queries (192 tokens);
- 5m: a random-init GPT-NeoX, hidden 256, 4 layers, 4096 embedding rows (5.3M parameters; benchmark/random_world.py)
  on the tiny world's queries cut to 128 tokens.

Roofline: the FLOPs of a call (2 x matmul parameters x tokens through them + the attention products, pads included,
the same count for every side: what generate computes) per second, against the best of a few 2048^3 fp32 matmuls
timed in the same process at the same thread count. A one-token step also has to read the whole KV cache and the
weights (at 5M with batch 64: ~80 MB of cache and ~17 MB of weights against ~0.5 GFLOP). One thread runs its kernels
one after another, so the floor of a call is the FLOPs at the matmul peak plus, per step, the attention's KV-cache
bytes at the read bandwidth (the best sum over a 256 MB fp32 tensor, far larger than the caches, in the same process)
where they take longer than its FLOPs. The report gives each side's share of that floor.

    OMP_NUM_THREADS=1 python benchmark/sampling.py                  # both configurations, ~5 min on 2 cores
    OMP_NUM_THREADS=1 python benchmark/sampling.py --configs tiny --rounds 3
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` (size x size) @ (size x size) fp32 matmuls at the current thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def read_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of the fastest of `repeats` sums over a `megabytes` fp32 tensor (streamed from memory, not the caches)."""
    data = torch.ones(megabytes * 2 ** 20 // 4)
    data.sum()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def matmul_flops_per_token(config) -> int:
    """Multiply-adds x 2 of one token through every layer's QKV and output projections and its MLP (no unembedding)."""
    hidden, inner = config.hidden_size, config.intermediate_size
    return 2 * config.num_hidden_layers * (4 * hidden * hidden + 2 * hidden * inner)


def sampling_floor(config, rows: int, context_length: int, response_length: int, peak: float, bandwidth: float) -> dict:
    """Seconds of a sampling call at the roofline of one thread, whose kernels run one after another: the prefill's
    FLOPs at `peak`; then per one-token step, the projections' and unembedding's FLOPs at `peak` (their weights are
    read once per step, alongside far more FLOPs) plus the attention's own floor, the larger of its FLOPs at `peak`
    and the bytes of the KV cache it reads (pads included, fp32) at `bandwidth`. Also the attention's bytes alone."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    prefill = sampling_flops(config, rows, context_length, 1)
    matmuls = rows * (matmul_flops_per_token(config) + 2 * hidden * config.vocab_size)
    attention = [(2 * 2 * layers * hidden * rows * columns, 4 * 2 * layers * rows * hidden * columns)  # (FLOPs, bytes)
                 for columns in range(context_length + 1, context_length + response_length)]
    seconds = (prefill + matmuls * len(attention)) / peak + sum(max(flops / peak, size / bandwidth)
                                                                 for flops, size in attention)
    return {"seconds": seconds, "cache_seconds": sum(size for _, size in attention) / bandwidth,
            "cache_bytes": sum(size for _, size in attention) / len(attention)}


def sampling_flops(config, rows: int, context_length: int, response_length: int) -> float:
    """Multiply-adds x 2 of one sampling call: a prefill of rows x context tokens (logits of the last one only) and
    response_length - 1 one-token steps with logits, attention over every cached column (pads included)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    per_token = matmul_flops_per_token(config)
    unembed = 2 * hidden * config.vocab_size
    attention = lambda queries, keys: 2 * 2 * layers * hidden * queries * keys  # QK^T and AV
    prefill = rows * (context_length * per_token + unembed + attention(context_length, (context_length + 1) / 2))
    steps = sum(rows * (per_token + unembed + attention(1, context_length + t + 1)) for t in range(response_length - 1))
    return prefill + steps


def load_config(name: str) -> tuple:
    """-> (policy, (64, T_q) queries, pad id, unsampled ids, label)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo import disable_dropout, unsampled_token_ids

    if name == "tiny":
        folder, data = os.path.join(ROOT, "models", "tiny", "sft_1"), os.path.join(ROOT, "data", "tiny_tldr", "sft")
        if not os.path.exists(folder):
            sys.exit(f"{folder} is missing: build the tiny world with benchmark/tiny.sh first")
    else:
        import random_world

        folder, data = random_world.random_models()[0], random_world.query128_data()
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    disable_dropout(policy)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    queries = datasets.load_from_disk(data)["train"].with_format("torch")[:64]["query_token"]
    unsampled = torch.tensor(unsampled_token_ids(tokenizer, policy.get_output_embeddings().weight.size(0)))
    params = sum(p.numel() for p in policy.parameters())
    label = (f"{name}: {params / 1e6:.2f}M parameters (hidden {policy.config.hidden_size}, {policy.config.num_hidden_layers} "
             f"layers, {policy.config.vocab_size} embedding rows), 64 queries of {queries.shape[1]} tokens "
             f"({(queries == tokenizer.pad_token_id).float().mean():.0%} pads)")
    return policy, queries, tokenizer.pad_token_id, unsampled, label


def measure(name: str, rounds: int, response_length: int, temperature: float) -> dict:
    """Time the samplers on configuration `name`, alternating; check they draw the same tokens."""
    from transformers import CompileConfig, GenerationConfig

    from ppo import StaticSampler, sample_rollout
    from sft import generate

    policy, queries, pad_id, unsampled, label = load_config(name)
    config = GenerationConfig(max_new_tokens=response_length, min_new_tokens=response_length,
                              temperature=temperature, top_k=0, top_p=1.0, do_sample=True,
                              return_dict_in_generate=True, output_scores=True, suppress_tokens=unsampled.tolist())
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # generate() compiles only on accelerators unless told so
    static_config = GenerationConfig(**config.to_dict())
    static_config.cache_implementation, static_config.compile_config = "static", compile_config
    fast = StaticSampler(queries.shape[0])
    no_eos = -1  # no id is -1: every side samples all response_length tokens, as generate does here
    sides = {
        "HF generate": lambda: generate(policy, queries, pad_id, config),
        "HF generate, static cache + compile": lambda: generate(policy, queries, pad_id, static_config),
        "plain loop (sample_rollout)": lambda: sample_rollout(policy, queries, pad_id, no_eos, response_length,
                                                              temperature, unsampled)[0],
        "fast path (StaticSampler)": lambda: fast(policy, queries, pad_id, no_eos, response_length, temperature,
                                                  unsampled)[0],
    }
    seconds = {side: [] for side in sides}
    with torch.no_grad():
        start = time.perf_counter()
        torch.manual_seed(0)
        sides["fast path (StaticSampler)"]()
        compile_seconds = time.perf_counter() - start
        for side in sides:  # warm-up of the others (and transformers' compile)
            torch.manual_seed(0)
            sides[side]()
        order = list(sides)
        for index in range(rounds):
            samples = {}
            for side in order[index % len(order):] + order[:index % len(order)]:
                torch.manual_seed(100 + index)
                start = time.perf_counter()
                samples[side] = sides[side]()
                seconds[side].append(time.perf_counter() - start)
            reference = samples["HF generate"]
            for side, sampled in samples.items():
                if not torch.equal(sampled, reference):
                    sys.exit(f"{name}, round {index}: {side} sampled other tokens than HF generate")
            print(f"{name} round {index + 1}: " + ", ".join(f"{side} {seconds[side][-1]:.3f} s" for side in sides)
                  + f"; load {os.getloadavg()[0]:.2f}", flush=True)
    flops = sampling_flops(policy.config, queries.shape[0], queries.shape[1], response_length)
    return {"label": label, "seconds": seconds, "compile_seconds": compile_seconds, "flops": flops,
            "tokens": queries.shape[0] * response_length,
            "shape": (policy.config, queries.shape[0], queries.shape[1], response_length)}


def write_report(lines: list, path: str, script: str) -> None:
    """Print the report `lines` with the command that made it (`script` and this process's flags), and write it to `path`."""
    command = " ".join([script, *sys.argv[1:]])
    report = "\n".join([*lines, f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} python {command}`"])
    print("\n" + report)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        file.write(report + "\n")


def report_lines(result: dict, peak: float, bandwidth: float) -> list:
    """One configuration's section of the report: each sampler's median time over the rounds against HF generate's,
    the matmul peak and the floor, and what the 2x target asks of the floor."""
    seconds = {side: sorted(values)[len(values) // 2] for side, values in result["seconds"].items()}
    generate_seconds = seconds["HF generate"]
    floor = sampling_floor(*result["shape"], peak, bandwidth)
    lines = [f"## {result['label']}", "",
              "| sampler | median s per call | tokens/s | ratio vs HF generate | GFLOP/s | of matmul peak | of the floor |",
              "|---|---|---|---|---|---|---|"]
    for side, value in seconds.items():
        achieved = result["flops"] / value
        lines.append(f"| {side} | {value:.3f} | {result['tokens'] / value:.0f} | {generate_seconds / value:.2f}x | "
                     f"{achieved / 1e9:.1f} | {achieved / peak:.0%} | {floor['seconds'] / value:.0%} |")
    lines += ["", f"Floor of a call: {floor['seconds']:.3f} s (FLOPs at the matmul peak, the attention's KV-cache reads "
              f"at the read bandwidth: {floor['cache_bytes'] / 1e6:.0f} MB per step, {floor['cache_seconds']:.3f} s in "
              f"all). Half of HF generate's time ({generate_seconds / 2:.3f} s, the 2x target) asks for "
              f"{floor['seconds'] / (generate_seconds / 2):.0%} of the floor's speed."]
    per_round = [g / f for g, f in zip(result["seconds"]["HF generate"], result["seconds"]["fast path (StaticSampler)"])]
    lines += ["", f"Fast path vs HF generate per round: {', '.join(f'{r:.2f}x' for r in per_round)}. "
              f"First call of the fast path (compiling its step): {result['compile_seconds']:.1f} s. "
              f"FLOPs per call: {result['flops'] / 1e9:.2f} G.", ""]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", choices=("tiny", "5m"), default=["tiny", "5m"])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the four sides, the order rotated each round")
    parser.add_argument("--response_length", type=int, default=53)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results", "sampling.md"))
    args = parser.parse_args()
    threads = torch.get_num_threads()
    started, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()[0]
    peak, bandwidth = matmul_peak(), read_bandwidth()
    results = {name: measure(name, args.rounds, args.response_length, args.temperature) for name in args.configs}
    peak_after, bandwidth_after = matmul_peak(), read_bandwidth()
    lines = [f"# Sampling: ppo.py's fast path vs HF generate vs the plain loop ({started})", "",
             f"fp32 on CPU, {threads} thread(s) (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
             f"batch 64, {args.response_length} response tokens all sampled on every side, temperature "
             f"{args.temperature}, {args.rounds} rounds, the four sides alternating (order rotated each round), "
             f"each call timed alone (time.perf_counter, no grad), the same tokens on every side (checked). "
             f"Load average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on a 2-core machine "
             f"shared with other jobs. Matmul peak (best 2048^3 fp32 matmul, same process and threads): "
             f"{peak / 1e9:.1f} GFLOP/s before, {peak_after / 1e9:.1f} after. Read bandwidth (best sum over a 256 MB "
             f"fp32 tensor): {bandwidth / 1e9:.1f} GB/s before, {bandwidth_after / 1e9:.1f} after.", ""]
    peak, bandwidth = max(peak, peak_after), max(bandwidth, bandwidth_after)
    for result in results.values():
        lines += report_lines(result, peak, bandwidth)
    write_report(lines, args.out, "benchmark/sampling.py")


if __name__ == "__main__":
    main()

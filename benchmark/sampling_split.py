"""Where a fast-path sampling call spends its time, piece by piece, each against its own floor.

benchmark/sampling.py times whole calls side by side; this script splits ppo.py's fast path (StaticSampler) into its
pieces and times each alone, on the same model and queries (fp32, no grad, one process, best of a few repeats):

- the prefill (prefill_by_length, 4 groups): floor = its FLOPs over the queries' real tokens at the matmul peak;
- one compiled decode step (StaticSampler's step, the cache holding the prefill): floor = its matmul FLOPs at the
  matmul peak plus the bytes of the KV cache it reads (every column of the static cache) at the read bandwidth;
- its attention alone, per layer, on caches of the step's shape (one per layer, so that they stream from memory
  as in the step): transformers' eager formulation run eagerly (MKL's batched matmuls) and compiled by inductor
  (what the step runs), and torch's SDPA; floor = reading the layer's keys and values once at the read bandwidth;
- the draws of one step (draw_tokens: exponential noise from the CPU generator, as torch.multinomial draws it);
  floor = the generator's own uniform draws, which the random stream fixes;
- the whole call (for reference), against prefill + steps x (step + draws).

The matmul peak (the best 2048^3 fp32 matmul) and the read bandwidth (the best sum over a 256 MB fp32 tensor) are
measured in the same process at the same thread count. With HF generate's time for the same call (sampling.py) this
gives what a 2x fast path would need of each piece.

    OMP_NUM_THREADS=1 python benchmark/sampling_split.py                  # both configurations, ~2 min on 2 cores
    OMP_NUM_THREADS=1 python benchmark/sampling_split.py --configs 5m
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# noqa: E402 below: sampling must be importable first; importing it also puts ROOT on sys.path
from sampling import (ROOT, load_config, matmul_flops_per_token, matmul_peak, read_bandwidth,  # noqa: E402
                      write_report)


def best_seconds(function, repeats: int, warmup: int = 2) -> float:
    """The fastest of `repeats` timed calls of `function()`, after `warmup` untimed ones."""
    for _ in range(warmup):
        function()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def prefill_flops(config, lengths: list) -> float:
    """Multiply-adds x 2 of a prefill over queries of `lengths` real tokens (pads not counted): every token through
    the projections and the MLP, the logits of each query's last token, and causal attention (QK^T and AV)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    return float(sum(length * matmul_flops_per_token(config) + 2 * hidden * config.vocab_size
                     + 2 * 2 * layers * hidden * length * (length + 1) / 2 for length in lengths))


def step_floor(config, rows: int, columns: int, peak: float, bandwidth: float) -> tuple:
    """(seconds, cache bytes) of one decode step's floor: its projections' and logits' FLOPs at `peak`, plus every
    column of the static cache (`columns` wide: query, response, pads and columns not yet written) read once, keys and
    values of every layer in fp32, at `bandwidth`."""
    matmuls = rows * (matmul_flops_per_token(config) + 2 * config.hidden_size * config.vocab_size)
    cache_bytes = 4 * 2 * config.num_hidden_layers * rows * config.hidden_size * columns
    return matmuls / peak + cache_bytes / bandwidth, cache_bytes


def eager_attention(query, keys, values, mask, scale):
    """transformers' eager attention of one layer: softmax(q k^T * scale + mask) v, (B, H, 1, D) -> (B, H, 1, D)."""
    weights = torch.matmul(query, keys.transpose(2, 3)) * scale + mask
    return torch.matmul(F.softmax(weights, dim=-1, dtype=torch.float32), values)


def split(name: str, repeats: int, response_length: int, temperature: float, peak: float, bandwidth: float) -> dict:
    """Time the fast path's pieces on configuration `name`; -> {piece: (seconds, floor seconds)} and the shapes."""
    from transformers import StaticCache

    from ppo import StaticSampler, draw_tokens, prefill_by_length, sampling_distribution

    policy, queries, pad_id, unsampled, label = load_config(name)
    config = policy.config
    rows, context_length = queries.shape
    hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    columns = context_length + response_length  # the static cache's width
    attention_mask = queries != pad_id
    position_ids = (attention_mask.long().cumsum(1) - 1).masked_fill(~attention_mask, 0)
    input_ids = torch.masked_fill(queries, ~attention_mask, 0)
    step_seconds_floor, cache_bytes = step_floor(config, rows, columns, peak, bandwidth)
    pieces = {}
    with torch.no_grad():
        sampler = StaticSampler(rows)
        torch.manual_seed(0)
        call = lambda: sampler(policy, queries, pad_id, -1, response_length, temperature, unsampled)  # noqa: E731
        call()  # compiles the step
        pieces["whole call (fast path)"] = (best_seconds(call, repeats, warmup=1), None)
        prefill = lambda: prefill_by_length(policy, input_ids, attention_mask, position_ids, groups=4)  # noqa: E731
        pieces["prefill"] = (best_seconds(prefill, repeats), prefill_flops(config, attention_mask.sum(1).tolist()) / peak)
        # One decode step on a cache that holds the prefill, as StaticSampler.__call__ fills it.
        logits, keys_values = prefill()
        cache = StaticCache(config=config, max_cache_len=columns)
        for layer_index, (keys, values) in enumerate(keys_values):
            cache.update(keys, values, layer_index)
        del keys_values
        step_mask = torch.cat((attention_mask, attention_mask.new_ones(rows, response_length)), 1)
        token, step_positions = input_ids[:, -1], position_ids[:, -1:] + 1
        attention = config._attn_implementation
        policy.set_attn_implementation("eager")
        try:  # each call writes the next cache column: at most response_length - 1 calls, the warm-up's included
            step = lambda: sampler.step(policy, token, step_positions, step_mask, cache, temperature, unsampled)  # noqa: E731
            pieces["one decode step (compiled)"] = (best_seconds(step, min(repeats * 5, response_length - 4)),
                                                    step_seconds_floor)
        finally:
            policy.set_attn_implementation(attention)
        _, probs = sampling_distribution(logits[:, -1], temperature, unsampled)
        pieces["draws of one step"] = (best_seconds(lambda: draw_tokens(probs), repeats * 5),
                                       best_seconds(lambda: torch.empty(probs.shape, dtype=torch.float64).uniform_(),
                                                    repeats * 5))
        # The attention of one layer, on a cache of the step's shape; one cache per layer, read in turn.
        head_size = hidden // heads
        caches = [(torch.randn(rows, heads, columns, head_size), torch.randn(rows, heads, columns, head_size))
                  for _ in range(layers)]
        query = torch.randn(rows, heads, 1, head_size)
        mask = torch.zeros(rows, 1, 1, columns).masked_fill(~step_mask[:, None, None, :], torch.finfo(torch.float32).min)
        scale = head_size ** -0.5
        compiled = torch.compile(eager_attention, dynamic=False)
        sdpa = lambda q, k, v, m, s: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=s)  # noqa: E731
        layer_floor = cache_bytes / layers / bandwidth
        reference = eager_attention(query, *caches[0], mask, scale)
        for side, function in (("eager (MKL batched matmuls)", eager_attention), ("compiled (inductor, as the step)", compiled),
                               ("SDPA", sdpa)):
            if not torch.allclose(function(query, *caches[0], mask, scale), reference, atol=1e-5):
                sys.exit(f"{name}: the attention '{side}' disagrees with the eager one")
            seconds = best_seconds(lambda: [function(query, keys, values, mask, scale) for keys, values in caches],
                                   repeats * 2) / layers
            pieces[f"attention of one layer: {side}"] = (seconds, layer_floor)
        pieces["reading one layer's keys and values (sum)"] = (
            best_seconds(lambda: [keys.sum() + values.sum() for keys, values in caches], repeats * 2) / layers, layer_floor)
    return {"label": label, "pieces": pieces, "steps": response_length - 1, "layers": layers,
            "cache_mb": cache_bytes / 1e6}


def split_lines(result: dict) -> list:
    """One configuration's section of the report: each piece against its floor, and the whole call against prefill +
    steps x (step + draws)."""
    pieces, steps = result["pieces"], result["steps"]
    lines = [f"## {result['label']}", "", "| piece | ms | floor ms | share of the floor's speed |", "|---|---|---|---|"]
    for piece, (seconds, floor) in pieces.items():
        share = f"{floor / seconds:.0%}" if floor else ""
        lines.append(f"| {piece} | {seconds * 1e3:.2f} | {floor * 1e3:.2f} | {share} |" if floor else
                     f"| {piece} | {seconds * 1e3:.2f} | | |")
    prefill, step, draws = pieces["prefill"][0], pieces["one decode step (compiled)"][0], pieces["draws of one step"][0]
    attention = pieces["attention of one layer: compiled (inductor, as the step)"][0] * result["layers"]
    lines += ["", f"Prefill + {steps} x (step + draws) = {prefill:.3f} + {steps} x ({step * 1e3:.2f} + "
              f"{draws * 1e3:.2f} ms) = {prefill + steps * (step + draws):.3f} s against the whole call's "
              f"{pieces['whole call (fast path)'][0]:.3f} s. The step's attention (its {result['layers']} layers, "
              f"as compiled, on a {result['cache_mb']:.0f} MB cache) is {attention * 1e3:.2f} ms of its "
              f"{step * 1e3:.2f} ms.", ""]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", choices=("tiny", "5m"), default=["tiny", "5m"])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each piece (steps and draws: 5x)")
    parser.add_argument("--response_length", type=int, default=53)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results", "sampling_split.md"))
    args = parser.parse_args()
    started, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()[0]
    peak, bandwidth = matmul_peak(), read_bandwidth()
    results = {name: split(name, args.repeats, args.response_length, args.temperature, peak, bandwidth)
               for name in args.configs}
    lines = [f"# Sampling: the fast path's pieces against their floors ({started})", "",
             f"fp32 on CPU, {torch.get_num_threads()} thread(s) (OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', 'unset')}), batch 64, {args.response_length} response tokens, "
             f"temperature {args.temperature}; each piece timed alone, the best of its repeats (time.perf_counter, no "
             f"grad). Matmul peak {peak / 1e9:.1f} GFLOP/s, read bandwidth {bandwidth / 1e9:.1f} GB/s (same process). "
             f"Load average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on a 2-core machine.", ""]
    for result in results.values():
        lines += split_lines(result)
    write_report(lines, args.out, "benchmark/sampling_split.py")


if __name__ == "__main__":
    main()

"""What one forward of a --offload engine costs by rows: is it the rows, or streaming the whole frozen model?

ppo.py --offload (the paper's 6.9B PPO) runs the reference policy and the RM as DeepSpeed ZeRO-3 engines whose
parameters stay in host memory (ppo.offload_frozen_models): every forward fetches each layer to the GPU, gathers it
and frees it. The rollout calls each engine once per chunk of --local_rollout_forward_batch_size rows (knobs.sh: 4 of
a rank's 64 at 6.9B), so an update streams each model 16 times where one call on the 64 rows would stream it once
(benchmark/README.md, "Where 6.9B spends time"). This times one such engine, built by ppo.offload_frozen_models
itself, on a random-init Pythia shape: ppo.response_logits (what the rollout asks of the reference policy) on rows
of `--context` left-padded query tokens + 53 response tokens, at each of `--rows`, the mean of `--repeats` calls
after one warm-up call each, with the peak GPU memory of those calls. --pin_memory builds the engine with
DeepSpeed's pinned host buffers (`offload_param.pin_memory`, which ppo.py does not set) for a second table.

    python benchmark/offload_stream.py                          # Pythia-6.9B shape, bf16, one GPU (~30 GB host memory)
    python benchmark/offload_stream.py --pin_memory             # also with pinned host buffers
    python benchmark/offload_stream.py --size tiny --context 32 --allow_cpu   # a smoke run on CPU (fp32)

Prints a markdown table (rows, ms a call, ms a row, peak GPU memory) and what a rollout of 64 rows per rank would
spend in this engine's calls at each chunk size: 64 / rows calls.
"""

import argparse
import os
import socket
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmark")]

import ppo  # noqa: E402
from gpu_check import SIZES, padded_rows, pythia_config  # noqa: E402

SHAPES = {**SIZES, "6.9b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                intermediate_size=16384, vocab_size=50432)}
PAD, RESPONSE, LOCAL_BATCH = 1, 53, 64  # 64: a rank's rollout rows in the paper's runs (512 / 8 GPUs)


def frozen_policy(size: str, dtype: torch.dtype):
    """A Pythia-shaped GPTNeoXForCausalLM on the CPU in `dtype`, its weights small random values, built without
    transformers' slow random init (the values do not matter here, only the shapes)."""
    from transformers import GPTNeoXForCausalLM

    config = pythia_config(SHAPES[size])
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        policy = GPTNeoXForCausalLM(config)
    policy = policy.to(dtype).to_empty(device="cpu")  # allocated once, in `dtype` (13.8 GB at 6.9B in bf16)
    rotary = policy.gpt_neox.rotary_emb
    # Its inv_freq buffer computed anew in fp32, as ppo.py keeps it (to_empty left it unset)
    policy.gpt_neox.rotary_emb = type(rotary)(config=config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.uniform_(-0.02, 0.02, generator=generator)
    return policy.eval()


def offload_engine(policy, dtype: torch.dtype, pin_memory: bool):
    """The reference-policy engine exactly as ppo.offload_frozen_models builds it (its config, pinned if asked)."""
    import types

    import deepspeed

    initialize = deepspeed.initialize

    def initialize_pinned(model, config):
        config["zero_optimization"]["offload_param"]["pin_memory"] = True
        return initialize(model=model, config=config)

    if pin_memory:  # ppo.py's config with one key added
        deepspeed.initialize = initialize_pinned
    try:
        accelerator = types.SimpleNamespace(mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
        engine, _ = ppo.offload_frozen_models(accelerator, types.SimpleNamespace(local_micro_batch_size=1), policy,
                                              torch.nn.Linear(1, 1))  # a stand-in RM: only the policy is timed
    finally:
        deepspeed.initialize = initialize
    return engine


def time_calls(engine, rows_list: list, context: int, repeats: int, device) -> list:
    """[(rows, seconds a call, peak GPU bytes or None)] of ppo.response_logits on `engine` at each row count, on rows
    of random ids whose row i is left-padded by (7 i mod context / 2) tokens, as PPO's queries are."""
    out = []
    for rows in rows_list:
        query_lengths = [context - (7 * i) % (context // 2) for i in range(rows)]
        ids = padded_rows(query_lengths, PAD, device, torch.Generator().manual_seed(rows), context, RESPONSE)
        with torch.no_grad():
            ppo.response_logits(engine, ids, PAD, context)  # warm-up: the first fetch of each layer
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            tick = time.perf_counter()
            for _ in range(repeats):
                ppo.response_logits(engine, ids, PAD, context)
            if device.type == "cuda":
                torch.cuda.synchronize()
        seconds = (time.perf_counter() - tick) / repeats
        out.append((rows, seconds, torch.cuda.max_memory_allocated() if device.type == "cuda" else None))
    return out


def report(title: str, timings: list) -> list:
    """The markdown table of `timings` and a rollout's time in this engine by chunk size."""
    lines = [f"### {title}", "", "| rows a call | ms a call | ms a row | peak GPU memory GiB |", "|---|---|---|---|"]
    for rows, seconds, peak in timings:
        memory = f"{peak / 2 ** 30:.2f}" if peak is not None else "n/a"
        lines.append(f"| {rows} | {1e3 * seconds:.1f} | {1e3 * seconds / rows:.2f} | {memory} |")
    lines += ["", f"A rollout of {LOCAL_BATCH} rows per rank in this engine: " + "; ".join(
        f"chunks of {rows}: {LOCAL_BATCH // rows} calls, {LOCAL_BATCH // rows * seconds:.2f} s"
        for rows, seconds, _ in timings if LOCAL_BATCH % rows == 0) + " (the RM's engine streams as much again).", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default="6.9b")
    parser.add_argument("--context", type=int, default=512, help="query tokens a row (the paper's 512)")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64], help="rows a call, each timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pin_memory", action="store_true", help="also time the engine with pinned host buffers")
    parser.add_argument("--allow_cpu", action="store_true", help="run on the CPU in fp32 (a smoke run)")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if not (on_gpu or args.allow_cpu):
        sys.exit("no GPU: this measures a GPU's host-to-device streaming (--allow_cpu for a smoke run)")
    device, dtype = (torch.device("cuda"), torch.bfloat16) if on_gpu else (torch.device("cpu"), torch.float32)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
    with socket.socket() as free:  # one process of its own process group, as DeepSpeed's engines need
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(0)
    name = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    lines = [f"## --offload's engine: a forward by rows ({args.size} shape, {str(dtype).removeprefix('torch.')}, "
             f"{name}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"Rows of {args.context} query tokens + {RESPONSE} response tokens; the mean of {args.repeats} calls after "
             "a warm-up; ppo.response_logits on the engine ppo.offload_frozen_models builds.", ""]
    variants = [("ppo.py's engine (offload_param unpinned)", False)] + [("pinned host buffers", True)] * args.pin_memory
    for title, pinned in variants:
        tick = time.perf_counter()
        policy = frozen_policy(args.size, dtype)  # anew for each engine: ZeRO-3 partitions a module's parameters
        parameters = sum(p.numel() for p in policy.parameters())
        engine = offload_engine(policy, dtype, pinned)
        title += f", {parameters / 1e6:,.1f} M parameters, built in {time.perf_counter() - tick:.0f} s"
        lines += report(title, time_calls(engine, args.rows, args.context, args.repeats, device))
        del engine, policy
    print("\n".join(lines))


if __name__ == "__main__":
    main()

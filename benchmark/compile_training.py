"""PPO's training pass, eager against ppo.py --compile_training (each GPT-NeoX layer compiled on its own).

One pass = ppo.py's PPO-epoch forward of policy and critic (PolicyAndValueWrapper through
response_logits_and_values: the response window, the last layer at the response positions only)
and its backward, on a random-init Pythia shape, at a micro-batch of 16 rows of `context` + 53
tokens. Two micro-batches of different left padding give two window widths, as PPO's micro-batches
do. The compiled side is PolicyAndValueWrapper(..., compile_layers=True) on the same modules, as ppo.py
--compile_training builds it (ppo.compiled_layers: one graph for every layer, for any width); --backend
aot_eager swaps inductor for dynamo's graphs run with the eager kernels.

    python benchmark/compile_training.py                      # Pythia-1B shape, bf16 on one GPU (~1 min)
    python benchmark/compile_training.py --size tiny --context 32 --allow_cpu   # a smoke run on CPU
    python benchmark/compile_training.py --backend aot_eager  # dynamo's graphs run eagerly: its overhead alone
    python benchmark/compile_training.py --check              # also: as exact as the eager pass? (bf16 against fp32)

Prints a markdown table: ms per pass (the mean of --repeats after one warm-up call of each width),
eager and compiled, the seconds the two compiles took, and the peak GPU memory. With --profile N, also
each mode's N costliest ops (CUDA kernels on a GPU) and how busy the device was: where the pass's
time goes, for what might come after compiling. With --check, also how far the compiled pass's logits, values
and gradients are from the eager pass's, beside how far bf16 rounding alone moves the eager pass (against an fp32
copy of it): is the compiled pass as exact as the eager one?
"""

import argparse
import copy
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmark")]

import ppo  # noqa: E402
from gpu_check import SIZES, pythia_config  # noqa: E402

PAD, ROWS, RESPONSE = 1, 16, 53


def padded_batch(context: int, first_pad: int, device: str) -> torch.Tensor:
    """(16, context + 53) random ids; row i left-padded by first_pad + (10 i mod 150) tokens, at most context - 1."""
    ids = torch.randint(2, 1000, (ROWS, context + RESPONSE), device=device)
    for i in range(ROWS):
        ids[i, :min(first_pad + (10 * i) % 150, context - 1)] = PAD
    return ids


def build_models(size: str, device: str, dtype: torch.dtype) -> tuple:
    """A random-init policy of Pythia's settings at `size` and a ScalarModel critic on the same config."""
    from transformers import GPTNeoXForCausalLM

    config = pythia_config(SIZES[size])
    config._attn_implementation = "sdpa"  # what ppo.py's windowed last layer runs on
    torch.manual_seed(0)
    with torch.device(device):
        policy = GPTNeoXForCausalLM(config)
        base_config = {k: v for k, v in policy.base_model.config.to_dict().items() if k != "_name_or_path"}
        critic = ppo.ScalarModel(ppo.ScalarModelConfig(base_config=base_config))
    # Parameters only, as DeepSpeed casts: the rotary buffers stay fp32.
    return ppo.cast_parameters(policy, dtype), ppo.cast_parameters(critic, dtype)


def agreement_lines(eager_model, compiled_model, ids: torch.Tensor, context: int) -> str:
    """The compiled pass against the eager one on `ids` (one forward and backward each, the benchmark's stand-in loss),
    and both against an fp32 copy of the eager pass: max |difference| of the response logits and of the values, and
    the gradients' relative error ||g - g_ref|| / ||g_ref|| over every parameter of policy and critic."""
    def run(model) -> tuple:
        logits, values = ppo.response_logits_and_values(model, ids, PAD, context, RESPONSE)
        (logits.float().logsumexp(-1).mean() + values.float().mean()).backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return logits.detach().float(), values.detach().float(), grads

    eager, compiled = run(eager_model), run(compiled_model)
    reference_model = copy.deepcopy(eager_model).float()
    reference = run(reference_model)
    del reference_model

    def gap(a: tuple, b: tuple) -> str:
        return (f"{(a[0] - b[0]).abs().max():.2e} | {(a[1] - b[1]).abs().max():.2e} | "
                f"{(a[2] - b[2]).norm() / b[2].norm():.2e}")

    width = ppo.response_window(ids, PAD, context, RESPONSE)[0].size(1)
    return "\n".join([f"Agreement on the first micro-batch, window width {width} (mean |logit| "
                      f"{eager[0].abs().mean():.2f}, mean |value| {eager[1].abs().mean():.3f}):", "",
                      "| pair | max abs logit diff | max abs value diff | gradient relative error |", "|---|---|---|---|",
                      f"| compiled vs eager | {gap(compiled, eager)} |",
                      f"| eager vs its fp32 copy | {gap(eager, reference)} |",
                      f"| compiled vs the fp32 copy | {gap(compiled, reference)} |", ""])


def profile_lines(name: str, step, repeats: int, top: int, device: str) -> str:
    """`repeats` calls of `step` under torch.profiler -> a markdown table of its `top` ops by self time on the device
    (CUDA kernels; CPU ops without CUDA), per pass, and how much of the wall time the device was busy."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step()  # warm: no compile, no allocator growth inside the profile
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / repeats * 1e3
    def own(event) -> float:  # microseconds of `event` itself, over all calls
        if device == "cuda":  # the kernels' own time, not also that of the CPU ops that launched them
            return event.self_device_time_total if event.device_type == DeviceType.CUDA else 0
        return event.self_cpu_time_total

    events = sorted((event for event in prof.key_averages() if own(event) > 0), key=own, reverse=True)
    busy = sum(own(event) for event in events) / repeats / 1e3  # ms per pass
    lines = [f"{name}: {wall:.1f} ms a pass (wall, under the profiler), {busy:.1f} ms of it busy on the "
             f"{'GPU' if device == 'cuda' else 'CPU, summed over threads'}", "",
             "| op | ms a pass | share of busy | calls a pass |", "|---|---|---|---|"]
    for event in events[:top]:
        lines.append(f"| {event.key[:90]} | {own(event) / repeats / 1e3:.2f} | {own(event) / repeats / 1e3 / busy:.0%} "
                     f"| {event.count / repeats:.0f} |")
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b", help="model shape (default: Pythia-1B)")
    parser.add_argument("--context", type=int, default=512, help="query tokens per row (default: the paper's 512)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per width and mode")
    parser.add_argument("--allow_cpu", action="store_true", help="run without CUDA, in fp32 (a smoke run)")
    parser.add_argument("--backend", choices=["inductor", "aot_eager"], default="inductor",
                        help="torch.compile's backend (default: ppo.py's, inductor); aot_eager runs dynamo's "
                             "graphs with the eager kernels, which shows what the compiled code itself gains")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile --repeats passes of each mode (first width) and print its N costliest ops")
    parser.add_argument("--check", action="store_true",
                        help="also compare the compiled pass's logits, values and gradients with the eager pass's and "
                             "with an fp32 copy's (first width; the fp32 copy needs 8 bytes a parameter more)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.allow_cpu:
        sys.exit("compile_training.py: no CUDA device; pass --allow_cpu for a smoke run on CPU")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    policy, critic = build_models(args.size, device, dtype)
    eager_model = ppo.PolicyAndValueWrapper(policy, critic).train()
    compiled_model = ppo.PolicyAndValueWrapper(policy, critic, compile_layers=True,  # the same modules
                                               backend=args.backend).train()
    batches = [padded_batch(args.context, first_pad, device) for first_pad in (0, 40)]
    widths = [ppo.response_window(ids, PAD, args.context, RESPONSE)[0].size(1) for ids in batches]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def step(model, ids: torch.Tensor) -> None:  # the PPO epochs' forward and backward, a stand-in loss
        logits, values = ppo.response_logits_and_values(model, ids, PAD, args.context, RESPONSE)
        (logits.float().logsumexp(-1).mean() + values.float().mean()).backward()
        model.zero_grad(set_to_none=True)

    def milliseconds(model) -> list:  # per width: one warm-up, then the mean of --repeats
        out = []
        for ids in batches:
            step(model, ids)
            sync()
            start = time.perf_counter()
            for _ in range(args.repeats):
                step(model, ids)
            sync()
            out.append(1000 * (time.perf_counter() - start) / args.repeats)
        return out

    eager = milliseconds(eager_model)
    compile_seconds = []
    for ids in batches:  # the first call compiles (any width); the second only if its window has no pads (no mask)
        sync()
        start = time.perf_counter()
        step(compiled_model, ids)
        sync()
        compile_seconds.append(time.perf_counter() - start)
    compiled = milliseconds(compiled_model)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{device_name}, {dtype}, size {args.size}, {ROWS} rows of {args.context} + {RESPONSE} tokens, backend "
          f"{args.backend}, torch {torch.__version__}")
    print("| window width | eager ms | --compile_training ms | compiled / eager |")
    print("|---|---|---|---|")
    for width, e, c in zip(widths, eager, compiled):
        print(f"| {width} | {e:.1f} | {c:.1f} | {c / e:.3f} |")
    print(f"compile: first call {compile_seconds[0]:.1f} s, the second width {compile_seconds[1]:.1f} s "
          f"(its first compiled call)")
    if device == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB")
    for name, model in (("eager", eager_model), ("--compile_training", compiled_model)) if args.profile else ():
        print(profile_lines(name, lambda: step(model, batches[0]), args.repeats, args.profile, device))
    if args.check:
        print(agreement_lines(eager_model, compiled_model, batches[0], args.context))


if __name__ == "__main__":
    main()

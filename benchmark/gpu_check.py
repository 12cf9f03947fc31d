"""The real path on a GPU, in one command: a Pythia-1B-shaped model through SFT, RM, DPO and PPO updates.

One SFT, one RM, one DPO and two PPO updates at the paper's per-GPU batch (SFT 16 samples in
micro-batches of 1, RM and DPO 8 pairs in micro-batches of 1, PPO 64 episodes in micro-batches of 16
with rollouts of 64: benchmark/knobs.sh at 1B), each through `accelerate launch` with the paper's
DeepSpeed ZeRO-2 bf16 config on one process, each stage loading the previous one's output. PPO runs
twice: plain, then with both fast paths (--fast_sampling --compile_training); should the compiled run
fail, it runs again with --fast_sampling alone and the report names the error. DPO runs last: the report of
everything else is written before it, so a check stopped at a device's time limit keeps PPO's numbers. No Hub needed: the
model is Pythia-1B's architecture (hidden 2048, 16 layers, 8 heads, rotary 25%, 50304 embedding rows)
with random weights saved in fp16 as the Hub's are, the tokenizer the tiny world's (its [PAD] appended
after the last token, as for Pythia), the data the tiny world's posts joined into queries that fill
the paper's 512 tokens. With --hub, the real EleutherAI/pythia-1b-deduped checkpoint instead.

Printed and written to runs/gpu_check.md (--out; benchmark/results/gpu_check.md keeps every check): the device and versions; per stage its wall
time and peak GPU memory; the second PPO update's time split in each run (generation / scoring /
training), and what the first update took more (compiling the fast paths); each run's training phase against
its floor (plain forward + backward passes, and the bf16 matmul peak measured in the same run), and that pass at
micro-batches of 32 and 64 rows (does a larger --local_micro_batch_size train faster per row?); PPO's training
pass, and the rollout's scoring of 64 rows, at the runs' query lengths (nearly 512 tokens) and at TL;DR-like ones
(mean 364; the real data's 347), in 1, 2 and 4 forwards of rows sorted by length (does --length_groups pay on a
GPU?), and the fast run's update projected at those lengths; the floor's pass by operator kind (matmuls, attention and its kernels, the rest: torch.profiler); the
first-epoch ratio of each run (mean, and max |ratio - 1| over tokens); the windowed training forward against the
plain full forward (max |difference| of the logits, bf16); decode tokens/s at the paper's rollout
batch of the fast path (StaticSampler) and of the plain loop (sample_rollout), and how many of their
tokens agree.

    bash benchmark/gpu_check.sh                       # any CUDA machine, ~5-8 min on one H100 or H200
    python benchmark/gpu_check.py --size tiny --launcher plain --allow_cpu --out /tmp/check.md   # CPU smoke
"""

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = os.path.join(REPO, "assets", "tiny_world")
sys.path.insert(0, REPO)

# Pythia-1B (EleutherAI/pythia-1b-deduped config.json) and a tiny stand-in for smoke runs.
SIZES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192, vocab_size=50304),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1344),
}
# The paper's per-GPU batches at 1B (benchmark/knobs.sh): the global batch / 8 GPUs.
STAGE_FLAGS = {
    "sft.py": ["--batch_size", "16", "--local_micro_batch_size", "1", "--total_episodes", "16",
               "--num_eval_samples", "8", "--local_eval_batch_size", "4"],
    "reward.py": ["--batch_size", "8", "--local_micro_batch_size", "1", "--total_episodes", "8",
                  "--num_eval_samples", "8", "--local_eval_batch_size", "8"],
    "dpo.py": ["--batch_size", "8", "--local_micro_batch_size", "1", "--total_episodes", "8",
               "--num_eval_samples", "8", "--local_eval_batch_size", "8"],
    "ppo.py": ["--batch_size", "64", "--local_micro_batch_size", "16", "--local_rollout_forward_batch_size", "64",
               "--total_episodes", "128", "--num_eval_samples", "8", "--local_eval_batch_size", "8"],
}
LENGTHS = ["--query_length", "512", "--max_sft_response_length", "53", "--max_sft_query_response_length", "562",
           "--max_rm_response_length", "169", "--max_rm_query_response_length", "638", "--cnndm_query_length", "1919",
           "--cnndm_max_rm_response_length", "155", "--cnndm_max_rm_query_response_length", "2021",
           "--no_check_length_correctness"]  # the paper's budgets; the tiny texts stay under them


# Query lengths like the real TL;DR queries' (Pythia's tokenizer and 512-token budget: mean 346.7, median 352, at most
# 512 tokens, in the reference's preprocessed data). The PPO runs below train on queries that fill the 512 tokens, the
# worst case for ppo.py's training window, which drops only the left pads that all rows of a micro-batch share. These
# are the committed tiny world's SFT train queries 0, 64, ..., 4032, their lengths in its 192-token budget scaled to
# 512 (mean 364, median 356: slightly longer than the real ones); tests/test_benchmarks.py derives them again.
TLDR_LIKE_QUERY_LENGTHS = (
    413, 475, 267, 363, 381, 360, 357, 336, 371, 451, 477, 413, 421, 336, 291, 325,
    475, 248, 312, 224, 477, 373, 296, 341, 264, 293, 331, 264, 464, 355, 499, 333,
    331, 352, 379, 368, 227, 304, 309, 387, 507, 293, 424, 296, 400, 291, 456, 336,
    453, 427, 349, 477, 429, 485, 301, 483, 301, 408, 392, 357, 267, 285, 320, 317)


def tldr_like_query_lengths(tiny_query_lengths: list, tiny_budget: int = 192, budget: int = 512) -> tuple:
    """Every 64th of the tiny world's SFT train query lengths (tokens, of a `tiny_budget`-token query), scaled to a
    `budget`-token query: TLDR_LIKE_QUERY_LENGTHS."""
    return tuple(min(budget, round(length * budget / tiny_budget)) for length in tiny_query_lengths[::64])


def query_lengths(sft_dataset: str, pad_id: int, rows: Optional[int] = None) -> list:
    """The query tokens (ids other than `pad_id`) of each of the first `rows` train rows (None: all) of
    preprocess_tldr.py's SFT dataset folder `sft_dataset`."""
    import datasets

    train = datasets.load_from_disk(sft_dataset)["train"]
    queries = train.select(range(min(rows, len(train))) if rows is not None else range(len(train)))["query_token"]
    return [sum(token != pad_id for token in query) for query in queries]


def pythia_like_tokenizer(folder: str) -> None:
    """The tiny world's tokenizer with no pad token ([PAD] is added after its last token, as for Pythia)."""
    tokenizer_json = json.load(open(os.path.join(WORLD, "pythia-tiny", "tokenizer.json")))
    for token in tokenizer_json["added_tokens"]:
        if token["content"] == "[PAD]":
            token["content"] = "<|padding|>"
    vocab = tokenizer_json["model"]["vocab"]
    if "[PAD]" in vocab:
        vocab["<|padding|>"] = vocab.pop("[PAD]")
    config = json.load(open(os.path.join(WORLD, "pythia-tiny", "tokenizer_config.json")))
    config.pop("pad_token", None)
    json.dump(tokenizer_json, open(os.path.join(folder, "tokenizer.json"), "w"))
    json.dump(config, open(os.path.join(folder, "tokenizer_config.json"), "w"))


def pythia_config(shape: dict):
    """A GPTNeoXConfig of `shape` (hidden size, layers, heads, MLP width, vocabulary: a SIZES entry) with Pythia's other
    settings (the benchmarks' random-init models)."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(**shape, max_position_embeddings=2048, hidden_act="gelu", layer_norm_eps=1e-5,
                         use_parallel_residual=True, tie_word_embeddings=False, attention_bias=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                         hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)


def build_model(folder: str, size: str) -> None:
    """A randomly initialised GPT-NeoX of `size` with Pythia's other settings, saved in fp16 as the Hub's weights."""
    from transformers import GPTNeoXForCausalLM

    os.makedirs(folder, exist_ok=True)
    pythia_like_tokenizer(folder)
    config = pythia_config(SIZES[size])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = GPTNeoXForCausalLM(config)
    model.half().save_pretrained(folder)


def build_world(folder: str) -> None:
    """The tiny world's datasets with every post made of several posts' paragraphs: queries fill the 512 tokens."""
    import datasets

    def lengthen(posts: list) -> list:  # post i ++ the next five, as paragraphs
        return ["\n\n".join(posts[(i + k) % len(posts)] for k in range(6)) for i in range(len(posts))]

    cache = os.path.join(folder, ".cache")
    sft = datasets.load_dataset(os.path.join(WORLD, "tldr_3_filtered"), cache_dir=cache)
    os.makedirs(os.path.join(folder, "tldr_3_filtered", "data"))
    shutil.copy(os.path.join(WORLD, "tldr_3_filtered", "README.md"), os.path.join(folder, "tldr_3_filtered"))
    for split, rows in (("train", 128), ("validation", 16), ("test", 16)):
        part = sft[split].select(range(rows))
        part = part.remove_columns("post").add_column("post", lengthen(part["post"]))
        part.to_parquet(os.path.join(folder, "tldr_3_filtered", "data", f"{split}.parquet"))
    preference = datasets.load_dataset(os.path.join(WORLD, "summarize_from_feedback"), "comparisons", cache_dir=cache)
    os.makedirs(os.path.join(folder, "summarize_from_feedback", "comparisons"))
    shutil.copy(os.path.join(WORLD, "summarize_from_feedback", "README.md"),
                os.path.join(folder, "summarize_from_feedback"))
    for split, rows in (("train", 64), ("validation", 32)):
        batches = preference[split]["batch"]
        tldr = [i for i, batch in enumerate(batches) if "cnndm" not in batch][:rows]
        news = [i for i, batch in enumerate(batches) if "cnndm" in batch][:8]
        part = preference[split].select(tldr + news)
        posts = lengthen([info["post"] for info in part.select(range(len(tldr)))["info"]]) + [None] * len(news)
        part = part.map(lambda row, i: {"info": {**row["info"], "post": posts[i] if i < len(tldr) else row["info"]["post"]}},
                        with_indices=True)
        part.to_parquet(os.path.join(folder, "summarize_from_feedback", "comparisons", f"{split}.parquet"))
    shutil.rmtree(cache)


def run(command: list, log: str, env: dict) -> float:
    """Run `command`, its output to `log`; seconds taken. Raises with the log's tail when it fails."""
    start = time.time()
    with open(log, "w") as file:
        result = subprocess.run(command, stdout=file, stderr=subprocess.STDOUT, env=env, cwd=os.path.dirname(log))
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {' '.join(command)}\n" + open(log).read()[-4000:])
    return time.time() - start


def keep_log(log: str, out: str, name: Optional[str] = None) -> None:
    """The last 20,000 characters of a stage's `log`, beside the report `out` (gpu_check_logs/), so that they come back
    from a device machine with the report even when the check is stopped (the scratch folder does not)."""
    folder = os.path.join(os.path.dirname(os.path.abspath(out)), "gpu_check_logs")
    os.makedirs(folder, exist_ok=True)
    with open(log, errors="replace") as source, \
            open(os.path.join(folder, f"{name or os.path.basename(log)[:-len('.log')]}.log"), "w") as target:
        target.write(source.read()[-20000:])


def write_partial(args, name: str, versions: str, timings: dict, memory: dict, status: str) -> None:
    """The report so far, at `args.out`: device, versions and each stage that ended (the full report replaces it);
    a check stopped at the device's time limit still leaves what it measured."""
    lines = ["# benchmark/gpu_check.sh (partial)", "", f"- device: **{name}**", f"- {versions}",
             f"- date: {time.strftime('%Y-%m-%d %H:%M')}, command: `{' '.join(sys.argv)}`", f"- status: {status}", "",
             "| stage | wall time (s, loading and eval included) | peak GPU memory |", "|---|---|---|",
             *[f"| {stage} | {seconds:.0f} | {memory.get(stage, 'n/a')} |" for stage, seconds in timings.items()], ""]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as file:
        file.write("\n".join(lines))


def last_error(log: str) -> str:
    """The last line of `log` that states an exception and its message (not the launcher's ChildFailedError), with
    the next line if it ends in a colon; else the log's last line: for the report."""
    lines = [line.strip() for line in open(log).read().splitlines() if line.strip()] or ["(empty log)"]
    errors = [i for i, line in enumerate(lines)
              if re.search(r"\w+(Error|Exception): \S", line) and "ChildFailedError" not in line]
    i = errors[-1] if errors else len(lines) - 1
    return " ".join(lines[i:i + 2] if lines[i].endswith(":") else lines[i:i + 1])[:400]


def peak_memory(log: str) -> str:
    """The `peak GPU memory: X GiB` a stage printed, or 'n/a' (no CUDA)."""
    found = re.findall(r"peak GPU memory: ([\d.]+) GiB", open(log).read())
    return f"{found[-1]} GiB" if found else "n/a"


@torch.no_grad()
def forward_checks(sft_folder: str, pad_id: int, device: str, sft_dataset: str) -> dict:
    """The windowed training forward vs the plain full forward (bf16), the rollout sampler's decode speed, the training
    floor, and PPO's training pass and the rollout's scoring at the runs' query lengths (the first 64 of `sft_dataset`)
    and at TL;DR-like ones."""
    from transformers import AutoModelForCausalLM

    from ppo import PolicyAndValueWrapper, StaticSampler, cast_parameters, response_window, sample_rollout
    from reward import ScalarModel, ScalarModelConfig  # a new RM is reward.py's: ppo.py's copy only loads one

    dtype = torch.bfloat16
    policy = cast_parameters(AutoModelForCausalLM.from_pretrained(sft_folder, dtype=torch.float32), dtype).to(device)
    policy.eval()
    base_config = {k: v for k, v in policy.base_model.config.to_dict().items() if k != "_name_or_path"}
    critic = ScalarModel(ScalarModelConfig(base_config=base_config))
    critic.backbone.load_state_dict(policy.base_model.state_dict())
    critic = cast_parameters(critic, dtype).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    rows, context, response_length = 16, 512, 53
    queries = torch.randint(2, 1000, (rows, context), generator=generator)
    for i in range(rows):  # left padding of 10 ... 160 tokens, as truncated posts leave: every row is padded, so the
        queries[i, :10 + 10 * i] = pad_id  # window starts past column 0 and the check compares a real cut
    responses = torch.randint(2, 1000, (rows, response_length), generator=generator)
    query_responses = torch.cat((queries, responses), 1).to(device)
    cut = response_window(query_responses, pad_id, context, response_length)
    logits, _ = PolicyAndValueWrapper(policy, critic)(*cut, response_length)
    mask = query_responses != pad_id
    full = policy(input_ids=query_responses.masked_fill(~mask, 0), attention_mask=mask).logits
    full = full[:, context - 1:context - 1 + response_length]
    difference = (logits.float() - full.float()).abs()
    window = {"window_max_abs_diff": difference.max().item(), "window_mean_abs_diff": difference.mean().item(),
              "logit_scale": full.float().abs().mean().item(),  # read now: nothing later may cost them
              "window_columns": cut[0].shape[1]}
    # Decode: the paper's rollout batch (64 prompts of 512 tokens), 53 new tokens, no early stop.
    batch = torch.randint(2, 1000, (64, context), generator=generator).to(device)
    unsampled = torch.tensor([pad_id], device=device)
    fast = StaticSampler(64)
    fast(policy, batch, pad_id, -1, response_length, 0.7, unsampled)  # its first call compiles the decode step
    sample_rollout(policy, batch[:4], pad_id, -1, 4, 0.7, unsampled)  # warm-up
    seconds, samples = {}, {}
    for name, sampler in (("plain", sample_rollout), ("fast", fast), ("plain", sample_rollout), ("fast", fast)):
        if device == "cuda":
            torch.cuda.synchronize()
        torch.manual_seed(0)
        start = time.time()
        samples[name] = sampler(policy, batch, pad_id, -1, response_length, 0.7, unsampled)[0]  # EOS -1: no early stop
        if device == "cuda":
            torch.cuda.synchronize()
        seconds[name] = min(seconds.get(name, float("inf")), time.time() - start)  # the faster of two, alternating
    same = (samples["plain"] == samples["fast"])[:, context:].float().mean().item()
    floor = training_floor(policy, pad_id, device)
    run_lengths = functools.cache(lambda: query_lengths(sft_dataset, pad_id, 64))  # read once, by the first to ask
    groups = diagnostic(lambda: length_group_passes(PolicyAndValueWrapper(policy, critic), pad_id, device,
                                                    run_lengths()))
    scoring = diagnostic(lambda: scoring_group_passes(policy, critic, pad_id, device, run_lengths()))
    return {**floor, **window, "length_groups": groups, "scoring_groups": scoring, "same_tokens": same,
            **{f"{name}_tokens_per_second": 64 * response_length / value for name, value in seconds.items()},
            **{f"{name}_seconds": value for name, value in seconds.items()}}


def mean_seconds(step, repeats: int, device: str, warmups: int = 2) -> float:
    """Seconds per call of `step`: the mean of `repeats` calls after `warmups` calls."""
    for _ in range(warmups):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.time()
    for _ in range(repeats):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.time() - start) / repeats


def training_floor(policy, pad_id: int, device: str) -> dict:
    """The matmul peak and one plain forward + backward of `policy` (bf16) at a PPO micro-batch: the floor of training."""
    seconds = functools.partial(mean_seconds, device=device)
    size = 8192 if device == "cuda" else 512
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    peak = 2 * size ** 3 / seconds(lambda: a @ a, 10)
    rows, context, response_length = 16, 512, 53
    ids = torch.randint(2, 1000, (rows, context + response_length), device=device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    for i in range(rows):  # left padding of 0 ... 150 tokens, as in forward_checks
        mask[i, :10 * i] = False

    def step():
        with torch.enable_grad():
            logits = policy(input_ids=ids.masked_fill(~mask, 0), attention_mask=mask).logits
            logits[:, context - 1:-1].float().mean().backward()
        policy.zero_grad(set_to_none=True)

    step_seconds = seconds(step, 5)
    # The same pass at larger micro-batches (the 16 rows repeated): does the GPU run a PPO micro-batch of 32 or 64
    # (--local_micro_batch_size, memory permitting) faster per row? None where it ran out of memory.
    per_16_rows = {}
    base_ids, base_mask = ids, mask
    for factor in (2, 4):
        ids, mask = base_ids.repeat(factor, 1), base_mask.repeat(factor, 1)
        try:
            per_16_rows[rows * factor] = seconds(step, 3) / factor
        except torch.cuda.OutOfMemoryError:
            per_16_rows[rows * factor] = None
        policy.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    ids, mask = base_ids, base_mask
    operators = diagnostic(lambda: operator_seconds(step, device))  # the pass at 16 rows, profiled last
    weights = sum(p.numel() for name, p in policy.named_parameters() if "embed_in" not in name)  # LM head counted
    return {"peak_flops": peak, "step_seconds": step_seconds, "step_flops": 6 * weights * base_ids.numel(),
            "weights": weights, "per_16_rows": per_16_rows, "operators": operators}


MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv"})


def operator_seconds(step, device: str) -> dict:
    """Where one call of `step` spends its time, from torch.profiler (the GPU's kernels on CUDA, the CPU's ops on a
    CPU), by the operator that ran it: {"matmul": s, "attention": s, "other": s, "attention_ops": [its ops' names]}.
    Attention = the SDPA ops and their backward, whose names say the kernel (flash, efficient, cudnn); SDPA's math
    fallback shows by name too (aten::_scaled_dot_product_attention_math), but its matmuls and softmax count as
    matmul and other. Raises when a GPU profile recorded no GPU time (CUPTI not running: torch only warns)."""
    from torch.profiler import ProfilerActivity, profile

    step()  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as profiler:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    attention_ops = set()
    for event in profiler.key_averages():
        # On a GPU, the ops' rows only: each holds the kernels it launched, which a kernel's own row would count
        # again, and the profiler's own rows may carry an op's kernels too (pytorch#193924).
        if device == "cuda" and not event.key.startswith("aten::"):
            continue
        took = (event.self_device_time_total if device == "cuda" else event.self_cpu_time_total) / 1e6
        if "attention" in event.key.lower():
            seconds["attention"] += took
            if event.key.startswith("aten::"):  # the ops, not their autograd wrappers
                attention_ops.add(event.key)
        else:
            seconds["matmul" if event.key in MATMULS else "other"] += took
    if device == "cuda" and sum(seconds.values()) <= 0:
        raise RuntimeError("the profiler recorded no GPU time (CUPTI not running?)")
    return {**seconds, "attention_ops": sorted(attention_ops)}


def diagnostic(measure):
    """measure(), or {"error": what went wrong}: a failed extra measurement must not cost the check its report."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 (out of memory, a profile without GPU time, a missing dataset, ...)
        failure = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    if torch.cuda.is_available():
        try:  # what the failed measurement held (outside the except: its traceback no longer holds the tensors)
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 (a broken device: the report is written all the same)
            pass
    return failure


def padded_rows(query_lengths, pad_id: int, device: str, generator: torch.Generator, context: int = 512,
                response_length: int = 53) -> torch.Tensor:
    """(len(query_lengths), context + response_length) random ids, each query left-padded to `context` tokens."""
    ids = torch.randint(2, 1000, (len(query_lengths), context + response_length), generator=generator)
    for row, length in enumerate(query_lengths):
        ids[row, :context - length] = pad_id
    return ids.to(device)


def length_group_passes(model, pad_id: int, device: str, run_lengths: list, lengths: tuple = TLDR_LIKE_QUERY_LENGTHS,
                        groups: tuple = (1, 2, 4)) -> dict:
    """PPO's training pass of a micro-batch of 16 rows: ppo.py's forward of policy and critic (the PolicyAndValueWrapper
    `model`, response_logits_and_values_by_length) and a backward, eager; the mean seconds per micro-batch over 4
    micro-batches of query lengths. Of `run_lengths` (the PPO runs' queries, 64) in one forward: "runs" (their mean
    length: "run_query_length"); of `lengths` (TL;DR-like query lengths, 64; their mean: "query_length") in each
    number of `groups` forwards (--length_groups): "groups", {that number: seconds}."""
    from ppo import response_logits_and_values_by_length

    context, response_length, rows = 512, 53, 16
    generator = torch.Generator().manual_seed(0)

    def micro_batches(query_lengths) -> list:  # 4 of (rows, 512 + 53) ids
        return [padded_rows(query_lengths[start:start + rows], pad_id, device, generator)
                for start in range(0, 4 * rows, rows)]

    def step(ids: torch.Tensor, forwards: int) -> None:
        with torch.enable_grad():
            logits, values = response_logits_and_values_by_length(model, ids, pad_id, context, response_length,
                                                                  forwards)
            (logits.float().mean() + values.float().mean()).backward()
        model.zero_grad(set_to_none=True)

    def mean_pass(batches: list, forwards: int) -> float:
        return sum(mean_seconds(lambda: step(ids, forwards), 2, device, 1) for ids in batches) / len(batches)

    real = micro_batches(lengths)
    return {"runs": mean_pass(micro_batches(run_lengths), 1), "run_query_length": sum(run_lengths) / len(run_lengths),
            "query_length": sum(lengths) / len(lengths),
            "groups": {forwards: mean_pass(real, forwards) for forwards in groups}}


def scoring_group_passes(policy, critic, pad_id: int, device: str, run_lengths: list,
                         lengths: tuple = TLDR_LIKE_QUERY_LENGTHS, groups: tuple = (1, 2, 4)) -> dict:
    """The rollout's scoring of one chunk of 64 rows (ppo.py's rollout: the reference policy's logits, response_logits;
    the critic's values, get_values; the RM's scores, get_score, the critic standing in for the RM, of the same shape),
    no grad; the mean seconds of 2 passes after a warm-up. Of `run_lengths` (the PPO runs' queries, 64) in one forward:
    "runs"; of `lengths` (TL;DR-like, 64) in each number of `groups` forwards (--length_groups): "groups"."""
    from ppo import get_score, get_values, response_logits

    context = 512
    generator = torch.Generator().manual_seed(1)

    def score(ids: torch.Tensor, forwards: int) -> None:
        with torch.no_grad():
            response_logits(policy, ids, pad_id, context, forwards)
            get_values(critic, ids, pad_id, context, forwards)
            get_score(critic, ids, pad_id, context, forwards)

    runs, real = (padded_rows(query_lengths, pad_id, device, generator) for query_lengths in (run_lengths, lengths))
    return {"runs": mean_seconds(lambda: score(runs, 1), 2, device, 1),
            "groups": {forwards: mean_seconds(lambda: score(real, forwards), 2, device, 1) for forwards in groups}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b", help="model shape (default: Pythia-1B)")
    parser.add_argument("--hub", action="store_true", help="use EleutherAI/pythia-1b-deduped from the Hub instead")
    parser.add_argument("--launcher", choices=("deepspeed", "plain"), default="deepspeed",
                        help="deepspeed: the paper's ZeRO-2 bf16 config on 1 process; plain: python, fp32")
    parser.add_argument("--work", default="/tmp/gpu_check", help="scratch folder (emptied first)")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "gpu_check.md"),
                        help="the report (default runs/gpu_check.md: benchmark/results/gpu_check.md keeps every check, "
                             "the latest first, added by hand)")
    parser.add_argument("--allow_cpu", action="store_true", help="run without CUDA (a smoke run of this script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.allow_cpu:
        raise SystemExit(f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}): this check "
                         "measures a GPU. On CPU, --allow_cpu --size tiny --launcher plain runs it as a smoke test.")
    missing = [name for name in ("deepspeed", "datasets", "tyro", "rouge_score", "tensorboard", "accelerate")
               if __import__("importlib").util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"missing packages {missing}: pip install -r requirements.txt (with a CUDA torch)")
    for script in ("preprocess_tldr", "sft", "reward", "dpo", "ppo"):  # their imports, before minutes of work
        try:
            __import__("importlib").import_module(script)
        except ImportError as error:
            raise SystemExit(f"{script}.py cannot be imported here ({error}): install what it names (a device machine "
                             "reaches no registry: bring its wheels, benchmark/gpu_wheels.sh)") from None
    import accelerate
    import deepspeed
    import transformers

    args.work = os.path.abspath(args.work)  # the stages run in it (cwd) and are given paths below it
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    versions = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
                f"accelerate {accelerate.__version__}, deepspeed {deepspeed.__version__}")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run, not a measurement)"
    print(f"device: {name}\n{versions}", flush=True)

    model = "EleutherAI/pythia-1b-deduped" if args.hub else os.path.join(args.work, "pythia-like")
    if not args.hub:
        build_model(model, args.size)
    build_world(os.path.join(args.work, "world"))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    timings, memory = {}, {}
    compile_failure = checks = None
    # A stage that fails, or a check stopped at the device's time limit, still leaves the report of the stages that
    # ended and their logs' tails beside --out (write_partial, keep_log); from the checks after PPO's runs on, the full
    # report, with DPO's row to come.
    try:
        world = os.path.join(args.work, "world")
        timings["preprocess"] = run([sys.executable, os.path.join(REPO, "preprocess_tldr.py"), "--base_model", model,
                                     "--sft_dataset", os.path.join(world, "tldr_3_filtered"),
                                     "--preference_dataset", os.path.join(world, "summarize_from_feedback"), *LENGTHS],
                                    os.path.join(args.work, "preprocess.log"), env)
        launch = ([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   os.path.join(REPO, "benchmark", "accelerate", "deepspeed_zero2.yaml"), "--num_processes", "1"]
                  if args.launcher == "deepspeed" else [sys.executable])
        model_name = os.path.basename(model) if not args.hub else model
        # Each stage finds the last one's output at its default path; PPO runs twice, the second time with both
        # fast paths: the sampler and the compiled training layers (its own run name and output folder).
        fast_output = os.path.join(args.work, "models", model_name, "ppo_fast")
        # DPO last: issue 17's numbers (the PPO runs and the checks after them) come first, and the report with them,
        # so that a check stopped at the device's time limit during DPO's stage keeps them.
        stages = {"sft": ("sft.py", []), "reward": ("reward.py", []), "ppo": ("ppo.py", ["--run_name", "ppo"]),
                  "ppo_fast": ("ppo.py", ["--fast_sampling", "--run_name", "ppo_fast", "--output_dir", fast_output]),
                  "dpo": ("dpo.py", [])}
        for stage, (script, extra) in stages.items():
            log = os.path.join(args.work, f"{stage}.log")
            command = [*launch, os.path.join(REPO, script), "--base_model", model, *STAGE_FLAGS[script], *extra]
            try:
                timings[stage] = run(command + (["--compile_training"] if stage == "ppo_fast" else []), log, env)
            except SystemExit:
                # The sampler's own compile failing (ppo.py names --fast_sampling) would fail the retry the same way.
                if stage != "ppo_fast" or "--fast_sampling:" in last_error(log):
                    raise
                # A compiler failure must not cost the rest of a GPU session's only check: note it, and time
                # the fast sampler alone.
                compile_failure = last_error(log)
                print(f"--compile_training failed ({compile_failure}): the fast run again with --fast_sampling "
                      "only", flush=True)
                os.replace(log, os.path.join(args.work, "ppo_fast_compile_failed.log"))  # kept for a look
                keep_log(os.path.join(args.work, "ppo_fast_compile_failed.log"), args.out)
                for folder in (fast_output, os.path.join(args.work, "runs", "ppo_fast")):
                    shutil.rmtree(folder, ignore_errors=True)
                timings[stage] = run(command, log, env)
            memory[stage] = peak_memory(log)
            print(f"{stage}: {timings[stage]:.0f} s, peak GPU memory {memory[stage]}", flush=True)
            keep_log(log, args.out)
            if stage == "ppo_fast":
                stats, stats_fast = (scalars_of(os.path.join(args.work, "runs", run)) for run in ("ppo", "ppo_fast"))
                sft_folder = os.path.join(args.work, "models", model_name, "sft_1")
                pad_id = json.load(open(os.path.join(sft_folder, "args.json")))["pad_token_id"]
                sft_data = os.path.join(args.work, "data", model_name, "tldr", "sft")
                checks = forward_checks(sft_folder, pad_id, device, sft_data)
                measured = (stats, stats_fast, checks, compile_failure)
                write_report(args, name, versions, timings, memory, *measured, dpo="the check stopped before it ended")
            elif stage != "dpo":
                write_partial(args, name, versions, timings, memory, f"{stage} done; the next steps had not ended")
    except SystemExit as failure:
        for log in sorted(file for file in os.listdir(args.work) if file.endswith(".log")):
            keep_log(os.path.join(args.work, log), args.out)
        status = f"stopped: {str(failure).splitlines()[0][:300]}"
        if checks is None:
            write_partial(args, name, versions, timings, memory, status)
        else:  # DPO's stage failed: the report of everything else, DPO's row saying so
            write_report(args, name, versions, timings, memory, *measured, dpo=status)
        raise
    lines = write_report(args, name, versions, timings, memory, *measured)
    print("\n".join(lines))


def write_report(args, name: str, versions: str, timings: dict, memory: dict, stats: dict, stats_fast: dict,
                 checks: dict, compile_failure: Optional[str], dpo: Optional[str] = None) -> list:
    """The full report (report_lines) at `args.out`; `dpo`: why DPO's row has no numbers (its stage comes last)."""
    lines = report_lines(args, name, versions, timings, memory, stats, stats_fast, checks, compile_failure, dpo)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as file:
        file.write("\n".join(lines))
    return lines


def ratio_of(stats: dict) -> str:
    """A PPO run's first update: the first epoch's ratio (the sampler's log-probabilities against the training
    forward's) and the KL to the reference."""
    return (f"mean {stats['policy/ratio_first_epoch'][0]:.5f}, max |ratio - 1| "
            f"{stats['policy/ratio_first_epoch_max_deviation'][0]:.4f}; KL to the reference at the first update "
            f"{stats['objective/kl'][0]:.5f}")


def training_line(stats: dict, stats_fast: dict, checks: dict, compile_failure: Optional[str] = None) -> str:
    """Each run's PPO training phase against its floor: epochs x micro-batches x 2 models of plain forward + backward."""
    from ppo import Args

    flags = STAGE_FLAGS["ppo.py"]
    micro_batches = int(flags[flags.index("--batch_size") + 1]) // int(flags[flags.index("--local_micro_batch_size") + 1])
    passes = Args.num_ppo_epochs * micro_batches * 2  # policy and critic (the same backbone)
    floor = passes * checks["step_seconds"]

    def measured(stats: dict) -> str:
        training = stats["time/training"][-1]
        achieved = passes * checks["step_flops"] / training
        return (f"{training:.2f} s = {training / floor:.2f}x the floor, {achieved / 1e12:.0f} TFLOP/s = "
                f"{achieved / checks['peak_flops']:.0%} of the matmul peak")

    eager, compiled = stats["time/training"][-1], stats_fast["time/training"][-1]
    if compile_failure is None:
        fast = f"compiled layers (--compile_training) {measured(stats_fast)}; compiled / eager {compiled / eager:.3f}."
    else:
        fast = f"the fast run's eager layers {measured(stats_fast)} (--compile_training failed: {compile_failure})."
    return (f"Training phase against its floor (bf16, the same run): a plain forward + backward of the policy at a "
            f"micro-batch of 16 x 565 tokens takes {checks['step_seconds'] * 1e3:.0f} ms, "
            f"{checks['step_flops'] / checks['step_seconds'] / 1e12:.0f} TFLOP/s, "
            f"{checks['step_flops'] / checks['step_seconds'] / checks['peak_flops']:.0%} of the measured bf16 matmul "
            f"peak ({checks['peak_flops'] / 1e12:.0f} TFLOP/s; 6 x {checks['weights'] / 1e9:.2f} B non-embedding "
            f"weights x tokens). PPO's training phase is {passes} such passes ({Args.num_ppo_epochs} epochs x "
            f"{micro_batches} micro-batches x policy and critic): floor {floor:.2f} s. Measured: eager layers "
            f"{measured(stats)}; {fast} {larger_micro_batches(checks)} {operators_line(checks)}")


def larger_micro_batches(checks: dict) -> str:
    """The floor's pass at micro-batches of 32 and 64 rows, per 16 rows, against the pass at 16."""
    def one(rows: int, seconds: Optional[float]) -> str:
        if seconds is None:
            return f"{rows} rows out of memory"
        return f"{rows} rows {seconds * 1e3:.0f} ms ({seconds / checks['step_seconds']:.2f}x)"

    return ("The same pass at larger micro-batches (--local_micro_batch_size), per 16 rows: "
            + ", ".join(one(rows, seconds) for rows, seconds in checks["per_16_rows"].items()) + ".")


def length_groups_line(stats_fast: dict, checks: dict, compile_failure: Optional[str] = None) -> str:
    """PPO's training pass and the rollout's scoring at the runs' query lengths and at TL;DR-like ones in 1, 2 and 4
    length groups; and what the fast run's update would take if its PPO epochs (and its scoring, where measured)
    scaled as the fastest setting at those lengths."""
    passes, scoring = checks["length_groups"], checks["scoring_groups"]
    if "error" in passes:
        return f"PPO's training pass at TL;DR-like query lengths: not measured ({passes['error']})."

    def settings(runs: float, grouped: dict) -> str:  # one forward, then each number of groups, against the runs'
        return ", ".join(f"{'one forward' if forwards == 1 else f'--length_groups {forwards}'} "
                         f"{grouped[forwards] * 1e3:.0f} ms ({grouped[forwards] / runs:.2f}x)" for forwards in grouped)

    def fastest(grouped: dict) -> int:
        return min(grouped, key=lambda forwards: grouped[forwards])

    runs, grouped = passes["runs"], passes["groups"]
    best = fastest(grouped)
    split = [stats_fast[f"time/{phase}"][-1] for phase in ("generation", "scoring", "training")]
    scored = "error" not in scoring
    scoring_ratio = scoring["groups"][fastest(scoring["groups"])] / scoring["runs"] if scored else 1.0
    projected = split[0] + split[1] * scoring_ratio + split[2] * grouped[best] / runs
    line = (f"PPO's training pass of a micro-batch of 16 (ppo.py's forward of policy and critic, and a backward; "
            f"eager; the mean over 4 micro-batches), at the query lengths of the runs above (mean "
            f"{passes['run_query_length']:.0f} of 512 tokens): {runs * 1e3:.0f} ms. At TL;DR-like query lengths (mean "
            f"{passes['query_length']:.0f}; TLDR_LIKE_QUERY_LENGTHS, the real data's mean is 347): "
            f"{settings(runs, grouped)}. ")
    if scored:
        line += (f"The rollout's scoring of 64 rows (the reference's logits, the critic's values, the RM's scores; no "
                 f"grad): {scoring['runs'] * 1e3:.0f} ms at the runs' lengths; at TL;DR-like ones "
                 f"{settings(scoring['runs'], scoring['groups'])}. ")
    else:
        line += f"The rollout's scoring at TL;DR-like query lengths: not measured ({scoring['error']}). "
    return line + (
        f"If the fast run's PPO epochs scaled as the {'one forward' if best == 1 else f'{best} groups'}"
        + (" and its scoring as the fastest scoring setting" if scored else "")
        + f", its update on TL;DR-like queries would take {split[0]:.2f} + {split[1]:.2f} x {scoring_ratio:.2f} + "
        f"{split[2]:.2f} x {grouped[best] / runs:.2f} = {projected:.2f} s (a projection: its whole training phase, "
        f"{'eager' if compile_failure else 'compiled'}, scaled as the eager pass; generation as measured"
        + ("" if scored else "; scoring as measured") + ").")


def operators_line(checks: dict) -> str:
    """The floor's pass by operator kind (operator_seconds), or why it was not measured."""
    operators = checks["operators"]
    if "error" in operators:
        return f"The pass by operator: not measured ({operators['error']})."
    total = operators["matmul"] + operators["attention"] + operators["other"]
    if total <= 0:
        return "The pass by operator: not measured (no time recorded)."
    share = {kind: f"{operators[kind] * 1e3:.1f} ms ({operators[kind] / total:.0%})"
             for kind in ("matmul", "attention", "other")}
    return (f"The pass by operator (torch.profiler, one pass): matmuls {share['matmul']}, attention {share['attention']}"
            f" ({', '.join(operators['attention_ops']) or 'no op'}), the rest {share['other']}.")


def report_lines(args, name: str, versions: str, timings: dict, memory: dict, stats: dict, stats_fast: dict,
                 checks: dict, compile_failure: Optional[str] = None, dpo: Optional[str] = None) -> list:
    """The lines of gpu_check.md: device, stages, the PPO update's split, ratio, floor, window and decode checks;
    `dpo`: why DPO's row has no numbers, if it has none."""
    # the second update's split: the first one includes compiling the fast paths (sampling step, training layers)
    def update_split(stats: dict, run: str) -> str:
        split = {phase: stats[f"time/{phase}"][-1] for phase in ("generation", "scoring", "training")}
        total = sum(split.values())
        return (f"| {run} | {total:.2f} | " + " | ".join(f"{split[phase]:.2f} ({split[phase] / total:.0%})"
                                                           for phase in ("generation", "scoring", "training")) + " |")

    precision = "bf16" if args.launcher == "deepspeed" else "fp32"
    from ppo import Args

    defaults_fast, defaults_compiled = Args.fast_sampling, Args.compile_training
    fast_flags = "--fast_sampling" + (" --compile_training" if compile_failure is None else "")
    lines = [
        "# benchmark/gpu_check.sh", "",
        f"- device: **{name}**", f"- {versions}",
        f"- model: {'EleutherAI/pythia-1b-deduped (Hub)' if args.hub else f'random-init Pythia-{args.size} shape, fp16 on disk'}; "
        f"launch: {'DeepSpeed ZeRO-2, bf16, 1 process' if args.launcher == 'deepspeed' else 'python, fp32'}",
        f"- date: {time.strftime('%Y-%m-%d')}, command: `{' '.join(sys.argv)}`", "",
        "| stage | per-GPU batch | wall time (s, loading and eval included) | peak GPU memory |", "|---|---|---|---|",
        f"| SFT, 1 update | 16 x 1 | {timings['sft']:.0f} | {memory['sft']} |",
        f"| RM, 1 update | 8 pairs x 1 | {timings['reward']:.0f} | {memory['reward']} |",
        f"| DPO, 1 update | 8 pairs x 1 | {timings['dpo']:.0f} | {memory['dpo']} |" if dpo is None else
        f"| DPO, 1 update | 8 pairs x 1 | not measured: {dpo} | n/a |",
        f"| PPO, 2 updates | 64 episodes, micro 16, rollout 64 | {timings['ppo']:.0f} | {memory['ppo']} |",
        f"| PPO, 2 updates, {fast_flags} | the same | {timings['ppo_fast']:.0f} | {memory['ppo_fast']} |", "",
        f"PPO update, the second of each run (the first one includes compiling the fast paths; ppo.py's defaults are "
        f"--fast_sampling {defaults_fast}, --compile_training {defaults_compiled}), seconds:", "",
        "| run | update | generation | scoring | training |", "|---|---|---|---|---|",
        update_split(stats, "plain loop (sample_rollout), eager layers"
                     + ("" if defaults_fast or defaults_compiled else " (the defaults)")),
        update_split(stats_fast, f"StaticSampler, {'eager' if compile_failure else 'compiled'} layers ({fast_flags})"),
        *([] if compile_failure is None else [f"--compile_training failed, so the fast run sampled with StaticSampler "
                                              f"only: {compile_failure}"]), "", target_line(stats, stats_fast), "",
        compile_line(stats, stats_fast, fast_flags), "",
        f"First-epoch ratio ({precision} sampling loop vs {precision} training forward): {ratio_of(stats)}. The fast run "
        f"(StaticSampler, {'eager' if compile_failure else 'compiled'} layers): {ratio_of(stats_fast)}.", "",
        training_line(stats, stats_fast, checks, compile_failure), "",
        length_groups_line(stats_fast, checks, compile_failure), "",
        f"Windowed training forward ({checks.get('window_columns', 'n/a')} columns) vs the plain full forward (bf16, 16 "
        f"rows of 512 + 53, every row left-padded): max |logit difference| "
        f"{checks['window_max_abs_diff']:.4f}, mean {checks['window_mean_abs_diff']:.5f} (mean |logit| "
        f"{checks['logit_scale']:.2f}).", "",
        f"Decode (bf16, 64 prompts of 512 tokens, 53 new tokens, the faster of two alternating calls each): "
        f"fast path (StaticSampler, --fast_sampling) {checks['fast_tokens_per_second']:.0f} tokens/s "
        f"({checks['fast_seconds']:.2f} s), plain loop (sample_rollout) {checks['plain_tokens_per_second']:.0f} "
        f"tokens/s ({checks['plain_seconds']:.2f} s): {checks['plain_seconds'] / checks['fast_seconds']:.2f}x; "
        f"the same tokens at {checks['same_tokens']:.1%} of positions (same seed; bf16 rounding may move a "
        f"draw).", ""]
    return lines


def compile_line(stats: dict, stats_fast: dict, fast_flags: str) -> str:
    """What the fast paths' compiling costs, inside ppo.py: each run's first update against its second, by phase (the
    plain run's first update pays for warming up only; the fast run's also for compiling the sampler's step, in
    generation, and the layers, in training)."""
    def extra(stats: dict, phase: str) -> float:
        return stats[f"time/{phase}"][0] - stats[f"time/{phase}"][-1]

    return (f"The first update over the second (compiling and warming up), seconds: generation "
            f"+{extra(stats, 'generation'):.1f} plain, +{extra(stats_fast, 'generation'):.1f} with {fast_flags}; training "
            f"+{extra(stats, 'training'):.1f} plain, +{extra(stats_fast, 'training'):.1f} with {fast_flags}.")


def target_line(stats: dict, stats_fast: dict) -> str:
    """Issue 17's verdict on the faster run's second update: at most 4 s on one H100 (64 episodes of 512 + 53 tokens at
    1B), generation at most 40% of it."""
    def split(stats: dict) -> tuple:
        phases = [stats[f"time/{phase}"][-1] for phase in ("generation", "scoring", "training")]
        return sum(phases), phases[0] / sum(phases)

    (update, generation), run = min((split(stats), "plain"), (split(stats_fast), "fast"))
    return (f"Target (issue 17, one H100, the 1B shape): a PPO update in at most 4 s, generation at most 40% of it. "
            f"The faster run ({run}): {update:.2f} s ({'met' if update <= 4 else f'not met, {update - 4:.2f} s over'}), "
            f"generation {generation:.0%} ({'met' if generation <= 0.4 else 'not met'}).")


def scalars_of(folder: str) -> dict:
    """{tag: [values]} of one TensorBoard run folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    return {tag: [event.value for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


if __name__ == "__main__":
    main()

"""The path users run first, seen on CPU: Pythia from the Hub (fp16 weights, an embedding with more
rows than the tokenizer has tokens, no pad token in its files but the pad `<|padding|>` that transformers 5
gives its tokenizer class), bf16, DeepSpeed, and stages that chain by their
default paths.

A "Pythia-like" model is made on the fly from the tiny world's pythia-tiny with exactly these
traits. The pure helpers these traits need (fp32 loading, fp32 rotary frequencies, sampling masks,
equal evaluation batches, the GPU check, a training window never 0 wide) are tested against
hand-computed values; then the whole pipeline runs on the Pythia-like model twice: once in fp32
with nothing but --base_model (each stage finds the last one's output by convention), once in
bf16 under DeepSpeed ZeRO-2 on 2 CPU processes (the paper's launch).

What does not work on CPU, and how it is covered instead: no flash / memory-efficient attention
kernels and no CUDA graphs (sdpa's math kernel runs; benchmark/gpu_check.sh measures the GPU path);
bf16 matmuls run, but slowly and with CPU accumulation order, so bf16 results are compared with
bf16 tolerances, not bit for bit; DeepSpeed needs DS_ACCELERATOR=cpu and the gloo backend
(ENV_NOTES), and its fused optimizers are not used (the scripts hand it torch's AdamW).
"""

import json
import math
import os
import shutil
import socket
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import REPO, WORLD, early_exits, multi_process_slot, one_process, run_python, tiny_lengths
import reward
from ppo import (PolicyAndValueWrapper, cast_parameters, disable_dropout, entropy_from_logits, eval_batches,
                 gpu_problem, last_hidden_states, load_fp32, mask_logits, model_name, response_masks, response_window,
                 rotary_problem, sample_rollout, sampling_distribution, scaled_logits, trained_width,
                 unsampled_token_ids)
from sft import generate  # HF generate, as sft.py's and dpo.py's evaluations call it

EOS = 0
NAME = "pythia-like"  # the fixture's folder name: default paths go to data/pythia-like, models/pythia-like


def make_pythia_like(folder):
    """pythia-tiny as the Hub ships Pythia: fp16 weights; `<|padding|>` at id 1 and no pad token in its files, read
    by the class Pythia's config names (GPTNeoXTokenizer, which transformers 5 gives the pad `<|padding|>`), so
    the [PAD] the stages add lands at len(tokenizer); an embedding with rows no token owns."""
    model = AutoModelForCausalLM.from_pretrained(WORLD / "pythia-tiny", dtype=torch.float32)
    tokenizer_json = json.loads((WORLD / "pythia-tiny" / "tokenizer.json").read_text())
    for token in tokenizer_json["added_tokens"]:
        if token["content"] == "[PAD]":
            token["content"] = "<|padding|>"
    vocab = tokenizer_json["model"]["vocab"]
    vocab["<|padding|>"] = vocab.pop("[PAD]")
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = json.loads((WORLD / "pythia-tiny" / "tokenizer_config.json").read_text())
    config.pop("pad_token")
    config.pop("backend")  # Pythia's tokenizer_config.json names its class and no backend
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPTNeoXTokenizer"}))
    tokens = len(AutoTokenizer.from_pretrained(folder))
    if model.config.vocab_size < tokens + 8:  # Pythia: 50304 rows for 50277 tokens
        model.resize_token_embeddings(64 * (tokens // 64 + 2))
    model.half().save_pretrained(folder)


@pytest.fixture(scope="module")
def pythia_like(tmp_path_factory):
    """Folder of the Pythia-like model, and its tokenizer's length before [PAD] is added."""
    folder = tmp_path_factory.mktemp("hub") / NAME
    make_pythia_like(folder)
    return folder


def test_pythia_like_has_pythias_traits(pythia_like):
    tokenizer = AutoTokenizer.from_pretrained(pythia_like)
    assert "pad_token" not in json.loads((pythia_like / "tokenizer_config.json").read_text())
    # transformers 5 reads Pythia's files with the pad `<|padding|>` (under 4.x: none); the stages replace it by [PAD]
    assert type(tokenizer).__name__ == "GPTNeoXTokenizer" and (tokenizer.pad_token, tokenizer.pad_token_id) == (
        "<|padding|>", 1)
    with safe_open(str(pythia_like / "model.safetensors"), "pt") as file:
        assert {file.get_tensor(key).dtype for key in file.keys()} == {torch.float16}
    assert AutoModelForCausalLM.from_pretrained(pythia_like).dtype == torch.float16  # transformers 5: the saved dtype
    model = load_fp32(AutoModelForCausalLM, str(pythia_like), "--base_model")
    assert {param.dtype for param in model.parameters()} == {torch.float32}
    assert model.get_output_embeddings().weight.size(0) > len(tokenizer) + 1  # rows no token owns, [PAD]'s among them


# ---------------------------------------------------------------------------------------------
# Pure helpers of the real path
# ---------------------------------------------------------------------------------------------


def test_model_name_keeps_base_models_apart(tmp_path):
    assert model_name("EleutherAI/pythia-1b-deduped") == "EleutherAI/pythia-1b-deduped"
    assert model_name("EleutherAI/pythia-2.8b-deduped") != model_name("EleutherAI/pythia-1b-deduped")
    (tmp_path / "my-model").mkdir()
    assert model_name(str(tmp_path / "my-model") + "/") == "my-model"


@pytest.mark.parametrize("num_rows, world_size, batch_size", [(5, 2, 2), (1, 2, 4), (0, 3, 2), (10, 3, 4), (7, 2, 1),
                                                               (64, 8, 8), (3, 4, 2)])
def test_eval_batches_same_count_on_every_rank_and_every_row_once(num_rows, world_size, batch_size):
    ranks = [eval_batches(num_rows, rank, world_size, batch_size) for rank in range(world_size)]
    assert len({len(batches) for batches in ranks}) == 1  # as many (collective) forwards on every rank
    assert len({tuple(len(indices) for indices, _ in batches) for batches in ranks}) == 1  # of the same sizes
    kept = sorted(i for batches in ranks for indices, real in batches for i in indices[:real])
    assert kept == list(range(num_rows))  # each row kept exactly once
    for rank, batches in enumerate(ranks):
        assert all(0 <= i < max(num_rows, 1) for indices, _ in batches for i in indices)  # fillers are real rows
        assert [i for indices, real in batches for i in indices[:real]] == list(range(rank, num_rows, world_size))


def test_gpu_problem_only_when_a_gpu_launch_finds_none():
    assert gpu_problem({}, cuda_available=False) is None  # plain `python sft.py`: the CPU, as asked
    assert gpu_problem({"ACCELERATE_USE_DEEPSPEED": "true"}, cuda_available=True) is None
    problem = gpu_problem({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "bf16"}, False)
    assert "asks for a GPU (DeepSpeed)" in problem and "DS_ACCELERATOR=cpu" in problem and torch.__version__ in problem
    assert gpu_problem({"ACCELERATE_USE_DEEPSPEED": "true", "DS_ACCELERATOR": "cpu"}, False) is None  # a rehearsal
    problem = gpu_problem({"ACCELERATE_MIXED_PRECISION": "bf16"}, False)
    assert "mixed precision bf16" in problem and "--cpu" in problem
    assert gpu_problem({"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "True"}, False) is None


def test_rotary_frequencies_stay_fp32_when_parameters_go_bf16():
    model = AutoModelForCausalLM.from_pretrained(WORLD / "pythia-tiny", dtype=torch.float32)
    exact = model.gpt_neox.rotary_emb.inv_freq.clone()
    assert rotary_problem({"model": model}) is None
    cast_parameters(model, torch.bfloat16)
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}
    assert rotary_problem({"model": model}) is None and torch.equal(model.gpt_neox.rotary_emb.inv_freq, exact)
    rounded = AutoModelForCausalLM.from_pretrained(WORLD / "pythia-tiny").to(torch.bfloat16)  # the blanket cast
    problem = rotary_problem({"reference": rounded})
    assert "reference: gpt_neox.rotary_emb.inv_freq is torch.bfloat16" in problem
    # What the rounding costs: the angle of the last frequency pair at distance 565 (Pythia-1B's rotary dims).
    inv_freq_1b = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64)
    assert (565 * (inv_freq_1b - inv_freq_1b.bfloat16().float())).abs().max() > 0.1


def test_log_probs_of_bf16_logits_are_read_in_fp32():
    """Under DeepSpeed the reference's and the trained policy's logits are bf16: they are divided by T in fp32, as the
    sampler's are, so the three log-probs of the same logits agree exactly (a bf16 division would round twice)."""
    torch.manual_seed(0)
    logits = (torch.randn(4, 8, 300) * 8).to(torch.bfloat16)  # Pythia's logits reach 10-30
    unsampled, temperature = torch.tensor([1, 299]), 0.7 + 1e-7
    scaled = scaled_logits(logits, temperature, unsampled)
    assert scaled.dtype == torch.float32 and torch.equal(scaled, mask_logits(logits.float() / temperature, unsampled))
    assert torch.equal(sampling_distribution(logits, temperature, unsampled)[0], scaled)  # the sampler's scores
    in_bf16 = mask_logits(logits / temperature, unsampled).float()
    assert (in_bf16 != scaled).float().mean() > 0.5  # what the reference's and the trained log-probs used to read


def test_a_row_of_non_finite_logits_draws_uniformly_from_the_sampled_ids_only():
    """Blown-up weights give nan / inf logits, on which multinomial raises: such a row draws from the ids it may
    sample ([PAD] and unowned rows never), and a finite row from its softmax, as it is."""
    logits = torch.tensor([[float("nan")] * 6, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    unsampled = torch.tensor([1, 5])
    _, probs = sampling_distribution(logits, 1.0, unsampled)
    assert probs[0].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]  # unnormalised weights: multinomial takes them
    torch.testing.assert_close(probs[1], mask_logits(logits[1:], unsampled).softmax(-1)[0])


def test_unsampled_ids_are_pad_and_unowned_rows():
    class Tokenizer:  # Pythia's numbers: 50277 tokens, [PAD] added as 50277, 50304 embedding rows
        pad_token_id = 50277

        def __len__(self):
            return 50278

    assert unsampled_token_ids(Tokenizer(), 50304) == list(range(50277, 50304))
    assert unsampled_token_ids(Tokenizer(), 50277) == []  # no spare rows: [PAD] lies past the logits, nothing to mask
    logits = torch.zeros(2, 3, 6)
    masked = mask_logits(logits, torch.tensor([1, 5]))
    assert (masked[..., [1, 5]] == torch.finfo(torch.float32).min).all() and (masked[..., [0, 2, 3, 4]] == 0).all()
    probabilities = masked.softmax(-1)
    assert (probabilities[..., [1, 5]] == 0).all() and torch.allclose(probabilities[..., 0], torch.tensor(0.25))
    entropy = torch.logsumexp(masked, -1) - (probabilities * masked).sum(-1)  # no NaN from 0 * lowest
    torch.testing.assert_close(entropy, torch.full((2, 3), math.log(4)))
    torch.testing.assert_close(entropy_from_logits(masked), entropy)  # what objective/entropy logs, the same


def test_entropy_from_logits_is_the_categorical_entropy():
    """objective/entropy's helper against torch's Categorical, on peaked logits and with masked ids (the entropy of
    the ids left, no NaN)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7) * 4
    torch.testing.assert_close(entropy_from_logits(logits), torch.distributions.Categorical(logits=logits).entropy())
    kept = torch.distributions.Categorical(logits=logits[..., [0, 2, 3, 4, 6]]).entropy()
    torch.testing.assert_close(entropy_from_logits(mask_logits(logits, torch.tensor([1, 5]))), kept)


def tiny_policy(pythia_like):
    """The Pythia-like model in fp32, dropout off, eval mode; its tokenizer with [PAD] added."""
    policy = load_fp32(AutoModelForCausalLM, str(pythia_like), "--base_model").eval()
    disable_dropout(policy)
    tokenizer = AutoTokenizer.from_pretrained(pythia_like, padding_side="right")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return policy, tokenizer


def queries_of(tokenizer, n, width=40):
    """n left-padded queries of the tiny world's validation posts."""
    import pandas as pd

    posts = pd.read_parquet(WORLD / "tldr_3_filtered" / "data" / "validation.parquet")["post"][:n]
    rows = [tokenizer.encode(f"POST: {post}\n\nTL;DR:")[-width + 5 * i:] for i, post in enumerate(posts)]
    return torch.tensor([[tokenizer.pad_token_id] * (width - len(row)) + row for row in rows])


def test_sampling_never_emits_pad_or_unowned_ids_even_when_they_are_likeliest(pythia_like):
    """A hook makes [PAD] and an unowned row the likeliest tokens by far: unmasked sampling emits them at
    once; the rollout loop (ppo.py's rollouts and evaluations) and generate with suppress_tokens (sft.py's and
    dpo.py's evaluations) never do."""
    from transformers import GenerationConfig

    policy, tokenizer = tiny_policy(pythia_like)
    pad, unowned = tokenizer.pad_token_id, policy.get_output_embeddings().weight.size(0) - 1
    assert pad == len(tokenizer) - 1 and unowned >= len(tokenizer)

    def boost(module, inputs, output):
        output[..., pad] += 50.0
        output[..., unowned] += 49.0
        return output
    policy.get_output_embeddings().register_forward_hook(boost)
    queries, length = queries_of(tokenizer, 4), 12
    unsampled = torch.tensor(unsampled_token_ids(tokenizer, policy.get_output_embeddings().weight.size(0)))
    config = dict(max_new_tokens=length, min_new_tokens=length, temperature=0.7, top_k=0, top_p=1.0, do_sample=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        plain = generate(policy, queries, pad, GenerationConfig(**config))
        assert (plain[:, queries.shape[1]:] == pad).float().mean() > 0.5  # the hook bites without the mask
        evaluated = generate(policy, queries, pad, GenerationConfig(**config, suppress_tokens=unsampled.tolist()))
        rollout, scores = sample_rollout(policy, queries, pad, EOS, length, 0.7, unsampled)
    for sampled in (evaluated[:, queries.shape[1]:], rollout[:, queries.shape[1]:]):
        assert sampled.max() < len(tokenizer) - 1 and not (sampled == pad).any()
    assert torch.isfinite(torch.log_softmax(scores, -1).gather(2, rollout[:, queries.shape[1]:, None])).all()


def test_training_window_is_never_zero_wide(pythia_like):
    """Reproducer: a micro-batch whose only response starts with [PAD] (EOS index -1). The window was
    n = 0 and x[:, -0:] selected every position; now it is 1 wide and equals the full forward there."""
    policy, tokenizer = tiny_policy(pythia_like)
    pad = tokenizer.pad_token_id
    queries = queries_of(tokenizer, 1)
    responses = torch.full((1, 6), pad)  # the response starts with [PAD]
    query_responses = torch.cat((queries, responses), 1)
    eos_index, _, _ = response_masks(responses, pad, score_after_eos=False)
    assert eos_index.tolist() == [-1]
    n = trained_width(eos_index, responses.size(1), score_after_eos=False)
    assert n == 1
    assert trained_width(torch.tensor([2, 9]), 6, score_after_eos=True) == 6  # never past the response either
    # through the longest row's EOS (index 4: 5 columns), and the token after it with score_after_eos
    assert trained_width(torch.tensor([2, 4]), 10, score_after_eos=False) == 5
    assert trained_width(torch.tensor([2, 4]), 10, score_after_eos=True) == 6
    ids, mask, positions = response_window(query_responses, pad, queries.shape[1], n)
    with torch.no_grad():
        hidden = last_hidden_states(policy.base_model, ids, mask, positions, n)  # (1, 1, d)
        full = policy.base_model(input_ids=query_responses.masked_fill(query_responses == pad, 0),
                                 attention_mask=query_responses != pad).last_hidden_state
    assert hidden.shape[1] == 1
    torch.testing.assert_close(hidden[:, 0], full[:, queries.shape[1] - 1], rtol=1e-5, atol=1e-5)


def test_windowed_forward_in_bf16_matches_full_forward(pythia_like):
    """PPO's windowed training forward under bf16 autocast on CPU (accelerate's mixed precision) against the
    plain full forward under the same autocast: equal within bf16 tolerance."""
    policy, tokenizer = tiny_policy(pythia_like)
    pad = tokenizer.pad_token_id
    critic = reward.ScalarModel(reward.ScalarModelConfig(base_config={k: v for k, v in policy.base_model.config.to_dict().items()
                                                                      if k != "_name_or_path"}))
    critic.backbone.load_state_dict(policy.base_model.state_dict())
    queries = queries_of(tokenizer, 4)
    torch.manual_seed(0)
    responses = torch.randint(2, 1000, (4, 10))
    responses[0, 4], responses[0, 5:] = EOS, pad
    query_responses = torch.cat((queries, responses), 1)
    context, n = queries.shape[1], 8
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, values = PolicyAndValueWrapper(policy, critic)(*response_window(query_responses, pad, context, n), n)
        attention_mask = query_responses != pad
        full = policy(input_ids=query_responses.masked_fill(~attention_mask, 0), attention_mask=attention_mask).logits
        full_values = critic(query_responses.masked_fill(~attention_mask, 0), attention_mask)
    assert logits.dtype == torch.bfloat16  # autocast really ran the projections in bf16
    full, full_values = full[:, context - 1:context - 1 + n], full_values[:, context - 1:context - 1 + n]
    # bf16 keeps 8 bits of mantissa: a relative rounding of 2^-8 per op, a few ops deep
    torch.testing.assert_close(logits.float(), full.float(), rtol=0.05, atol=0.1)
    torch.testing.assert_close(values.float(), full_values.float(), rtol=0.05, atol=0.1)
    assert (logits.float().argmax(-1) == full.float().argmax(-1)).float().mean() > 0.9


# ---------------------------------------------------------------------------------------------
# The pipeline on the Pythia-like model
# ---------------------------------------------------------------------------------------------

TINY = {  # scale knobs only: at least one real update per stage, seconds each
    "sft.py": ["--lr", "1e-3", "--batch_size", "8", "--local_micro_batch_size", "4", "--total_episodes", "16",
               "--response_length", "8", "--local_eval_batch_size", "8", "--num_eval_samples", "5"],
    "reward.py": ["--lr", "1e-3", "--batch_size", "8", "--local_micro_batch_size", "4", "--total_episodes", "16",
                  "--local_eval_batch_size", "8", "--num_eval_samples", "5"],
    "dpo.py": ["--lr", "1e-3", "--batch_size", "8", "--local_micro_batch_size", "4", "--total_episodes", "16",
               "--response_length", "8", "--local_eval_batch_size", "8", "--num_eval_samples", "5"],
    "ppo.py": ["--lr", "1e-4", "--batch_size", "8", "--local_micro_batch_size", "4", "--total_episodes", "16",
               "--local_rollout_forward_batch_size", "8", "--response_length", "8", "--local_eval_batch_size", "8",
               "--num_eval_samples", "5"],
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The tiny world's two datasets (Hub schemas) cut to what the chain reads: 64 / 16 / 16 posts; 64 train
    pairs, 24 TL;DR and 8 CNN/DM validation pairs. Preprocessing all 21k rows took ~95 s of CI's time."""
    import datasets

    root = tmp_path_factory.mktemp("source")
    cache = str(root / ".cache")
    posts = datasets.load_dataset(str(WORLD / "tldr_3_filtered"), cache_dir=cache)
    (root / "tldr_3_filtered" / "data").mkdir(parents=True)
    shutil.copy(WORLD / "tldr_3_filtered" / "README.md", root / "tldr_3_filtered")
    for split, rows in (("train", 64), ("validation", 16), ("test", 16)):
        posts[split].select(range(rows)).to_parquet(str(root / "tldr_3_filtered" / "data" / f"{split}.parquet"))
    pairs = datasets.load_dataset(str(WORLD / "summarize_from_feedback"), "comparisons", cache_dir=cache)
    (root / "summarize_from_feedback" / "comparisons").mkdir(parents=True)
    shutil.copy(WORLD / "summarize_from_feedback" / "README.md", root / "summarize_from_feedback")
    for split, (tldr_rows, news_rows) in (("train", (64, 0)), ("validation", (24, 8))):
        batches = pairs[split]["batch"]
        tldr = [i for i, batch in enumerate(batches) if "cnndm" not in batch][:tldr_rows]
        news = [i for i, batch in enumerate(batches) if "cnndm" in batch][:news_rows]
        pairs[split].select(tldr + news).to_parquet(
            str(root / "summarize_from_feedback" / "comparisons" / f"{split}.parquet"))
    shutil.rmtree(cache)
    return root


def preprocess(cwd, source, base_model, *flags):
    """preprocess_tldr.py on `source` (a cut of the tiny world) with the tokenizer of `base_model`, run in `cwd`.
    The world's length flags are budgets here (the cut's longest rows may be shorter)."""
    return run_python([sys.executable, str(REPO / "preprocess_tldr.py"), "--base_model", str(base_model),
                       "--sft_dataset", str(source / "tldr_3_filtered"),
                       "--preference_dataset", str(source / "summarize_from_feedback"),
                       *tiny_lengths(), "--no_check_length_correctness", *flags], cwd=cwd, timeout=600)


def stage(cwd, script, *flags, processes=1, bf16=False, check=True):
    """Run a stage script in `cwd`: plain python, or 2 CPU processes of DeepSpeed ZeRO-2 (bf16 or not)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if processes == 1 and not bf16:
        cmd = [sys.executable, str(REPO / script)]
    else:
        with socket.socket() as sock:  # a free port: other test sessions may launch at the same time
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env.pop("ACCELERATE_USE_CPU", None)  # ENV_NOTES: CPU DeepSpeed must not set it (it would drop DeepSpeed)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "benchmark/accelerate/deepspeed_zero2.yaml"), "--num_processes", str(processes),
               "--mixed_precision", "bf16" if bf16 else "no", "--main_process_port", str(port), str(REPO / script)]
    with multi_process_slot(processes):
        result = run_python(cmd + [str(flag) for flag in flags], cwd=cwd, env=env, timeout=600)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def saved_dtypes(folder):
    """{dtype of every saved tensor}, and the dtype the saved config states."""
    with safe_open(str(folder / "model.safetensors"), "pt") as file:
        dtypes = {file.get_tensor(key).dtype for key in file.keys()}
    return dtypes, json.loads((folder / "config.json").read_text())["dtype"]


def scalars(cwd, run_name):
    """{tag: [values]} of a run's TensorBoard folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cwd / "runs" / run_name))
    events.Reload()
    return {tag: [event.value for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def chained(pythia_like, source, tmp_path_factory):
    """preprocess -> sft -> reward -> dpo -> ppo on the Pythia-like model in fp32, each given nothing but
    --base_model (and scale knobs): every input is the previous stage's default output. The working folder."""
    cwd = tmp_path_factory.mktemp("chain")
    result = preprocess(cwd, source, pythia_like)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # --track, as the SLURM launchers pass it with TRACK=1: W&B is disabled here (WANDB_MODE, conftest.py), but its
    # calls and every table logged to it are still made, so a W&B API the stages misuse fails here, not at a real
    # run's end.
    for script in ("sft.py", "reward.py", "dpo.py", "ppo.py"):
        stage(cwd, script, "--base_model", pythia_like, *TINY[script], "--run_name", script[:-3], "--track")
    return cwd


def test_stages_chain_by_default_paths_in_fp32(chained, pythia_like):
    data = chained / "data" / NAME / "tldr"
    pad = len(AutoTokenizer.from_pretrained(pythia_like))  # [PAD] appended after the last token, as for Pythia
    data_args = json.loads((data / "args.json").read_text())
    assert data_args["pad_token_id"] == pad and data_args["base_model_name"] == NAME
    for stage_name in ("sft", "reward", "dpo", "ppo"):
        out = chained / "models" / NAME / f"{stage_name}_1"
        saved = json.loads((out / "args.json").read_text())
        assert saved["base_model_name"] == NAME and saved["pad_token_id"] == pad and saved["track"]
        assert saved["tokenizer_identity"] == data_args["tokenizer_identity"]  # [PAD] included on both sides
        assert saved_dtypes(out) == ({torch.float32}, "float32")  # fp32 from fp16 Hub weights
        assert AutoTokenizer.from_pretrained(out).pad_token_id == pad
    inputs = json.loads((chained / "models" / NAME / "ppo_1" / "args.json").read_text())
    assert inputs["sft_model_path"] == os.path.join("models", NAME, "sft_1")
    assert inputs["reward_model_path"] == os.path.join("models", NAME, "reward_1")
    assert inputs["query_dataset"] == os.path.join("data", NAME, "tldr", "sft")
    ppo = scalars(chained, "ppo")
    assert abs(ppo["policy/ratio_first_epoch"][0] - 1) < 1e-4 and abs(ppo["objective/kl"][0]) < 1e-4
    # Each update logs the rate it used: the cosine from --lr (1e-3) down to 0 over the runs' 2 updates.
    for run_name, prefix in (("sft", "train/sft"), ("reward", "train/rm"), ("dpo", "train/dpo")):
        assert scalars(chained, run_name)[f"{prefix}/lr"] == pytest.approx([1e-3, 5e-4]), run_name
    dpo = scalars(chained, "dpo")
    margins = [chosen - rejected
               for chosen, rejected in zip(dpo["train/dpo/chosen_rewards"], dpo["train/dpo/rejected_rewards"])]
    assert dpo["train/dpo/margin"] == pytest.approx(margins, abs=1e-6)


def test_missing_inputs_stop_before_anything_is_written(chained, pythia_like, tmp_path):
    """Each stage in an empty folder: the message names the missing path, the command that creates it and
    the flag to pass instead, and nothing is written."""
    expected = {"sft.py": ("--query_dataset", f"data/{NAME}/tldr/sft", f"python preprocess_tldr.py --base_model {pythia_like}"),
                "reward.py": ("--sft_model_path", f"models/{NAME}/sft_1", f"python sft.py --base_model {pythia_like} --seed 1"),
                "dpo.py": ("--sft_model_path", f"models/{NAME}/sft_1", f"python sft.py --base_model {pythia_like} --seed 1"),
                "ppo.py": ("--sft_model_path", f"models/{NAME}/sft_1", f"python sft.py --base_model {pythia_like} --seed 1")}
    shutil.copytree(chained / "data", tmp_path / "data")  # the data is there, the models are not
    (tmp_path / "empty").mkdir()  # sft.py starts in an empty folder
    with_sft = tmp_path / "with_sft"  # PPO with the SFT model there but not the reward model
    shutil.copytree(chained / "data", with_sft / "data")
    shutil.copytree(chained / "models" / NAME / "sft_1", with_sft / "models" / NAME / "sft_1")
    starts = [(tmp_path / "empty" if script == "sft.py" else tmp_path, REPO / script, ["--base_model", pythia_like])
              for script in expected] + [(with_sft, REPO / "ppo.py", ["--base_model", pythia_like])] + [
        (tmp_path, REPO / "dpo.py", ["--base_model", pythia_like, "--query_dataset", f"data/{NAME}/tldr/sft"]),
        (with_sft, REPO / "ppo.py", ["--sft_model_path", f"models/{NAME}/sft_1"])]  # the base model from its record
    # one interpreter for the five starts (conftest.early_exits), each in its folder
    results = early_exits(starts, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for (flag, path, command), result in zip(expected.values(), results):
        assert result.returncode != 0 and "SetupError" in result.stderr, result.stderr[-2000:]
        message = next(line for line in result.stderr.splitlines() if f"{flag} {path}: no such folder" in line)
        assert f"`{command}`" in message and f"pass {flag}" in message
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "empty", "with_sft"]
    # PPO with the SFT model there but not the reward model: the reward model is named.
    assert f"--reward_model_path models/{NAME}/reward_1: no such folder" in results[-3].stderr
    assert f"`python reward.py --base_model {pythia_like} --seed 1`" in results[-3].stderr
    # A data folder given on the command line is carried into the command that creates the missing model.
    assert f"`python sft.py --base_model {pythia_like} --seed 1 --query_dataset data/{NAME}/tldr/sft`" in results[-2].stderr
    # No --base_model: the reward model's command names the one the SFT model records (the 1B default did), as the
    # default paths do (reward.py reads no weights from --base_model: it names folders).
    assert f"--reward_model_path models/{NAME}/reward_1: no such folder" in results[-1].stderr
    assert f"`python reward.py --base_model {NAME} --seed 1`" in results[-1].stderr, results[-1].stderr[-1000:]
    assert sorted(p.name for p in (with_sft / "models" / NAME).iterdir()) == ["sft_1"]
    assert sorted(p.name for p in with_sft.iterdir()) == ["data", "models"]


def test_missing_data_names_the_data_the_sft_model_was_fine_tuned_on(chained, pythia_like, tmp_path):
    """No --base_model and no data at the default path, but the SFT model's args.json names preprocess_tldr.py's output
    elsewhere (the tiny world's data/tiny_tldr, say): the message gives the base model the SFT model records, not its
    bare name, and the flags that pass that data."""
    shutil.copytree(chained / "data" / NAME / "tldr", tmp_path / "mydata")
    sft_model = tmp_path / "models" / NAME / "sft_1"
    shutil.copytree(chained / "models" / NAME / "sft_1", sft_model)
    saved = json.loads((sft_model / "args.json").read_text())
    (sft_model / "args.json").write_text(json.dumps({**saved, "query_dataset": "mydata/sft"}))
    starts = [(tmp_path, REPO / script, ["--sft_model_path", f"models/{NAME}/sft_1"]) for script in
              ("reward.py", "dpo.py", "ppo.py")]
    results = early_exits(starts, env={**os.environ, "OMP_NUM_THREADS": "1"})
    make = f"`python preprocess_tldr.py --base_model {pythia_like}`, or pass the data models/{NAME}/sft_1 was fine-tuned on: "
    for result in results[:2]:
        assert result.returncode != 0, result.stderr[-2000:]
        assert (f"--label_dataset data/{NAME}/tldr/preference: no such folder. Create it with {make}"
                "`--label_dataset mydata/preference --query_dataset mydata/sft`") in result.stderr, result.stderr[-2000:]
    assert (f"--query_dataset data/{NAME}/tldr/sft: no such folder. Create it with {make}`--query_dataset mydata/sft`"
            in results[2].stderr), results[2].stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "mydata"]  # nothing written


def test_a_model_of_another_base_is_never_picked_up(chained, tmp_path):
    """A run for another base model looks in its own folders, and refuses an SFT model trained from another base."""
    other = ["--base_model", "EleutherAI/pythia-2.8b-deduped"]
    sft_model = ["--sft_model_path", chained / "models" / NAME / "sft_1"]
    ppo, rm, dpo, ppo_given = early_exits(  # one interpreter for all four (conftest.early_exits)
        [(chained, REPO / "ppo.py", other), (chained, REPO / "reward.py", other + sft_model),
         (chained, REPO / "dpo.py", other + sft_model), (chained, REPO / "ppo.py", other + sft_model)],
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "--sft_model_path models/EleutherAI/pythia-2.8b-deduped/sft_1: no such folder" in ppo.stderr
    for result in (rm, dpo):
        assert f"was fine-tuned from {NAME}, not from --base_model EleutherAI/pythia-2.8b-deduped" in result.stderr
    assert (f"--sft_model_path {sft_model[1]} was trained from {NAME}, not from --base_model "
            f"EleutherAI/pythia-2.8b-deduped: pass --base_model {NAME} or another --sft_model_path") in ppo_given.stderr
    assert not (chained / "models" / "EleutherAI").exists()


def test_bf16_deepspeed_pipeline(chained, pythia_like, tmp_path):
    """sft -> reward -> dpo -> ppo in bf16 under DeepSpeed ZeRO-2 on 2 CPU processes (the paper's launch; every
    stage checks after prepare that no rotary frequency is below fp32). Saved weights are the fp32 masters;
    DPO's reference takes the policy's precision path (h = 0 before the first step: loss log 2); PPO's first
    ratio is 1 within bf16 noise."""
    shutil.copytree(chained / "data", tmp_path / "data")
    for script in ("sft.py", "reward.py", "dpo.py", "ppo.py"):
        stage(tmp_path, script, "--base_model", pythia_like, *TINY[script], "--run_name", script[:-3],
              processes=2, bf16=True)
    for stage_name in ("sft", "reward", "dpo", "ppo"):
        out = tmp_path / "models" / NAME / f"{stage_name}_1"
        assert saved_dtypes(out) == ({torch.float32}, "float32")
    with safe_open(str(tmp_path / "models" / NAME / "sft_1" / "model.safetensors"), "pt") as file:
        weight = file.get_tensor("gpt_neox.layers.0.mlp.dense_h_to_4h.weight")
    assert (weight != weight.bfloat16().float()).float().mean() > 0.5  # the fp32 masters, not bf16 copies upcast
    dpo = scalars(tmp_path, "dpo")
    assert dpo["train/dpo/loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    ppo = scalars(tmp_path, "ppo")
    assert abs(ppo["policy/ratio_first_epoch"][0] - 1) < 0.02  # bf16 sampling loop vs bf16 training forward
    assert abs(ppo["objective/kl"][0]) < 0.1  # summed over a response: bf16 rounding only, policy = reference


def test_default_paths_follow_the_base_model_the_sft_model_records(tmp_path, monkeypatch):
    """Given only --sft_model_path, each later stage reads the base model's name from the SFT model's args.json and
    looks for every other default under it: PPO's reward model too, never a default of another base model (all
    Pythia sizes share one tokenizer, so nothing else would notice a 1B RM scoring a 2.8B policy)."""
    import dpo
    import ppo

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine" / "sft_3").mkdir(parents=True)
    (tmp_path / "models" / "mine" / "sft_3" / "args.json").write_text(json.dumps({"base_model_name": "mine"}))
    accelerator = one_process()
    args = ppo.Args(seed=3, sft_model_path="models/mine/sft_3", base_model=None)
    with pytest.raises(ppo.SetupError, match=r"^--reward_model_path models/mine/reward_3: no such folder"):
        ppo.ppo_inputs(args, accelerator)
    assert (args.base_model, args.query_dataset, args.output_dir) == (
        "mine", os.path.join("data", "mine", "tldr", "sft"), os.path.join("models", "mine", "ppo_3"))
    for module in (reward, dpo):
        args = module.Args(seed=3, sft_model_path="models/mine/sft_3", base_model=None)
        with pytest.raises(module.SetupError, match=r"^--label_dataset data/mine/tldr/preference: no such folder"):
            module.resolve_paths(args, accelerator, module.__name__)
        with pytest.raises(module.SetupError, match="was fine-tuned from mine, not from --base_model other/model"):
            module.resolve_paths(module.Args(seed=3, sft_model_path="models/mine/sft_3", base_model="other/model"),
                                 accelerator, module.__name__)


def test_a_hub_model_without_its_base_model_named_is_refused(tmp_path, monkeypatch):
    """A Hub id as --sft_model_path (or PPO's --reward_model_path) has no args.json here to name its base model: the
    default, Pythia 1B, would have named a 2.8B run's folders, run and Hub repository. --base_model is asked for;
    given, it names them. A missing local folder is still a missing folder (with the command that makes it)."""
    import dpo
    import ppo

    monkeypatch.chdir(tmp_path)
    accelerator = one_process()
    with pytest.raises(ppo.SetupError, match=r"^--sft_model_path someone/pythia-2.8b-sft: no such folder here, so a "
                                                 r"Hub id, and no args.json here says .*: check the path, or pass"):
        ppo.ppo_inputs(ppo.Args(sft_model_path="someone/pythia-2.8b-sft"), accelerator)
    with pytest.raises(ppo.SetupError, match=r"^--reward_model_path someone/rm: no such folder here, so a Hub id, "
                                                 r"and no args.json here says .* --base_model"):
        ppo.ppo_inputs(ppo.Args(reward_model_path="someone/rm"), accelerator)
    for module in (reward, dpo):
        with pytest.raises(module.SetupError, match=r"^--sft_model_path someone/pythia-2.8b-sft: no such folder here, "
                                                            r"so a Hub id, and no args.json here"):
            module.resolve_paths(module.Args(sft_model_path="someone/pythia-2.8b-sft"), accelerator, module.__name__)
        args = module.Args(sft_model_path="someone/pythia-2.8b-sft", base_model="EleutherAI/pythia-2.8b-deduped")
        with pytest.raises(module.SetupError, match=r"^--label_dataset data/EleutherAI/pythia-2.8b-deduped/tldr/"):
            module.resolve_paths(args, accelerator, module.__name__)  # named by --base_model; on to the next input
        with pytest.raises(module.SetupError, match=r"^--sft_model_path scratch/mine/sft_1: no such folder"):
            module.resolve_paths(module.Args(sft_model_path="scratch/mine/sft_1"), accelerator, module.__name__)


def test_every_missing_input_is_named_in_one_start(tmp_path, monkeypatch):
    """A start with several inputs missing names them all, each with the command that makes it (one start each was a
    start too many), and only then looks at the output folder."""
    import dpo
    import ppo

    monkeypatch.chdir(tmp_path)  # nothing here: every default input is missing
    accelerator = one_process()
    for module in (reward, dpo):
        with pytest.raises(module.SetupError) as refused:
            module.resolve_paths(module.Args(), accelerator, module.__name__)
        lines = str(refused.value).splitlines()
        assert [line.split(":")[0].strip() for line in lines] == [
            "--sft_model_path models/EleutherAI/pythia-1b-deduped/sft_1",
            "--label_dataset data/EleutherAI/pythia-1b-deduped/tldr/preference",
            "--query_dataset data/EleutherAI/pythia-1b-deduped/tldr/sft"], lines
    with pytest.raises(ppo.SetupError) as refused:
        ppo.ppo_inputs(ppo.Args(), accelerator)
    assert [line.split(":")[0].strip() for line in str(refused.value).splitlines()] == [
        "--sft_model_path models/EleutherAI/pythia-1b-deduped/sft_1",
        "--reward_model_path models/EleutherAI/pythia-1b-deduped/reward_1",
        "--query_dataset data/EleutherAI/pythia-1b-deduped/tldr/sft"]
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_a_dataset_that_cannot_load_is_named_by_its_flag(stage, tmp_path):
    """A Hub dataset id that cannot be reached (offline here; not found, gated) or a folder that is no saved dataset
    stops the start naming the flag; it was a raw traceback from datasets on every rank."""
    module = __import__(stage)
    with pytest.raises(module.SetupError, match=r"^--query_dataset someone/no-such-data: cannot load it \(Connection"):
        module.load_data("someone/no-such-data", "--query_dataset")
    (tmp_path / "empty").mkdir()
    with pytest.raises(module.SetupError, match=rf"^--label_dataset {tmp_path / 'empty'}: cannot load it \("):
        module.load_data(str(tmp_path / "empty"), "--label_dataset")
    # preprocess_tldr.py's output folder itself (data/tiny_tldr): the flag's own dataset inside it is named
    for flag, inside in (("--label_dataset", "preference"), ("--query_dataset", "sft")):
        (tmp_path / "empty" / inside).mkdir(exist_ok=True)
        with pytest.raises(module.SetupError, match=rf"; pass {tmp_path / 'empty' / inside} \(the folder holds "):
            module.load_data(str(tmp_path / "empty"), flag)


def test_rotary_frequencies_in_fp16_are_refused_too():
    """Any inv_freq below fp32 is named, fp16 as well as bf16 (an fp16 launch casts as a bf16 one does)."""
    model = AutoModelForCausalLM.from_pretrained(WORLD / "pythia-tiny").to(torch.float16)
    assert rotary_problem({"policy": model}) == "policy: gpt_neox.rotary_emb.inv_freq is torch.float16"


def test_ds_accelerator_cpu_excuses_only_a_deepspeed_launch():
    """DS_ACCELERATOR=cpu (exported for a DeepSpeed rehearsal) does not let a bf16 launch without DeepSpeed train
    on the CPU: that one still needs accelerate's --cpu."""
    problem = gpu_problem({"ACCELERATE_MIXED_PRECISION": "bf16", "DS_ACCELERATOR": "cpu"}, False)
    assert problem and "mixed precision bf16" in problem and "--cpu" in problem

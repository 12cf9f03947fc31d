"""Tests of sft.py: its helpers against hand-computed values (Details 3, 7, 9), bad inputs refused
before any compute, and subprocess runs on the tiny world: a smoke run, 2 processes (DDP and
DeepSpeed ZeRO-2, on CPU) vs 1, an interrupted and resumed run vs an uninterrupted one.

The subprocess runs share one configuration, small enough for seconds: global batch 8 as micro-batch
4 x 2 accumulation steps (1 process) or 4 x 1 x 2 processes, 4 updates at lr 1e-3, eval on 15
validation queries with 8 sampled tokens. Each runs in its own working directory (runs/ lands there).
"""

import hashlib
import json
import os
import re
import shutil
import socket
import sys
from types import SimpleNamespace

import datasets
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import sft
from conftest import (REPO, WORLD, early_exits, generate_with_scores, multi_process_slot, one_process, run_python,
                      sampler_with_junk_after_eos)

BASE = WORLD / "pythia-tiny"
TINY_RUN = ["--base_model", str(BASE), "--lr", "1e-3", "--batch_size", "8", "--local_micro_batch_size", "4",
            "--total_episodes", "32", "--response_length", "8", "--local_eval_batch_size", "16",
            "--num_eval_samples", "15"]  # odd: over 2 processes a rank repeats a row
# The loss is a token mean per micro-batch, and both runs form the same micro-batches of 4 from the
# shared episode order; 1 process and 2 processes then only sum the same micro-batch gradients in
# a different order (accelerate's loss / 2 then a sum, vs DDP's all-reduce mean), so float rounding
# alone separates them: measured 2e-7 after 4 updates of lr 1e-3, which move the weights by ~4e-3.
PROCESS_TOLERANCE = 1e-5
RESUME_TOLERANCE = 1e-6  # same ops in the same order on one process: equal in practice


def run_sft(cwd, *flags, processes=1, deepspeed=False, check=True):
    """Run sft.py in `cwd`, for 2 processes through `accelerate launch` on CPU (DDP, or DeepSpeed
    ZeRO-2 with the repository's config); the CompletedProcess."""
    env = dict(os.environ)
    if processes == 1:
        cmd = [sys.executable, str(REPO / "sft.py")]
    else:
        with socket.socket() as sock:  # a free port: other test sessions may launch at the same time
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # ENV_NOTES: CPU DDP needs --multi_gpu with ACCELERATE_USE_CPU; CPU DeepSpeed must not set it.
        backend = ["--config_file", str(REPO / "benchmark/accelerate/deepspeed_zero2.yaml")] if deepspeed else [
            "--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"]
        env.pop("ACCELERATE_USE_CPU", None)
        env.update({} if deepspeed else {"ACCELERATE_USE_CPU": "1"})
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *backend, "--num_processes", str(processes),
               "--mixed_precision", "no", "--main_process_port", str(port), str(REPO / "sft.py")]
    with multi_process_slot(processes):
        result = run_python(cmd + [str(flag) for flag in flags], cwd=cwd, env=env, timeout=300)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def weights(folder):
    """The saved model's tensors."""
    return load_file(str(folder / "model.safetensors"))


def max_difference(a, b):
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[key].float() - b[key].float()).abs().max().item() for key in a)


@pytest.fixture(scope="module")
def single_run(tiny_tldr, tmp_path_factory):
    """The tiny configuration on one process: (output folder, its working directory)."""
    cwd = tmp_path_factory.mktemp("sft_single")
    run_sft(cwd, *TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", cwd / "out")
    return cwd / "out", cwd


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------


def test_first_true_indices():
    bools = torch.tensor([[False, True, False, True], [False, False, False, False], [True, False, False, False]])
    assert sft.first_true_indices(bools).tolist() == [1, 4, 0]  # a row without True -> its length


def test_truncate_response_keeps_eos_and_pads_after():
    eos, pad = 0, 1
    responses = torch.tensor([[5, 0, 7, 8], [5, 6, 7, 8], [0, 3, 0, 4], [5, 6, 7, 0]])
    expected = [[5, 0, 1, 1], [5, 6, 7, 8], [0, 1, 1, 1], [5, 6, 7, 0]]
    assert sft.truncate_response(responses, eos, pad).tolist() == expected


def test_next_token_nll_counts_only_non_pad_targets():
    torch.manual_seed(0)
    pad = 1
    ids = torch.tensor([[4, 2, 0, 1, 1], [3, 3, 2, 4, 0]])  # right-padded; EOS (0) is a target
    logits = torch.randn(2, 5, 6)
    nll_sum, count = sft.next_token_nll(logits, ids, pad)
    naive, n = 0.0, 0  # a loop over every (row, position) whose next id is not a pad
    for b in range(2):
        for t in range(4):
            if ids[b, t + 1] != pad:
                naive -= torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]].item()
                n += 1
    assert count.item() == n == 2 + 4
    assert nll_sum.item() == pytest.approx(naive, rel=1e-6)
    logits[0, 2:] += 100 * torch.randn(3, 6)  # logits whose targets are pads (or past the end) do not count
    assert sft.next_token_nll(logits, ids, pad)[0].item() == pytest.approx(naive, rel=1e-6)
    # A [PAD] past the embedding table (forward allows it: a tokenizer given a pad it had no row for) is no target
    # either, and indexes no logit.
    past = torch.where(ids == pad, 6, ids)
    assert [x.item() for x in sft.next_token_nll(logits, past, 6)] == pytest.approx([naive, n], rel=1e-6)



@pytest.mark.parametrize("groups", [1, 2, 3, 6])
def test_nll_by_length_matches_one_forward(groups):
    """The training forward's fast path: rows cut to their longest and sorted into `groups` forwards give the
    nll sum, token count and gradients of one forward over the full width (rows of 2-9 tokens of 12 columns)."""
    model = AutoModelForCausalLM.from_pretrained(BASE)
    sft.disable_dropout(model)
    model.train()
    pad = 1
    lengths = [9, 2, 6, 4, 7, 3]  # unsorted, as a micro-batch comes
    generator = torch.Generator().manual_seed(0)
    ids = torch.full((len(lengths), 12), pad)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(2, 1000, (length,), generator=generator)
        ids[row, length - 1] = 0  # EOS, a target

    def loss_and_grads(nll, count):
        grads = torch.autograd.grad(nll / count, list(model.parameters()))
        return nll.item(), int(count), torch.cat([g.flatten() for g in grads])

    plain = loss_and_grads(*sft.next_token_nll(sft.forward(model, ids, pad).logits, ids, pad))
    fast = loss_and_grads(*sft.nll_by_length(model, ids, pad, groups))
    assert fast[1] == plain[1] == sum(lengths) - len(lengths)
    assert fast[0] == pytest.approx(plain[0], rel=1e-6)
    # float rounding only: a one-row forward without pads takes SDPA's causal kernel, not the masked one (~5e-6 of
    # the largest gradient, measured)
    assert torch.allclose(fast[2], plain[2], atol=2e-5 * plain[2].abs().max().item(), rtol=1e-4)
    assert plain[2].abs().max() > 1e-3  # gradients that a dropped row or a wrong target would change

def test_disable_dropout_makes_train_forwards_deterministic():
    model = AutoModelForCausalLM.from_pretrained(BASE).train()
    assert model.config.hidden_dropout == model.config.attention_dropout == 0.1  # the tiny model has dropout
    ids = torch.randint(2, 1000, (2, 24))
    torch.manual_seed(0)
    assert not torch.equal(model(ids).logits, model(ids).logits)
    sft.disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)
    assert model.config.hidden_dropout == model.config.attention_dropout == 0.0  # saved with the model
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_gradient_accumulation_and_its_exact_division():
    assert sft.gradient_accumulation(128, 16, 8) == 1  # the paper's 8xH100 run: 16 x 1 x 8
    assert sft.gradient_accumulation(128, 1, 8) == 16  # the reference's default: 1 x 16 x 8
    assert sft.gradient_accumulation(128, 16, 1) == 8
    assert sft.gradient_accumulation(8, 4, 1) == 2
    for batch, micro, world in ((128, 3, 8), (8, 16, 1), (10, 4, 2), (0, 1, 1)):
        with pytest.raises(sft.SetupError, match=rf"--batch_size {batch} .* {micro} x world size {world}"):
            sft.gradient_accumulation(batch, micro, world)


def test_episode_order_is_one_shared_shuffle():
    order = sft.episode_order(10, 25, seed=3)
    assert order.shape == (25,)
    assert sorted(order[:10].tolist()) == sorted(order[10:20].tolist()) == list(range(10))  # a permutation per pass
    assert order[:10].tolist() != order[10:20].tolist()  # reshuffled at each pass
    assert torch.equal(order, sft.episode_order(10, 25, seed=3))  # every rank computes the same order
    # update, micro-step, rank, micro-batch: ranks read disjoint rows of each update, and 1 process
    # with 2 accumulation steps reads exactly the micro-batches that 2 processes read.
    order = sft.episode_order(10, 16, seed=3)
    two_ranks = order.view(2, 1, 2, 4)
    one_rank = order.view(2, 2, 1, 4)
    assert torch.equal(two_ranks[:, 0, 1], one_rank[:, 1, 0])
    assert not set(two_ranks[0, 0, 0].tolist()) & set(two_ranks[0, 0, 1].tolist())


def test_mean_rouge():
    scores = sft.mean_rouge(["the cat sat", "a b"], ["the cat sat", "c d"])
    assert scores == pytest.approx({"rouge1": 0.5, "rouge2": 0.5, "rougeL": 0.5})
    # "the cat sat" vs "a cat sat down": 2 common unigrams, P 2/3 R 2/4 -> F1 4/7; bigram "cat sat": F1 2/5
    scores = sft.mean_rouge(["the cat sat"], ["a cat sat down"])
    assert scores == pytest.approx({"rouge1": 4 / 7, "rouge2": 2 / 5, "rougeL": 4 / 7})


@pytest.mark.parametrize("length_groups", [1, 2])
def test_sft_update_steps_on_the_mean_of_each_micro_batchs_token_mean_loss(length_groups):
    """Detail 9: a micro-batch's loss is its next-token NLL summed over non-pad targets (query included) over their
    number; the update is one step on the mean of its micro-batches' losses (accelerate's accumulation). Against
    next_token_nll on the plain forward and a naive SGD step, with micro-batches of 19 and 6 targets: a loss divided by
    rows (a per-sequence sum) passed every other test."""
    import copy

    from accelerate import Accelerator

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(BASE)
    sft.disable_dropout(model)
    naive, before = copy.deepcopy(model).train(), {name: p.detach().clone() for name, p in model.named_parameters()}
    pad = 1  # the tiny world's [PAD]
    ids = torch.randint(2, 200, (4, 12))
    for row, end in enumerate([12, 9, 5, 3]):  # right-padded rows of different lengths
        ids[row, end:] = pad
    micro_batches = [ids[:2], ids[2:]]
    accelerator = Accelerator(cpu=True)
    accelerator.gradient_accumulation_steps = 2
    model, optimizer = accelerator.prepare(model.train(), torch.optim.SGD(model.parameters(), lr=0.1))
    losses = sft.sft_update(accelerator, model, optimizer, micro_batches, pad, length_groups)

    expected = torch.stack([torch.divide(*sft.next_token_nll(sft.forward(naive, batch, pad).logits, batch, pad))
                            for batch in micro_batches])
    torch.testing.assert_close(losses, expected.detach())
    expected.mean().backward()
    with torch.no_grad():
        for parameter in naive.parameters():
            parameter -= 0.1 * parameter.grad
    trained = dict(accelerator.unwrap_model(model).named_parameters())
    assert max((trained[name] - before[name]).abs().max().item() for name in before) > 1e-2  # the step moved them
    assert max((trained[name] - parameter).abs().max().item() for name, parameter in naive.named_parameters()) < 1e-5


def test_output_dir_problem(tmp_path):
    flags = {"seed": 1, "lr": 1e-3, "resume": False}
    assert sft.output_dir_problem(str(tmp_path / "new"), flags, ("resume",)) is None
    assert sft.output_dir_problem(str(tmp_path), flags, ("resume",)) is None  # empty
    (tmp_path / "model.safetensors").write_text("")
    assert "not empty and has no args.json" in sft.output_dir_problem(str(tmp_path), flags, ("resume",))
    (tmp_path / "args.json").write_text(json.dumps({**flags, "run_name": "x"}))
    assert sft.output_dir_problem(str(tmp_path), {**flags, "resume": True}, ("resume",)) is None
    problem = sft.output_dir_problem(str(tmp_path), {**flags, "seed": 2}, ("resume",))
    assert "holds a different run (seed=1 there, 2 now)" in problem
    # A start that failed before any work left args.json alone: the corrected command may use the folder.
    (tmp_path / "model.safetensors").unlink()
    assert sft.output_dir_problem(str(tmp_path), {**flags, "seed": 2}, ("resume",)) is None
    # A path inside a file is refused here, at start (makedirs failed only after the models had loaded).
    for inside in ("args.json", "args.json/run/out"):
        assert sft.output_dir_problem(str(tmp_path / inside), flags, ("resume",)) == (
            f"--output_dir {tmp_path / inside}: {tmp_path / 'args.json'} is a file, not a folder: choose a new or "
            "empty folder")


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_a_finished_run_is_never_trained_over(tmp_path, stage):
    """A folder published whole (eval_metrics.json in it) holds a finished run: the same flags again are refused
    (retraining would replace a model that later stages were trained from), --resume of it has nothing to do
    (RunFinished: a requeued job exits 0), and other flags see a different run, as before."""
    module = __import__(stage)
    flags = {"seed": 1, "lr": 1e-3, "resume": False}
    (tmp_path / "args.json").write_text(json.dumps({**flags, "run_name": "x"}))
    (tmp_path / "model.safetensors").write_text("")
    assert module.output_dir_problem(str(tmp_path), flags, ("resume",)) is None  # not published: no eval_metrics
    (tmp_path / "eval_metrics.json").write_text("{}")
    problem = module.output_dir_problem(str(tmp_path), flags, ("resume",))
    assert f"--output_dir {tmp_path} holds the finished run of these flags" in problem and "Delete the folder" in problem
    with pytest.raises(module.RunFinished, match="holds the finished run of these flags") as finished:
        module.output_dir_problem(str(tmp_path), {**flags, "resume": True}, ("resume",))
    assert finished.value.output_dir == str(tmp_path) and finished.value.flags == {**flags, "resume": True}
    assert "holds a different run (seed=1 there, 2 now)" in module.output_dir_problem(
        str(tmp_path), {**flags, "seed": 2, "resume": True}, ("resume",))


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_a_finished_run_is_pushed_again_by_rank_0_on_its_own_branch(tmp_path, stage, monkeypatch):
    """--resume --push_to_hub of a finished run (its push at the end of training may have failed) pushes its folder
    again, on the branch of its run name (from its args.json), to the entity of this start; other ranks push nothing.
    A failed push says the run is saved and how to push it again."""
    import huggingface_hub

    module = __import__(stage)
    (tmp_path / "args.json").write_text(json.dumps({"run_name": "tldr__m__1__99", "exp_name": "x",
                                                    "base_model_name": "org/model"}))
    pushes = []
    monkeypatch.setattr(module, "push_to_hub", lambda *args: pushes.append(args))
    flags = {"exp_name": "x", "hf_entity": "someone", "push_to_hub": True}
    monkeypatch.setenv("RANK", "1")
    module.push_again(str(tmp_path), flags)
    assert pushes == []
    monkeypatch.setenv("RANK", "0")
    module.push_again(str(tmp_path), flags)
    assert pushes == [(str(tmp_path), "x", "someone")]

    class FailingApi:  # the Hub reached, the upload cut off
        def __init__(self, *args, **kwargs):
            self.calls = []

        def __getattr__(self, name):
            if name == "upload_folder":
                raise ConnectionError("connection reset")
            return lambda *args, **kwargs: {"name": "me"}

    monkeypatch.undo()
    monkeypatch.setattr(huggingface_hub, "HfApi", FailingApi)
    with pytest.raises(RuntimeError, match=f"pushing {tmp_path} to the Hub failed \\(ConnectionError\\); the run is "
                                           "saved there, and the same command with --resume pushes it again"):
        module.push_to_hub(str(tmp_path), "x", None)


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_a_run_is_pushed_to_the_repository_of_its_base_model_on_its_own_branch(tmp_path, stage, monkeypatch):
    """The repository is named after the base model as the run's args.json records it (a Hub id, or a local
    folder's own name), "/" as "_": every seed of a stage in one repository, as the reference code names them.
    Never after a path: an absolute --sft_model_path on a cluster's scratch made a name past the Hub's 96
    characters (and public), so the push failed after training, and again at every --resume."""
    import huggingface_hub

    module = __import__(stage)
    calls = []

    class RecordingApi:
        def __getattr__(self, name):
            return lambda *args, **kwargs: calls.append((name, args, kwargs)) or {"name": "me"}

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    for base_model_name, repo_id in (("EleutherAI/pythia-6.9b-deduped", "me/EleutherAI_pythia-6.9b-deduped__x__tldr"),
                                     ("pythia-tiny", "someone/pythia-tiny__x__tldr")):
        calls.clear()
        (tmp_path / "args.json").write_text(json.dumps({
            "run_name": "x__m__44413__99", "base_model_name": base_model_name,
            "sft_model_path": "/lustre/fsw/portfolios/nlp/users/jdoe/tldr/models/EleutherAI/pythia-6.9b-deduped/sft_1"}))
        module.push_to_hub(str(tmp_path), "x", None if repo_id.startswith("me/") else "someone")
        assert ("upload_folder", (), {"folder_path": str(tmp_path), "repo_id": repo_id,
                                      "revision": "x__m__44413__99"}) in calls, calls
        assert ("create_branch", (repo_id,), {"branch": "x__m__44413__99", "exist_ok": True}) in calls, calls
        huggingface_hub.utils.validate_repo_id(repo_id)  # the Hub's own rules (96 characters at most)


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_a_model_folder_of_the_wrong_stage_is_named_before_it_loads(tmp_path, stage):
    """An RM folder passed where a causal LM is wanted (and, in ppo.py, the reverse) stops with what the folder
    holds and what the flag takes, not a loader's traceback ("update Transformers", 200 config names)."""
    from transformers import AutoModelForCausalLM

    module = __import__(stage)
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(json.dumps({"model_type": "scalar_model"}))
    with pytest.raises(module.SetupError, match=r"--sft_model_path .*rm holds a reward model \(reward.py's output\); "
                                                r"--sft_model_path takes sft.py's output or a base model"):
        module.load_fp32(AutoModelForCausalLM, str(tmp_path / "rm"), "--sft_model_path")
    if stage == "ppo":
        (tmp_path / "lm").mkdir()
        (tmp_path / "lm" / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
        with pytest.raises(module.SetupError, match=r"holds a causal LM \(gpt_neox: sft.py's output or a base model\); "
                                                    r"--reward_model_path takes reward.py's output"):
            module.load_fp32(module.ScalarModel, str(tmp_path / "lm"), "--reward_model_path")
        # The reference code's RM (its config class names no model_type, so config.json holds ""): not ours either.
        (tmp_path / "reference_rm").mkdir()
        (tmp_path / "reference_rm" / "config.json").write_text(json.dumps({"model_type": "", "bias": 0.3}))
        with pytest.raises(module.SetupError, match=r"reference_rm holds a model whose config.json names no model_type "
                                                    r"\(the reference code's reward models are such\); "
                                                    r"--reward_model_path takes reward.py's output"):
            module.load_fp32(module.ScalarModel, str(tmp_path / "reference_rm"), "--reward_model_path")
    model = module.load_fp32(AutoModelForCausalLM, str(WORLD / "pythia-tiny"), "--sft_model_path")  # the right kind
    assert model.dtype == torch.float32


@pytest.mark.parametrize("stage", ["reward", "dpo", "ppo"])
def test_a_tuned_policy_given_as_the_sft_model_is_said_at_start(tmp_path, stage, tiny_tldr):
    """dpo.py's and ppo.py's folders sit beside sft.py's (models/tiny/dpo_1, sft_1): one given as --sft_model_path
    starts the run from a tuned policy, which is allowed (PPO on top of DPO is an experiment) but said at the start,
    before anything loads (here the start is then refused for another reason: an output folder of foreign files)."""
    module = __import__(stage)
    for writer, record in (("dpo.py", {"beta": 0.05}), ("ppo.py", {"kl_coef": 0.05})):
        folder = tmp_path / writer
        folder.mkdir()
        (folder / "args.json").write_text(json.dumps({**record, "base_model_name": "pythia-tiny"}))
        assert module.policy_writer_warning(str(folder), "--sft_model_path") == (
            f"warning: --sft_model_path {folder} was written by {writer}, not by sft.py (its args.json says so): this "
            "run starts from that policy, not from an SFT model as the paper's does")
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "args.json").write_text(json.dumps({"exp_name": "sft", "base_model_name": "pythia-tiny"}))
    for quiet in (tmp_path / "sft", WORLD / "pythia-tiny"):  # sft.py's output; a base model (no args.json)
        assert module.policy_writer_warning(str(quiet), "--sft_model_path") is None
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not a run")
    inputs = (["--reward_model_path", str(tmp_path / "sft")] if stage == "ppo" else
              ["--label_dataset", str(tiny_tldr / "preference")])
    start = run_python([sys.executable, str(REPO / f"{stage}.py"), "--sft_model_path", str(tmp_path / "dpo.py"),
                        "--base_model", str(WORLD / "pythia-tiny"), "--query_dataset", str(tiny_tldr / "sft"), *inputs,
                        "--output_dir", str(tmp_path / "foreign")], cwd=tmp_path, timeout=300)
    assert start.returncode == 1 and "not empty and has no args.json" in start.stderr, start.stderr[-2000:]
    assert f"warning: --sft_model_path {tmp_path / 'dpo.py'} was written by dpo.py" in start.stdout


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_a_checkpoint_lacking_the_models_weights_is_refused(tmp_path, stage):
    """from_pretrained starts each weight a checkpoint lacks at random and only prints a report: a model stored under
    other weight names (here gpt_neox.* renamed lm_backbone.*; in ppo.py also an RM in the reference code's layout,
    lm_backbone.* and scalar_head.*) is refused, naming the flag, the missing weights and what the file holds."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    module = __import__(stage)

    def renamed(source, folder, renames):
        shutil.copytree(source, folder)
        weights = load_file(str(folder / "model.safetensors"))
        for old, new in renames:
            weights = {key.replace(old, new, 1) if key.startswith(old) else key: value for key, value in weights.items()}
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return str(folder)

    lm = renamed(WORLD / "pythia-tiny", tmp_path / "lm", [("gpt_neox.", "lm_backbone.")])
    with pytest.raises(module.SetupError, match=r"--sft_model_path .*lm: 3\d of the model's weights are not in its "
                                                r"checkpoint \(gpt_neox\..*\) and would start at random; it holds "
                                                r"lm_backbone\..* --sft_model_path takes sft.py's output or a base model"):
        module.load_fp32(AutoModelForCausalLM, lm, "--sft_model_path")
    if stage == "ppo":
        base = AutoModelForCausalLM.from_pretrained(WORLD / "pythia-tiny").base_model
        config = {key: value for key, value in base.config.to_dict().items() if key != "_name_or_path"}
        module.ScalarModel(module.ScalarModelConfig(base_config=config)).save_pretrained(tmp_path / "rm")
        module.load_fp32(module.ScalarModel, str(tmp_path / "rm"), "--reward_model_path")  # ours: loads
        reference = renamed(tmp_path / "rm", tmp_path / "reference_rm", [("backbone.", "lm_backbone."),
                                                                          ("head.", "scalar_head.")])
        with pytest.raises(module.SetupError, match=r"--reward_model_path .*reference_rm: \d+ of the model's weights "
                                                    r"are not in its checkpoint .* it holds lm_backbone\..* "
                                                    r"--reward_model_path takes reward.py's output$"):
            module.load_fp32(module.ScalarModel, reference, "--reward_model_path")


def test_a_run_resumes_with_another_checkpoint_cadence(tmp_path):
    """--save_every only says when checkpoints are written: a run continued with another cadence (say, a SLURM
    job requeued after SAVE_EVERY_* changed) is the same run, in every training stage."""
    import dpo
    import ppo
    import reward

    assert sft.RESUME_FLAGS == reward.RESUME_FLAGS == dpo.RESUME_FLAGS == ppo.RESUME_FLAGS
    flags = {"seed": 1, "save_every": 100, "resume": False}
    (tmp_path / "args.json").write_text(json.dumps(flags))
    (tmp_path / "checkpoints" / "update_100").mkdir(parents=True)
    (tmp_path / "checkpoints" / "update_100" / "trainer_state.json").write_text("{}")
    assert sft.output_dir_problem(str(tmp_path), {**flags, "save_every": 50, "resume": True}, sft.RESUME_FLAGS) is None
    # Where it logs and publishes may change too (a job resubmitted with TRACK=0 after a W&B outage).
    assert sft.output_dir_problem(str(tmp_path), {**flags, "track": True, "wandb_entity": "me", "push_to_hub": True,
                                                  "resume": True}, sft.RESUME_FLAGS) is None
    problem = sft.output_dir_problem(str(tmp_path), {**flags, "seed": 2, "resume": True}, sft.RESUME_FLAGS)
    assert "holds a different run (seed=1 there, 2 now)" in problem


def test_a_resume_under_another_mixed_precision_is_refused(tmp_path):
    """accelerate's --mixed_precision (or a default accelerate config) is no flag of the stage, yet it changes every
    number of the run: a resume must launch as the run was launched. Runs recorded before it was saved resume."""
    import dpo
    import ppo
    import reward

    flags = {"seed": 1, "resume": False}
    (tmp_path / "checkpoints" / "update_100").mkdir(parents=True)
    (tmp_path / "checkpoints" / "update_100" / "trainer_state.json").write_text("{}")
    for module in (sft, reward, dpo, ppo):
        (tmp_path / "args.json").write_text(json.dumps({**flags, "mixed_precision": "bf16"}))
        resume = {**flags, "resume": True}
        assert module.output_dir_problem(str(tmp_path), {**resume, "mixed_precision": "bf16"}, module.RESUME_FLAGS) is None
        problem = module.output_dir_problem(str(tmp_path), {**resume, "mixed_precision": "no"}, module.RESUME_FLAGS)
        assert "holds a different run (mixed_precision='bf16' there, 'no' now)" in problem, module.__name__
        (tmp_path / "args.json").write_text(json.dumps(flags))  # written before the record existed
        assert module.output_dir_problem(str(tmp_path), {**resume, "mixed_precision": "no"}, module.RESUME_FLAGS) is None


def test_missing_columns():
    table = datasets.Dataset.from_dict({"query_token": [[1]], "reference_response_token": [[1]]})
    data = datasets.DatasetDict(train=table, validation=table)
    assert sft.missing_columns(data, ("train", "validation"), ("query_token",)) == []
    assert sft.missing_columns(data, ("train", "test"), ("query_token", "query_reference_response_token")) == [
        "test", "train.query_reference_response_token"]


def test_ids_in_data_by_hand():
    """The pad and EOS ids of a dataset without args.json (a Hub dataset), read off a right-padded token column."""
    rows = {"train": datasets.Dataset.from_dict({"r": [[5, 6, 0, 1, 1], [7, 0, 1, 1, 1], [8, 9, 10, 11, 0]]})}
    assert sft.ids_in_data(rows, "r") == {"eos_token_id": 0, "pad_token_id": 1}  # 2 of 3 rows padded
    rows = {"train": datasets.Dataset.from_dict({"r": [[5, 6, 0], [7, 8, 0], [8, 0, 1]]})}
    assert sft.ids_in_data(rows, "r") is None  # most rows fill the width (and end with EOS): no pad to read
    rows = {"train": datasets.Dataset.from_dict({"r": [[5, 1, 1], [7, 8, 1], [8, 0, 1]]})}
    assert sft.ids_in_data(rows, "r") is None  # no one id before the pads: not EOS-terminated responses


def test_check_tokenizer_pad_rules():
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    ids = {"eos_token_id": 0, "pad_token_id": 1}
    assert sft.check_tokenizer(tokenizer, ids, "data") is False  # already has a distinct [PAD]
    tokenizer.pad_token = None  # Pythia's case: no pad token -> [PAD], the id the dataset was built with
    assert sft.check_tokenizer(tokenizer, ids, "data") is True and tokenizer.pad_token == "[PAD]"
    with pytest.raises(sft.SetupError, match="data was tokenized with"):
        sft.check_tokenizer(tokenizer, {"eos_token_id": 0, "pad_token_id": 7}, "data")
    tokenizer.pad_token = tokenizer.eos_token
    with pytest.raises(sft.SetupError, match="is its EOS token"):
        sft.check_tokenizer(tokenizer, None, "data")


def test_a_base_model_that_pads_with_its_eos_gets_the_pad_its_data_was_built_with(tiny_tldr, tmp_path):
    """A base model whose tokenizer pads with EOS (Qwen2.5's base models do) is taken, as preprocess_tldr.py takes it:
    [PAD] replaces that pad, so the ids and the tokenizer's identity are the data's. (check_tokenizer still refuses
    such a pad in the tuned models the later stages load: test_check_tokenizer_pad_rules.)"""
    from types import SimpleNamespace

    shutil.copytree(BASE, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|endoftext|>"}))
    assert AutoTokenizer.from_pretrained(tmp_path / "model").pad_token_id == 0  # the EOS
    printed = []
    args = SimpleNamespace(base_model=str(tmp_path / "model"), query_dataset=str(tiny_tldr / "sft"))
    tokenizer, identity = sft.sft_tokenizer(args, SimpleNamespace(print=printed.append), None, True)
    assert (tokenizer.pad_token, tokenizer.pad_token_id, tokenizer.eos_token_id) == ("[PAD]", 1, 0)
    assert identity == json.loads((tiny_tldr / "args.json").read_text())["tokenizer_identity"]
    assert any("pads with its EOS" in line for line in printed), printed


def test_generate_samples_exactly_response_length_and_eos_can_occur(tiny_tldr):
    # transformers fills eos / pad from the model's generation_config: with min_new_tokens that
    # would forbid EOS in every sample. `generate` sets them aside, so EOS shows up and truncation acts.
    model = AutoModelForCausalLM.from_pretrained(BASE).eval()
    assert model.generation_config.eos_token_id == 0
    queries = datasets.load_from_disk(str(tiny_tldr / "sft"))["validation"].with_format("torch")[:8]["query_token"]
    config = GenerationConfig(max_new_tokens=44, min_new_tokens=44, temperature=0.01 + 1e-7, top_k=0, top_p=1.0,
                              do_sample=True, return_dict_in_generate=True)
    with torch.no_grad():
        torch.manual_seed(1)
        query_responses = sft.generate(model, queries, 1, config)
        torch.manual_seed(1)
        with_scores, scores = generate_with_scores(model, queries, 1, config)
    assert query_responses.shape == (8, queries.shape[1] + 44) and scores.shape == (8, 44, 1280)
    assert torch.equal(query_responses, with_scores)  # the ids do not depend on keeping the scores
    assert torch.equal(query_responses[:, :queries.shape[1]], queries)  # the queries come back with their pads
    responses = query_responses[:, queries.shape[1]:]
    assert (responses == 0).any(1).sum() >= 2  # the base model ends some summaries within 44 tokens
    truncated = sft.truncate_response(responses, 0, 1)
    assert ((truncated == 0).sum(1) <= 1).all()


def test_generate_ignores_the_models_own_generation_config(tiny_tldr):
    """A checkpoint's generation_config.json (a Hub model may ship top_k, repetition_penalty, ...) fills every field the
    evaluation's config leaves unset: `generate` samples as the evaluation's config alone says, and leaves the model's
    generation_config as it was (saved with the model)."""
    model = AutoModelForCausalLM.from_pretrained(BASE).eval()
    queries = datasets.load_from_disk(str(tiny_tldr / "sft"))["validation"].with_format("torch")[:4]["query_token"]
    config = sft.sampling_config(20, 0.7, [1])
    with torch.no_grad():
        torch.manual_seed(0)
        plain = sft.generate(model, queries, 1, config)
        model.generation_config.no_repeat_ngram_size, model.generation_config.top_k = 1, 2
        own = model.generation_config
        torch.manual_seed(0)
        assert torch.equal(sft.generate(model, queries, 1, config), plain)
    assert model.generation_config is own and own.top_k == 2 and own.eos_token_id == 0


# ---------------------------------------------------------------------------------------------
# Bad inputs: a clear error before a model is loaded
# ---------------------------------------------------------------------------------------------


def bad_input(case, tiny_tldr, single_run, tmp_path):
    """Flags for one bad-input case (building what it needs in tmp_path) and the error it must raise."""
    flags = [*TINY_RUN, "--output_dir", tmp_path / "out", "--query_dataset", tiny_tldr / "sft"]
    if case == "missing column":
        data = datasets.load_from_disk(str(tiny_tldr / "sft"))
        data["validation"] = data["validation"].remove_columns("query_token")
        data.save_to_disk(str(tmp_path / "data" / "sft"))
        return flags + ["--query_dataset", tmp_path / "data" / "sft"], "lacks ['validation.query_token']"
    if case == "different run":
        (tmp_path / "out").mkdir()
        saved = json.loads((single_run[0] / "args.json").read_text())
        (tmp_path / "out" / "args.json").write_text(json.dumps({**saved, "output_dir": str(tmp_path / "out")}))
        (tmp_path / "out" / "eval_metrics.json").write_text("{}")  # its work (an args.json alone is a failed start)
        return flags + ["--seed", "2"], "holds a different run (seed=1 there, 2 now)"
    if case == "rows padded otherwise":  # no args.json beside it, as a Hub dataset: its rows say which ids it holds
        data = datasets.load_from_disk(str(tiny_tldr / "sft"))
        columns = ["query_token", "reference_response_token", "query_reference_response_token"]
        data = data.map(lambda row: {c: [7 if t == 1 else t for t in row[c]] for c in columns})  # pad 1 -> 7
        data.save_to_disk(str(tmp_path / "hub" / "sft"))
        return flags + ["--query_dataset", tmp_path / "hub" / "sft"], (
            "{'eos_token_id': 0, 'pad_token_id': 7}, this tokenizer has {'eos_token_id': 0, 'pad_token_id': 1}")
    if case == "batch above the split":  # one epoch in batches larger than the train split: no update at all
        rows = len(datasets.load_from_disk(str(tiny_tldr / "sft"))["train"])
        return flags + ["--total_episodes", "None", "--num_train_epochs", "1", "--batch_size", str(8 * rows)], (
            f"its train split ({rows} rows) x --num_train_epochs 1 is less than one batch of {8 * rows}: "
            "pass --total_episodes")
    return flags + ["--batch_size", "10"], "--batch_size 10 is not a positive multiple of --local_micro_batch_size 4"


BAD_INPUTS = ["missing column", "different run", "rows padded otherwise", "batch above the split",
              "batch does not divide"]


@pytest.fixture(scope="module")
def bad_input_starts(tiny_tldr, single_run, tmp_path_factory):
    """{case: (its working folder, the error it must raise, the start's CompletedProcess)}: the starts run in one
    interpreter (conftest.early_exits), each in a folder of its own."""
    cases = {}
    for case in BAD_INPUTS:
        cwd = tmp_path_factory.mktemp("bad_input")
        flags, message = bad_input(case, tiny_tldr, single_run, cwd)
        cases[case] = (cwd, flags, message)
    results = early_exits([(cwd, REPO / "sft.py", flags) for cwd, flags, _ in cases.values()])
    return {case: (cwd, message, result) for (case, (cwd, _, message)), result in zip(cases.items(), results)}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_fails_before_training(case, bad_input_starts):
    tmp_path, message, result = bad_input_starts[case]
    assert result.returncode != 0
    assert "SetupError" in result.stderr and message in result.stderr, result.stderr[-2000:]
    assert "Loading weights" not in result.stdout + result.stderr  # failed before any model was loaded
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


def test_smoke_run_saves_a_loadable_model(single_run):
    out, cwd = single_run
    args = json.loads((out / "args.json").read_text())
    assert (args["num_updates"], args["gradient_accumulation_steps"], args["local_micro_batch_size"]) == (4, 2, 4)
    assert args["git_commit"] and args["pad_token_id"] == 1 and args["eos_token_id"] == 0
    # how accelerate ran it (a default accelerate config could have turned on DeepSpeed, bf16 or dynamo unseen)
    assert args["launch"] == {"distributed_type": "NO", "processes": 1, "dynamo_backend": "NO"}
    assert args["mixed_precision"] == "no"  # beside the flags: --resume compares it
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == 1 and tokenizer.eos_token_id == 0
    assert model.config.hidden_dropout == model.config.attention_dropout == 0.0
    assert max_difference(weights(out), load_file(str(BASE / "model.safetensors"))) > 1e-3  # it trained
    table = pd.read_csv(out / "eval_validation.csv")
    assert list(table.columns) == ["query", "response", "reference"] and len(table) == 15
    assert table["query"].str.endswith("TL;DR:").all() and "[PAD]" not in table["query"][0]
    metrics = json.loads((out / "eval_metrics.json").read_text())["validation"]
    assert set(metrics) == {"loss", "rouge1", "rouge2", "rougeL"} and 0 < metrics["rougeL"] < 1
    assert not (out / "checkpoints").exists()  # removed once the run has finished
    assert list((cwd / "runs" / args["run_name"]).glob("events.out.tfevents.*"))
    assert re.fullmatch(r"sft__pythia-tiny__1__\d+", args["run_name"])  # the model's name keeps a sweep's sizes apart


def test_two_processes_match_one(single_run, tiny_tldr, tmp_path):
    run_sft(tmp_path, *TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", tmp_path / "out", processes=2)
    args = json.loads((tmp_path / "out" / "args.json").read_text())
    assert (args["world_size"], args["gradient_accumulation_steps"]) == (2, 1)
    assert max_difference(weights(tmp_path / "out"), weights(single_run[0])) < PROCESS_TOLERANCE
    # The eval loss is reduced over both ranks' tokens: the same number as on one process.
    losses = [json.loads((folder / "eval_metrics.json").read_text())["validation"]["loss"]
              for folder in (tmp_path / "out", single_run[0])]
    assert losses[0] == pytest.approx(losses[1], abs=1e-4)
    # The eval rows of both ranks come back in the split's order.
    queries = [pd.read_csv(folder / "eval_validation.csv")["query"] for folder in (tmp_path / "out", single_run[0])]
    assert queries[0].equals(queries[1])


def test_resume_matches_uninterrupted(single_run, tiny_tldr, tmp_path):
    flags = [*TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", tmp_path / "out", "--save_every", "1"]
    result = run_sft(tmp_path, *flags, "--stop_after_updates", "2")
    assert "stopped after update 2 of 4" in result.stdout
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["update_2"]  # only the latest
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # Resumed with a --stop_after_updates it has passed: nothing is trained, and it says where the run stands.
    result = run_sft(tmp_path, *flags, "--resume", "--stop_after_updates", "1")
    assert "stopped after update 2 of 4" in result.stdout, result.stdout[-2000:]
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["update_2"]
    # Resumed with a --stop_after_updates beyond the run's end (a job's share of updates): it ends at update 4.
    result = run_sft(tmp_path, *flags, "--resume", "--stop_after_updates", "99")
    assert "at update 2" in result.stdout
    assert max_difference(weights(tmp_path / "out"), weights(single_run[0])) < RESUME_TOLERANCE


def test_resume_refuses_inputs_rewritten_since_the_run_started(tiny_tldr, tmp_path):
    """The run records the sha256 of its inputs' args.json (preprocess_tldr.py's beside the data, a stage's in a model
    folder): after the data is built again in place (or the SFT model PPO started from is retrained), --resume would go
    on with other inputs than the interrupted run had; it is refused, naming the input, and nothing is written."""
    data = tmp_path / "data"
    shutil.copytree(tiny_tldr / "sft", data / "sft")
    shutil.copy(tiny_tldr / "args.json", data / "args.json")
    flags = [*TINY_RUN, "--query_dataset", data / "sft", "--output_dir", tmp_path / "out", "--save_every", "1"]
    run_sft(tmp_path, *flags, "--stop_after_updates", "1")
    recorded = json.loads((tmp_path / "out" / "args.json").read_text())["input_args_json"]
    built = hashlib.sha256((data / "args.json").read_bytes()).hexdigest()[:16]
    assert recorded == {"--base_model": None, "--query_dataset": built}  # the tiny base model has no args.json
    (data / "args.json").write_text(json.dumps({**json.loads((data / "args.json").read_text()), "again": 1}))  # rebuilt
    before = sorted(path.name for path in (tmp_path / "out").rglob("*"))
    result = run_sft(tmp_path, *flags, "--resume", check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"holds a different run (input_args_json={{'--base_model': None, '--query_dataset': '{built}'}} there" \
        in result.stderr, result.stderr[-2000:]
    assert sorted(path.name for path in (tmp_path / "out").rglob("*")) == before


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_input_prints_read_a_models_own_args_json_and_the_one_beside_a_datasets_splits(stage, tmp_path):
    import dataclasses

    module = __import__(stage)
    models, data = module.INPUTS
    assert set(models + data) <= {field.name for field in dataclasses.fields(module.Args)}
    assert "query_dataset" in data and ("sft_model_path" in models) == (stage != "sft")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "args.json").write_text("{}")
    (tmp_path / "data" / "sft").mkdir(parents=True)
    (tmp_path / "data" / "args.json").write_text("[]")
    args = SimpleNamespace(base_model="org/hub-id", model=str(tmp_path / "model"), dataset=str(tmp_path / "data" / "sft"))
    assert module.input_prints(args, ("base_model", "model"), ("dataset",)) == {
        "--base_model": None, "--model": hashlib.sha256(b"{}").hexdigest()[:16],
        "--dataset": hashlib.sha256(b"[]").hexdigest()[:16]}


def test_a_run_out_of_minutes_checkpoints_and_resumes_to_the_uninterrupted_end(single_run, tiny_tldr, tmp_path):
    """--stop_after_minutes (a SLURM job's time limit, as benchmark/slurm passes it): once that many minutes have
    passed, the update that ends is checkpointed and the run stops (0 minutes: after update 1, with --save_every 0);
    resumed without the flag, it ends where the uninterrupted run does."""
    flags = [*TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", tmp_path / "out", "--save_every", "0"]
    result = run_sft(tmp_path, *flags, "--stop_after_minutes", "0")
    assert "stopped after update 1 of 4" in result.stdout
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["update_1"]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    result = run_sft(tmp_path, *flags, "--resume")
    assert "at update 1" in result.stdout
    assert max_difference(weights(tmp_path / "out"), weights(single_run[0])) < RESUME_TOLERANCE


def test_resume_on_another_number_of_processes_matches_uninterrupted(single_run, tiny_tldr, tmp_path):
    """Update 1 on 2 processes (1 micro-batch each), updates 2-4 resumed on one (2 micro-batches): each update is still
    one optimizer step over its 8 rows (the step counter carried over from 2 processes stepped mid-update)."""
    flags = [*TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", tmp_path / "out", "--save_every", "1"]
    run_sft(tmp_path, *flags, "--stop_after_updates", "1", processes=2)
    result = run_sft(tmp_path, *flags, "--resume")
    assert "at update 1" in result.stdout
    assert json.loads((tmp_path / "out" / "args.json").read_text())["gradient_accumulation_steps"] == 2
    assert max_difference(weights(tmp_path / "out"), weights(single_run[0])) < PROCESS_TOLERANCE


def test_a_finished_run_resumed_in_bf16_is_refused_as_another_run(single_run, tiny_tldr):
    """The mixed precision comes from accelerate (its flag, env or default config), not from sft.py's flags: a
    requeued start of a finished fp32 run under bf16 is another run, refused before anything loads."""
    out = single_run[0]  # its own folder (the flags compare --output_dir): neither start may write a byte there
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    command = [sys.executable, str(REPO / "sft.py"), *map(str, TINY_RUN), "--query_dataset", str(tiny_tldr / "sft"),
               "--output_dir", str(out), "--resume"]
    bf16 = {**os.environ, "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "1"}  # a CPU rehearsal
    refused = run_python(command, cwd=single_run[1], env=bf16, timeout=300)
    assert refused.returncode != 0 and "mixed_precision='no' there, 'bf16' now" in refused.stderr, refused.stderr[-2000:]
    same = run_python(command, cwd=single_run[1], env=dict(os.environ), timeout=300)
    assert same.returncode == 0 and "nothing to do" in same.stdout, same.stdout[-2000:] + same.stderr[-2000:]
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == before


def test_deepspeed_zero2_matches_one_process(single_run, tiny_tldr, tmp_path):
    # The paper's launcher config on 2 CPU processes (fp32: bf16 is for GPUs). DeepSpeed reads the
    # micro-batch and the accumulation from the script and must not clip gradients (accelerate
    # would fill in clipping at 1.0: a difference of 1e-3 here); then it matches like DDP.
    run_sft(tmp_path, *TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", tmp_path / "out",
            "--num_eval_samples", "0", processes=2, deepspeed=True)
    assert max_difference(weights(tmp_path / "out"), weights(single_run[0])) < PROCESS_TOLERANCE
    saved = json.loads((tmp_path / "out" / "args.json").read_text())  # recorded as accelerate ran it
    assert (saved["launch"]["distributed_type"], saved["launch"]["processes"], saved["mixed_precision"]) == (
        "DEEPSPEED", 2, "no")


def test_adamw_is_the_plain_adamw_fused_only_on_a_gpu():
    """sft.adamw (the stages' identical copies: test_conventions) == torch.optim.AdamW(lr, eps, weight_decay): on a CPU
    the same optimizer, step for step to the bit; asked for a GPU, its fused step gives the same update up to rounding."""
    args = sft.Args(lr=1e-2, eps=1e-5, weight_decay=0.01)
    torch.manual_seed(0)
    start, grads = torch.randn(5, 3), [torch.randn(5, 3) for _ in range(3)]

    def trained(make_optimizer):
        weight = torch.nn.Parameter(start.clone())
        optimizer = make_optimizer([weight])
        for grad in grads:
            weight.grad = grad.clone()
            optimizer.step()
        return optimizer, weight.detach()

    plain, plain_weight = trained(lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-5, weight_decay=0.01))
    on_cpu, cpu_weight = trained(lambda params: sft.adamw(params, args, torch.device("cpu")))
    on_gpu, gpu_weight = trained(lambda params: sft.adamw(params, args, torch.device("cuda")))  # the fused kernel
    assert not on_cpu.param_groups[0]["fused"] and on_gpu.param_groups[0]["fused"]
    for optimizer in (on_cpu, on_gpu):
        assert {key: optimizer.param_groups[0][key] for key in ("lr", "eps", "weight_decay")} == {
            "lr": 1e-2, "eps": 1e-5, "weight_decay": 0.01}
    assert torch.equal(cpu_weight, plain_weight)
    assert torch.allclose(gpu_weight, plain_weight, atol=1e-6) and not torch.equal(gpu_weight, start)


def test_length_groups_benchmark_smoke_run(tiny_tldr, tmp_path):
    """benchmark/sft_length_groups.py: every layout gives the full-width loss and gradients, then is timed."""
    out = tmp_path / "sft_length_groups.md"
    result = run_python([sys.executable, str(REPO / "benchmark" / "sft_length_groups.py"), "--query_dataset",
                         str(tiny_tldr / "sft"), "--batch_size", "8", "--rounds", "1", "--updates", "1",
                         "--length_groups", "1", "3", "--out", str(out)], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and "length group" in line]
    assert [row[0] for row in rows] == ["| 1 length group", "| 3 length groups"]
    for row in rows:  # |loss difference| / max |gradient difference| against full width
        assert all(float(value) < 1e-3 for value in row[3].rstrip(" |").split(" / ")), row


def test_rng_state_resumes_on_this_processs_gpu_whatever_the_gpus_seen(tmp_path, monkeypatch):
    """save_rng_state keeps every visible GPU's CUDA state; load_rng_state restores this process's GPU's only, so a
    resume that sees more GPUs than the save (CUDA_VISIBLE_DEVICES widened) or other ones does not crash on a missing
    key. CUDA faked: this machine has none."""
    import torch

    states = [torch.full((8,), i, dtype=torch.uint8) for i in range(2)]  # the save saw 2 GPUs
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: restored.append(state.clone()))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("restores other GPUs' states"))
    sft.save_rng_state(str(tmp_path / "rng"))
    for device, expected in ((1, states[1]), (5, None), (0, states[0])):  # the resume sees 8 GPUs
        monkeypatch.setattr(torch.cuda, "current_device", lambda: device)
        restored.clear()
        assert sft.load_rng_state(str(tmp_path / "rng"))
        assert (restored == []) if expected is None else (len(restored) == 1 and torch.equal(restored[0], expected))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run resuming a GPU checkpoint
    restored.clear()
    assert sft.load_rng_state(str(tmp_path / "rng")) and restored == []


def test_zero_stage_3_is_refused_by_the_stages_that_check_whole_parameters():
    """sft.py, reward.py and dpo.py check the model's embedding rows and evaluate with whole parameters: under ZeRO-3
    (parameters sharded as they load) they stop at start, naming ZeRO-3 and the config to use, instead of blaming
    the tokenizer (0 embedding rows); no DeepSpeed and stages 0-2 start."""
    from types import SimpleNamespace

    assert sft.sharded_parameters_problem(None, "sft.py") is None
    assert all(sft.sharded_parameters_problem(SimpleNamespace(zero_stage=stage), "sft.py") is None for stage in (0, 1, 2))
    problem = sft.sharded_parameters_problem(SimpleNamespace(zero_stage=3), "reward.py")
    assert "ZeRO stage 3" in problem and "reward.py" in problem and "deepspeed_zero2.yaml" in problem


def test_a_deepspeed_checkpoint_resumes_only_on_as_many_processes(tmp_path):
    """DeepSpeed saves an optimizer shard per process and refuses to load them on another number: --resume says so
    at start, naming the number to launch, instead of failing inside DeepSpeed once every model is loaded. DDP
    checkpoints (no shards) resume on any number; no --resume, no checkpoint."""
    from types import SimpleNamespace

    checkpoint = tmp_path / "checkpoints" / "update_3"
    (checkpoint / "deepspeed").mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    for rank in range(2):
        (checkpoint / "deepspeed" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (checkpoint / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(b"")
    args = SimpleNamespace(output_dir=str(tmp_path), resume=True)
    launch = lambda processes, deepspeed=True: SimpleNamespace(  # noqa: E731
        num_processes=processes, state=SimpleNamespace(deepspeed_plugin=object() if deepspeed else None))
    assert sft.checkpoint_to_resume(args, launch(2)) == (3, str(checkpoint))
    for processes in (8, 1):  # more processes than shards, and fewer
        with pytest.raises(sft.SetupError, match="saved by DeepSpeed on 2 processes.*--num_processes 2"):
            sft.checkpoint_to_resume(args, launch(processes))
    assert sft.checkpoint_to_resume(SimpleNamespace(output_dir=str(tmp_path), resume=False), launch(8)) is None
    shutil.rmtree(checkpoint / "deepspeed")  # a DDP checkpoint
    assert sft.checkpoint_to_resume(args, launch(8, deepspeed=False)) == (3, str(checkpoint))
    assert sft.checkpoint_to_resume(SimpleNamespace(output_dir=str(tmp_path / "none"), resume=True), launch(1)) is None


@pytest.mark.parametrize("save_every, stop_after_updates, saved_at", [(3, None, [3, 6, 9, 10]), (5, None, [5, 10]),
                                                                     (0, 5, [5]), (4, 6, [4, 6]), (0, None, [])])
def test_checkpoints_are_written_every_save_every_updates_and_at_stop_after_updates(
        save_every, stop_after_updates, saved_at, tmp_path, monkeypatch):
    """check_and_checkpoint, as the loop calls it after updates 1, 2, ...: a checkpoint at every multiple of
    --save_every and, with --save_every, at the last update (a job requeued during the final evaluation redoes no
    update), and at --stop_after_updates (with --save_every 0 too: the run stops there, and --resume needs it)."""
    from types import SimpleNamespace

    saved = []
    monkeypatch.setattr(sft, "save_checkpoint", lambda accelerator, folder, update, *rest: saved.append(update))
    args = SimpleNamespace(output_dir=str(tmp_path), num_updates=10, save_every=save_every,
                           stop_after_updates=stop_after_updates, stop_after_minutes=None)
    model = torch.nn.Linear(2, 2)
    for update in range(1, (stop_after_updates or args.num_updates) + 1):
        assert not sft.check_and_checkpoint(one_process(), args, update, torch.ones(2), "run", model, None, None)
    assert saved == saved_at


def test_each_rank_resumes_its_own_python_numpy_and_torch_random_states(tmp_path):
    """save_training_state keeps every rank's RNG states apart (rank 1 writes no model: DDP); load_rng_state puts each
    generator back where that rank's was: the draws after it are those that rank would have drawn."""
    import random

    import numpy as np

    def draws():
        return random.random(), np.random.rand(), torch.rand(3).tolist()

    before = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        expected = {}
        for rank in (0, 1):
            sft.seed_everything(rank + 1)
            sft.save_training_state(one_process(rank), str(tmp_path), model, optimizer)
            expected[rank] = draws()
        assert expected[0] != expected[1]
        for rank in (1, 0):
            sft.seed_everything(99)
            assert sft.load_rng_state(str(tmp_path / f"rng_state_{rank}"))
            assert draws() == expected[rank], rank
    finally:
        random.setstate(before[0]), np.random.set_state(before[1]), torch.set_rng_state(before[2])


def test_deepspeed_models_are_saved_from_the_fp32_master_weights(monkeypatch):
    """Under DeepSpeed bf16 the module holds bf16 copies; fp32_state_dict returns ZeRO's fp32 master weights instead
    (faked here: DeepSpeed on a CPU trains in fp32), every tensor fp32. Each master comes as a full copy on the GPU
    (a stand-in here) and goes to the CPU as it comes, on rank 0 only: every rank calls the collective, and the
    other ranks, which save nothing, keep no copy (all of them on each GPU would not fit at 6.9B) and get no state
    dict (an fp32 copy per rank in host memory), nor ask accelerate for its bf16 copy (ZeRO-3, where that copy is a
    collective, is refused at start)."""
    from types import SimpleNamespace

    import deepspeed.utils

    class OnTheGpu:  # a master weight as DeepSpeed hands it; .cpu() is the one way out
        def __init__(self, tensor):
            self.tensor = tensor

        def cpu(self):
            moved.append(self.tensor)
            return self.tensor

    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    torch.manual_seed(0)
    master = {id(param): torch.randn(param.shape) for param in model.parameters()}  # not representable in bf16
    calls, moved = [], []
    monkeypatch.setattr(deepspeed.utils, "safe_get_full_fp32_param",
                        lambda param: calls.append(param) or OnTheGpu(master[id(param)]))
    gathered = []
    for main in (True, False):
        accelerator = SimpleNamespace(get_state_dict=lambda module: gathered.append(1) or dict(module.state_dict()),
                                      unwrap_model=lambda m: m, is_main_process=main,
                                      state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
        calls.clear(), moved.clear(), gathered.clear()
        state_dict = sft.fp32_state_dict(accelerator, model)
        assert len(calls) == 2 and len(moved) == (2 if main else 0)  # weight and bias
        # accelerate's state dict: a bf16 copy on the CPU that only rank 0 needs
        assert len(gathered) == (1 if main else 0)
        if not main:
            assert state_dict == {}
            continue
        for name, param in model.named_parameters():
            assert state_dict[name].dtype == torch.float32 and torch.equal(state_dict[name], master[id(param)]), name


def test_save_fp32_says_float32_for_a_bf16_module(tmp_path):
    """The module's compute copy is bf16 under DeepSpeed: the saved config names the dtype of the fp32 weights saved,
    so that a plain from_pretrained(dtype="auto") loads them in fp32."""
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.bfloat16)
    sft.save_fp32(model, str(tmp_path), {name: tensor.float() for name, tensor in model.state_dict().items()})
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    assert all(tensor.dtype == torch.float32 for tensor in weights(tmp_path).values())
    assert AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").dtype == torch.float32


def test_mean_rouge_does_not_stem():
    """ROUGE as the reference computes it (`evaluate`'s rouge: rouge-score without a stemmer): "cats" is not "cat"."""
    assert sft.mean_rouge(["my cats"], ["my cat"])["rouge1"] == pytest.approx(0.5)


def test_evaluation_samples_at_the_eval_temperature_the_full_length():
    """The evaluation's sampler: temperature T + 1e-7 (the reference's), always response_length new tokens (EOS cut
    afterwards), no top-k or top-p, the unsampled ids suppressed; dpo.py's copy is the same function."""
    config = sft.sampling_config(53, 0.01, [7, 9])
    assert config.temperature == pytest.approx(0.01 + 1e-7) and config.do_sample
    assert config.max_new_tokens == config.min_new_tokens == 53 and config.top_k == 0 and config.top_p == 1.0
    assert list(config.suppress_tokens) == [7, 9] and not config.output_scores  # ids only: no (B, T, V) scores kept
    assert config.return_dict_in_generate  # generate returns an output with .sequences


def test_sft_evaluate_cuts_each_summary_at_its_eos_and_counts_real_rows_only(tiny_tldr, monkeypatch):
    """sft_evaluate on 3 rows in batches of 2 (the last batch padded with a repeated row): each summary is the sampled
    ids after the query up to its first EOS (junk after it dropped, the query's last token not included); the loss is
    the token mean over the 3 real rows' references, the padding row not counted twice; ROUGE over the 3 rows."""
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    pad = 1
    monkeypatch.setattr(sft, "generate", sampler_with_junk_after_eos(tokenizer))
    # the rows come back in split order however gather_object joins the ranks' lists (here: reversed)
    monkeypatch.setattr(sft, "gather_object", lambda rows: list(reversed(rows)))
    dataset = datasets.load_from_disk(tiny_tldr / "sft")["validation"].select(range(3))
    dataset = dataset.with_format("torch", columns=list(sft.REQUIRED_COLUMNS))
    model = AutoModelForCausalLM.from_pretrained(BASE)
    sft.disable_dropout(model)
    metrics, rows = sft.sft_evaluate(one_process(), model, dataset, tokenizer, None, 2)
    assert [row["response"] for row in rows] == ["a cat sat"] * 3
    assert [row["reference"] for row in rows] == [r.strip() for r in tokenizer.batch_decode(
        dataset[:]["reference_response_token"], skip_special_tokens=True)]
    with torch.no_grad():
        ids = dataset[:]["query_reference_response_token"]
        nll, count = sft.next_token_nll(sft.forward(model.eval(), ids, pad).logits, ids, pad)
    assert metrics["loss"] == pytest.approx((nll / count).item(), rel=1e-5)
    assert metrics["rouge1"] == pytest.approx(sft.mean_rouge(["a cat sat"] * 3, [r["reference"] for r in rows])["rouge1"])

    seven = datasets.load_from_disk(tiny_tldr / "sft")["validation"].select(range(7))
    seven = seven.with_format("torch", columns=list(sft.REQUIRED_COLUMNS))
    # of 7 rows, rank 1 of 2 reads rows 1, 3 and 5, its last batch padded with row 5
    metrics, rows = sft.sft_evaluate(one_process(1, 2), model, seven, tokenizer, None, 2)
    assert len(rows) == 3  # this rank's rows (gather_object joins the ranks' lists)
    with torch.no_grad():
        ids = seven[[1, 3, 5]]["query_reference_response_token"]
        nll, count = sft.next_token_nll(sft.forward(model.eval(), ids, pad).logits, ids, pad)
    assert metrics["loss"] == pytest.approx((nll / count).item(), rel=1e-5)


def test_ids_in_data_wants_most_rows_padded():
    """Half the rows padded is not 'most': no pad is read (a column of unpadded rows whose last ids happen to agree)."""
    rows = {"train": datasets.Dataset.from_dict({"r": [[5, 0, 1, 1], [6, 0, 1, 1], [7, 8, 9, 3], [4, 5, 6, 3]]})}
    assert sft.ids_in_data(rows, "r") is None
    rows = {"train": datasets.Dataset.from_dict({"r": [[5, 6, 0, 1], [7, 0, 1, 1], [8, 0, 1, 1], [4, 3, 2, 0]]})}
    assert sft.ids_in_data(rows, "r") == {"eos_token_id": 0, "pad_token_id": 1}


def test_updates_count_every_epoch_of_the_train_split(tiny_tldr, tmp_path):
    """Without --total_episodes, sft_inputs sets num_updates to the train split x --num_train_epochs in whole batches."""
    accelerator = one_process()
    args = sft.Args(base_model=str(BASE), query_dataset=str(tiny_tldr / "sft"), output_dir=str(tmp_path / "out"),
                    batch_size=8, num_train_epochs=3)
    dataset, *_ = sft.sft_inputs(args, accelerator)
    assert args.num_updates == len(dataset["train"]) * 3 // 8 and not (tmp_path / "out").exists()


def test_length_groups_benchmark_table_by_hand_and_full_width_is_the_stored_width(monkeypatch):
    """benchmark/sft_length_groups.py: render_table on made-up rounds (rows / s from the median round, each against full
    width; the timed micro-batches' mean tokens and cut cells, the warm-up batch left out), and "full width" runs one
    forward over the rows as stored, the length groups over rows cut to their longest."""
    sys.path.insert(0, str(REPO / "benchmark"))
    import sft_length_groups

    pad = 1
    rows = torch.full((2, 6), pad)
    rows[0, :2], rows[1, :3] = 5, 6  # 5 tokens, longest row 3
    timed = torch.full((2, 6), pad)
    timed[0, :4], timed[1, :1] = 5, 6  # 5 tokens, longest 4: 8 cells
    args = SimpleNamespace(updates=2, batch_size=2, rounds=3, length_groups=[1], base_model=str(BASE))
    seconds = {"full width": [1.0, 2.0, 6.0], "1 length group": [1.0, 1.0, 4.0]}  # medians 2 and 1 s (means 3, 2)
    table = sft_length_groups.render_table(args, "cpu", seconds, {"1 length group": (1e-7, 2e-7)},
                                           [rows, timed, timed], pad)
    assert "the timed micro-batches hold 5 tokens each, 8 cells when cut to their longest row" in table
    assert "| full width | 2.0 | 1.00x |  |" in table and "| 1 length group | 4.0 | 2.00x | 1.0e-07 / 2.0e-07 |" in table

    widths = []
    real = sft.forward
    monkeypatch.setattr(sft, "forward", lambda model, ids, *args, **kwargs: widths.append(ids.shape[1])
                        or real(model, ids, *args, **kwargs))
    model = AutoModelForCausalLM.from_pretrained(BASE)
    sft_length_groups.batch_nll(model, rows, "full width", pad)
    assert widths == [6]


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_a_push_the_hub_would_refuse_is_refused_at_start(stage, monkeypatch, tmp_path):
    """--push_to_hub pushes to {base model}__{exp_name}__tldr on the run name's branch once the run has ended, where
    --resume cannot rename either (a changed --exp_name is another run): names the Hub refuses stop the start, and so
    do an offline shell and a machine without a Hub token, which would fail the push after the whole run."""
    from types import SimpleNamespace

    import huggingface_hub.constants

    module = __import__(stage)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the tests' shell is offline
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in")
    flags = SimpleNamespace(push_to_hub=True, hf_entity=None, exp_name="sft", run_name=None)
    assert module.push_problem(flags, "EleutherAI/pythia-6.9b-deduped") is None
    assert module.push_problem(SimpleNamespace(**{**vars(flags), "run_name": "sft__pythia__1__1764662400"}), "m") is None
    for bad in ({"exp_name": "my sft"}, {"exp_name": "x" * 60}, {"exp_name": "a--b"}, {"hf_entity": "a b"}):
        problem = module.push_problem(SimpleNamespace(**{**vars(flags), **bad}), "EleutherAI/pythia-6.9b-deduped")
        assert problem.startswith(f"--push_to_hub: --exp_name {bad.get('exp_name', 'sft')!r} or --hf_entity "), bad
    for bad in ("a..b", "-x", "a/b", "a b"):
        assert module.push_problem(SimpleNamespace(**{**vars(flags), "run_name": bad}), "m") == (
            f"--push_to_hub: --run_name {bad!r} names no git branch: want letters, digits, _ . - (no '..')")
    assert module.push_problem(SimpleNamespace(**{**vars(flags), "push_to_hub": False, "exp_name": "my sft"}), "m") is None
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))  # `hf auth login`'s
    assert "no Hub token on this machine" in module.push_problem(flags, "m")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE is set in this shell" in module.push_problem(flags, "m")
    assert module.push_problem(SimpleNamespace(**{**vars(flags), "push_to_hub": False}), "m") is None


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo"])
def test_a_rank_that_exits_at_once_closes_its_wandb_run_first(stage, monkeypatch):
    """leave_process_group ends a run of several processes with os._exit, which skips the exit handler W&B closes a
    run with: a run stopped early (--stop_after_minutes: every requeued SLURM attempt) kept only its header."""
    from types import SimpleNamespace

    module = __import__(stage)
    events = []
    fake = SimpleNamespace(run=object(), finish=lambda: events.append("wandb.finish"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(module.torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(module.torch.distributed, "destroy_process_group", lambda: events.append("left"))
    monkeypatch.setattr(module.os, "_exit", lambda code: events.append(f"exit {code}"))
    module.leave_process_group(True)
    assert events == ["left", "wandb.finish", "exit 0"]
    fake.run = None  # closed already (a finished run), or never opened (no --track, another rank)
    module.leave_process_group(True)
    assert events[3:] == ["left", "exit 0"]


@pytest.mark.parametrize("stage, start", [("sft", "start_sft_logging"), ("reward", "start_logging"),
                                          ("dpo", "start_logging"), ("ppo", "start_ppo_logging")])
def test_a_resumed_tracked_run_logs_on_into_its_own_wandb_run(stage, start, tmp_path, monkeypatch):
    """--track: W&B's run id comes from the run name, with resume="allow", so a requeued run (--resume: the run name
    read back from its checkpoint) continues the W&B run it started instead of opening one per attempt."""
    from types import SimpleNamespace

    module = __import__(stage)
    calls, events = [], []
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=lambda **kwargs: calls.append(kwargs)
                                                              or events.append("wandb.init")))
    real_writer = module.SummaryWriter
    monkeypatch.setattr(module, "SummaryWriter", lambda *a, **k: events.append("writer") or real_writer(*a, **k))
    monkeypatch.chdir(tmp_path)
    args = module.Args(output_dir=str(tmp_path / "out"), track=True)
    recorded = {"base_model_name": "EleutherAI/pythia-1b-deduped"}
    extra = ("pairs",) if stage in ("reward", "dpo") else ()
    run_name, writer = getattr(module, start)(args, one_process(), None, recorded, *extra)
    writer.close()
    checkpoint = tmp_path / "update_3"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"run_name": run_name}))
    resumed_name, writer = getattr(module, start)(args, one_process(), (3, str(checkpoint)), recorded, *extra)
    writer.close()
    assert resumed_name == run_name and [call["id"] for call in calls] == [module.wandb_run_id(run_name)] * 2
    assert all(call["resume"] == "allow" and call["name"] == run_name for call in calls)
    # sync_tensorboard reads only the writers made after wandb.init: the other way round, no scalar reached W&B
    assert events == ["wandb.init", "writer"] * 2
    assert module.wandb_run_id("a/b:c d") == "a_b_c_d" and len(module.wandb_run_id("x" * 100)) == 64
    assert module.wandb_run_id("x" * 100) != module.wandb_run_id("x" * 99 + "y")  # a long name keeps its end's hash

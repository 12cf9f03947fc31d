"""Tokenizer identity (issue 16): EOS and [PAD] ids are not enough. Every stage records
`tokenizer_identity` (sha256 of the vocabulary and special tokens) in its args.json, compares the
identities of everything it loads (data, SFT model, reward model and its tokenizer), checks that
every model's embedding holds every id, and stops before anything is written, naming each side.

"Another vocabulary" below is the tiny world's tokenizer with the ids of two ordinary tokens swapped:
same EOS and [PAD] ids, so the old id check passed and every stage trained silently on it.
"""

import json
import os
import shutil

import pytest
from transformers import AutoTokenizer

import dpo
import ppo
import reward
import sft
from conftest import REPO, WORLD, early_exits
from test_ppo import make_reward_model

BASE = WORLD / "pythia-tiny"
TINY = ["--batch_size", "8", "--local_micro_batch_size", "4", "--total_episodes", "8", "--local_eval_batch_size", "8",
        "--num_eval_samples", "4"]


def other_vocabulary(folder):
    """A copy of the tiny model whose tokenizer swaps the ids of '!' and '"' (EOS 0 and [PAD] 1 unchanged)."""
    shutil.copytree(BASE, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["!"], vocab['"'] = vocab['"'], vocab["!"]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def identity(folder):
    """tokenizer_identity of the tokenizer saved in `folder`."""
    return sft.tokenizer_identity(AutoTokenizer.from_pretrained(folder))


def data_of(tiny_tldr, folder, tokenizer_folder):
    """The tiny world's datasets under `folder`, its args.json recording the identity of `tokenizer_folder`
    (as preprocess_tldr.py records the tokenizer it used)."""
    folder.mkdir()
    for name in ("sft", "preference"):
        os.symlink(tiny_tldr / name, folder / name)
    built = json.loads((tiny_tldr / "args.json").read_text())
    (folder / "args.json").write_text(json.dumps({**built, "tokenizer_identity": identity(tokenizer_folder)}))
    return folder


def test_identity_tells_vocabularies_apart(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    tokenizer.save_pretrained(tmp_path / "saved")
    assert identity(tmp_path / "saved") == sft.tokenizer_identity(tokenizer)  # survives save / load
    assert len({module.tokenizer_identity(tokenizer) for module in (sft, reward, dpo, ppo)}) == 1
    other = AutoTokenizer.from_pretrained(other_vocabulary(tmp_path / "other"))
    assert (other.eos_token_id, other.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert sft.tokenizer_identity(other) != sft.tokenizer_identity(tokenizer)
    no_pad = AutoTokenizer.from_pretrained(BASE)
    no_pad.pad_token = None  # a [PAD] added by add_pad_token gives the identity of the saved tokenizer with it
    sft.add_pad_token(no_pad)
    assert sft.tokenizer_identity(no_pad) == sft.tokenizer_identity(tokenizer)


def test_identity_problem_names_each_side():
    assert sft.identity_problem({"a": "1" * 64, "b": None, "c": "1" * 64}) is None  # unknown sides are skipped
    problem = sft.identity_problem({"--query_dataset x (x/args.json)": "1" * 64, "--base_model y (its tokenizer)": "2" * 64})
    assert "--query_dataset x (x/args.json) has 1111111111111111" in problem
    assert "--base_model y (its tokenizer) has 2222222222222222" in problem


def test_vocabulary_problem_counts_every_id_but_pad():
    tokenizer = AutoTokenizer.from_pretrained(BASE)  # ids 0 ... n - 1, [PAD] = 1
    n = len(tokenizer)
    assert tokenizer.pad_token_id == 1 and n > 1000
    assert sft.vocabulary_problem(tokenizer, n, "m") is None
    assert f"m has 1000 embedding rows, but the tokenizer has ids up to {n - 1}" in sft.vocabulary_problem(tokenizer, 1000, "m")
    tokenizer.pad_token = None
    tokenizer.add_special_tokens({"pad_token": "<new pad>"})  # id n, past the table: masked, so fine
    assert tokenizer.pad_token_id == n
    assert sft.vocabulary_problem(tokenizer, n, "m") is None


def ppo_flags(tiny_tldr, rm):
    return ["--query_dataset", tiny_tldr / "sft", "--sft_model_path", BASE, "--reward_model_path", rm,
            "--local_rollout_forward_batch_size", "8", "--response_length", "4", *TINY]


@pytest.fixture(scope="module")
def refusals(tiny_tldr, tmp_path_factory):
    """{case: (its folder, what it held before, its CompletedProcess)}: five starts that must stop before writing
    anything, each in a folder of its own, all run in one interpreter (conftest.early_exits)."""
    starts = {}
    for script in ("sft.py", "reward.py", "dpo.py"):  # a model of another vocabulary than the data's
        cwd = tmp_path_factory.mktemp("vocabulary")
        model = other_vocabulary(cwd / "model")
        data = data_of(tiny_tldr, cwd / "data", BASE)
        flags = (["--base_model", model, "--query_dataset", data / "sft", "--response_length", "4"] if script == "sft.py"
                 else ["--sft_model_path", model, "--label_dataset", data / "preference", "--query_dataset", data / "sft"])
        starts[script] = (cwd, script, flags + TINY)
    cwd = tmp_path_factory.mktemp("ppo_vocabulary")  # the RM's own tokenizer: same special ids, other vocabulary
    make_reward_model(cwd / "rm")
    AutoTokenizer.from_pretrained(other_vocabulary(cwd / "other")).save_pretrained(cwd / "rm")
    starts["ppo.py, another vocabulary"] = (cwd, "ppo.py", ppo_flags(tiny_tldr, cwd / "rm"))
    cwd = tmp_path_factory.mktemp("ppo_small")  # same tokenizer, an RM embedding of 1000 rows
    make_reward_model(cwd / "rm")
    small = ppo.ScalarModel.from_pretrained(cwd / "rm")
    small.backbone.resize_token_embeddings(1000)
    small.config.base_config["vocab_size"] = 1000
    small.save_pretrained(cwd / "rm")
    assert ppo.ScalarModel.from_pretrained(cwd / "rm").backbone.get_input_embeddings().weight.shape[0] == 1000
    starts["ppo.py, small embedding"] = (cwd, "ppo.py", ppo_flags(tiny_tldr, cwd / "rm"))
    before = {case: sorted(os.listdir(cwd)) for case, (cwd, _, _) in starts.items()}
    results = early_exits([(cwd, REPO / script, [*flags, "--output_dir", cwd / "out"])
                             for cwd, script, flags in starts.values()],
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return {case: (cwd, before[case], result) for (case, (cwd, _, _)), result in zip(starts.items(), results)}


def refused(refusals, case):
    """The start of `case` stopped with a SetupError and wrote nothing: (its folder, the last line of its stderr)."""
    cwd, before, result = refusals[case]
    assert result.returncode == 1 and "SetupError" in result.stderr, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]  # the message alone says what to fix
    assert sorted(os.listdir(cwd)) == before  # no output folder, no runs/
    return cwd, result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("script", ["sft.py", "reward.py", "dpo.py"])
def test_a_model_of_another_vocabulary_is_refused(script, refusals):
    tmp_path, message = refused(refusals, script)
    model, data = tmp_path / "model", tmp_path / "data"
    flag = "--base_model" if script == "sft.py" else "--sft_model_path"
    assert f"{flag} {model} (its tokenizer) has {identity(model)[:16]}" in message
    assert f"--query_dataset {data / 'sft'} ({data}/args.json) has {identity(BASE)[:16]}" in message


def test_ppo_refuses_a_reward_model_of_another_vocabulary(refusals):
    tmp_path, message = refused(refusals, "ppo.py, another vocabulary")
    assert f"--reward_model_path {tmp_path / 'rm'} (its tokenizer) has {identity(tmp_path / 'rm')[:16]}" in message
    assert f"--sft_model_path {BASE} (its tokenizer) has {identity(BASE)[:16]}" in message


def test_ppo_refuses_a_reward_model_too_small_for_the_policys_ids(refusals):
    """Same tokenizer, an embedding of 1000 rows: the first rollout's ids past row 999 used to raise an
    IndexError inside the RM after the first rollout; now it stops before anything is written."""
    tmp_path, message = refused(refusals, "ppo.py, small embedding")
    last_id = len(AutoTokenizer.from_pretrained(BASE)) - 1  # the world's [PAD] is id 1, so the last id is a real token
    assert f"--reward_model_path {tmp_path / 'rm'} has 1000 embedding rows, but the tokenizer has ids up to {last_id}" in message


def test_vocabulary_problem_needs_a_row_for_the_largest_id():
    """A model with exactly as many embedding rows as the tokenizer has ids passes; one row fewer cannot embed the
    largest id (an IndexError in the first forward that reads it) and is refused, for every stage."""
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    n = len(tokenizer)
    for module in (sft, reward, dpo, ppo):
        assert module.vocabulary_problem(tokenizer, n, "m") is None
        assert module.vocabulary_problem(tokenizer, n - 1, "m") == (
            f"m has {n - 1} embedding rows, but the tokenizer has ids up to {n - 1}: it was not trained with this "
            "tokenizer; use models and data made from one base model")


def test_ppo_checks_the_policys_embedding_as_well_as_the_critics():
    """model_problems names --sft_model_path when the policy's embedding is too small for the tokenizer's ids (the
    critic's is checked too: test_ppo_refuses_a_reward_model_too_small_for_the_policys_ids)."""
    from types import SimpleNamespace

    from test_ppo import tiny_models

    policy, critic = tiny_models()
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    args = SimpleNamespace(compile_training=False, sft_model_path="sft", reward_model_path="rm")
    assert ppo.model_problems(args, tokenizer, policy, critic) is None
    policy.resize_token_embeddings(1000)
    assert ppo.model_problems(args, tokenizer, policy, critic).startswith(
        "--sft_model_path sft has 1000 embedding rows, but the tokenizer has ids up to")


def test_add_pad_token_replaces_any_other_pad():
    """[PAD] replaces whatever pad a tokenizer came with (transformers 5 gives Pythia's '<|padding|>'), so the ids
    match the reference's datasets and checkpoints; a tokenizer already padding with [PAD] is left as it is."""
    for module in (sft, reward, dpo, ppo):
        tokenizer = AutoTokenizer.from_pretrained(BASE)
        assert module.add_pad_token(tokenizer) is False and tokenizer.pad_token == "[PAD]"
        tokenizer.add_special_tokens({"pad_token": "<|other pad|>"})
        assert module.add_pad_token(tokenizer) is True and tokenizer.pad_token == "[PAD]", module.__name__

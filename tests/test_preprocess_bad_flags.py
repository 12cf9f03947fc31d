"""Bad flags for preprocess_tldr.py: every flag is checked before anything is loaded or written, so a
failed start leaves no folder behind and the outputs of an earlier run as they were."""

import hashlib
import json
import sys
from pathlib import Path

import datasets
import pytest
import tyro

import preprocess_tldr as pre
from conftest import REPO, WORLD, run_python, tiny_lengths


def problems_of(*argv: str) -> list:
    return pre.preprocess_flag_problems(tyro.cli(pre.Args, args=list(argv)))


def test_paper_and_tiny_world_flags_pass():
    assert problems_of() == []  # the paper's values (the defaults)
    assert problems_of(*tiny_lengths()) == []  # benchmark/tiny.sh


@pytest.mark.parametrize("argv, expected", [
    (["--num_proc", "0"], "--num_proc 0: pass a number of worker processes >= 1"),
    (["--query_length", "0"], "--query_length 0: pass a positive number of tokens"),
    (["--max_sft_response_length", "-3"], "--max_sft_response_length -3: pass a positive number of tokens"),
    (["--cnndm_max_rm_query_response_length", "0"], "--cnndm_max_rm_query_response_length 0: pass a positive"),
    (["--query_length", "600"], "--query_length 600 is larger than --max_sft_query_response_length 562: a query of "
                                "that length leaves no room for its response; raise --max_sft_query_response_length "
                                "or lower --query_length"),
    (["--cnndm_query_length", "2047"], "--cnndm_query_length 2047 is larger than --cnndm_max_rm_query_response_length"),
    (["--max_rm_response_length", "638"], "--max_rm_response_length 638 is not smaller than "
                                          "--max_rm_query_response_length 638"),
    (["--output_dir", ""], "--output_dir '' is not a folder name"),
])
def test_each_bad_flag_is_named_with_its_fix(argv, expected):
    problems = problems_of(*argv)
    assert len(problems) >= 1 and any(expected in problem for problem in problems), problems


def test_output_dir_that_is_a_file_or_in_one_or_another_stages_folder_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    for inside in ("file", "file/data/tldr"):  # in a file: os.makedirs would fail only once the sources are loaded
        assert problems_of("--output_dir", str(tmp_path / inside)) == [
            f"--output_dir {tmp_path / inside}: {tmp_path / 'file'} is a file, not a folder: pass a new or existing "
            "folder"]
    model = tmp_path / "sft_model"  # a model's args.json (its flags, run name, tokenizer identity) must not be replaced
    model.mkdir()
    (model / "args.json").write_text(json.dumps({"sft_model_path": "x", "query_dataset": "y"}))
    assert problems_of("--output_dir", str(model)) == [
        f"--output_dir {model} holds an args.json that this script did not write (a model's folder?), which it would "
        "replace: pass a new folder, or the folder of an earlier preprocessing"]
    (model / "args.json").write_text(json.dumps({"sft_dataset": "x", "preference_dataset": "y"}))
    assert problems_of("--output_dir", str(model)) == []  # an earlier preprocessing's folder: replaced, as documented


def fingerprint(folder: Path) -> dict:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("case", ["bad flag, new folder", "bad flag, old outputs", "bad tokenizer, new folder"])
def test_failed_start_leaves_nothing_behind(tmp_path, case):
    out = tmp_path / "data" / "tldr"
    if case == "bad flag, old outputs":  # the outputs of an earlier run (any saved dataset will do)
        datasets.DatasetDict(train=datasets.Dataset.from_list([{"id": "a", "query_token": [1, 2]}])).save_to_disk(
            str(out / "sft"))
        (out / "args.json").write_text("{}")
    before = fingerprint(out) if out.exists() else None
    flags = ["--num_proc", "0"] if case.startswith("bad flag") else ["--num_proc", "1"]
    base_model = tmp_path / "no_such_tokenizer" if case.startswith("bad tokenizer") else WORLD / "pythia-tiny"
    command = [sys.executable, str(REPO / "preprocess_tldr.py"), "--base_model", str(base_model),
               "--sft_dataset", str(WORLD / "tldr_3_filtered"),
               "--preference_dataset", str(WORLD / "summarize_from_feedback"), "--output_dir", str(out),
               *tiny_lengths(), *flags]
    result = run_python(command, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]  # the message alone says what to fix
    if case.startswith("bad flag"):
        assert "SetupError: bad flags:\n  --num_proc 0: pass a number of worker processes >= 1" in result.stderr
    else:
        assert "no_such_tokenizer" in result.stderr
    if before is None:
        assert not (tmp_path / "data").exists()  # not even the parent folder was made
    else:
        assert fingerprint(out) == before and datasets.load_from_disk(str(out / "sft"))["train"]["id"] == ["a"]


def test_a_push_that_would_fail_at_the_end_is_refused_at_start(monkeypatch, tmp_path):
    """--push_to_hub pushes after all the tokenizing: an offline shell, a machine without a Hub token or an --hf_entity
    the Hub refuses stop the start, as in the training stages, not the end with a traceback."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the tests' shell is offline
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in")
    assert problems_of("--push_to_hub") == [] and problems_of("--push_to_hub", "--hf_entity", "my-org") == []
    assert problems_of("--push_to_hub", "--hf_entity", "my org")[0].startswith(
        "--push_to_hub: --hf_entity 'my org' names no Hub user or organisation")
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))  # `hf auth login`'s
    assert problems_of("--push_to_hub") == [
        "--push_to_hub: no Hub token on this machine, so the push at the end would fail: log in first "
        "(`hf auth login`, or HF_TOKEN in the environment)"]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE is set in this shell" in problems_of("--push_to_hub")[0]
    assert problems_of() == []  # without --push_to_hub nothing of the Hub is asked


def test_a_hub_that_refuses_the_token_at_the_end_says_the_outputs_are_saved(monkeypatch):
    import huggingface_hub

    def refused():
        raise OSError("401 Unauthorized")

    monkeypatch.setattr(huggingface_hub, "whoami", refused)
    args = tyro.cli(pre.Args, args=["--push_to_hub", "--output_dir", "data/x"])
    with pytest.raises(pre.SetupError, match=r"the Hub does not say who is logged in \(OSError: 401 Unauthorized\); "
                                             r"the outputs are saved in data/x, nothing was pushed"):
        pre.publish_datasets(args, None, None)

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

"""Bad rows and bad source files for preprocess_tldr.py: each fails before any tokenization, naming the
file and line or the split and row id, and leaves the outputs of an earlier run as they were."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import datasets
import pytest
from conftest import run_python

import preprocess_tldr as pre
from test_preprocess import (flag_args, make_tokenizer, preference_row, reference_flags, sft_row,
                             smoke_sources, write_world)


def fingerprint(folder: Path) -> dict:
    """{relative path: sha256} of every file under `folder`: equal fingerprints, untouched outputs."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def run(command: list, tmp_path: Path) -> subprocess.CompletedProcess:
    return run_python(command, timeout=300)


@pytest.fixture(scope="module")
def tok():
    tokenizer = make_tokenizer()
    pre.add_pad_token(tokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def old_output(tmp_path_factory, tok):
    """The outputs of a good run, to be copied where a failing run then writes."""
    folder = tmp_path_factory.mktemp("good")
    sft, preference = smoke_sources()
    command = write_world(folder, sft, preference) + ["--output_dir", str(folder / "out")]
    result = run(command + flag_args(reference_flags(tok, sft, preference)[0]), folder)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return folder / "out"


# ---- rows ----

@pytest.mark.parametrize("kind, change, expected", [
    ("sft", lambda row: row.update(summary=""), "expected a non-empty summary, got ''"),
    ("sft", lambda row: row.update(summary=" \n "), "expected a non-empty summary"),
    ("tldr", lambda row: row["summaries"][0].update(text=" "), "expected summaries[0].text to hold a summary"),
    ("cnndm", lambda row: row["summaries"][1].update(text="  "), "expected summaries[1].text to hold a summary"),
    ("tldr", lambda row: row["summaries"][1].update(policy=None), "expected summaries[1].policy to be a string, got None"),
    ("tldr", lambda row: row.update(info="a post"), "expected `info` to be a dict, got 'a post'"),  # its id is gone
    # a missing title or subreddit would be formatted as "TITLE: None" / "r/None" and trained on
    ("tldr", lambda row: row["info"].update(title=None), "expected info.title to be a string, got None"),
    ("tldr", lambda row: row["info"].update(subreddit=None), "expected info.subreddit to be a string, got None"),
    ("sft", lambda row: row.update(subreddit=None), "expected subreddit to be a string, got None"),
    ("tldr", lambda row: row["summaries"].append(dict(row["summaries"][0])),  # a third would be dropped silently
     "expected `summaries` to be a list of 2 summaries"),
    ("tldr", lambda row: row.update(choice=-1), "expected `choice` to be the integer 0 or 1, got -1"),
    ("tldr", lambda row: row.update(choice=1.0), "expected `choice` to be the integer 0 or 1, got 1.0"),  # a float column
])
def test_bad_rows_are_named_by_split_and_row(kind, change, expected):
    good = sft_row("ok") if kind == "sft" else preference_row("ok", cnndm=kind == "cnndm")
    bad = sft_row("bad3") if kind == "sft" else preference_row("bad3", cnndm=kind == "cnndm")
    change(bad)
    assert pre.bad_rows([good], "train", kind) == []
    found = pre.bad_rows([good, good, bad], "train", kind)
    assert len(found) == 1
    named = "no id" if expected.startswith("expected `info`") else "id 'bad3'"
    assert f"split 'train', row 2 ({named}): {expected}" in pre.bad_row_message("train", *found[0])


def test_duplicate_sft_ids_name_both_rows():
    assert pre.duplicate_id_problem({"train": ["a", "b"], "validation": ["c"], "test": ["d"]}) is None
    within = pre.duplicate_id_problem({"train": ["a", "b", "a"], "validation": ["c"]})
    assert "1 duplicate post id(s): id 'a' in split 'train' row 0 and split 'train' row 2" in within
    across = pre.duplicate_id_problem({"train": ["a", "b"], "validation": ["c"], "test": ["b", "c", "c"]})
    assert across.startswith("3 duplicate post id(s): id 'b' in split 'train' row 1 and split 'test' row 0; "
                             "id 'c' in split 'validation' row 0 and split 'test' row 1; id 'c'")
    assert "remove the repeated rows from the source" in across



def test_bad_rows_lists_every_bad_row_and_duplicate_rows_every_repeat():
    good, no_space, empty = preference_row("ok"), preference_row("s1"), preference_row("e1")
    no_space["summaries"][1]["text"] = "no space"
    empty["info"]["post"] = " "
    assert pre.bad_rows([good, no_space, good, empty], "train", "tldr") == [
        (1, "s1", "expected summaries[1].text to be a string starting with a space, got 'no space'"),
        (3, "e1", "expected a non-empty info.post, got ' '")]
    assert pre.bad_rows([good, good], "train", "tldr") == []
    # the first occurrence stays, every later one (in the splits' order) is a repeat of it
    assert pre.duplicate_rows({"train": ["a", "b", "a"], "validation": ["c"], "test": ["b", "a"]}) == [
        ("train", 2, "a", "train", 0), ("test", 0, "b", "train", 1), ("test", 1, "a", "train", 0)]
    # rows dropped anyway are skipped: the next copy is the first one
    assert pre.duplicate_rows({"train": ["a", "b", "a"], "validation": ["c"], "test": ["b", "a"]},
                              frozenset({("train", 0), ("test", 0)})) == [("test", 1, "a", "train", 2)]


def bad_sources():
    """smoke_sources() with a preference summary lacking its leading space, an empty SFT post and an SFT post id
    repeated across splits: three rows the script cannot use."""
    sft, preference = smoke_sources()
    preference["train"].append(preference_row("p3", texts=("the cat", " a dog")))
    sft["validation"].append(sft_row("b2", post=" "))
    sft["test"].append(sft_row("a2", summary="a cat"))  # a2 is a train post
    return sft, preference


def test_a_problem_of_every_row_of_a_split_is_named_once_as_the_sources():
    """A column missing from a whole split (another schema) is one problem of the source, not thousands of bad rows
    to drop: --drop_bad_rows would only empty the split."""
    sft, preference = smoke_sources()
    for row in preference["train"]:
        row["info"]["title"] = None
    sft = datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split, rows in sft.items()})
    preference = {split: datasets.Dataset.from_list(rows) for split, rows in preference.items()}
    validation, cnndm = pre.split_off_cnndm(preference["validation"], pre.CNNDM_BATCHES)
    preference = datasets.DatasetDict(train=preference["train"], validation=validation, validation_cnndm=cnndm)
    args = pre.Args(sft_dataset="sft_src", preference_dataset="pref_src", output_dir="out", drop_bad_rows=True)
    with pytest.raises(pre.DataError) as error:
        pre.check_rows(args, sft, preference)
    assert str(error.value) == (f"pref_src: every row of split 'train' ({len(preference['train'])} rows): expected "
                                "info.title to be a string, got None; the source lacks that column or holds another "
                                "schema: fix the source")


def test_check_rows_lists_every_bad_row_or_drops_them_all():
    sft, preference = bad_sources()
    sft = datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split, rows in sft.items()})
    preference = {split: datasets.Dataset.from_list(rows) for split, rows in preference.items()}
    validation, cnndm = pre.split_off_cnndm(preference["validation"], pre.CNNDM_BATCHES)
    preference = datasets.DatasetDict(train=preference["train"], validation=validation, validation_cnndm=cnndm)
    args = pre.Args(sft_dataset="sft_src", preference_dataset="pref_src", output_dir="out")
    with pytest.raises(pre.DataError) as error:
        pre.check_rows(args, sft, preference)
    message = str(error.value)
    assert message.startswith("3 row(s) this script cannot use:")
    assert "split 'validation', row 1 (id 'b2'): expected a non-empty post" in message
    assert ("split 'train', row 2 (id 'p3'): expected summaries[0].text to be a string starting with a space"
            in message)
    assert "sft_src: 1 duplicate post id(s): id 'a2' in split 'train' row 1 and split 'test' row 1" in message
    assert "pass --drop_bad_rows to leave them out" in message and "out/dropped_rows.json" in message

    args.drop_bad_rows = True
    kept_sft, kept_preference, dropped = pre.check_rows(args, sft, preference)
    assert [(row["source"], row["split"], row["row"], row["id"]) for row in dropped] == [
        ("sft_src", "validation", 1, "b2"), ("pref_src", "train", 2, "p3"), ("sft_src", "test", 1, "a2")]
    assert dropped[2]["problem"] == "post id 'a2' is already in split 'train' row 1"
    assert {split: dataset["id"][:] for split, dataset in kept_sft.items()} == {
        "train": ["a1", "a2", "a3"], "validation": ["b1"], "test": ["c1"]}
    assert [row["id"] for row in kept_preference["train"]["info"]] == ["p1", "p2"]
    assert kept_preference["validation"].num_rows == 1 and kept_preference["validation_cnndm"].num_rows == 2

    # a bad first copy of an id goes anyway: its good repeat is kept, and a bad repeat is listed once, as bad; an
    # SFT repeat at train row 1 leaves the preference data's train row 1 alone (the two datasets share split names)
    twice = datasets.DatasetDict(
        train=datasets.Dataset.from_list([sft_row("a1"), sft_row("a1"), sft_row("x", post=" ")]),
        validation=datasets.Dataset.from_list([sft_row("b1"), sft_row("y")]),
        test=datasets.Dataset.from_list([sft_row("x"), sft_row("y", post=" ")]))
    kept_sft, kept_preference, dropped = pre.check_rows(args, twice, preference)
    assert [(row["split"], row["row"], row["problem"]) for row in dropped if row["source"] == "sft_src"] == [
        ("train", 2, "expected a non-empty post, got ' '"), ("test", 1, "expected a non-empty post, got ' '"),
        ("train", 1, "post id 'a1' is already in split 'train' row 0")]
    assert {split: dataset["id"][:] for split, dataset in kept_sft.items()} == {
        "train": ["a1"], "validation": ["b1", "y"], "test": ["x"]}
    assert [row["id"] for row in kept_preference["train"]["info"]] == ["p1", "p2"]
    args.drop_bad_rows = False
    with pytest.raises(pre.DataError) as error:
        pre.check_rows(args, twice, preference)
    assert str(error.value).startswith("4 row(s)")  # 2 bad SFT rows, p3, the repeat of a1
    assert "1 duplicate post id(s): id 'a1' in split 'train' row 0 and split 'train' row 1;" in str(error.value)
    args.drop_bad_rows = True

    # dropping must not empty a split the later stages read, in either dataset
    good_validation = sft["validation"]
    sft["validation"] = datasets.Dataset.from_list([sft_row("b2", post=" ")])
    with pytest.raises(pre.DataError, match=r"sft_src without the dropped rows: split\(s\) \['validation'\] have no rows"):
        pre.check_rows(args, sft, preference)
    sft["validation"] = good_validation
    bad_validation = preference["validation"].map(lambda row: {"summaries": [{**row["summaries"][0], "text": "x"},
                                                                            row["summaries"][1]]})
    preference = datasets.DatasetDict({**preference, "validation": bad_validation})
    with pytest.raises(pre.DataError, match=r"pref_src without the dropped rows: split\(s\) \['validation'\] have no rows"):
        pre.check_rows(args, sft, preference)


def test_dropping_every_cnndm_row_says_that_split_is_empty_now(capsys):
    """validation_cnndm may be empty (a source without news rows), so dropping all of it is allowed, and said."""
    sft, preference = smoke_sources()
    preference["validation"][1]["summaries"][0]["text"] = " "  # the two CNN/DM rows: an empty summary,
    preference["validation"][2]["info"]["article"] = "\n"  # an empty article (one problem in all would be the source's)
    sft = datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split, rows in sft.items()})
    validation, cnndm = pre.split_off_cnndm(datasets.Dataset.from_list(preference["validation"]), pre.CNNDM_BATCHES)
    preference = datasets.DatasetDict(train=datasets.Dataset.from_list(preference["train"]), validation=validation,
                                      validation_cnndm=cnndm)
    args = pre.Args(sft_dataset="sft_src", preference_dataset="pref_src", output_dir="out", drop_bad_rows=True)
    kept_sft, kept_preference, dropped = pre.check_rows(args, sft, preference)
    assert kept_preference["validation_cnndm"].num_rows == 0 and len(dropped) == 2
    assert ("--drop_bad_rows: left out 2 row(s) (preference/validation_cnndm 2 of 2 (all: the split is empty now))"
            in capsys.readouterr().out)


def test_drop_bad_rows_end_to_end(tmp_path, tok):
    """The script fails on the three bad rows, naming them and the flag; with the flag it leaves them out, lists them
    in dropped_rows.json and tokenizes the rest as a clean source would be."""
    sft, preference = bad_sources()
    clean_sft, clean_preference = smoke_sources()
    flags = reference_flags(tok, clean_sft, clean_preference)[0]
    command = write_world(tmp_path, sft, preference) + flag_args(flags)
    out = tmp_path / "out"
    result = run(command + ["--output_dir", str(out)], tmp_path)
    assert result.returncode == 1 and "3 row(s) this script cannot use" in result.stderr, result.stderr[-2000:]
    assert "--drop_bad_rows" in result.stderr and not out.exists()  # a failed first run writes nothing
    result = run(command + ["--output_dir", str(out), "--drop_bad_rows"], tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert ("--drop_bad_rows: left out 3 row(s) (sft/validation 1 of 2, sft/test 1 of 2, preference/train 1 of 3)"
            in result.stdout), result.stdout
    dropped = json.loads((out / "dropped_rows.json").read_text())
    assert [(row["split"], row["row"], row["id"]) for row in dropped] == [
        ("validation", 1, "b2"), ("train", 2, "p3"), ("test", 1, "a2")]
    clean = tmp_path / "clean"
    clean.mkdir()
    result = run(write_world(clean, clean_sft, clean_preference) + flag_args(flags)
                 + ["--output_dir", str(clean / "out")], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("sft", "preference"):
        ours, theirs = datasets.load_from_disk(str(out / name)), datasets.load_from_disk(str(clean / "out" / name))
        assert ours.num_rows == theirs.num_rows
        assert all(ours[split][:] == theirs[split][:] for split in ours)

def test_empty_split_is_an_error_naming_it():
    rows = datasets.Dataset.from_list([sft_row()])
    dataset_dict = datasets.DatasetDict(train=rows, validation=rows.select([]), test=rows)
    with pytest.raises(pre.DataError, match=r"src: split\(s\) \['validation'\] have no rows"):
        pre.require_splits(dataset_dict, pre.SFT_SPLITS, "src")


# ---- files ----

@pytest.mark.parametrize("name, content, expected", [
    ("train.jsonl", b'{"a": 1}\n{"a": 2}\n{"a": \n{"a": 4}\n', "train.jsonl, line 3: invalid JSON"),
    ("train.jsonl", b'{"a": 1}\n\n{"a": "caf\xe9"}\n', "train.jsonl, line 3: byte 0xe9 is not UTF-8"),
    ("train.json", b"", "train.json: the file is empty"),
    ("train.json", b"\n  \n", "train.json: the file holds only whitespace"),
    ("train.json", b'[\n  {"a": 1},\n  {"a": 2}\n  {"a": 3}\n]\n', "train.json, line 4: invalid JSON"),
    ("train.parquet", b"", "train.parquet: the file is empty"),
    ("train.jsonl", b'{"a": 1}\n{"a": "\xe2\x80\xa8 text"}\n', None),  # valid (a U+2028 inside a string)
    ("train.json", b'[\n  {"a": 1},\n  {"a": 2}\n]\n', None),  # one document over several lines
])
def test_data_file_problem_names_file_and_line(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content)
    problem = pre.data_file_problem(str(path))
    assert problem is None if expected is None else (problem.startswith(str(tmp_path)) and expected in problem)


def test_load_source_names_the_bad_file_and_line(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps(sft_row("a")) + "\n")
    (folder / "test.jsonl").write_text(json.dumps(sft_row("b")) + "\n" + json.dumps(sft_row("c"))[:-1] + "\n")
    with pytest.raises(pre.DataError, match=r"test\.jsonl, line 2: invalid JSON"):
        pre.load_source(str(folder), None, str(tmp_path / "scratch"))
    with pytest.raises(pre.DataError, match=r"cannot load .*nowhere"):  # neither a folder nor a Hub id offline
        pre.load_source(str(tmp_path / "nowhere"), None, str(tmp_path / "scratch"))


def test_a_parquet_file_with_other_columns_is_named_with_them(tmp_path):
    """datasets' own error for files of one dataset with other columns ("An error occurred while generating the
    dataset") names neither the file nor the column."""
    import pyarrow
    import pyarrow.parquet

    world = Path(pre.__file__).parent / "assets" / "tiny_world" / "summarize_from_feedback"
    folder = tmp_path / "src"
    shutil.copytree(world, folder)
    train = folder / "comparisons" / "train.parquet"
    pyarrow.parquet.write_table(pyarrow.parquet.read_table(train).drop_columns(["choice"]), train)
    with pytest.raises(pre.DataError) as error:
        pre.load_source(str(folder), "comparisons", str(tmp_path / "scratch"))
    assert str(error.value) == (f"{train} and {folder / 'comparisons' / 'validation.parquet'} hold different columns: "
                                "only the first has [], only the second ['choice']; every file of a dataset must hold "
                                "the same columns")
    assert pre.columns_problem([str(world / "comparisons" / f"{split}.parquet") for split in ("train", "validation")]) \
        is None


def test_a_hub_loading_script_is_read_from_the_hubs_parquet_export(tmp_path, monkeypatch):
    """openai/summarize_from_feedback is a loading script on the Hub, which datasets 5 refuses to run: the default
    preference source is then read from the Hub's parquet export of it (its config's folder on refs/convert/parquet).
    Any other failure is still a DataError naming the flags."""
    calls = []

    def load_dataset(path, name=None, **options):
        calls.append((path, name, options))
        if options.get("revision") == "refs/convert/parquet":
            return "the export"
        raise RuntimeError(f"Dataset scripts are no longer supported, but found {path.split('/')[-1]}.py")

    monkeypatch.setattr(pre.datasets, "load_dataset", load_dataset)
    assert pre.load_source("openai/summarize_from_feedback", "comparisons", str(tmp_path)) == "the export"
    assert calls[-1] == ("openai/summarize_from_feedback", None,
                         {"revision": "refs/convert/parquet", "data_dir": "comparisons"})
    monkeypatch.setattr(pre.datasets, "load_dataset", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(pre.DataError, match=r"cannot load openai/summarize_from_feedback \(config comparisons\): "
                                            r"RuntimeError: boom; check --sft_dataset"):
        pre.load_source("openai/summarize_from_feedback", "comparisons", str(tmp_path))


def test_a_download_of_the_parquet_export_loads_its_configs_folder(tmp_path):
    """A local copy of the Hub's export (a folder per config, a folder per split, no dataset card) read with
    --preference_config comparisons gives that config's splits and rows, not the other config's."""
    world = Path(pre.__file__).parent / "assets" / "tiny_world"
    export = tmp_path / "export"
    for folder, source in (("comparisons/train", "summarize_from_feedback/comparisons/train.parquet"),
                           ("comparisons/validation", "summarize_from_feedback/comparisons/validation.parquet"),
                           ("axis/validation", "tldr_3_filtered/data/validation.parquet")):
        (export / folder).mkdir(parents=True)
        shutil.copy(world / source, export / folder / "0000.parquet")
    loaded = pre.load_source(str(export), "comparisons", str(tmp_path / "scratch"))
    original = datasets.load_dataset(str(world / "summarize_from_feedback"), "comparisons",
                                     cache_dir=str(tmp_path / "scratch2"))
    assert sorted(loaded) == ["train", "validation"]
    for split in loaded:
        assert loaded[split].features == original[split].features
        assert loaded[split][:3] == original[split][:3] and loaded[split].num_rows == original[split].num_rows


def test_a_local_loading_script_is_refused_with_the_way_out(tmp_path):
    folder = tmp_path / "summarize_from_feedback"
    folder.mkdir()
    (folder / "summarize_from_feedback.py").write_text("import datasets\n")
    with pytest.raises(pre.DataError, match=r"a loading script: give a folder of its parquet files instead"):
        pre.load_source(str(folder), "comparisons", str(tmp_path / "scratch"))

# ---- end to end: a preference set without CNN/DM rows works ----

def test_preference_data_without_cnndm_rows_works_and_says_so(tmp_path, tok):
    sft, preference = smoke_sources()
    preference["validation"] = [row for row in preference["validation"] if row["batch"] not in pre.CNNDM_BATCHES]
    command = write_world(tmp_path, sft, preference) + ["--output_dir", str(tmp_path / "out")]
    result = run(command + flag_args(reference_flags(tok, sft, preference)[0]), tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "no CNN/DM comparisons" in result.stdout and "validation_cnndm is empty" in result.stdout
    saved = datasets.load_from_disk(str(tmp_path / "out" / "preference"))
    assert saved.num_rows["validation_cnndm"] == 0  # the split is there, with every column, for later stages
    assert saved["validation_cnndm"].features == saved["validation"].features
    assert json.loads((tmp_path / "out" / "policy_pairs.json").read_text())["validation_cnndm"] == {}


# ---- end to end: a bad source keeps the old outputs ----

def write_jsonl_sources(folder: Path, sft: dict) -> None:
    """The SFT splits as JSON-lines files (what `datasets` infers from train.jsonl, ...), the test split broken."""
    folder.mkdir()
    for split, rows in sft.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "test.jsonl").write_text((folder / "test.jsonl").read_text() + '{"id": "c2", "post": \n')


@pytest.mark.parametrize("fault", ["empty summary", "duplicate id", "invalid JSON", "invalid JSON, first run"])
def test_bad_source_fails_and_keeps_the_old_outputs(tmp_path, tok, old_output, fault):
    sft, preference = smoke_sources()
    flags = reference_flags(tok, sft, preference)[0]
    out = tmp_path / "out"
    if fault != "invalid JSON, first run":
        shutil.copytree(old_output, out)
    before = fingerprint(out) if out.exists() else None
    if fault == "empty summary":
        sft["validation"].append(sft_row("b2", summary=" "))
    elif fault == "duplicate id":
        sft["test"].append(sft_row("a2", summary="a cat"))  # a2 is a train post
    command = write_world(tmp_path, sft, preference) + ["--output_dir", str(out)]
    if fault.startswith("invalid JSON"):
        write_jsonl_sources(tmp_path / "sft_json", sft)
        command[command.index("--sft_dataset") + 1] = str(tmp_path / "sft_json")
    result = run(command + flag_args(flags), tmp_path)
    assert result.returncode == 1 and "DataError" in result.stderr, result.stderr[-2000:]
    expected = {"empty summary": "split 'validation', row 1 (id 'b2'): expected a non-empty summary",
                "duplicate id": "id 'a2' in split 'train' row 1 and split 'test' row 1",
                "invalid JSON": f"{tmp_path / 'sft_json' / 'test.jsonl'}, line 2: invalid JSON",
                "invalid JSON, first run": "test.jsonl, line 2: invalid JSON"}[fault]
    assert expected in result.stderr
    if before is None:
        assert not out.exists()  # a failed first run leaves no folder behind
    else:
        assert fingerprint(out) == before  # nothing of the earlier run is lost, nothing is left beside it
        assert datasets.load_from_disk(str(out / "sft")).num_rows == {"train": 3, "validation": 1, "test": 1}

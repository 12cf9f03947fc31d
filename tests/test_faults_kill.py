"""Kills during a save (issue 16): checkpoints and the output folder are written beside their place
and renamed in whole, so a SIGKILL at any moment leaves the previous checkpoint and the previous
model loadable, the run resumes to the very weights of an uninterrupted one, and a normal run leaves
no scratch behind. A folder with checkpoints is never restarted at update 0 without --resume.

One chain of real sft.py processes in one output folder (the tiny configuration of test_sft.py, a
checkpoint after every update): an uninterrupted run; the same command again (refused: a finished run
is never trained over) and with --resume (nothing to do); the folder deleted, the same command killed
while it writes a checkpoint; a rerun without --resume (refused); --resume killed while it writes the
final model; --resume to the end. The swap's in-between states are built by hand and tidied in process.
"""

import json
import os
import queue
import shutil
import signal
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import sft
from conftest import REPO, WORLD, one_process, run_python
from test_sft import TINY_RUN, run_sft, weights


def run_until(cwd, flags, condition, timeout=300):
    """Start sft.py with `flags` in `cwd` (run_python, in a thread); SIGKILL it as soon as `condition()` holds. True if
    it was killed. Its output goes to cwd/killed.log."""
    pids, results = queue.Queue(), []
    start = threading.Thread(target=lambda: results.append(run_python(
        [sys.executable, str(REPO / "sft.py"), *map(str, flags)], cwd=cwd, timeout=timeout, started=pids.put)))
    start.start()
    pid, killed = pids.get(timeout=timeout), False
    while start.is_alive():
        if condition():
            os.kill(pid, signal.SIGKILL)  # the sft.py process itself (a fork of the test's fork server)
            killed = True
            break
        time.sleep(0.0005)
    start.join()
    (cwd / "killed.log").write_text(results[0].stdout + results[0].stderr if results else "")
    return killed


def checkpoint_loads(out):
    """The latest complete checkpoint of `out` loads into the model and holds finite weights; its update."""
    update, path = sft.latest_checkpoint(str(out / "checkpoints"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    AutoModelForCausalLM.from_pretrained(WORLD / "pythia-tiny").load_state_dict(tensors, strict=True)
    assert all(torch.isfinite(tensor).all() for tensor in tensors.values())
    assert load_file(os.path.join(path, "optimizer.safetensors"))  # the optimizer state is there and reads
    assert json.loads(open(os.path.join(path, "trainer_state.json")).read())["update"] == update
    return update


def previous_model_intact(out, reference):
    """The finished model of the first run is still in `out`, whole: it loads and has its weights."""
    AutoModelForCausalLM.from_pretrained(out)
    assert json.loads((out / "eval_metrics.json").read_text())["validation"]["loss"] > 0
    assert all(torch.equal(weights(out)[key], reference[key]) for key in reference)


STAND_IN_HUB = """import json, os
import huggingface_hub
import huggingface_hub.constants


class HfApi:  # records each call as [method, keyword arguments] in $HUB_CALLS
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        def call(*args, **kwargs):
            with open(os.environ["HUB_CALLS"], "a") as file:
                file.write(json.dumps([name, {**dict(zip(("repo_id",), args)), **kwargs}]) + "\\n")
            return {"name": "me"}
        return call


huggingface_hub.HfApi = HfApi
huggingface_hub.constants.HF_HUB_OFFLINE = False  # the stand-in Hub is reachable (the tests' shell is offline)
"""


def push_with_a_stand_in_hub(tmp_path, flags: list, again: bool = True) -> list:
    """Run sft.py FLAGS (one process) with huggingface_hub.HfApi replaced by a recorder (a sitecustomize.py on
    PYTHONPATH, which run_python's fork server for this environment imports at its start, as a fresh interpreter
    would); the calls it made, as [[method, keyword arguments]]. `again`: a finished run, pushed again with nothing
    trained."""
    (tmp_path / "hub").mkdir(exist_ok=True)
    (tmp_path / "hub" / "sitecustomize.py").write_text(STAND_IN_HUB)
    calls = tmp_path / "hub" / "calls.jsonl"
    calls.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'hub'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HUB_CALLS": str(calls), "HF_TOKEN": "hf_stand_in"}  # a token: the stand-in Hub checks none
    result = run_python([sys.executable, str(REPO / "sft.py"), *flags], cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    pushed_again = "nothing to train" in result.stdout and "pushing it again (--push_to_hub)" in result.stdout
    assert pushed_again == again, result.stdout[-2000:]
    return [json.loads(line) for line in calls.read_text().splitlines()]


CTRL_C_AT_CALL = """import os, runpy, signal, sys
name, count = sys.argv[1], int(sys.argv[2])
calls = 0


def profile(frame, event, arg):  # Ctrl-C (SIGINT to this process) at the start of the count-th call of `name`
    global calls
    if event == "call" and frame.f_code.co_name == name:
        calls += 1
        if calls == count:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGINT)


signal.signal(signal.SIGINT, signal.default_int_handler)  # as in an interactive shell's python
sys.argv = sys.argv[3:]
sys.setprofile(profile)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_says_how_to_continue_and_resume_finishes_the_run(tiny_tldr, tmp_path):
    """Ctrl-C in a training stage (all four share their __main__ block: test_conventions.py) prints what to do next,
    not a traceback of wherever it landed, and exits 130 as the shell does; the checkpoint before it stays whole, and
    --resume ends the run with the weights of a run never stopped."""
    (tmp_path / "ctrl_c.py").write_text(CTRL_C_AT_CALL)
    run = [*map(str, TINY_RUN), "--query_dataset", str(tiny_tldr / "sft"), "--num_eval_samples", "0"]
    flags = [*run, "--output_dir", str(tmp_path / "out"), "--save_every", "1"]
    stopped = run_python([sys.executable, str(tmp_path / "ctrl_c.py"), "save_checkpoint", "2", str(REPO / "sft.py"),
                          *flags], cwd=tmp_path, timeout=300)
    assert stopped.returncode == 130, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    assert "interrupted: each --save_every checkpoint is written whole" in stopped.stderr
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr, stopped.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["update_1"]
    resumed = run_sft(tmp_path, *flags, "--resume")
    assert "resumed from" in resumed.stdout and "update_1" in resumed.stdout
    run_sft(tmp_path, *run, "--output_dir", tmp_path / "plain")  # never stopped
    ours, plain = weights(tmp_path / "out"), weights(tmp_path / "plain")
    assert ours.keys() == plain.keys() and all(torch.equal(tensor, plain[name]) for name, tensor in ours.items())


def test_kills_during_saves_lose_nothing_and_the_run_resumes_bit_identical(tiny_tldr, tmp_path):
    out = tmp_path / "out"
    flags = [*TINY_RUN, "--query_dataset", tiny_tldr / "sft", "--output_dir", out, "--save_every", "1"]
    # uninterrupted: its model is the reference, and the "previous model" below; pushed at its end to a stand-in
    # Hub (sitecustomize.py records the calls), on its run's own branch
    calls = push_with_a_stand_in_hub(tmp_path, [str(flag) for flag in flags] + ["--push_to_hub"], again=False)
    reference = weights(out)
    run_name = json.loads((out / "args.json").read_text())["run_name"]
    # named after the base model's own name, not its path (an absolute one here): one repository for every seed
    assert os.path.isabs(flags[flags.index("--base_model") + 1])
    repo = "me/pythia-tiny__sft__tldr"
    assert ["upload_folder", {"folder_path": str(out), "repo_id": repo, "revision": run_name}] in calls, calls
    scratch = [tmp_path / ".out.partial", tmp_path / ".out.new", tmp_path / ".out.old"]
    assert not (out / "checkpoints").exists() and not any(path.exists() for path in scratch)

    # A finished run is never trained over: the same command is refused, and with --resume (a requeued job) it
    # has nothing to do (exit 0). Either way the model and its results stay as they were.
    finished_files = {name: (out / name).read_bytes() for name in os.listdir(out) if (out / name).is_file()}
    result = run_sft(tmp_path, *flags, check=False)
    assert result.returncode == 1 and "holds the finished run of these flags" in result.stderr, result.stderr[-2000:]
    assert "Delete the folder, or choose another, to train it again" in result.stderr
    result = run_sft(tmp_path, *flags, "--resume")
    assert f"nothing to do: {out} holds the finished run of these flags" in result.stdout
    assert {name: (out / name).read_bytes() for name in os.listdir(out) if (out / name).is_file()} == finished_files
    # With --push_to_hub (its push at the end may have failed) it is pushed again, on its run's branch, nothing
    # retrained: a stand-in Hub (sitecustomize.py) records the calls.
    calls = push_with_a_stand_in_hub(tmp_path, [str(flag) for flag in flags] + ["--resume", "--push_to_hub"])
    assert ["create_branch", {"repo_id": repo, "branch": run_name, "exist_ok": True}] in calls
    assert ["upload_folder", {"folder_path": str(out), "repo_id": repo, "revision": run_name}] in calls
    assert {name: (out / name).read_bytes() for name in os.listdir(out) if (out / name).is_file()} == finished_files
    assert not (out / "checkpoints").exists() and not any(path.exists() for path in scratch)
    previous_model_intact(out, reference)

    # Deleted, as the message says, the same command again, killed while it writes a checkpoint: a later
    # one, so that an earlier complete one is there (or, should this busy machine not schedule the poll
    # during that save, just after it).
    shutil.rmtree(out)

    def saving_a_checkpoint():
        names = os.listdir(out / "checkpoints") if (out / "checkpoints").is_dir() else []
        complete = [int(name.split("_")[1]) for name in names if "." not in name]
        return bool(complete) and (any(name.endswith(".partial") for name in names) or max(complete) >= 2)

    assert run_until(tmp_path, flags, saving_a_checkpoint), (tmp_path / "killed.log").read_text()[-3000:]
    update = checkpoint_loads(out)
    assert not (out / "model.safetensors").exists()  # nothing published yet

    # Without --resume the checkpoints would be dropped for a start at update 0: refused.
    result = run_sft(tmp_path, *flags, check=False)
    assert result.returncode != 0 and f"holds an unfinished run, checkpointed at update {update}" in result.stderr
    assert "pass --resume" in result.stderr and checkpoint_loads(out) == update

    # --resume, killed while it writes the final results and model beside the output folder.
    def saving_the_model():
        return (tmp_path / ".out.partial").exists()

    assert run_until(tmp_path, [*flags, "--resume"], saving_the_model), (tmp_path / "killed.log").read_text()[-3000:]
    # The signal may land a little later, even within the swap (between its two renames there is no
    # out/, but .out.old and .out.new are both whole); the next start finishes the swap first.
    if not out.exists():
        assert (tmp_path / ".out.old" / "args.json").exists() and (tmp_path / ".out.new" / "model.safetensors").exists()
    sft.tidy_output_dir(str(out))
    unfinished = (out / "checkpoints").exists()  # False only if the kill came after the new folder was complete
    if unfinished:  # the old folder, whole: its checkpoints, no model
        assert checkpoint_loads(out) >= update and not (out / "model.safetensors").exists()
    else:  # the new one, whole
        previous_model_intact(out, reference)

    # --resume to the end: bit for bit the uninterrupted run's model, and no scratch anywhere.
    result = run_sft(tmp_path, *flags, "--resume")
    assert "resumed from" in result.stdout or not unfinished
    assert all(torch.equal(weights(out)[key], reference[key]) for key in reference)
    assert not (out / "checkpoints").exists() and not any(path.exists() for path in scratch)
    assert not [name for name in os.listdir(out) if name.endswith(".partial")]


def folder_with(path, files):
    """Make folder `path` holding `files` ({name: text})."""
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)


@pytest.mark.parametrize("moment", ["new complete", "old retired", "new in place"])
def test_a_swap_cut_short_is_finished_at_the_next_start(moment, tmp_path):
    """publish_output renames staging -> .out.new, out -> .out.old, .out.new -> out: a kill between
    any two leaves whole folders, and tidy_output_dir (every start) completes the swap."""
    out = tmp_path / "out"
    new = {"model.safetensors": "new", "args.json": "{}"}
    if moment != "new in place":
        folder_with(tmp_path / ".out.new", new)
    if moment == "new complete":  # killed before out was renamed
        folder_with(out, {"args.json": "{}", "model.safetensors": "old"})
        (out / "checkpoints").mkdir()
    if moment in ("old retired", "new in place"):  # killed between the renames, or before .old was removed
        folder_with(tmp_path / ".out.old", {"args.json": "{}"})
    if moment == "new in place":
        folder_with(out, new)
    (out.parent / ".out.partial").mkdir()  # a staging folder left by an earlier kill
    sft.tidy_output_dir(str(out))
    assert (out / "model.safetensors").read_text() == "new" and not (out / "checkpoints").exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_tidy_drops_partial_files_so_a_failed_start_still_counts_as_one(tmp_path):
    """A kill while args.json was written leaves args.json.partial; the next start removes it (and a
    partial checkpoint), so the folder is again 'args.json only': a failed start, free to reuse."""
    out = tmp_path / "out"
    folder_with(out, {"args.json": json.dumps({"seed": 1}), "args.json.partial": "{"})
    (out / "checkpoints" / "update_2.partial").mkdir(parents=True)
    sft.tidy_output_dir(str(out))
    assert sorted(os.listdir(out)) == ["args.json", "checkpoints"]
    assert sft.latest_checkpoint(str(out / "checkpoints")) is None  # a .partial never counts
    (out / "checkpoints").rmdir()
    assert sft.output_dir_problem(str(out), {"seed": 2, "resume": False}, ("resume",)) is None


def test_latest_checkpoint_is_the_highest_complete_update(tmp_path):
    """A kill after a checkpoint's rename but before the older one is dropped leaves two complete checkpoints:
    --resume takes the later one, by number (update_10 after update_9); a folder without trainer_state.json (the last
    file save_checkpoint writes) or a .partial one is not complete."""
    for name, files in (("update_9", {"trainer_state.json": "{}"}), ("update_10", {"trainer_state.json": "{}"}),
                        ("update_12", {"model.safetensors": ""}), ("update_11.partial", {"trainer_state.json": "{}"})):
        folder_with(tmp_path / name, files)
    assert sft.latest_checkpoint(str(tmp_path)) == (10, str(tmp_path / "update_10"))


def test_a_checkpoint_cut_short_at_its_rename_keeps_the_previous_one(tmp_path, monkeypatch):
    """save_checkpoint drops the older checkpoints only once the new one is complete: killed at the rename that
    completes update_2, update_1 is still there, whole, and is what --resume loads."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    folder = tmp_path / "checkpoints"
    sft.save_checkpoint(one_process(), str(folder), 1, "run", model, optimizer, None)
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer.step()

    def killed(source, target):
        raise KeyboardInterrupt  # as a SIGKILL there would leave the files

    monkeypatch.setattr(sft.os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        sft.save_checkpoint(one_process(), str(folder), 2, "run", model, optimizer, None)
    monkeypatch.undo()
    assert sorted(os.listdir(folder)) == ["update_1", "update_2.partial"]
    assert sft.latest_checkpoint(str(folder)) == (1, str(folder / "update_1"))
    sft.load_checkpoint(one_process(), str(folder / "update_1"), model, optimizer, None)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in saved.items())


def test_publishing_swaps_in_the_new_results_beside_the_output_folder(tmp_path, monkeypatch):
    """A rerun over a finished run publishes its own model and metrics, never the old run's; args.json comes along,
    checkpoints do not. --output_dir written with a trailing slash (as shell completion writes it) changes nothing:
    the scratch folders are siblings of the output folder, never inside it."""
    monkeypatch.chdir(tmp_path)
    folder_with(tmp_path / "out", {"args.json": "{}", "model.safetensors": "old", "eval_metrics.json": "old"})
    (tmp_path / "out" / "checkpoints" / "update_2").mkdir(parents=True)
    for written in ("out", "out/", "./out", str(tmp_path / "out") + "/"):
        assert os.path.abspath(sft.scratch_path(written, "new")) == str(tmp_path / ".out.new"), written
    staging = sft.staging_folder("out/")
    assert os.path.abspath(staging) == str(tmp_path / ".out.partial")
    for name in ("model.safetensors", "eval_metrics.json"):
        (tmp_path / ".out.partial" / name).write_text("new")
    sft.publish_output(staging, "out/")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert {name: (tmp_path / "out" / name).read_text() for name in os.listdir(tmp_path / "out")} == {
        "args.json": "{}", "model.safetensors": "new", "eval_metrics.json": "new"}


def test_a_checkpoint_is_completed_only_after_every_rank_has_written_its_part(tmp_path, monkeypatch):
    """Every rank writes its part of update_k.partial (its RNG states; under DeepSpeed its optimizer shard); rank 0
    completes it (trainer_state.json, the rename) only after a barrier that follows those writes: a rank still
    writing never finds its folder renamed away, and a complete checkpoint holds every rank's part."""
    events = []
    accelerator = one_process()
    accelerator.wait_for_everyone = lambda: events.append("barrier")
    monkeypatch.setattr(sft, "save_training_state", lambda *args: events.append("part written"))
    rename = os.rename
    monkeypatch.setattr(sft.os, "rename", lambda source, target: events.append("renamed") or rename(source, target))
    sft.save_checkpoint(accelerator, str(tmp_path), 1, "run", None, None, None)
    assert "barrier" in events[events.index("part written"):events.index("renamed")], events
    assert sft.latest_checkpoint(str(tmp_path)) == (1, str(tmp_path / "update_1"))

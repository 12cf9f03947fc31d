"""A preprocess_tldr.py run killed (SIGKILL) at any moment leaves every output old or new, never half
written, and no scratch folder: real subprocesses are killed at chosen calls and after chosen delays."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
from conftest import REPO, WORLD, run_python, tiny_lengths

import preprocess_tldr as pre
from test_preprocess import flag_args, make_tokenizer, reference_flags, smoke_sources, write_world

OUTPUTS = ["args.json", "dropped_rows.json", "policy_pairs.json", "preference", "sft", "visuals"]
# as the script moves them
INSTALL_ORDER = ["sft", "preference", "visuals", "policy_pairs.json", "dropped_rows.json", "args.json"]
KILLER = str(REPO / "tests" / "kill_at_call.py")  # KILLER NAME N SCRIPT ARGS: SIGKILLed at the N-th call of NAME


def fingerprint(folder: Path) -> dict:
    """{relative path: sha256} of every file under `folder` (args.json without its output_dir, which differs)."""
    def content(path: Path) -> bytes:
        if path.name != "args.json":
            return path.read_bytes()
        return json.dumps({**json.loads(path.read_text()), "output_dir": None}, sort_keys=True).encode()
    return {str(path.relative_to(folder)): hashlib.sha256(content(path)).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def scratch_left(folder: Path) -> list:
    return [name for name in os.listdir(folder) if name.startswith(pre.SCRATCH_PREFIX)] if folder.exists() else []


def wait_for_clean_up(folder: Path) -> None:
    """The watcher cleans up once the killed run is gone; give it a few seconds on a busy machine."""
    deadline = time.time() + 30
    while scratch_left(folder) and time.time() < deadline:
        time.sleep(0.1)
    assert not scratch_left(folder), scratch_left(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Old and new sources (new: other summaries), their commands, and the old and new outputs."""
    tok = make_tokenizer()
    pre.add_pad_token(tok)
    folder = tmp_path_factory.mktemp("kill")
    commands = {}
    for version in ("old", "new"):
        sft, preference = smoke_sources()
        if version == "new":
            sft["train"][0]["summary"] = "the cat sat and sat"
            preference["train"][0]["summaries"][0]["text"] = " the cat sat and sat"
        (folder / version).mkdir()
        commands[version] = (write_world(folder / version, sft, preference) + ["--num_proc", "1"]
                             + flag_args(reference_flags(tok, sft, preference)[0]))
    outputs = {}
    for version, command in commands.items():
        outputs[version] = folder / f"{version}_out"
        result = run_python(command + ["--output_dir", str(outputs[version])], timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return commands, {version: fingerprint(out) for version, out in outputs.items()}, outputs


def versions(out: Path, fingerprints: dict) -> dict:
    """{output: the versions ("old", "new") it equals, file for file} after checking that each output is one
    of them (policy_pairs.json and dropped_rows.json are the same in both), and that the datasets load."""
    found = {}
    for name in OUTPUTS:
        mine = {path: digest for path, digest in fingerprint(out).items() if path.split("/")[0] == name}
        found[name] = {version for version, prints in fingerprints.items()
                       if mine == {path: digest for path, digest in prints.items() if path.split("/")[0] == name}}
        assert found[name], f"{name} is neither the old nor the new output"
    for name in ("sft", "preference"):
        datasets.load_from_disk(str(out / name))
    json.loads((out / "args.json").read_text())
    return found


@pytest.mark.parametrize("function, count, moved", [  # moved: outputs already new, in the order moved
    ("load_source", 2, 0),  # the SFT source loaded into the scratch cache, the preference one not yet
    ("save_to_disk", 3, 0),  # mid-save: the SFT train split written (into the scratch), validation not
    ("install_output", 2, 1),  # between moving sft and preference into place
    ("install_output", 6, 5),  # everything moved into place but args.json
])
def test_kill_at_a_chosen_call_leaves_old_or_new_outputs(tmp_path, runs, function, count, moved):
    commands, fingerprints, outputs = runs
    out = tmp_path / "out"
    shutil.copytree(outputs["old"], out)
    command = [sys.executable, KILLER, function, str(count)] + commands["new"][1:] + ["--output_dir", str(out)]
    result = run_python(command, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stdout[-2000:] + result.stderr[-2000:]
    wait_for_clean_up(out)
    assert sorted(os.listdir(out)) == OUTPUTS  # no scratch, no half-moved folder
    found = versions(out, fingerprints)
    assert all(("new" if i < moved else "old") in found[name] for i, name in enumerate(INSTALL_ORDER))
    if moved == 0:
        assert fingerprint(out) == fingerprints["old"]  # nothing of the earlier run is lost
    else:
        assert found["sft"] == {"new"} and found["args.json"] == {"old"}
    if moved == 1:  # and the next run finds nothing in its way
        result = run_python(commands["new"] + ["--output_dir", str(out)], timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert fingerprint(out) == fingerprints["new"] and not scratch_left(out)


@pytest.mark.parametrize("delay", [0.3, 1.5])
def test_kill_after_a_delay_leaves_old_or_new_outputs(tmp_path, runs, delay):
    """SIGKILL at wall-clock moments after the rows are validated (tokenizing, saving or moving into place)."""
    commands, fingerprints, outputs = runs
    out = tmp_path / "out"
    shutil.copytree(outputs["old"], out)
    process = subprocess.Popen(commands["new"] + ["--output_dir", str(out)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    for line in process.stdout:  # printed once every row is validated, before any tokenization
        if line.startswith("rows:"):
            break
    time.sleep(delay)
    process.kill()
    process.communicate(timeout=120)  # returns once the watcher, which shares stdout, is done too
    # The kill landed mid-run (the run goes on 3.6-4.0 s after the rows line on the fastest CPU measured).
    assert process.returncode == -signal.SIGKILL
    wait_for_clean_up(out)
    assert sorted(os.listdir(out)) == OUTPUTS
    versions(out, fingerprints)  # each output old or new, whole and loadable


def processes_with(text: str) -> list:
    """The pids of this machine's processes whose command line holds `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:  # gone meanwhile
            pass
    return found


def test_killed_as_a_worker_starts_leaves_no_process_behind(tmp_path, runs):
    """The run dies between a fork and the child's PR_SET_PDEATHSIG, so the kernel sends the child no signal. The
    second fork is `map`'s manager process, which, orphaned, would serve forever holding the watcher's pipe (and
    any pipe on the run's stdout: a CI run hung on this for 120 s); it must end itself."""
    commands, fingerprints, outputs = runs
    out = tmp_path / "out"
    shutil.copytree(outputs["old"], out)
    command = [sys.executable, KILLER, "fork", "2"] + commands["new"][1:] + ["--output_dir", str(out)]
    try:  # a plain start (not conftest's fork server): what it leaves running shows `out` on its command line
        with open(tmp_path / "log", "w") as log:  # not a pipe, which a leftover process would hold open
            returncode = subprocess.run(command, stdout=log, stderr=log, timeout=300).returncode
        assert returncode == -signal.SIGKILL, (tmp_path / "log").read_text()[-2000:]
        wait_for_clean_up(out)
        deadline = time.time() + 30
        while processes_with(str(out)) and time.time() < deadline:
            time.sleep(0.1)
        assert not processes_with(str(out))  # no worker, no watcher
        assert fingerprint(out) == fingerprints["old"]
    finally:
        for pid in processes_with(str(out)):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_while_workers_map_says_so_and_leaves_the_old_outputs(tmp_path, runs):
    """A terminal's Ctrl-C (SIGINT to the whole process group, `map`'s workers too) while 2 workers tokenize the
    tiny world's preference rows: exit 130 and a line saying what to do, not a traceback (it had surfaced as
    datasets' TimeoutError, exit 1, and could hang); the old outputs whole, no scratch and no process left."""
    _, fingerprints, outputs = runs
    out = tmp_path / "out"
    shutil.copytree(outputs["old"], out)
    command = [sys.executable, str(REPO / "preprocess_tldr.py"), "--sft_dataset", str(WORLD / "tldr_3_filtered"),
               "--preference_dataset", str(WORLD / "summarize_from_feedback"), "--base_model",
               str(WORLD / "pythia-tiny"), *tiny_lengths(), "--num_proc", "2", "--output_dir", str(out)]
    log = tmp_path / "log"
    try:  # a plain start in a session of its own: SIGINT to its group reaches the workers, as a terminal's does
        with open(log, "w") as file:
            # (SIGINT restored: a job started in the background of a script, as CI's pytest is, inherits it ignored)
            process = subprocess.Popen(command, stdout=file, stderr=file, start_new_session=True,
                                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            deadline = time.time() + 300
            # A progress bar reaches the file at its end (its line's newline): the SFT splits' last is done, and the
            # preference rows' map starts (6.6 s of 2 workers on CI's CPU).
            while "sft/test (num_proc=2): 100%" not in log.read_text():
                assert time.time() < deadline and process.poll() is None, log.read_text()[-2000:]
                time.sleep(0.05)
            time.sleep(1)
            os.killpg(process.pid, signal.SIGINT)
            returncode = process.wait(timeout=120)
        text = log.read_text()
        assert returncode == 130, text[-3000:]
        assert text.rstrip().endswith("the same command starts preprocessing again from the start"), text[-3000:]
        assert "Traceback" not in text and "Error" not in text, text[-3000:]
        wait_for_clean_up(out)
        assert fingerprint(out) == fingerprints["old"]
        deadline = time.time() + 30
        while processes_with(str(out)) and time.time() < deadline:
            time.sleep(0.1)
        assert not processes_with(str(out))  # no worker, no watcher
    finally:
        for pid in processes_with(str(out)):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_as_the_outputs_are_moved_into_place_waits_until_all_are_new(tmp_path, runs):
    """Ctrl-C between two moves into place (sft moved, preference not yet) takes effect once all are moved: exit 130,
    and every output new, where a kill there leaves sft new beside an old args.json (test above)."""
    commands, fingerprints, outputs = runs
    out = tmp_path / "out"
    shutil.copytree(outputs["old"], out)
    command = [sys.executable, KILLER, "install_output", "2"] + commands["new"][1:] + ["--output_dir", str(out)]
    result = run_python(command, env={**os.environ, "KILL_AT_CALL_SIGNAL": "SIGINT"}, timeout=300)
    assert result.returncode == 130, result.stdout[-2000:] + result.stderr[-2000:]
    assert "interrupted: the outputs are all as they were, or all new" in result.stderr
    wait_for_clean_up(out)
    assert fingerprint(out) == fingerprints["new"]


def test_kill_during_a_first_run_leaves_no_folder(tmp_path, runs):
    commands, _, _ = runs
    out = tmp_path / "data" / "tldr"
    command = [sys.executable, KILLER, "save_to_disk", "3"] + commands["new"][1:] + ["--output_dir", str(out)]
    result = run_python(command, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    deadline = time.time() + 30
    while (tmp_path / "data").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not (tmp_path / "data").exists()  # the folders the run made, emptied, are gone too


# ---- the pieces, in process ----

def test_install_output_replaces_files_and_folders(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "out" / "scratch"
    (scratch / "new" / "sft").mkdir(parents=True)
    (scratch / "new" / "sft" / "data").write_text("new")
    (scratch / "new" / "args.json").write_text("new")
    (scratch / "new" / "visuals").mkdir()
    (out / "sft").mkdir()
    (out / "sft" / "data").write_text("old")
    (out / "sft" / "old_only").write_text("old")
    (out / "args.json").write_text("old")
    for name in ("sft", "args.json", "visuals"):  # a folder onto a folder, a file onto a file, onto nothing
        pre.install_output(str(scratch), str(out), name)
    assert (out / "sft" / "data").read_text() == "new" and not (out / "sft" / "old_only").exists()
    assert (out / "args.json").read_text() == "new" and (out / "visuals").is_dir()
    assert os.listdir(scratch / "new") == ["sft"] and (scratch / "new" / "sft" / "old_only").exists()  # swapped


def test_exchange_paths_swaps_in_one_step(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    assert pre.exchange_paths(str(tmp_path / "a"), str(tmp_path / "b"))  # Linux: renameat2 RENAME_EXCHANGE
    assert os.listdir(tmp_path / "a") == [] and (tmp_path / "b" / "x").read_text() == "a"
    with pytest.raises(FileNotFoundError):
        pre.exchange_paths(str(tmp_path / "a"), str(tmp_path / "missing"))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_killed_between_the_two_renames_the_old_folder_comes_back(tmp_path, monkeypatch):
    """Without an atomic swap (e.g. NFS), a folder is replaced in two renames; killed between them, the
    old folder waits in the scratch and the clean-up (the watcher, or the next run) moves it back."""
    out = tmp_path / "out"
    scratch = out / f"{pre.SCRATCH_PREFIX}{os.uname().nodename}-{dead_pid()}"
    (scratch / "new" / "sft").mkdir(parents=True)
    (out / "sft").mkdir()
    (out / "sft" / "data").write_text("old")
    monkeypatch.setattr(pre, "exchange_paths", lambda first, second: False)
    renames, rename = [], os.rename

    def die_after_one_rename(source, target):
        if renames:
            raise KeyboardInterrupt("killed")  # stands for the SIGKILL between the two renames
        renames.append((source, target))
        rename(source, target)

    monkeypatch.setattr(pre.os, "rename", die_after_one_rename)
    with pytest.raises(KeyboardInterrupt):
        pre.install_output(str(scratch), str(out), "sft")
    monkeypatch.undo()
    assert not (out / "sft").exists() and (scratch / "old" / "sft" / "data").read_text() == "old"
    alive = out / f"{pre.SCRATCH_PREFIX}{os.uname().nodename}-{os.getppid()}"  # a running run's scratch
    alive.mkdir()
    pre.remove_stale_scratch(str(out))  # what the next run does first (the watcher runs the same code)
    assert (out / "sft" / "data").read_text() == "old"
    assert sorted(os.listdir(out)) == [alive.name, "sft"]  # the dead run's scratch is gone, the live one's kept

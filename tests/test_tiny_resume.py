"""benchmark/tiny.sh started again after an interruption: the stages that finished are kept, the one that was
running continues from its checkpoint, and a change of code or of a stage's command reruns from there on.

The stages are stood in for by a `python` on PATH that records each call and writes what a stage leaves
behind (its output folder; a checkpoint when told to die mid-run), so the job's bookkeeping runs in seconds.
That a resumed stage gives the uninterrupted stage's result is each script's own test (test_sft.py,
test_reward.py, test_dpo.py, test_ppo.py)."""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys

from conftest import REPO

SCRIPTS = ("preprocess_tldr.py", "sft.py", "reward.py", "dpo.py", "ppo.py", "judge.py", "tiny_world.py")
STAND_IN = """#!{python}
import json, os, shutil, sys
args = sys.argv[1:]
if args[0] == "-c":  # tiny.sh's environment.json
    print(json.dumps({{"torch_threads": 2}}))
    sys.exit(0)
script, flags = os.path.basename(args[0]), args[1:]
out = flags[flags.index("--output_dir") + 1] if "--output_dir" in flags else None
checkpoint = os.path.join(out or "", "checkpoints", "update_2")
with open(os.environ["CALLS"], "a") as file:
    file.write(json.dumps({{"script": script, "resume": "--resume" in flags,
                           "from_checkpoint": os.path.isdir(checkpoint),
                           "lr": flags[flags.index("--lr") + 1] if "--lr" in flags else None}}) + "\\n")
if out:
    os.makedirs(out, exist_ok=True)
if script == os.environ.get("DIE_IN"):  # killed after its checkpoint of update 2
    os.makedirs(checkpoint, exist_ok=True)
    sys.exit(137)
if script == "ppo.py":  # an evaluation's samples for the report's curve, in runs/<its --run_name>
    run = os.path.join("runs", flags[flags.index("--run_name") + 1])
    os.makedirs(run, exist_ok=True)
    open(os.path.join(run, "samples_validation_320.csv"), "w").close()
shutil.rmtree(os.path.join(out or "", "checkpoints"), ignore_errors=True)  # a finished run drops them
"""


def make_checkout(root):
    """A copy of tiny.sh in a checkout whose scripts are placeholders, the committed world's name, and the stand-in."""
    (root / "benchmark").mkdir(parents=True)
    shutil.copy(REPO / "benchmark" / "tiny.sh", root / "benchmark" / "tiny.sh")
    for script in SCRIPTS:
        (root / script).write_text("# version 1\n")
    (root / "assets" / "tiny_world").mkdir(parents=True)
    (root / "assets" / "tiny_world" / "world.json").write_text("{}")
    (root / "bin").mkdir()
    python = root / "bin" / "python"
    python.write_text(STAND_IN.format(python=sys.executable))
    python.chmod(python.stat().st_mode | stat.S_IEXEC)


def ppo_runs(root, models="models/tiny"):
    """runs/<tiny.sh's PPO run>: named by the seed (1) and the real path of $MODELS."""
    return root / "runs" / f"tiny_ppo_1_{hashlib.sha256(str((root / models).resolve()).encode()).hexdigest()[:8]}"


def start(root, **env):
    """One start of tiny.sh in `root` -> (exit status, [(script, resume, from_checkpoint, lr)] called, timings rows)."""
    calls = root / "calls.jsonl"
    calls.unlink(missing_ok=True)
    result = subprocess.run(["bash", "benchmark/tiny.sh"], cwd=root, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PATH": f"{root / 'bin'}:{os.environ['PATH']}", "CALLS": str(calls),
                                 **env})
    called = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    timings = (root / "models" / "tiny" / "timings.tsv").read_text().splitlines()[1:]
    return result.returncode, [(c["script"], c["resume"], c["from_checkpoint"], c["lr"]) for c in called], \
        [row.rsplit("\t", 1)[0] for row in timings], result.stdout


def test_a_start_after_an_interruption_keeps_finished_stages_and_resumes_the_one_cut_short(tmp_path):
    make_checkout(tmp_path)
    status, called, _, _ = start(tmp_path, DIE_IN="reward.py")  # killed during the RM
    assert status == 137
    assert [c[0] for c in called] == ["preprocess_tldr.py", "sft.py", "sft.py", "reward.py"]
    assert all(resume for script, resume, _, _ in called if script in ("reward.py",))

    # Again: preprocessing and both SFT runs are kept; the RM continues from its checkpoint; then the rest.
    status, called, rows, stdout = start(tmp_path)
    assert status == 0, stdout
    assert called == [("reward.py", True, True, "3e-4"), ("dpo.py", True, False, "1e-4"),
                      ("ppo.py", True, False, "1e-4"), ("judge.py", False, False, None),
                      ("tiny_report.py", False, False, None)]
    assert rows == ["preprocess (an earlier start)", "sft: base model (an earlier start)", "sft (an earlier start)",
                    "reward (resumed)", "dpo", "ppo", "judge (gold)"]
    assert "=== sft: kept, finished by an earlier start of this job" in stdout

    # A third start has nothing left to run but the report; the RM's row still says it was resumed.
    status, called, rows, _ = start(tmp_path)
    assert status == 0 and [c[0] for c in called] == ["tiny_report.py"]
    assert rows[3] == "reward (resumed) (an earlier start)" and rows[-1] == "judge (gold) (an earlier start)"

    # Another PPO lr: the stages before PPO are kept, PPO starts afresh (its earlier samples cleared), then the rest.
    stale = ppo_runs(tmp_path) / "samples_validation_9999.csv"
    stale.write_text("an evaluation of the PPO run at the other lr")
    (tmp_path / "models" / "tiny" / "ppo_1" / "args.json").write_text('{"lr": 0.0001}')  # ppo.py would refuse it
    status, called, rows, _ = start(tmp_path, PPO_LR="2e-4")
    assert not stale.exists() and not (tmp_path / "models" / "tiny" / "ppo_1" / "args.json").exists()
    assert status == 0 and called == [("ppo.py", True, False, "2e-4"), ("judge.py", False, False, None),
                                      ("tiny_report.py", False, False, None)]
    assert rows[:5] == [f"{name} (an earlier start)" for name in ("preprocess", "sft: base model", "sft",
                                                                   "reward (resumed)", "dpo")]


def test_changed_code_reruns_every_stage_and_continues_no_checkpoint(tmp_path):
    make_checkout(tmp_path)
    status, _, _, _ = start(tmp_path, DIE_IN="ppo.py")
    assert status == 137 and (tmp_path / "models" / "tiny" / "ppo_1" / "checkpoints" / "update_2").is_dir()
    stale = ppo_runs(tmp_path) / "samples_validation_9999.csv"
    stale.parent.mkdir(parents=True)
    stale.write_text("an evaluation by the code before")
    (tmp_path / "ppo.py").write_text("# version 2\n")  # the code changed between the two starts
    status, called, rows, _ = start(tmp_path)
    assert status == 0
    assert [c[0] for c in called] == ["preprocess_tldr.py", "sft.py", "sft.py", "reward.py", "dpo.py", "ppo.py",
                                      "judge.py", "tiny_report.py"]
    assert not any(from_checkpoint for _, _, from_checkpoint, _ in called)  # the old PPO checkpoint was dropped
    assert not stale.exists()  # the earlier run's evaluations do not mix into the new curve
    assert rows == ["preprocess", "sft: base model", "sft", "reward", "dpo", "ppo", "judge (gold)"]


def test_an_earlier_stage_run_again_drops_a_later_stages_checkpoint(tmp_path):
    """Killed in the RM, then SFT's command changed: SFT runs again, and the RM starts afresh rather than continuing
    from a checkpoint trained on the old SFT model (nor is it marked resumed)."""
    make_checkout(tmp_path)
    status, _, _, _ = start(tmp_path, DIE_IN="reward.py")
    assert status == 137 and (tmp_path / "models" / "tiny" / "reward_1" / "checkpoints" / "update_2").is_dir()
    script = tmp_path / "benchmark" / "tiny.sh"
    script.write_text(script.read_text().replace("--lr 2e-3", "--lr 1e-3"))  # SFT's lr
    status, called, rows, stdout = start(tmp_path)
    assert status == 0, stdout
    assert ("sft.py", True, False, "1e-3") in called and ("reward.py", True, False, "3e-4") in called
    assert "reward" in rows and "reward (resumed)" not in rows


def test_a_checkpoint_cut_short_is_not_a_resume(tmp_path):
    """A stage killed while writing its first checkpoint leaves update_N.partial, which the stages drop: the next
    start runs it from update 0, so its time is judged (not marked resumed)."""
    make_checkout(tmp_path)
    start(tmp_path, DIE_IN="reward.py")
    checkpoints = tmp_path / "models" / "tiny" / "reward_1" / "checkpoints"
    (checkpoints / "update_2").rename(checkpoints / "update_2.partial")
    status, _, rows, _ = start(tmp_path)
    assert status == 0 and rows[3] == "reward"


def test_a_start_leaves_no_earlier_report_and_never_deletes_an_inherited_clear(tmp_path):
    """A start that fails leaves no report of an earlier start behind; a CLEAR in the caller's environment (tiny.sh
    sets one for the PPO stage only) is not deleted."""
    make_checkout(tmp_path)
    keep = tmp_path / "precious"
    keep.mkdir()
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    for name in ("report.md", "findings.json"):
        (tmp_path / "models" / "tiny" / name).write_text("an earlier start's")
    status, _, _, _ = start(tmp_path, DIE_IN="sft.py", CLEAR=str(keep))
    assert status == 137 and keep.is_dir()
    assert not (tmp_path / "models" / "tiny" / "report.md").exists()
    assert not (tmp_path / "models" / "tiny" / "findings.json").exists()


def test_a_world_below_a_cache_folder_is_still_part_of_the_job_key(tmp_path):
    """Only the world's own .cache/ is left out of the key: a world kept under some other .cache/ folder that
    changes between two starts reruns the job."""
    make_checkout(tmp_path)
    world = tmp_path / "store" / ".cache" / "w"
    world.mkdir(parents=True)
    (world / "world.json").write_text('{"seed": 1}')
    start(tmp_path, WORLD=str(world))
    (world / "world.json").write_text('{"seed": 1, "rebuilt": true}')
    status, called, _, _ = start(tmp_path, WORLD=str(world))
    assert status == 0 and [c[0] for c in called][:2] == ["preprocess_tldr.py", "sft.py"]

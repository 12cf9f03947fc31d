"""benchmark/tiny.sh started again after an interruption: the stages that finished are kept, the one that was
running continues from its checkpoint, and a change of code or of a stage's command reruns from there on.

The stages are stood in for by a `python` on PATH that records each call and writes what a stage leaves
behind (its output folder; a checkpoint when told to die mid-run), so the job's bookkeeping runs in seconds.
That a resumed stage gives the uninterrupted stage's result is each script's own test (test_sft.py,
test_reward.py, test_dpo.py, test_ppo.py)."""

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
if script == "ppo.py":  # an evaluation's samples for the report's curve
    os.makedirs("runs/tiny_ppo_1", exist_ok=True)
    open("runs/tiny_ppo_1/samples_validation_320.csv", "w").close()
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
    stale = tmp_path / "runs" / "tiny_ppo_1" / "samples_validation_9999.csv"
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
    stale = tmp_path / "runs" / "tiny_ppo_1" / "samples_validation_9999.csv"
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

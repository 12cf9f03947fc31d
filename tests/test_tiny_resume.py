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
# What tiny.sh sets for every stage: offline, CPU (DeepSpeed's accelerator), no tokenizer threads of their own.
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
               "TOKENIZERS_PARALLELISM": "false"}
STAND_IN = """#!{python}
import json, os, shutil, sys
ENVIRONMENT = {environment}
args = sys.argv[1:]
if args[0] == "-c":  # tiny.sh's environment.json (THREADS: another machine's thread count)
    print(json.dumps({{"torch_threads": int(os.environ.get("THREADS", "2"))}}))
    sys.exit(0)
script, flags = os.path.basename(args[0]), args[1:]
out = flags[flags.index("--output_dir") + 1] if "--output_dir" in flags else None
checkpoint = os.path.join(out or "", "checkpoints", "update_2")
with open(os.environ["CALLS"], "a") as file:
    file.write(json.dumps({{"script": script, "resume": "--resume" in flags,
                           "from_checkpoint": os.path.isdir(checkpoint),
                           "lr": flags[flags.index("--lr") + 1] if "--lr" in flags else None,
                           "flags": flags, "environment": {{name: os.environ.get(name) for name in ENVIRONMENT}}}}) + "\\n")
if out:
    os.makedirs(out, exist_ok=True)
if script == "tiny_world.py":  # a world built where $WORLD points
    world = flags[flags.index("--out_dir") + 1]
    os.makedirs(world, exist_ok=True)
    open(os.path.join(world, "world.json"), "w").write(json.dumps({{"seed": flags[flags.index("--seed") + 1]}}))
if script == os.environ.get("DIE_IN"):  # killed after its checkpoint of update 2
    os.makedirs(checkpoint, exist_ok=True)
    sys.exit(137)
if script == os.environ.get("DIE_AFTER_SAVE"):  # killed after writing its results, before tiny.sh's record
    open(os.path.join(out, "eval_metrics.json"), "w").write("{{}}")
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
    python.write_text(STAND_IN.format(python=sys.executable, environment=repr(sorted(ENVIRONMENT))))
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
    timings = (root / env.get("MODELS", "models/tiny") / "timings.tsv").read_text().splitlines()[1:]
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
    report = ("report.md", "findings.json", "report.png", "report_tokens.png")
    for name in report:
        (tmp_path / "models" / "tiny" / name).write_text("an earlier start's")
    status, _, _, _ = start(tmp_path, DIE_IN="sft.py", CLEAR=str(keep))
    assert status == 137 and keep.is_dir()
    assert [name for name in report if (tmp_path / "models" / "tiny" / name).exists()] == []


def test_a_world_below_a_cache_folder_is_still_part_of_the_job_key(tmp_path):
    """Only the world's own .cache/ is left out of the key: a world kept under some other .cache/ folder that
    changes between two starts reruns the job."""
    make_checkout(tmp_path)
    world = tmp_path / "store" / ".cache" / "w"
    world.mkdir(parents=True)
    (world / "world.json").write_text('{"seed": 1}')
    assert start(tmp_path, WORLD=str(world))[0] == 0  # every stage recorded as finished: only a new key reruns them
    (world / "world.json").write_text('{"seed": 1, "rebuilt": true}')
    status, called, _, _ = start(tmp_path, WORLD=str(world))
    assert status == 0 and [c[0] for c in called][:2] == ["preprocess_tldr.py", "sft.py"]


def calls(root):
    """The stand-in's record of the last start: [{script, flags, environment, ...}] in the order they ran."""
    return [json.loads(line) for line in (root / "calls.jsonl").read_text().splitlines()]


def test_every_stage_runs_offline_on_cpu_and_every_training_stage_can_be_resumed(tmp_path):
    """Whatever the caller's shell exports, each stage runs offline with DeepSpeed on the CPU; each training stage
    writes checkpoints (--save_every) and continues from one (--resume): without --save_every a second start has no
    checkpoint to continue from and trains the stage cut short from update 0."""
    make_checkout(tmp_path)
    status, _, _, stdout = start(tmp_path, **{name: "0" for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                                   "TRANSFORMERS_OFFLINE")},
                                 DS_ACCELERATOR="cuda", TOKENIZERS_PARALLELISM="true")
    assert status == 0, stdout
    recorded = calls(tmp_path)
    assert [c["script"] for c in recorded] == ["preprocess_tldr.py", "sft.py", "sft.py", "reward.py", "dpo.py", "ppo.py",
                                               "judge.py", "tiny_report.py"]
    for call in recorded:
        assert call["environment"] == ENVIRONMENT, call["script"]
    training = [c for c in recorded if c["script"] in ("sft.py", "reward.py", "dpo.py", "ppo.py")
                and ("--total_episodes", "0") not in zip(c["flags"], c["flags"][1:])]  # not the base model's eval
    assert [c["script"] for c in training] == ["sft.py", "reward.py", "dpo.py", "ppo.py"]
    for call in training:
        assert "--resume" in call["flags"] and "--save_every" in call["flags"], call["script"]
        assert int(call["flags"][call["flags"].index("--save_every") + 1]) > 0, call["script"]


def test_another_thread_count_runs_the_job_afresh(tmp_path):
    """The thread count changes the numbers: a start on another thread count (environment.json) keeps no stage and
    continues no checkpoint, even of the stage that was cut short."""
    make_checkout(tmp_path)
    status, _, _, _ = start(tmp_path, DIE_IN="reward.py", THREADS="2")
    assert status == 137
    status, called, rows, stdout = start(tmp_path, THREADS="4")
    assert status == 0, stdout
    assert [c[0] for c in called] == ["preprocess_tldr.py", "sft.py", "sft.py", "reward.py", "dpo.py", "ppo.py",
                                      "judge.py", "tiny_report.py"]
    assert not any(from_checkpoint for _, _, from_checkpoint, _ in called)
    assert rows == ["preprocess", "sft: base model", "sft", "reward", "dpo", "ppo", "judge (gold)"]


def test_a_stage_whose_output_folder_was_removed_runs_again(tmp_path):
    """`rm -r models/tiny/ppo_1` (what tiny_report.py tells a user to do with a damaged artifact): the next start runs
    PPO and the stages after it again, and keeps the ones before."""
    make_checkout(tmp_path)
    assert start(tmp_path)[0] == 0
    shutil.rmtree(tmp_path / "models" / "tiny" / "ppo_1")
    status, called, rows, stdout = start(tmp_path)
    assert status == 0, stdout
    assert [c[0] for c in called] == ["ppo.py", "judge.py", "tiny_report.py"]
    assert rows[-2:] == ["ppo", "judge (gold)"] and (tmp_path / "models" / "tiny" / "ppo_1").is_dir()


def test_a_stage_cut_short_under_another_command_is_not_kept_when_the_first_command_returns(tmp_path):
    """PPO finished at lr 1e-4; a start at 2e-4 is killed in PPO (its folder now holds the 2e-4 run's checkpoint); a
    start back at 1e-4 must run PPO again, not keep the cut-short 2e-4 folder as the finished 1e-4 run."""
    make_checkout(tmp_path)
    assert start(tmp_path)[0] == 0
    status, _, _, _ = start(tmp_path, PPO_LR="2e-4", DIE_IN="ppo.py")
    assert status == 137
    status, called, rows, stdout = start(tmp_path)
    assert status == 0, stdout
    assert called[0] == ("ppo.py", True, False, "1e-4")  # afresh: not the 2e-4 run's checkpoint either
    assert "ppo" in rows and "ppo (an earlier start)" not in rows


def test_seed_models_and_world_reach_every_stage_and_the_report(tmp_path):
    """SEED, MODELS and WORLD from the caller: a world that is not the committed one is built there with that seed,
    every stage reads and writes <MODELS>/<stage>_<SEED>, and the report reads that world (its noise ceiling)."""
    make_checkout(tmp_path)
    world = tmp_path / "worlds" / "w2"
    status, _, rows, stdout = start(tmp_path, SEED="2", MODELS="out/m2", WORLD=str(world))
    assert status == 0, stdout
    recorded = calls(tmp_path)
    value = lambda call, flag: call["flags"][call["flags"].index(flag) + 1]  # noqa: E731
    assert recorded[0]["script"] == "tiny_world.py" and value(recorded[0], "--out_dir") == str(world)
    assert value(recorded[0], "--seed") == "2" and rows[0] == "tiny world"
    assert "--no_check_length_correctness" in recorded[1]["flags"]  # another world: the lengths are bounds
    outputs = [value(c, "--output_dir") for c in recorded if "--output_dir" in c["flags"]][1:]  # after $DATA
    assert outputs == [f"out/m2/{stage}_2" for stage in ("base", "sft", "reward", "dpo", "ppo", "judge")]
    assert all(value(c, "--seed") == "2" for c in recorded if "--seed" in c["flags"])
    report = recorded[-1]
    assert report["script"] == "tiny_report.py" and {"--models", "--seed", "--world"} <= set(report["flags"])
    assert (value(report, "--models"), value(report, "--seed"), value(report, "--world")) == ("out/m2", "2", str(world))
    assert (tmp_path / "out" / "m2" / "environment.json").is_file()
    # the committed world: its exact lengths are checked
    start(tmp_path)
    assert "--no_check_length_correctness" not in calls(tmp_path)[0]["flags"]


def test_a_world_whose_build_was_cut_short_is_built_again(tmp_path):
    """tiny_world.py writes world.json once the world is whole: a folder without it (a build killed midway, its
    pretraining checkpoint left for the build to continue from) is built again before any stage reads it."""
    make_checkout(tmp_path)
    world = tmp_path / "w"
    (world / ".pretraining").mkdir(parents=True)
    status, called, rows, stdout = start(tmp_path, WORLD=str(world))
    assert status == 0, stdout
    assert [c[0] for c in called][:2] == ["tiny_world.py", "preprocess_tldr.py"] and rows[0] == "tiny world"
    assert (world / "world.json").is_file()


def test_data_rewritten_by_another_job_runs_preprocessing_and_every_later_stage_again(tmp_path):
    """$DATA is shared by jobs that do not set it (WORLD=/tmp/w MODELS=/tmp/m bash benchmark/tiny.sh writes the default
    data/tiny_tldr): a start after another world's preprocessing wrote there must not keep its own preprocessing and
    train on the other world's data; its args.json, as each stage left it, says so."""
    make_checkout(tmp_path)
    assert start(tmp_path)[0] == 0
    (tmp_path / "data" / "tiny_tldr" / "args.json").write_text('{"sft_dataset": "/tmp/w/tldr_3_filtered"}')
    status, called, rows, stdout = start(tmp_path)
    assert status == 0, stdout
    assert [c[0] for c in called] == ["preprocess_tldr.py", "sft.py", "sft.py", "reward.py", "dpo.py", "ppo.py",
                                      "judge.py", "tiny_report.py"]
    assert "(an earlier start)" not in "".join(rows)
    assert [c[0] for c in start(tmp_path)[1]] == ["tiny_report.py"]  # and then it is kept as this job left it


def test_another_seed_in_the_same_models_folder_is_refused_and_changes_nothing(tmp_path):
    """SEED=2 into the models/tiny of a finished seed-1 job would take over the stage records, and the next seed-1
    start would delete its finished runs: refused before anything is written, naming the folders to use."""
    make_checkout(tmp_path)
    assert start(tmp_path)[0] == 0
    models = tmp_path / "models" / "tiny"
    before = {path: path.read_bytes() for path in models.rglob("*") if path.is_file()}
    result = subprocess.run(["bash", "benchmark/tiny.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
                                 "CALLS": str(tmp_path / "calls2.jsonl"), "SEED": "2"})
    assert result.returncode == 2 and not (tmp_path / "calls2.jsonl").exists()
    assert "models/tiny holds the main job of SEED=1" in result.stderr and "MODELS=models/tiny_seed2" in result.stderr
    assert {path: path.read_bytes() for path in models.rglob("*") if path.is_file()} == before
    status, called, _, _ = start(tmp_path)  # seed 1 again: every stage kept
    assert status == 0 and [c[0] for c in called] == ["tiny_report.py"]


def test_a_stage_killed_after_saving_its_results_is_marked_resumed(tmp_path):
    """Killed between the script saving its results and tiny.sh writing the stage's record: the next start runs the
    script again, which finds its run finished and exits in seconds. That row is marked resumed (the report then does
    not judge the 12-minute bar on a stage timed in part), and the stages after it run."""
    make_checkout(tmp_path)
    status, called, _, _ = start(tmp_path, DIE_AFTER_SAVE="dpo.py")
    assert status == 137 and called[-1][0] == "dpo.py"
    status, called, rows, stdout = start(tmp_path)
    assert status == 0, stdout
    assert [c[0] for c in called] == ["dpo.py", "ppo.py", "judge.py", "tiny_report.py"]
    assert "dpo (resumed)" in rows and "ppo" in rows

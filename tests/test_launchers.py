"""The SLURM launchers of the paper's sweep (benchmark/launch.sh, benchmark/slurm/*.sbatch,
benchmark/knobs.sh), checked through their dry runs: no SLURM, no GPU, no model is loaded.

  - every flag a dry run prints exists in the script's `--help`;
  - the global batch of every training command equals the paper's (SFT 128, RM / DPO 64, PPO 512)
    for every model on the 8 processes of the accelerate config, and divides exactly into
    micro-batches x 8 ranks (the scripts derive the accumulation steps from it);
  - every (model, seed) of the sweep runs once, each stage reads the previous stage's folder, and
    every training command can resume (--resume, --save_every) under --requeue;
  - the pipeline chains the stages with job dependencies;
  - under a fake srun, a task runs its command, skips a finished run, and requeues itself on USR1.
"""

import ast
import atexit
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
SLURM = REPO / "benchmark" / "slurm"
STAGES = ("preprocess", "sft", "reward", "dpo", "ppo", "judge")
SCRIPTS = {"preprocess": "preprocess_tldr.py", "sft": "sft.py", "reward": "reward.py", "dpo": "dpo.py",
           "ppo": "ppo.py", "judge": "judge.py"}
TRAINING = ("sft", "reward", "dpo", "ppo")
# The paper's global batches (Table 3 of the paper; the reference's released runs on 8 GPUs).
PAPER_BATCH = {"sft": 128, "reward": 64, "dpo": 64, "ppo": 512}
PAPER_MODELS = ("EleutherAI/pythia-1b-deduped", "EleutherAI/pythia-2.8b-deduped", "EleutherAI/pythia-6.9b-deduped")
PAPER_SEEDS = ("44413", "55513", "66613", "77713")
PAPER_GPUS = 8
# Rows of the paper's eval splits (README: SFT validation / test), for the ZeRO-3 eval check.
EVAL_ROWS = {"validation": 6447, "test": 6553}
# A clean environment for the dry runs: the knobs' defaults, not whatever the caller exported.
KNOB_VARS = ("MODELS", "SEEDS", "DATA", "OUT_ROOT", "TOKENIZER_MODEL", "ACCELERATE_CONFIG", "TRACK", "PUSH",
             "SAVE_EVERY_SFT", "SAVE_EVERY_RM", "SAVE_EVERY_DPO", "SAVE_EVERY_PPO", "ARRAY_THROTTLE",
             "JUDGE_MODEL", "JUDGE_ARRAY_THROTTLE", "PREPROCESS_FLAGS", "FAST_SAMPLING", "COMPILE_TRAINING", "OPENAI_API_KEY",
             "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_SUBMIT_DIR")
ENV = {key: value for key, value in os.environ.items() if key not in KNOB_VARS}


def bash(*args, env=None, timeout=60):
    """Run bash with `args` in the repository root -> CompletedProcess (text)."""
    return subprocess.run(["bash", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**ENV, **(env or {})})


LAUNCH_COPY = []  # the folder that holds a copy of benchmark/, made at the first launch() call


def launch(*args, env=None):
    """Run benchmark/launch.sh from a copy of benchmark/ in a temporary folder -> CompletedProcess. launch.sh submits
    only the tasks whose runs are not complete, so it must not see the runs this checkout may hold (its default
    models/ and data/tldr), and it makes runs/slurm/ where it stands."""
    if not LAUNCH_COPY:
        root = Path(tempfile.mkdtemp(prefix="launch_"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        shutil.copytree(REPO / "benchmark", root / "benchmark", ignore=shutil.ignore_patterns("results", "__pycache__"))
        LAUNCH_COPY.append(root)
    return bash(str(LAUNCH_COPY[0] / "benchmark" / "launch.sh"), *args, env=env)


def help_flags(text: str) -> set:
    """Flag names (underscored) of a tyro --help text: the option rows `│ --a_b X`, `│ --c, --no_c` (or dashed)."""
    flags = set()
    for line in text.splitlines():
        row = re.match(r"^[│|]\s+(--[\w-]+(?:,\s*--[\w-]+)*)", line)
        if row:
            flags.update(flag[2:].replace("-", "_") for flag in re.findall(r"--[\w-]+", row.group(1)))
    return flags


def args_defaults(path: Path) -> dict:
    """{field: default} of the `Args` dataclass of a script, read from its source (nothing imported)."""
    tree = ast.parse(path.read_text())
    args = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args")
    defaults = {}
    for node in args.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            try:
                defaults[node.target.id] = ast.literal_eval(node.value)
            except ValueError:
                pass  # a factory or an expression: not a number we check
    return defaults


# The paper's settings that the sweep takes from the scripts' defaults (its launchers pass only scale knobs), as
# ../shared/DETAILS.md gives them (Details 4, 9, 10, 19, 20, 24; evaluation at temperature 0.01) and the reference's
# torch AdamW (weight decay 0.01): a default changed by mistake would change every run of the sweep, silently.
PAPER_DEFAULTS = {
    "preprocess": {"query_length": 512, "max_sft_response_length": 53, "max_sft_query_response_length": 562,
                   "max_rm_response_length": 169, "max_rm_query_response_length": 638,
                   "cnndm_max_rm_response_length": 155, "cnndm_max_rm_query_response_length": 2021},
    "sft": {"lr": 3e-6, "eps": 1e-5, "weight_decay": 0.01, "scheduler": "cosine", "batch_size": 128,
            "num_train_epochs": 1, "response_length": 53, "temperature": 0.01},
    "reward": {"lr": 3e-6, "eps": 1e-5, "weight_decay": 0.01, "scheduler": "cosine", "batch_size": 64,
               "num_train_epochs": 1},
    "dpo": {"beta": 0.05, "ipo": False, "label_smoothing": 0.0, "lr": 3e-6, "eps": 1e-5, "weight_decay": 0.01,
            "scheduler": "cosine", "batch_size": 64, "num_train_epochs": 1, "response_length": 53,
            "temperature": 0.01},
    "ppo": {"total_episodes": 1_000_000, "lr": 3e-6, "eps": 1e-5, "weight_decay": 0.01, "batch_size": 512,
            "num_minibatches": 1, "num_ppo_epochs": 4, "kl_coef": 0.05, "gamma": 1.0, "lam": 0.95, "cliprange": 0.2,
            "cliprange_value": 0.2, "vf_coef": 0.1, "temperature": 0.7, "eval_temperature": 0.01,
            "response_length": 53, "whiten_rewards": False, "non_eos_penalty": True, "penalty_reward_value": -1.0,
            "score_after_eos": False, "zero_critic_head": False},
}


def test_every_setting_the_sweep_leaves_to_a_script_is_the_papers(dry_runs):
    """The sweep's commands pass none of these flags, and each script's default is the paper's value."""
    for stage, expected in PAPER_DEFAULTS.items():
        defaults = args_defaults(REPO / SCRIPTS[stage])
        assert {flag: defaults.get(flag, "missing") for flag in expected} == expected, stage
        given = {flag for command in dry_runs[stage] for flag in command["flags"]}
        assert not given & set(expected), f"{stage}: the sweep passes {sorted(given & set(expected))}"


@pytest.fixture(scope="module")
def helps(script_help):
    """{stage: flags of its script's --help, or None when the script does not exist} (conftest's `script_help`:
    each script's --help runs once per test run, shared with test_conventions.py)."""
    def run(stage):
        script = REPO / SCRIPTS[stage]
        if not script.is_file():
            return stage, None
        result = script_help(script)
        assert result["returncode"] == 0, f"{SCRIPTS[stage]} --help failed:\n{result['stderr'][-2000:]}"
        return stage, help_flags(result["stdout"])
    return dict(run(stage) for stage in STAGES)


def parse_dry_run(text: str) -> list:
    """Commands of a dry run (comment lines skipped) -> [{"launcher", "script", "flags": {name: [values]}}]."""
    commands = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#") or line.startswith("sbatch "):
            continue
        tokens = shlex.split(line)
        at = next(i for i, token in enumerate(tokens) if token.endswith(".py"))
        flags, name = {}, None
        for token in tokens[at + 1:]:
            if token.startswith("--"):
                name = token[2:].split("=")[0]
                flags.setdefault(name, [])
                if "=" in token:
                    flags[name].append(token.split("=", 1)[1])
            else:
                assert name is not None, f"a value before any flag in: {line}"
                flags[name].append(token)
        commands.append({"launcher": tokens[:at], "script": Path(tokens[at]).name, "flags": flags, "line": line})
    return commands


@pytest.fixture(scope="module")
def dry_runs():
    """{stage: parsed commands of `bash benchmark/slurm/<stage>.sbatch --dry-run`} (the knobs' defaults)."""
    out = {}
    for stage in STAGES:
        result = bash(str(SLURM / f"{stage}.sbatch"), "--dry-run")
        assert result.returncode == 0, result.stderr
        out[stage] = parse_dry_run(result.stdout)
    return out


def one(command: dict, flag: str) -> str:
    """The single value of `flag` in a parsed command."""
    values = command["flags"][flag]
    assert len(values) == 1, f"--{flag} takes one value, got {values}: {command['line']}"
    return values[0]


def world_size(command: dict) -> int:
    """Processes of an `accelerate launch --config_file X` command (its --num_processes, else X's)."""
    launcher = command["launcher"]
    assert launcher[:2] == ["accelerate", "launch"], f"not an accelerate launch: {command['line']}"
    if "--num_processes" in launcher:
        return int(launcher[launcher.index("--num_processes") + 1])
    config = yaml.safe_load((REPO / launcher[launcher.index("--config_file") + 1]).read_text())
    return int(config["num_processes"])


@pytest.mark.parametrize("stage", STAGES)
def test_dry_run_flags_exist_in_help(stage, dry_runs, helps):
    flags = helps[stage]
    if flags is None:  # not skipped: a launcher for a script that is not there is a failure to see
        pytest.fail(f"{SCRIPTS[stage]} does not exist yet: cannot check the flags that "
                    f"benchmark/slurm/{stage}.sbatch passes to it")
    assert dry_runs[stage], f"the dry run of {stage}.sbatch printed no command"
    for command in dry_runs[stage]:
        assert command["script"] == SCRIPTS[stage]
        unknown = sorted(set(command["flags"]) - flags)
        assert not unknown, f"{SCRIPTS[stage]} has no flag(s) {unknown}: {command['line']}"
        assert "gradient_accumulation_steps" not in command["flags"], "derived by the scripts, never passed"


@pytest.mark.parametrize("stage", TRAINING)
def test_global_batch_is_the_papers_for_every_size(stage, dry_runs):
    defaults = args_defaults(REPO / SCRIPTS[stage]) if (REPO / SCRIPTS[stage]).is_file() else {}
    seen_models = set()
    for command in dry_runs[stage]:
        flags = command["flags"]
        world = world_size(command)
        assert world == PAPER_GPUS, f"the paper's runs use 8 GPUs, this one {world}: {command['line']}"
        if "batch_size" in flags:
            batch = int(one(command, "batch_size"))
        else:
            assert "batch_size" in defaults, f"{SCRIPTS[stage]}: no --batch_size flag and no default to read"
            batch = defaults["batch_size"]
        micro = int(one(command, "local_micro_batch_size")) if "local_micro_batch_size" in flags \
            else defaults["local_micro_batch_size"]
        minibatches = int(one(command, "num_minibatches")) if "num_minibatches" in flags \
            else defaults.get("num_minibatches", 1)
        assert batch == PAPER_BATCH[stage], f"global batch {batch}, paper {PAPER_BATCH[stage]}: {command['line']}"
        assert batch % (micro * world * minibatches) == 0, (
            f"batch {batch} is not a multiple of micro {micro} x {world} ranks x {minibatches} minibatches")
        seen_models.add(one(command, "output_dir").split("/")[2])  # models/EleutherAI/<model>/<stage>_<seed>
    assert len(seen_models) == len(PAPER_MODELS)


@pytest.mark.parametrize("stage", ("sft", "reward", "dpo", "ppo", "judge"))
def test_sweep_covers_models_x_seeds_in_deterministic_folders(stage, dry_runs):
    commands = dry_runs[stage]
    assert len(commands) == len(PAPER_MODELS) * len(PAPER_SEEDS)
    expected = [f"models/{model}/{stage}_{seed}" for model in PAPER_MODELS for seed in PAPER_SEEDS]
    assert [one(command, "output_dir") for command in commands] == expected  # index i = MODELS[i/4], SEEDS[i%4]
    # every seed trains with its own seed, and the judge draws each seed's A/B order with it
    assert [one(command, "seed") for command in commands] == list(PAPER_SEEDS) * len(PAPER_MODELS)


def test_each_stage_reads_the_previous_stages_folder(dry_runs):
    data = one(dry_runs["preprocess"][0], "output_dir")
    assert one(dry_runs["preprocess"][0], "base_model") == PAPER_MODELS[0]  # one tokenizer for every Pythia size
    for i, (model, seed) in enumerate((m, s) for m in PAPER_MODELS for s in PAPER_SEEDS):
        sft, reward, dpo, ppo, judge = (dry_runs[stage][i] for stage in ("sft", "reward", "dpo", "ppo", "judge"))
        assert one(sft, "base_model") == model and one(ppo, "base_model") == model
        for command in (sft, reward, dpo, ppo):
            assert one(command, "query_dataset") == f"{data}/sft"
        for command in (reward, dpo):
            assert one(command, "label_dataset") == f"{data}/preference"
        for command in (reward, dpo, ppo):
            assert one(command, "sft_model_path") == one(sft, "output_dir")
        assert one(ppo, "reward_model_path") == one(reward, "output_dir")
        tables = dict(table.split("=", 1) for table in judge["flags"]["tables"])
        assert tables == {f"{method}__seed{seed}": f"{one(source, 'output_dir')}/eval_validation.csv"
                          for method, source in (("sft", sft), ("ppo", ppo), ("dpo", dpo))}
        assert sorted(judge["flags"]["pairs"]) == [f"dpo__seed{seed}:sft__seed{seed}", f"ppo__seed{seed}:sft__seed{seed}"]


@pytest.mark.parametrize("stage", TRAINING)
def test_training_tasks_resume_after_a_requeue(stage, dry_runs):
    header = (SLURM / f"{stage}.sbatch").read_text()
    assert re.search(r"^#SBATCH --requeue$", header, re.M), f"{stage}.sbatch is not requeueable"
    for command in dry_runs[stage]:
        assert "resume" in command["flags"] and int(one(command, "save_every")) > 0, command["line"]


def test_every_requeueable_task_is_warned_before_its_time_limit():
    """A task that asks to be requeued gets USR1 ahead of its time limit (common.sh requeues it then): without the
    signal, a task killed at its limit ends FAILED/TIMEOUT and SLURM never requeues it."""
    for path in sorted(SLURM.glob("*.sbatch")):
        header = path.read_text()
        if re.search(r"^#SBATCH --requeue$", header, re.M):
            assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", header, re.M), path.name


def test_every_requeued_attempt_appends_to_its_log_and_training_takes_the_node_s_memory():
    """A requeued task keeps its job id, so its --output file is the same: opened for appending, the attempt that
    failed (a node failure's traceback) stays readable. A training task holds 8 ranks, each loading its models in
    fp32 in host memory first (PPO: four models a rank): --exclusive alone leaves the memory to the cluster's default."""
    for path in sorted(SLURM.glob("*.sbatch")):
        header = path.read_text()
        assert re.search(r"^#SBATCH --open-mode=append$", header, re.M), path.name
        if path.stem in TRAINING:
            assert re.search(r"^#SBATCH --mem=0$", header, re.M), path.name


def test_offload_exactly_for_6_9b_ppo_and_every_rank_evaluates_the_same_number_of_batches(dry_runs):
    for stage in TRAINING:
        for command in dry_runs[stage]:
            big = "6.9b" in command["line"].split(" --output_dir ")[1].split()[0]
            assert ("offload" in command["flags"]) == (stage == "ppo" and big), command["line"]
            if "offload" in command["flags"]:
                # ZeRO-3 engines gather parameters collectively: every rank must run as many eval
                # forwards as every other, or the run hangs (ppo.py shards rank r: r, r+8, ...).
                eval_batch = int(one(command, "local_eval_batch_size"))
                for split, rows in EVAL_ROWS.items():
                    batches = {math.ceil(len(range(rank, rows, PAPER_GPUS)) / eval_batch) for rank in range(PAPER_GPUS)}
                    assert len(batches) == 1, f"{split}: ranks run {sorted(batches)} eval batches: {command['line']}"


def test_ppo_samples_with_the_fast_path_at_every_size(dry_runs):
    """knobs.sh's FAST_SAMPLING=1 (measured on a GPU: benchmark/results/gpu_check.md) reaches every PPO task."""
    assert dry_runs["ppo"]
    for command in dry_runs["ppo"]:
        assert "fast_sampling" in command["flags"], command["line"]
    for stage in TRAINING:
        if stage != "ppo":
            assert not any("fast_sampling" in command["flags"] for command in dry_runs[stage])


def test_preprocess_takes_more_flags_only_when_asked(dry_runs):
    """knobs.sh's PREPROCESS_FLAGS is empty: preprocess runs with its defaults (it fails on a bad source row or a
    length that differs from its flag, saying which flag to pass); PREPROCESS_FLAGS reaches preprocess, and no other
    stage, word for word."""
    assert dry_runs["preprocess"] and set(dry_runs["preprocess"][0]["flags"]) == {"base_model", "output_dir"}
    flags = "--drop_bad_rows --max_sft_query_response_length 563"
    for stage in STAGES:
        result = bash(str(SLURM / f"{stage}.sbatch"), "--dry-run", env={"PREPROCESS_FLAGS": flags})
        assert result.returncode == 0, result.stderr
        commands = parse_dry_run(result.stdout)
        assert commands
        assert all(("drop_bad_rows" in command["flags"]) == (stage == "preprocess") for command in commands)
        if stage == "preprocess":
            assert commands[0]["line"].endswith(" " + flags) and one(commands[0], "max_sft_query_response_length") == "563"


def test_ppo_compiles_its_training_layers_unless_told_not_to(dry_runs):
    """knobs.sh's COMPILE_TRAINING=1 (timed inside ppo.py on a GPU and as exact as the eager pass:
    benchmark/results/gpu_check.md, 2026-11-30) reaches every PPO task and no other stage's; COMPILE_TRAINING=0 none."""
    for stage in STAGES:
        assert dry_runs[stage] and all(("compile_training" in command["flags"]) == (stage == "ppo")
                                       for command in dry_runs[stage]), stage
    result = bash(str(SLURM / "ppo.sbatch"), "--dry-run", env={"COMPILE_TRAINING": "0"})
    assert result.returncode == 0, result.stderr
    commands = parse_dry_run(result.stdout)
    assert commands and not any("compile_training" in command["flags"] for command in commands)


def test_accelerate_config_is_the_papers():
    config = yaml.safe_load((REPO / "benchmark" / "accelerate" / "deepspeed_zero2.yaml").read_text())
    assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == 2
    assert config["mixed_precision"] == "bf16" and config["num_processes"] == PAPER_GPUS
    assert config["deepspeed_config"]["offload_optimizer_device"] == "none"


def test_knobs_table_has_the_papers_sizes():
    result = bash("-c", "source benchmark/knobs.sh && for m in $MODELS; do knobs $m && "
                        'echo "$m $PPO_MICRO $PPO_ROLLOUT $PPO_OFFLOAD"; done; echo "$SEEDS"; knobs gpt2')
    assert result.returncode != 0 and "no knobs for model 'gpt2'" in result.stderr  # an unknown model fails
    lines = result.stdout.splitlines()
    assert lines[:3] == [f"{PAPER_MODELS[0]} 16 64 0", f"{PAPER_MODELS[1]} 4 32 0", f"{PAPER_MODELS[2]} 1 4 1"]
    assert lines[3].split() == list(PAPER_SEEDS)


def test_pipeline_chains_the_stages_with_dependencies(dry_runs):
    result = launch("--dry-run")
    assert result.returncode == 0, result.stderr
    submits = {Path(line.split()[-1]).stem: line for line in result.stdout.splitlines() if line.startswith("sbatch ")}
    assert list(submits) == list(STAGES)
    assert "--dependency" not in submits["preprocess"] and "--array" not in submits["preprocess"]
    assert "--dependency=afterok:<preprocess job id>" in submits["sft"]
    for stage, needs in (("reward", ["sft"]), ("dpo", ["sft"]), ("ppo", ["reward"]), ("judge", ["ppo", "dpo"])):
        assert "--array=0-11" in submits[stage]
        assert f"--dependency={','.join(f'aftercorr:<{need} job id>' for need in needs)}" in submits[stage]
    # the pipeline's dry run prints the stage launchers' own dry runs
    commands = parse_dry_run(result.stdout)
    assert [c["line"] for c in commands] == [c["line"] for stage in STAGES for c in dry_runs[stage]]
    for stage in STAGES:  # the training stages ask SLURM for GPUS_PER_NODE GPUs and start as many processes
        assert ("--gpus-per-task=8" in submits[stage]) == (stage in TRAINING), submits[stage]
    result4 = launch("--dry-run", "sft", "ppo", env={"GPUS_PER_NODE": "4"})
    assert result4.returncode == 0 and result4.stdout.count("--gpus-per-task=4 ") == 2, result4.stdout
    assert {world_size(c) for c in parse_dry_run(result4.stdout)} == {4}
    # a subset: the array shrinks and the tasks follow
    result = launch("--dry-run", "ppo", env={"MODELS": PAPER_MODELS[2], "SEEDS": "1 2"})
    assert "--array=0-1 " in result.stdout and "--dependency" not in result.stdout
    assert [one(c, "output_dir") for c in parse_dry_run(result.stdout)] == [f"models/{PAPER_MODELS[2]}/ppo_{s}" for s in (1, 2)]


def test_launch_refuses_a_gpu_count_that_does_not_divide_a_batch():
    """GPUS_PER_NODE x a rank's micro-batch must divide each stage's global batch, or every task would refuse at its
    start after waiting for a node: launch.sh refuses first, naming the stage, the model and the knob. Its batches
    are the scripts' defaults."""
    source = (REPO / "benchmark" / "launch.sh").read_text()
    batches = dict(re.findall(r"\[(\w+)\]=(\d+)", re.search(r"declare -A BATCH=\((.*)\)", source).group(1)))
    assert {stage: int(batch) for stage, batch in batches.items()} == {
        stage: args_defaults(REPO / SCRIPTS[stage])["batch_size"] for stage in TRAINING}
    result = launch("--dry-run", env={"GPUS_PER_NODE": "3"})
    assert result.returncode == 1 and "sbatch" not in result.stdout, result.stdout
    assert ("GPUS_PER_NODE=3 does not fit sft at EleutherAI/pythia-1b-deduped: its batch of 128 is not a multiple of "
            "3 GPUs x its micro-batch 1 (SFT_MICRO") in result.stderr, result.stderr
    # 2.8B PPO: 512 / (32 x 4) = 4; 1B PPO: 512 / (32 x 16) = 1; the other stages' 64 / 32 = 2
    assert launch("--dry-run", env={"GPUS_PER_NODE": "32"}).returncode == 0
    result = launch("--dry-run", "ppo", env={"GPUS_PER_NODE": "64"})
    assert result.returncode == 1 and "ppo at EleutherAI/pythia-1b-deduped: its batch of 512" in result.stderr
    assert launch("--dry-run", "judge", env={"GPUS_PER_NODE": "3"}).returncode == 0


FAKE_SRUN = r"""#!/usr/bin/env bash
echo "srun: $*"
out=; previous=
for arg in "$@"; do [[ $previous == --output_dir ]] && out=$arg; previous=$arg; done
if [[ -n ${FAKE_PROGRESS:-} ]]; then  # a run that gets one update further: its checkpoint, complete
  last=0
  for path in "$out"/checkpoints/update_*; do [[ -e $path ]] && ((${path##*_} > last)) && last=${path##*_}; done
  mkdir -p "$out/checkpoints/update_$((last + 1))" && echo {} > "$out/checkpoints/update_$((last + 1))/trainer_state.json"
  echo "fake run: saved checkpoints/update_$((last + 1))"
fi
sleep "${FAKE_SLEEP:-0}"
"""


def test_a_task_runs_skips_when_done_and_requeues_itself(tmp_path):
    """Under a fake srun / scontrol (and a python whose torch sees a GPU): task 5 runs its command with srun;
    a finished run is skipped, or with PUSH=1 started to be pushed again; USR1 (the time-limit warning) calls `scontrol requeue <array job>_<task>`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\necho "scontrol: $*"\n')
    (bin_dir / "python").write_text("#!/usr/bin/env bash\nexit 0\n")  # the CUDA check finds nothing wrong
    for tool in ("srun", "scontrol", "python"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT_ROOT": str(tmp_path / "models"), "SLURM_JOB_ID": "77",
           "SLURM_ARRAY_JOB_ID": "70", "SLURM_SUBMIT_DIR": str(REPO)}
    result = bash(str(SLURM / "reward.sbatch"), env={**env, "SLURM_ARRAY_TASK_ID": "5"})
    assert result.returncode == 0, result.stderr
    out = tmp_path / "models" / PAPER_MODELS[1] / "reward_55513"
    assert ("srun: accelerate launch --config_file benchmark/accelerate/deepspeed_zero2.yaml --num_processes 8 "
            "reward.py") in result.stdout
    assert f"--output_dir {out} " in result.stdout and "--resume" in result.stdout

    out.mkdir(parents=True)
    (out / "eval_metrics.json").write_text("{}")
    result = bash(str(SLURM / "reward.sbatch"), env={**env, "SLURM_ARRAY_TASK_ID": "5"})
    assert result.returncode == 0 and "nothing to do" in result.stdout and "srun:" not in result.stdout
    # PUSH=1: the script starts (with --resume --push_to_hub it trains nothing and pushes the finished run again)
    result = bash(str(SLURM / "reward.sbatch"), env={**env, "SLURM_ARRAY_TASK_ID": "5", "PUSH": "1"})
    assert result.returncode == 0 and "it starts only to push it to the Hub again (PUSH=1)" in result.stdout
    assert "srun: accelerate launch" in result.stdout and "--resume" in result.stdout
    assert "--push_to_hub" in result.stdout, result.stdout
    # preprocessing is no training stage: done is done, whatever flags it was given
    data = tmp_path / "data"
    data.mkdir()
    (data / "args.json").write_text("{}")
    result = bash(str(SLURM / "preprocess.sbatch"), env={**env, "DATA": str(data), "PUSH": "1",
                                                          "PREPROCESS_FLAGS": "--push_to_hub"})
    assert result.returncode == 0 and "nothing to do" in result.stdout and "srun:" not in result.stdout, result.stdout

    def warned(progress: bool, stage: str = "reward", **extra) -> tuple:  # task 4 under USR1 while srun runs
        process = subprocess.Popen(["bash", str(SLURM / f"{stage}.sbatch")], cwd=REPO, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env={**ENV, **env, "SLURM_ARRAY_TASK_ID": "4", "FAKE_SLEEP": "5",
                                        **({"FAKE_PROGRESS": "1"} if progress else {}), **extra})
        started = []
        # Signalled once srun has started, so the USR1 trap is set, and, with progress, once the fake run has
        # saved its checkpoint: a fixed wait can come too early on a loaded machine.
        for line in process.stdout:
            started.append(line)
            if line.startswith("fake run: saved ") if progress else line.startswith("srun: "):
                break
        process.send_signal(signal.SIGUSR1)
        signalled = time.monotonic()
        stdout, stderr = process.communicate(timeout=30)
        outcome.update(returncode=process.returncode, seconds=time.monotonic() - signalled)
        return "".join(started) + stdout, stderr

    outcome = {}
    stdout, _ = warned(progress=True)  # the attempt got further (a checkpoint past its start): requeued
    assert "scontrol: requeue 70_4" in stdout, stdout
    stdout, stderr = warned(progress=False)  # it did not (the final evaluation outlasts the limit): not again
    assert "scontrol:" not in stdout and "not requeueing 70_4: this attempt saved no checkpoint past update 1" in stderr
    assert "longer time limit" in stderr
    # and the job goes on: the run may still finish before the limit (srun, 5 s here, ends as it would have)
    assert outcome["returncode"] == 0 and outcome["seconds"] > 3, outcome
    # preprocessing starts over at every attempt: at its time limit it is not requeued to meet the limit again
    stdout, stderr = warned(progress=False, stage="preprocess", DATA=str(tmp_path / "unfinished_data"),
                            SLURM_ARRAY_JOB_ID="", SLURM_ARRAY_TASK_ID="")  # one job, no array
    assert "srun: python preprocess_tldr.py" in stdout and "scontrol:" not in stdout, stdout
    assert "preprocess: not requeueing 77: its script cannot resume" in stderr and "longer one" in stderr, stderr
    assert outcome["returncode"] == 0, outcome


def test_a_sweep_larger_than_the_header_s_array_is_refused_when_submitted_directly(tmp_path):
    """`sbatch <stage>.sbatch` takes the header's --array=0-11 (3 models x 4 seeds): with SEEDS of 5 the tasks 12-14
    would never be submitted, silently. Every task refuses then, naming the --array to pass; an array that
    benchmark/launch.sh submitted (SWEEP_ARRAY) or the default sweep runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "python").write_text("#!/usr/bin/env bash\nexit 0\n")  # the CUDA check finds nothing wrong
    for tool in ("srun", "python"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT_ROOT": str(tmp_path / "models"), "SLURM_JOB_ID": "77",
           "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "0",
           "SLURM_ARRAY_TASK_MAX": "11", "SLURM_SUBMIT_DIR": str(REPO)}
    five_seeds = {"SEEDS": "44413 55513 66613 77713 88813"}
    result = bash(str(SLURM / "sft.sbatch"), env={**env, **five_seeds})
    assert result.returncode == 2 and "srun:" not in result.stdout, result.stdout + result.stderr
    assert ("sft: the sweep has 15 tasks (MODELS x SEEDS) and this array the header's 0-11: submit it with "
            "benchmark/launch.sh, or sbatch --array=0-14 benchmark/slurm/sft.sbatch") in result.stderr, result.stderr
    for fine in ({**five_seeds, "SWEEP_ARRAY": "0-14"}, {}, {**five_seeds, "SLURM_ARRAY_TASK_MAX": "14"}):
        result = bash(str(SLURM / "sft.sbatch"), env={**env, **fine})
        assert result.returncode == 0 and "srun: accelerate launch" in result.stdout, (fine, result.stderr)


def test_a_training_run_stops_before_the_time_limit_and_its_task_requeues(tmp_path):
    """Under SLURM a training run gets --stop_after_minutes: the job's time left (squeue's %L) less
    STOP_MARGIN_MINUTES (20). A run that exits 0 without its DONE file stopped there, and the task requeues itself;
    without a time limit (UNLIMITED) the flag is left out and nothing is requeued. A job with no more than the
    margin left starts nothing and fails, naming the fix (else each requeue would stop at once, forever)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)  # exits 0, writes no DONE file; with FAKE_PROGRESS a checkpoint further
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\necho "scontrol: $*"\n')
    (bin_dir / "squeue").write_text('#!/usr/bin/env bash\necho "$FAKE_LEFT"\n')
    (bin_dir / "python").write_text("#!/usr/bin/env bash\nexit 0\n")  # the CUDA check finds nothing wrong
    for tool in ("srun", "scontrol", "squeue", "python"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT_ROOT": str(tmp_path / "models"), "SLURM_JOB_ID": "77",
           "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "5", "SLURM_SUBMIT_DIR": str(REPO), "FAKE_PROGRESS": "1"}
    for left in ("08:59", "20:59"):
        result = bash(str(SLURM / "ppo.sbatch"), env={**env, "FAKE_LEFT": left})
        assert result.returncode == 1 and "srun:" not in result.stdout and "scontrol:" not in result.stdout
        assert f"the job has {int(left[:2])} minutes left" in result.stderr and "SBATCH_TIMELIMIT" in result.stderr
    for left, minutes in (("1-02:30:00", 1570), ("45:08", 25), ("21:00", 1), ("UNLIMITED", None)):
        result = bash(str(SLURM / "ppo.sbatch"), env={**env, "FAKE_LEFT": left})
        assert result.returncode == 0, result.stderr
        srun = next(line for line in result.stdout.splitlines() if line.startswith("srun: "))
        assert ("--stop_after_minutes" in srun) == (minutes is not None), (left, srun)
        if minutes is not None:
            assert srun.endswith(f"--stop_after_minutes {minutes}"), (left, srun)
        assert ("scontrol: requeue 70_5" in result.stdout) == (minutes is not None), (left, result.stdout)
    # a run that finished (its DONE file written) is not requeued
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\necho "srun: $*"; mkdir -p "$OUT_DIR"; echo {} > "$OUT_DIR/eval_metrics.json"\n')
    out = tmp_path / "models" / PAPER_MODELS[1] / f"ppo_{PAPER_SEEDS[1]}"
    result = bash(str(SLURM / "ppo.sbatch"), env={**env, "FAKE_LEFT": "3:00:00", "OUT_DIR": str(out)})
    assert result.returncode == 0 and "--stop_after_minutes 160" in result.stdout, result.stderr
    assert "scontrol: requeue" not in result.stdout


def test_a_training_task_stops_at_once_on_a_node_without_cuda(tmp_path):
    """This machine has no GPU: a training task says so, naming its torch's CUDA build (none for CI's CPU build;
    pip gives a CUDA build on Pythons without a CPU wheel here), and never reaches srun; the GPU-free stages
    (preprocess, judge) still run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\necho "srun: $*"\n')
    (bin_dir / "srun").chmod(0o755)
    python_dir = Path(sys.executable).parent  # the test's own python and torch
    build = torch.version.cuda or "none, a CPU-only torch"
    env = {"PATH": f"{bin_dir}:{python_dir}:{os.environ['PATH']}", "OUT_ROOT": str(tmp_path / "models"),
           "SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "0", "SLURM_SUBMIT_DIR": str(REPO)}
    for stage in ("sft", "reward", "dpo", "ppo"):
        result = bash(str(SLURM / f"{stage}.sbatch"), env=env)
        assert result.returncode != 0 and "srun:" not in result.stdout, result.stdout
        assert f"sees no CUDA GPU (CUDA build: {build}" in result.stderr, result.stderr
        assert "Nothing was started" in result.stderr
    result = bash(str(SLURM / "preprocess.sbatch"), env=env)
    assert result.returncode == 0 and "srun: python preprocess_tldr.py" in result.stdout, result.stderr


def test_judge_task_runs_again_until_a_run_finished_with_no_row_left_to_retry(tmp_path):
    """judge.py writes results.json after every run, also a stopped one or one with failed rows: the task
    counts as done only when the run was not stopped and no failed row is left that a rerun would ask again, and
    only for the judge model it was run with (JUDGE_MODEL changed: the new judge's run is not done)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\necho "srun: $*"\n')
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "OUT_ROOT": str(tmp_path / "models"),
           "SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "0", "SLURM_SUBMIT_DIR": str(REPO),
           "JUDGE_MODEL": "judge-test"}
    out = tmp_path / "models" / PAPER_MODELS[0] / f"judge_{PAPER_SEEDS[0]}"
    out.mkdir(parents=True)
    for stopped, failures, runs, model in ((None, [{"row": 3, "asked_by_rerun": True}], True, "judge-test"),
                                           ("401 Unauthorized", [], True, "judge-test"),
                                           (None, [{"row": 3, "asked_by_rerun": False}], False, "judge-test"),
                                           (None, [], False, "judge-test"),
                                           (None, [], True, "another-judge")):
        (out / "results.json").write_text(json.dumps({"model": model, "this_run": {"stopped": stopped},
                                                      "failures": failures}))
        result = bash(str(SLURM / "judge.sbatch"), env=env)
        assert result.returncode == 0, result.stderr
        assert ("srun: python judge.py --judge openai --model judge-test " in result.stdout) == runs, (
            stopped, failures, result.stdout)
        assert ("nothing to do" in result.stdout) != runs
    # No judge model (the paper's is shut down, judge.py has none by default): the task refuses to start.
    result = bash(str(SLURM / "judge.sbatch"), env={**env, "JUDGE_MODEL": ""})
    assert result.returncode == 1 and "set JUDGE_MODEL" in result.stderr and "srun" not in result.stdout


def test_the_judge_stage_is_submitted_with_a_model_and_one_task_at_a_time():
    """Every judge task's calls share one API key's rate limit: launch.sh runs JUDGE_ARRAY_THROTTLE (1) of them at
    once, whatever ARRAY_THROTTLE sets for the GPU stages, and refuses to submit anything while JUDGE_MODEL or
    OPENAI_API_KEY is unset."""
    result = launch("--dry-run", "ppo", "judge", env={"JUDGE_MODEL": "judge-test"})
    submits = {Path(line.split()[-1]).stem: line for line in result.stdout.splitlines() if line.startswith("sbatch ")}
    assert "--array=0-11%1 " in submits["judge"] and "--array=0-11 " in submits["ppo"]
    judged = [c for c in parse_dry_run(result.stdout) if c["script"] == "judge.py"]
    assert len(judged) == 12 and all(one(c, "model") == "judge-test" for c in judged)
    result = launch("--dry-run", "ppo", "judge", env={"JUDGE_MODEL": "m", "ARRAY_THROTTLE": "3"})
    submits = {Path(line.split()[-1]).stem: line for line in result.stdout.splitlines() if line.startswith("sbatch ")}
    assert "--array=0-11%3 " in submits["ppo"] and "--array=0-11%1 " in submits["judge"]
    result = launch("--dry-run", "judge", env={"JUDGE_MODEL": "m", "JUDGE_ARRAY_THROTTLE": "4"})
    assert "--array=0-11%4 " in result.stdout
    unknown = launch("--dry-run", "sft", env={"MODELS": "EleutherAI/pythia-1.4b-deduped"})
    assert unknown.returncode == 1 and "no knobs for model 'EleutherAI/pythia-1.4b-deduped'" in unknown.stderr
    assert "Nothing was submitted" in unknown.stderr and "sbatch" not in unknown.stdout
    refused = launch("sft", "judge")  # no JUDGE_MODEL: nothing reaches sbatch
    assert refused.returncode == 1 and "needs JUDGE_MODEL" in refused.stderr
    assert "Nothing was submitted" in refused.stderr and refused.stdout == ""
    # no API key in the shell the jobs inherit: the same
    refused = launch("sft", "judge", env={"JUDGE_MODEL": "m"})
    assert refused.returncode == 1 and "the judge stage needs OPENAI_API_KEY in this shell" in refused.stderr
    assert "Nothing was submitted" in refused.stderr and refused.stdout == ""


KNOB_FLAGS = {"sft": {"local_micro_batch_size": "SFT_MICRO", "local_eval_batch_size": "SFT_EVAL"},
              "reward": {"local_micro_batch_size": "RM_MICRO", "local_eval_batch_size": "PREF_EVAL"},
              "dpo": {"local_micro_batch_size": "DPO_MICRO", "local_eval_batch_size": "PREF_EVAL"},
              "ppo": {"local_micro_batch_size": "PPO_MICRO", "local_rollout_forward_batch_size": "PPO_ROLLOUT",
                      "local_eval_batch_size": "PPO_EVAL"}}


def test_every_task_gets_its_models_row_of_the_knobs_table(dry_runs):
    """Each training command passes its model's own knobs (benchmark/knobs.sh), each in its own flag: a 2.8B RM
    evaluating 4 pairs a rank instead of 1, or a rollout forward of PPO_MICRO rows, would run out of memory (or
    crawl) only on the cluster."""
    names = sorted({knob for knobs in KNOB_FLAGS.values() for knob in knobs.values()})
    script = "source benchmark/knobs.sh && for m in $MODELS; do knobs $m && echo " + " ".join(f"${n}" for n in names) + "; done"
    result = bash("-c", script)
    assert result.returncode == 0, result.stderr
    table = {model: dict(zip(names, line.split())) for model, line in zip(PAPER_MODELS, result.stdout.splitlines())}
    for stage, flags in KNOB_FLAGS.items():
        for i, command in enumerate(dry_runs[stage]):
            model = PAPER_MODELS[i // len(PAPER_SEEDS)]
            assert {flag: one(command, flag) for flag in flags} == {flag: table[model][knob] for flag, knob in flags.items()}, (
                stage, model, command["line"])


def test_a_failed_task_cancels_its_dependants_and_a_task_past_the_array_is_refused():
    """launch.sh submits every stage with --kill-on-invalid-dep=yes: a failed predecessor cancels the tasks that
    wait on it instead of leaving them pending forever. A task index past the sweep (12 of 0-11) starts nothing."""
    result = launch("--dry-run")
    submits = [line for line in result.stdout.splitlines() if line.startswith("sbatch ")]
    assert len(submits) == len(STAGES) and all("--kill-on-invalid-dep=yes" in line for line in submits), submits
    n = len(PAPER_MODELS) * len(PAPER_SEEDS)
    result = bash(str(SLURM / "sft.sbatch"), env={"SLURM_ARRAY_TASK_ID": str(n)})
    assert result.returncode == 2 and f"array task '{n}' is not in 0-{n - 1}" in result.stderr, result.stderr


def finish(out_root: Path, model: str, run: str) -> None:
    """Mark `out_root/model/run` complete, as its stage's last file does."""
    (out_root / model / run).mkdir(parents=True)
    (out_root / model / run / "eval_metrics.json").write_text("{}")


def test_each_launcher_lists_only_its_tasks_with_work_left(tmp_path):
    """`<stage>.sbatch --pending` prints the indices launch.sh submits: a complete run is left out, unless PUSH=1
    starts a training task to push it again (never a complete preprocessing); the judge's own test of a finished
    run decides for it."""
    env = {"OUT_ROOT": str(tmp_path / "models"), "DATA": str(tmp_path / "data"), "MODELS": PAPER_MODELS[0]}
    finish(tmp_path / "models", PAPER_MODELS[0], "sft_55513")
    finish(tmp_path / "models", PAPER_MODELS[0], "sft_77713")

    def pending(stage: str, **extra) -> list:  # the tasks with work left: "I", or "I:push" for a push only
        result = bash(str(SLURM / f"{stage}.sbatch"), "--pending", env={**env, **extra})
        assert result.returncode == 0, result.stderr
        rows = [line.split("\t") for line in result.stdout.splitlines()]
        assert [row[0] for row in rows] == [str(i) for i in range(len(rows))]  # every task, in order, with its folder
        assert all(row[2] == (str(tmp_path / "data") if stage == "preprocess" else
                              f"{tmp_path / 'models'}/{PAPER_MODELS[0]}/{stage}_{PAPER_SEEDS[int(row[0])]}")
                   for row in rows), rows
        return [row[0] + (":push" if row[1] == "push" else "") for row in rows if row[1] != "done"]
    assert pending("sft") == ["0", "2"]
    assert pending("reward") == ["0", "1", "2", "3"]
    assert pending("sft", PUSH="1") == ["0", "1:push", "2", "3:push"]  # complete, started only to push again
    assert pending("preprocess") == ["0"]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "args.json").write_text("{}")
    for push in ("0", "1"):
        assert pending("preprocess", PUSH=push) == []
    judged = tmp_path / "models" / PAPER_MODELS[0] / "judge_66613"
    judged.mkdir(parents=True)
    (judged / "results.json").write_text(json.dumps({"model": "judge-a", "this_run": {}, "failures": []}))
    for model, expected in (("judge-a", ["0", "1", "3"]), ("judge-b", ["0", "1", "2", "3"]), ("", ["0", "1", "2", "3"])):
        assert pending("judge", JUDGE_MODEL=model) == expected, model
    (judged / "results.json").write_text('{"model": "judge-a", "this')  # torn: not finished, said in one line
    result = bash(str(SLURM / "judge.sbatch"), "--pending", env={**env, "JUDGE_MODEL": "judge-a"})
    assert pending("judge", JUDGE_MODEL="judge-a") == ["0", "1", "2", "3"]
    assert "results.json unreadable" in result.stderr and "Traceback" not in result.stderr


def sha16(path: Path) -> str:
    """The first 16 hex digits of the sha256 of a file: what a stage records of its inputs' args.json."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_a_complete_run_on_inputs_rebuilt_since_is_stale_and_stops_the_sweep(tmp_path):
    """A finished run records the sha256 of its inputs' args.json (input_args_json). Once an input is rebuilt or gone
    (SFT deleted and trained again under a finished RM, the data preprocessed again), the run is `stale`: its task
    refuses to start (neither skipped as complete nor trained over), launch.sh submits nothing and names it. A judge
    whose policies finished again after it judged them judges again."""
    models, data = tmp_path / "models", tmp_path / "data"
    data.mkdir()
    (data / "args.json").write_text('{"seed": 1}')
    sft, reward = models / PAPER_MODELS[0] / "sft_44413", models / PAPER_MODELS[0] / "reward_44413"
    for run in ("sft_44413", "reward_44413"):
        finish(models, PAPER_MODELS[0], run)
    (sft / "args.json").write_text(json.dumps({"base_model": PAPER_MODELS[0], "query_dataset": str(data / "sft"),
                                               "input_args_json": {"--base_model": None,
                                                                   "--query_dataset": sha16(data / "args.json")}}))
    (reward / "args.json").write_text(json.dumps({"sft_model_path": str(sft), "label_dataset": str(data / "preference"),
                                                  "input_args_json": {"--sft_model_path": sha16(sft / "args.json"),
                                                                      "--label_dataset": sha16(data / "args.json")}}))
    env = {**fake_slurm(tmp_path), "OUT_ROOT": str(models), "DATA": str(data), "MODELS": PAPER_MODELS[0],
           "SEEDS": PAPER_SEEDS[0]}

    def state(stage: str) -> str:
        result = bash(str(SLURM / f"{stage}.sbatch"), "--pending", env=env)
        assert result.returncode == 0, result.stderr
        return result.stdout.split("\t")[1]
    assert (state("sft"), state("reward")) == ("done", "done")
    (sft / "args.json").write_text((sft / "args.json").read_text() + "\n")  # SFT trained again
    assert (state("sft"), state("reward")) == ("done", "stale")
    task = bash(str(SLURM / "reward.sbatch"), env={**env, "SLURM_ARRAY_TASK_ID": "0"})
    assert task.returncode == 1 and "Nothing was started" in task.stderr, task.stdout + task.stderr
    assert f"--sft_model_path {sft} was rebuilt since this run used it" in task.stderr
    assert f"rm -r {reward}" in task.stderr
    result = launch("sft", "reward", "ppo", env=env)
    assert result.returncode == 1 and f"\n  {reward} (reward 0)\n" in result.stderr, result.stdout + result.stderr
    assert "Nothing was submitted" in result.stderr and not (tmp_path / "sbatch.log").exists()
    (data / "args.json").unlink()  # the data gone: SFT's run is stale too
    assert (state("sft"), state("reward")) == ("stale", "stale")
    # The judge of PPO, SFT and DPO of that seed: their runs finished again after it judged them.
    judged = models / PAPER_MODELS[0] / "judge_44413"
    judged.mkdir()
    (judged / "results.json").write_text(json.dumps({"model": "judge-a", "this_run": {}, "failures": []}))
    env["JUDGE_MODEL"] = "judge-a"
    assert state("judge") == "done"
    finish(models, PAPER_MODELS[0], "ppo_44413")
    os.utime(models / PAPER_MODELS[0] / "ppo_44413" / "eval_metrics.json",
             (time.time() + 5, time.time() + 5))  # after results.json, whatever the file system's clock resolution
    assert state("judge") == "work"


def test_a_complete_run_made_with_other_flags_is_stale(tmp_path):
    """A finished run whose args.json records a flag of its task's command otherwise (DATA or PREPROCESS_FLAGS
    changed, OUT_ROOT kept) is another run than the sweep asks for: `stale`, and its task refuses to start. The run
    that exactly this command made (its args.json as the script records it) is `done`, and so it stays when only
    flags that change nothing it computes differ (tracking, checkpoints, the fast paths, preprocessing's workers)."""
    import importlib
    from dataclasses import asdict

    import tyro

    env = {"OUT_ROOT": str(tmp_path / "models"), "DATA": str(tmp_path / "data"), "MODELS": PAPER_MODELS[0],
           "SEEDS": PAPER_SEEDS[0]}
    stages = ("preprocess",) + TRAINING
    for stage in stages:  # each run made by its task's command, its args.json written as the script writes it
        (command,) = parse_dry_run(bash(str(SLURM / f"{stage}.sbatch"), "--dry-run", env=env).stdout)
        words = shlex.split(command["line"])
        words = words[next(i for i, word in enumerate(words) if word.endswith(".py")) + 1:]
        args = tyro.cli(importlib.import_module(SCRIPTS[stage][:-3]).Args, args=words, use_underscores=True)
        out = Path(args.output_dir)
        out.mkdir(parents=True)
        (out / "args.json").write_text(json.dumps({**asdict(args), "input_args_json": {}, "git_commit": "abc"}))
        (out / ("args.json" if stage == "preprocess" else "eval_metrics.json")).touch()

    def states(**extra) -> dict:
        def state(stage):
            result = bash(str(SLURM / f"{stage}.sbatch"), "--pending", env={**env, **extra})
            assert result.returncode == 0, result.stderr
            return result.stdout.split("\t")[1]
        return {stage: state(stage) for stage in stages}
    assert set(states().values()) == {"done"}
    assert set(states(TRACK="0", SAVE_EVERY_PPO="7", SAVE_EVERY_SFT="3", FAST_SAMPLING="0", COMPILE_TRAINING="0",
                      PREPROCESS_FLAGS="--num_proc 4").values()) == {"done"}
    assert states(PREPROCESS_FLAGS="--no_check_length_correctness")["preprocess"] == "stale"
    assert states(PREPROCESS_FLAGS="--max_sft_query_response_length 563")["preprocess"] == "stale"
    # The data built again elsewhere, the models' folder kept: every training run was made from the old data.
    (tmp_path / "data2").mkdir()
    moved = states(DATA=str(tmp_path / "data2"))
    assert moved == {"preprocess": "work", "sft": "stale", "reward": "stale", "dpo": "stale", "ppo": "stale"}
    task = bash(str(SLURM / "sft.sbatch"), env={**env, "DATA": str(tmp_path / "data2"), "SLURM_ARRAY_TASK_ID": "0"})
    assert task.returncode == 1 and "Nothing was started" in task.stderr, task.stdout + task.stderr
    assert (f"--query_dataset was '{tmp_path}/data/sft' in this run, the sweep now gives {tmp_path}/data2/sft"
            in task.stderr), task.stderr
    # The mixed precision it ran in (args.json records accelerate's) against the one the sweep's launch asks for.
    sft_args = tmp_path / "models" / PAPER_MODELS[0] / f"sft_{PAPER_SEEDS[0]}" / "args.json"
    sft_args.write_text(json.dumps({**json.loads(sft_args.read_text()), "mixed_precision": "bf16"}))
    assert states()["sft"] == "done"  # the paper's config: bf16
    fp32 = tmp_path / "fp32.yaml"
    fp32.write_text((REPO / "benchmark" / "accelerate" / "deepspeed_zero2.yaml").read_text().replace(
        "mixed_precision: bf16", "mixed_precision: 'no'"))
    assert states(ACCELERATE_CONFIG=str(fp32))["sft"] == "stale"
    task = bash(str(SLURM / "sft.sbatch"), env={**env, "ACCELERATE_CONFIG": str(fp32), "SLURM_ARRAY_TASK_ID": "0"})
    assert task.returncode == 1 and "it ran in mixed precision 'bf16', the sweep's launch now asks for 'no'" in task.stderr


FAKE_SBATCH = r"""#!/usr/bin/env bash
n=$(( $(cat "$FAKE_SBATCH_LOG" 2>/dev/null | wc -l) + 101 ))
if [[ $n == "${FAKE_SBATCH_REFUSES:-}" ]]; then echo "sbatch: error: QOSMaxSubmitJobPerUserLimit" >&2; exit 1; fi
echo "$n $*" >> "$FAKE_SBATCH_LOG"
echo "$n${FAKE_CLUSTER:+;$FAKE_CLUSTER}"
"""
FAKE_SQUEUE = r"""#!/usr/bin/env bash
if [[ -n ${FAKE_SQUEUE_FAILS:-} ]]; then echo "slurm_load_jobs error: Socket timed out" >&2; exit 1; fi
if [[ -n ${FAKE_QUEUE_CLUSTER:-} ]]; then  # the jobs are on that cluster: listed only when -M names it
  [[ " $* " == *" -M $FAKE_QUEUE_CLUSTER "* ]] || exit 0
  echo "CLUSTER: $FAKE_QUEUE_CLUSTER"
fi
printf '%b' "${FAKE_QUEUE:-}"
"""


def fake_slurm(tmp_path) -> dict:
    """A fake sbatch (job ids from 101, each call logged; FAKE_SBATCH_REFUSES=N refuses the call that would get id N;
    FAKE_CLUSTER=c prints "<id>;c" as sbatch --parsable does on a named cluster) and squeue (prints $FAKE_QUEUE;
    FAKE_SQUEUE_FAILS=1 fails) on PATH: the environment for launch(), W&B off (TRACK=0)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("sbatch", FAKE_SBATCH), ("squeue", FAKE_SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SBATCH_LOG": str(tmp_path / "sbatch.log"), "TRACK": "0"}


def test_a_sweep_submitted_again_submits_only_the_tasks_with_work_left(tmp_path):
    """Under a fake sbatch, with SFT complete for seeds 44413 and 66613 and the RM for 44413: SFT is submitted for
    the two other tasks only, the RM's task 0 not at all, and every task waits on the job that holds its own
    predecessor (aftercorr on an array without the task's index would wait for the whole array); a throttled stage's
    arrays run one after another. With every task complete nothing is submitted."""
    log = tmp_path / "sbatch.log"
    models = tmp_path / "models"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "args.json").write_text("{}")  # preprocessing is done
    for run in ("sft_44413", "sft_66613", "reward_44413"):
        finish(models, PAPER_MODELS[0], run)
    env = {**fake_slurm(tmp_path), "OUT_ROOT": str(models), "DATA": str(tmp_path / "data"), "MODELS": PAPER_MODELS[0],
           "SEEDS": " ".join(PAPER_SEEDS[:3]), "ARRAY_THROTTLE": "2"}
    result = launch("preprocess", "sft", "reward", "ppo", env=env)
    assert result.returncode == 0, result.stderr
    assert "preprocess: every task is complete; nothing to submit" in result.stdout
    assert "nothing was submitted" not in result.stdout
    assert "# sft: 2 of 3 tasks complete; submitting tasks 1" in result.stdout
    assert "# ppo: " not in result.stdout  # none complete: nothing to say
    submitted = [line.split(" ", 1) for line in log.read_text().splitlines()]

    def submit(job: str) -> str:
        return dict(submitted)[job]
    assert [args.split()[-1] for _, args in submitted] == [
        "benchmark/slurm/sft.sbatch", *["benchmark/slurm/reward.sbatch"] * 2, *["benchmark/slurm/ppo.sbatch"] * 3]
    assert "--array=1%2 " in submit("101") and "--dependency" not in submit("101")  # SFT: 55513 only
    # the RM: 66613 (its SFT done) at once, 55513 after SFT's job; one array after the other (the throttle)
    assert "--array=2%2 " in submit("102") and "--dependency" not in submit("102")
    assert "--array=1%2 " in submit("103") and "--dependency=aftercorr:101,afterany:102 " in submit("103")
    # PPO: 44413 at once (its RM done); 55513 and 66613 after the RM jobs that hold them, one array each
    assert "--array=0%2 " in submit("104") and "--dependency" not in submit("104")
    assert "--array=1%2 " in submit("105") and "--dependency=aftercorr:103,afterany:104 " in submit("105")
    assert "--array=2%2 " in submit("106") and "--dependency=aftercorr:102,afterany:105 " in submit("106")
    assert "sft: job 101, task 1 (logs:" in result.stdout and "ppo: job 106, task 2 (logs:" in result.stdout
    # no throttle: the arrays of a stage wait only for their predecessors
    log.unlink()
    result = launch("sft", "reward", "ppo", env={**env, "ARRAY_THROTTLE": ""})
    submitted = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert "--array=1 " in submit("103") and "--dependency=aftercorr:101 " in submit("103")
    assert "--array=2 " in submit("106") and "--dependency=aftercorr:102 " in submit("106")
    # all complete: nothing reaches sbatch
    log.unlink()
    for seed in PAPER_SEEDS[:3]:
        for stage in ("sft", "reward"):
            if not (models / PAPER_MODELS[0] / f"{stage}_{seed}").exists():
                finish(models, PAPER_MODELS[0], f"{stage}_{seed}")
    result = launch("preprocess", "sft", "reward", env=env)
    assert result.returncode == 0 and not log.exists(), result.stdout
    assert "every task of preprocess sft reward is complete or still in the queue; nothing was submitted" in result.stdout


def test_launch_without_sbatch_says_where_to_submit_from():
    result = launch("sft", env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 1 and "sbatch is not on PATH: submit from a SLURM login node" in result.stderr
    assert "Nothing was submitted" in result.stderr and result.stdout == ""


def test_a_task_whose_predecessor_is_complete_waits_for_what_that_one_would_have(tmp_path):
    """The data folder is gone but every SFT run is complete: preprocessing runs again, and the RM and DPO tasks wait
    for it (through SFT, which is not submitted), DPO and PPO's waits merge into one for the judge, each job once. With
    PUSH=1 the complete SFT runs are submitted to push again, last and waiting for nothing, and nothing waits for
    them."""
    log = tmp_path / "sbatch.log"
    models = tmp_path / "models"
    for seed in PAPER_SEEDS[:2]:
        finish(models, PAPER_MODELS[0], f"sft_{seed}")
    finish(models, PAPER_MODELS[0], f"reward_{PAPER_SEEDS[1]}")
    finish(models, PAPER_MODELS[0], f"ppo_{PAPER_SEEDS[1]}")
    env = {**fake_slurm(tmp_path), "OUT_ROOT": str(models), "DATA": str(tmp_path / "data"), "MODELS": PAPER_MODELS[0],
           "SEEDS": " ".join(PAPER_SEEDS[:2]), "JUDGE_MODEL": "m", "OPENAI_API_KEY": "k"}
    result = launch(env=env)
    assert result.returncode == 0, result.stderr
    submitted = dict(line.split(" ", 1) for line in log.read_text().splitlines())
    stage_of = {job: args.split()[-1].split("/")[-1].split(".")[0] for job, args in submitted.items()}
    assert list(stage_of.values()) == ["preprocess", "reward", "dpo", "ppo", "judge", "judge"], submitted  # no SFT
    assert "--array=0 " in submitted["102"] and "--dependency=afterok:101 " in submitted["102"]  # the RM of seed 1
    assert "--array=0-1 " in submitted["103"] and "--dependency=afterok:101 " in submitted["103"]  # DPO
    assert "--array=0 " in submitted["104"] and "--dependency=aftercorr:102 " in submitted["104"]  # PPO
    # the judge: seed 1 after its PPO and DPO; seed 2 after DPO and, through its complete PPO, RM and SFT, the data,
    # then (the judge's throttle of 1) after the other array
    assert "--array=0%1 --dependency=aftercorr:104,aftercorr:103 " in submitted["105"], submitted["105"]
    assert "--array=1%1 --dependency=afterok:101,aftercorr:103,afterany:105 " in submitted["106"], submitted["106"]
    assert "# sft: every task is complete; nothing to submit" in result.stdout

    log.unlink()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "args.json").write_text("{}")
    result = launch("sft", "reward", env={**env, "PUSH": "1"})
    assert result.returncode == 0, result.stderr
    submitted = dict(line.split(" ", 1) for line in log.read_text().splitlines())
    assert list(submitted) == ["101", "102", "103"], submitted
    assert "--array=0-1 " in submitted["101"] and "--dependency" not in submitted["101"]  # SFT pushed again
    assert "sft: job 101, tasks 0-1, to push again" in result.stdout
    assert "# sft: 2 of 2 tasks complete; pushing again tasks 0-1 (PUSH=1)" in result.stdout
    # the RM: seed 1 to train, waiting for nothing (its SFT is complete); seed 2 pushed again
    assert "--array=0 " in submitted["102"] and "--dependency" not in submitted["102"]
    assert "--array=1 " in submitted["103"] and "--dependency" not in submitted["103"]

    # seed 2 complete up to the judge, the data gone again: its judge waits for the data once, not once per path
    log.unlink()
    (tmp_path / "data" / "args.json").unlink()
    finish(models, PAPER_MODELS[0], f"dpo_{PAPER_SEEDS[1]}")
    result = launch(env=env)
    assert result.returncode == 0, result.stderr
    judge = [args for args in dict(line.split(" ", 1) for line in log.read_text().splitlines()).values()
             if args.endswith("judge.sbatch")]
    assert any("--array=1%1 --dependency=afterok:101," in args and args.count("afterok:101") == 1 for args in judge), judge


def test_pending_tasks_are_submitted_as_sbatch_ranges(tmp_path):
    """Tasks 1, 4 and 6 of 8 complete: SFT's array is 0,2-3,5,7 (a gap of one index is no range: a complete task
    in it would wait for a node again)."""
    models = tmp_path / "models"
    for model, seed in ((PAPER_MODELS[0], PAPER_SEEDS[1]), (PAPER_MODELS[1], PAPER_SEEDS[0]),
                        (PAPER_MODELS[1], PAPER_SEEDS[2])):
        finish(models, model, f"sft_{seed}")
    env = {"OUT_ROOT": str(models), "MODELS": " ".join(PAPER_MODELS[:2])}
    result = launch("--dry-run", "sft", env=env)
    assert result.returncode == 0, result.stderr
    assert "sbatch --parsable --kill-on-invalid-dep=yes --array=0,2-3,5,7 " in result.stdout, result.stdout
    assert "# sft: 3 of 8 tasks complete; submitting tasks 0,2-3,5,7" in result.stdout


def test_launch_refuses_while_jobs_of_the_sweep_are_queued_or_w_and_b_cannot_log(tmp_path):
    """A task whose folder a queued job of launch.sh's record (runs/slurm/jobs.tsv) writes is not submitted again
    (the two would delete each other's checkpoints), and its dependants wait for that job's task; a queued tldr-* job
    missing from the record is refused, unless QUEUED_OK=1 (another sweep's). TRACK=1 without a W&B login (nor
    WANDB_MODE=offline) would fail every task at its start: refused. A refusal by sbatch partway names the jobs
    already submitted."""
    if LAUNCH_COPY:  # earlier tests' submissions
        (LAUNCH_COPY[0] / "runs" / "slurm" / "jobs.tsv").unlink(missing_ok=True)
    env = {**fake_slurm(tmp_path), "OUT_ROOT": str(tmp_path / "models"), "DATA": str(tmp_path / "data"),
           "MODELS": PAPER_MODELS[0], "SEEDS": " ".join(PAPER_SEEDS[:2])}
    log = tmp_path / "sbatch.log"
    result = launch("sft", env=env)  # job 101: SFT of both seeds, recorded
    assert result.returncode == 0 and len(log.read_text().splitlines()) == 1, result.stderr
    ledger = (LAUNCH_COPY[0] / "runs" / "slurm" / "jobs.tsv").read_text().splitlines()
    sft_out = tmp_path / "models" / PAPER_MODELS[0]
    assert ledger == [f"101\t{i}\tsft\t{sft_out}/sft_{seed}\twork" for i, seed in enumerate(PAPER_SEEDS[:2])]
    # task 1 still queued (task 0 failed and left the queue), beside someone's other job: SFT's task 0 again, the
    # RM of seed 1 after its SFT in this call, the RM of seed 2 after the queued task (job ids go on from 102)
    queue = "101_1 tldr-sft\\n90 other-job\\n"
    result = launch("sft", "reward", env={**env, "FAKE_QUEUE": queue})
    assert result.returncode == 0, result.stderr
    submitted = dict(line.split(" ", 1) for line in log.read_text().splitlines())
    assert "--array=0 " in submitted["102"] and "--dependency" not in submitted["102"]  # SFT's task 0 only
    assert "--array=0 " in submitted["103"] and "--dependency=aftercorr:102 " in submitted["103"]
    assert "--array=1 " in submitted["104"] and "--dependency=afterok:101_1 " in submitted["104"], submitted
    assert "# sft: tasks 1 are in the queue already; 0 of 2 tasks complete; submitting tasks 0" in result.stdout
    log.unlink()
    # a queued job of the sweep that launch.sh did not submit: refused, unless QUEUED_OK=1
    unknown = "77_[0-11] tldr-sft\\n"
    result = launch("sft", env={**env, "FAKE_QUEUE": unknown})
    assert result.returncode == 1 and "jobs of the sweep that launch.sh did not submit are in the queue: " \
        "77_[0-11] (tldr-sft)" in result.stderr, result.stderr
    assert "QUEUED_OK=1" in result.stderr and not log.exists()
    result = launch("sft", env={**env, "FAKE_QUEUE": unknown, "QUEUED_OK": "1"})
    assert result.returncode == 0 and len(log.read_text().splitlines()) == 1, result.stderr
    # a dry run looks at the queue too: it says where a submission would stop, and leaves out what is queued
    result = launch("--dry-run", "sft", env={**env, "FAKE_QUEUE": unknown + "101_1 tldr-sft\\n"})
    assert result.returncode == 0, result.stderr
    assert ("# a submission would stop here: jobs of the sweep that launch.sh did not submit are in the queue: "
            in result.stdout) and "(scancel --name tldr-<stage>); QUEUED_OK=1 submits anyway" in result.stdout
    assert "# sft: tasks 1 are in the queue already;" in result.stdout and "--array=0 " in result.stdout
    log.unlink()
    env["SEEDS"] = PAPER_SEEDS[0]
    # W&B: no key, no netrc entry, online
    no_login = {**env, "TRACK": "1", "WANDB_MODE": "online", "WANDB_API_KEY": "", "NETRC": str(tmp_path / "netrc")}
    result = launch("sft", env=no_login)
    assert result.returncode == 1 and "TRACK=1 logs every training run to W&B" in result.stderr and not log.exists()
    assert launch("sft", env={**no_login, "WANDB_MODE": "offline"}).returncode == 0
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert launch("sft", env=no_login).returncode == 0
    # a W&B server of one's own: its host's login, not api.wandb.ai's
    own = {**no_login, "WANDB_BASE_URL": "https://wandb.example.org:8443/"}
    result = launch("sft", env=own)
    assert result.returncode == 1 and "no W&B login for wandb.example.org" in result.stderr
    (tmp_path / "netrc").write_text("machine wandb.example.org\n  login user\n  password k\n")
    assert launch("sft", env=own).returncode == 0
    assert launch("judge", env={**no_login, "NETRC": str(tmp_path / "none"), "JUDGE_MODEL": "m",
                                "OPENAI_API_KEY": "k"}).returncode == 0  # the judge logs nothing to W&B
    # sbatch refuses the third submission (a QOS limit): the two before are named
    log.unlink()
    result = launch("preprocess", "sft", "reward", env={**env, "FAKE_SBATCH_REFUSES": "103"})
    assert result.returncode == 1 and "QOSMaxSubmitJobPerUserLimit" in result.stderr
    assert "sbatch refused reward (above). Already submitted, and queued as they are: 101 102" in result.stderr


def test_a_later_call_waits_for_the_queued_tasks_of_an_earlier_one(tmp_path):
    """Submitted in two calls, as the README's nodes-without-internet recipe does (the training stages, then the
    judge): the judge waits for the queued PPO and DPO tasks of the first call, and, throttled, for the judge tasks
    still queued from before; a queued push (PUSH=1) is waited for by nothing; a reused job id of another stage is
    no queued task of this one; a named cluster's "<id>;<cluster>" is read as the id; if squeue fails while tasks
    may be queued, nothing is submitted."""
    if LAUNCH_COPY:  # earlier tests' submissions
        (LAUNCH_COPY[0] / "runs" / "slurm" / "jobs.tsv").unlink(missing_ok=True)
    env = {**fake_slurm(tmp_path), "OUT_ROOT": str(tmp_path / "models"), "DATA": str(tmp_path / "data"),
           "MODELS": PAPER_MODELS[0], "SEEDS": PAPER_SEEDS[0], "JUDGE_MODEL": "m", "OPENAI_API_KEY": "k",
           "FAKE_CLUSTER": "gpu"}
    log = tmp_path / "sbatch.log"

    def calls() -> dict:
        return dict(line.split(" ", 1) for line in log.read_text().splitlines())
    result = launch("preprocess", "sft", "reward", "dpo", "ppo", env=env)  # 101-105
    assert result.returncode == 0, result.stderr
    assert "--dependency=aftercorr:102 " in calls()["103"]  # the cluster's name is not part of the id
    everything = "101 tldr-preprocess\\n102_0 tldr-sft\\n103_0 tldr-reward\\n104_0 tldr-dpo\\n105_0 tldr-ppo\\n"
    result = launch("judge", env={**env, "FAKE_QUEUE": everything})
    assert result.returncode == 0, result.stderr
    assert "--array=0%1 --dependency=afterok:105_0,afterok:104_0 " in calls()["106"], calls()["106"]
    assert "warning" not in result.stderr  # its PPO and DPO are queued: no predecessor is missing
    # the same where the jobs run on a cluster named for sbatch: squeue is asked about that cluster
    result = launch("--dry-run", "judge", env={**env, "FAKE_QUEUE": everything, "FAKE_QUEUE_CLUSTER": "gpu",
                                               "SBATCH_CLUSTERS": "gpu"})
    assert "--dependency=afterok:105_0,afterok:104_0 " in result.stdout, result.stdout
    # the judge again, its task 106_0 still queued: nothing to submit
    result = launch("judge", env={**env, "FAKE_QUEUE": everything + "106_0 tldr-judge\\n"})
    assert result.returncode == 0 and "107" not in calls(), result.stdout
    assert "# judge: tasks 0 are in the queue already; every other task is complete; nothing to submit" in result.stdout
    # another seed's judge (a new task) while the first is queued: after it (the throttle); its own PPO and DPO are
    # neither complete nor queued (assumed done, as any stage left out of a call), what they wait for passes on
    queued = everything + "106_0 tldr-judge\\n"
    result = launch("judge", env={**env, "SEEDS": " ".join(PAPER_SEEDS[:2]), "FAKE_QUEUE": queued})
    assert result.returncode == 0, result.stderr
    assert "--array=1%1 --dependency=afterok:101,afterany:106 " in calls()["107"], calls()["107"]
    # a task whose predecessor is neither complete, nor queued, nor in the call: said (it would stop at its start)
    result = launch("--dry-run", "ppo", env={**env, "SEEDS": " ".join(PAPER_SEEDS[:2]), "FAKE_QUEUE": queued})
    assert result.returncode == 0, result.stderr
    assert (f"# warning: ppo task 1 needs reward task 1 ({tmp_path / 'models'}/{PAPER_MODELS[0]}/reward_{PAPER_SEEDS[1]}),"
            " which is not complete, not queued and not in this call") in result.stderr, result.stderr
    assert "ppo task 0 needs" not in result.stderr  # task 0 is queued itself
    # a job id SLURM gave again to a job of another stage is no queued task of this one
    result = launch("sft", env={**env, "FAKE_QUEUE": "102_0 tldr-ppo\\n", "QUEUED_OK": "1"})
    assert result.returncode == 0 and "--array=0 " in calls()["108"] and calls()["108"].endswith("sft.sbatch")
    # squeue fails while the record says tasks may be queued: nothing is submitted
    result = launch("sft", env={**env, "FAKE_SQUEUE_FAILS": "1"})
    assert result.returncode == 1 and "squeue failed" in result.stderr and "109" not in calls()

    # PUSH=1: a complete SFT run pushed again (job 109); while that push is queued the RM waits for nothing
    finish(tmp_path / "models", PAPER_MODELS[0], f"sft_{PAPER_SEEDS[0]}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "args.json").write_text("{}")
    result = launch("sft", env={**env, "PUSH": "1"})
    assert result.returncode == 0 and "sft: job 109, task 0, to push again" in result.stdout, result.stdout
    result = launch("reward", env={**env, "FAKE_QUEUE": "109_0 tldr-sft\\n"})
    assert result.returncode == 0 and "--dependency" not in calls()["110"], calls()["110"]

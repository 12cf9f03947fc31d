"""Bad flags (issue 16): every training stage checks every flag before it loads or writes anything,
lists all problems at once (each names its flag and what to pass instead), and leaves nothing behind
that would block the corrected command.

The flag checks are pure functions (`<stage>_flag_problems(args, world_size)`), tested in process;
a start of each stage's script (all four in one fresh interpreter, conftest.early_exits) shows they
run first: no model loaded, and no folder or file made, so the corrected command finds the folder as
the bad one did.
"""

import math
import os

import pytest

import dpo
import ppo
import reward
import sft
from conftest import REPO, WORLD, early_exits

BASE = str(WORLD / "pythia-tiny")
STAGES = {"sft.py": (sft, sft.sft_flag_problems), "reward.py": (reward, reward.reward_flag_problems),
          "dpo.py": (dpo, dpo.dpo_flag_problems), "ppo.py": (ppo, ppo.ppo_flag_problems)}
# Flags every stage has, each set to a value that cannot work (a NaN fails every comparison)
COMMON_BAD = {"lr": -1.0, "eps": math.nan, "weight_decay": math.inf, "local_eval_batch_size": 0, "save_every": -3,
              "stop_after_updates": 0, "stop_after_minutes": -5.0, "seed": -1}
# Flags of some stages (the cases: a negative response length, eval batch 0, -16 episodes, ...)
STAGE_BAD = {
    "sft.py": {"total_episodes": -16, "response_length": -1, "temperature": 0.0, "scheduler": "cosine_sometimes"},
    "reward.py": {"total_episodes": -16, "num_eval_samples": 0, "scheduler": "nope"},
    "dpo.py": {"total_episodes": 5, "response_length": -1, "beta": 0.0, "label_smoothing": 0.5},
    "ppo.py": {"total_episodes": -16, "response_length": -1, "gamma": 1.5, "num_ppo_epochs": 0,
               "eval_temperature": math.nan},
}


def bad_args(script):
    """(Args of `script` holding every bad value of COMMON_BAD and STAGE_BAD, {flag: bad value})."""
    bad = {**COMMON_BAD, **STAGE_BAD[script]}
    return STAGES[script][0].Args(**bad), bad


@pytest.mark.parametrize("script", list(STAGES))
def test_every_bad_flag_is_listed_at_once(script):
    module, flag_problems = STAGES[script]
    args, bad = bad_args(script)
    problems = flag_problems(args, 1)
    for flag in bad:  # each bad flag has its own line, with what to pass instead
        lines = [line for line in problems if line.startswith(f"--{flag} ")]
        assert len(lines) == 1 and ("want" in lines[0] or "not a positive multiple" in lines[0]), (flag, problems)
    assert len(problems) == len(bad)
    good = module.Args(base_model=BASE) if script == "sft.py" else module.Args()
    assert flag_problems(good, 1) == []  # the defaults are fine
    # the batch must split over the ranks: 4 processes cannot share micro-batches of 16 in a batch of 32
    assert any("--local_micro_batch_size" in line for line in flag_problems(module.Args(
        batch_size=32, local_micro_batch_size=16, **({"base_model": BASE} if script == "sft.py" else {})), 4))


def test_a_missing_model_folder_is_named():
    """A path that is neither a folder nor a Hub id: 'no model folder at PATH', not 'Repo id must be in the form'."""
    for path in ("/no/such/folder", "models/tiny/sft_9", "./here"):
        problem = sft.model_path_problem(path, "--base_model")
        assert f"--base_model {path}: no model folder at {path}, and it is not a Hub id either" in problem
    assert sft.model_path_problem(BASE, "--base_model") is None
    assert sft.model_path_problem("EleutherAI/pythia-1b-deduped", "--base_model") is None  # a Hub id
    assert "is a file" in sft.model_path_problem(str(WORLD / "world.json"), "--base_model")
    from transformers import AutoModelForCausalLM
    for module in (sft, reward, dpo, ppo):  # the loaders say it too, for whatever path reaches them
        with pytest.raises(module.SetupError, match="no model folder at /no/such/folder"):
            module.load_fp32(AutoModelForCausalLM, "/no/such/folder", "--sft_model_path")
        with pytest.raises(module.SetupError, match="no tokenizer at /no/such/folder"):
            module.load_tokenizer("/no/such/folder", "--sft_model_path")
        # a Hub id that is not here (offline here; on the Hub, a repository with its runs on branches, main empty)
        with pytest.raises(module.SetupError, match=r"reads? from a download: `hf download someone/sft-runs --revision "
                                                    r"RUN_NAME --local-dir DIR`, then pass DIR"):
            module.load_tokenizer("someone/sft-runs", "--sft_model_path")


@pytest.fixture(scope="module")
def bad_flag_starts(tiny_tldr, tmp_path_factory):
    """{script: (its working folder, the CompletedProcess of its start with every bad flag)}: the four stages'
    starts in one interpreter (conftest.early_exits), each in an empty folder of its own."""
    starts = {}
    for script in STAGES:
        cwd = tmp_path_factory.mktemp("bad_flags")
        _, bad = bad_args(script)
        typed = [token for flag, value in bad.items() for token in (f"--{flag}", str(value))]
        inputs = {"sft.py": ["--base_model", BASE, "--query_dataset", tiny_tldr / "sft"],
                  "ppo.py": ["--query_dataset", tiny_tldr / "sft", "--sft_model_path", BASE, "--reward_model_path", BASE]}
        starts[script] = (cwd, [*inputs.get(script, ["--sft_model_path", BASE]), "--output_dir", cwd / "out", *typed])
    results = early_exits([(cwd, REPO / script, flags) for script, (cwd, flags) in starts.items()],
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return {script: (cwd, result) for (script, (cwd, _)), result in zip(starts.items(), results)}


@pytest.mark.parametrize("script", list(STAGES))
def test_bad_flags_stop_before_anything_is_loaded_or_written(script, bad_flag_starts):
    """The real command line: every bad flag in one message, no model loaded, no folder created."""
    _, bad = bad_args(script)
    tmp_path, result = bad_flag_starts[script]
    assert result.returncode != 0
    assert f"{script} cannot start (nothing was loaded or written)" in result.stderr, result.stderr[-3000:]
    for flag, value in bad.items():  # each named with its value, as typed
        assert f"--{flag} {value}" in result.stderr, (flag, result.stderr[-3000:])
    assert "Loading weights" not in result.stdout + result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # no output folder, no runs/


def test_scheduler_check_judges_as_a_real_optimizer_would():
    """scheduler_problem builds each schedule on SchedulerProbe (no torch optimizer: building one imports
    torch._dynamo, ~2 s of every failed start): the same verdict as on a real torch optimizer, for names that
    build, that need extra arguments and that do not exist."""
    import torch
    from transformers import get_scheduler

    def on_real_optimizer(name):
        try:
            get_scheduler(name, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), num_warmup_steps=0,
                          num_training_steps=1)
        except (ValueError, TypeError) as error:
            return str(error).splitlines()[0]
        return None

    names = ("cosine", "linear", "constant", "constant_with_warmup", "polynomial", "inverse_sqrt",
             "cosine_with_min_lr", "warmup_stable_decay", "cosine_sometimes")
    verdicts = {name: on_real_optimizer(name) for name in names}
    assert verdicts["cosine"] is None and verdicts["warmup_stable_decay"] and verdicts["cosine_sometimes"]
    for module in (sft, reward, dpo):
        for name, error in verdicts.items():
            problem = module.scheduler_problem(name)
            assert (problem is None) == (error is None) and (error is None or error in problem), (module, name)
    for module in (sft, reward, dpo):  # it builds, but steps on a metric the stages never pass
        assert module.scheduler_problem("reduce_lr_on_plateau") == (
            "--scheduler reduce_lr_on_plateau: it needs a metric at every step; want e.g. cosine, linear or constant")


def test_paths_that_cannot_work_are_named(tmp_path):
    """Path flags are checked with the rest: an --output_dir that is a file, a missing --judged_file, a --gold_judge
    folder without world.json; and DPO's --label_smoothing, which IPO has not."""
    a_file, empty = str(WORLD / "world.json"), str(tmp_path)
    for script, (module, flag_problems) in STAGES.items():
        base = {"base_model": BASE} if script == "sft.py" else {}
        assert flag_problems(module.Args(output_dir=a_file, **base), 1) == [
            f"--output_dir {a_file} is a file: choose a folder"], script
    assert reward.reward_flag_problems(reward.Args(judged_file="/no/such.csv", gold_judge=empty), 1) == [
        "--judged_file /no/such.csv: no such file (want judge.py's judged/<run>.csv)",
        f"--gold_judge {empty}: no world.json there (want a tiny world folder)"]
    assert dpo.dpo_flag_problems(dpo.Args(ipo=True, label_smoothing=0.1, gold_judge=empty), 1) == [
        "--label_smoothing 0.1 with --ipo: want 0 (IPO has no label smoothing)",
        f"--gold_judge {empty}: no world.json there (want a tiny world folder)"]
    assert dpo.dpo_flag_problems(dpo.Args(ipo=True, gold_judge=str(WORLD)), 1) == []  # a world folder; IPO alone


def test_a_json_file_edited_into_invalid_json_is_named(tmp_path):
    """An args.json, trainer_state.json or world.json that a hand edit (or a full disk) left invalid: the stages say
    which file and what to do, as a SetupError (its message, no traceback), not a bare JSONDecodeError."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "args.json").write_text('{"lr": 3e-06, "seed": ')  # cut short
    (out / "events.out.tfevents").write_text("")  # the run's other files: output_dir_problem reads its args.json
    for module in (sft, reward, dpo, ppo):
        for read in (lambda: module.output_dir_problem(str(out), {"seed": 1}, ()),
                     lambda: module.recorded_tokenizer_identity(str(out)),
                     lambda: module.load_json(str(out / "args.json"))):
            with pytest.raises(module.SetupError) as raised:
                read()
            assert str(raised.value).startswith(f"{out / 'args.json'} is not valid JSON (Expecting value: line 1"), \
                module.__name__
            assert "remove the folder it is in and run the stage that wrote it again" in str(raised.value)
        assert module.load_json(str(WORLD / "world.json"))["args"]["seed"] == 1  # a valid file reads as json.load reads it
    # and every JSON file the stages read goes through load_json: no bare json.load elsewhere in them
    for script in STAGES:
        source = (REPO / script).read_text()
        assert source.count("json.load(") == 1 and "            return json.load(file)\n" in source, script


# Every range rule of every stage, at its edges, for 2 processes (each rank seeds with seed + rank x 100003, so the
# largest seed shrinks with the world size): {flag: (values refused, values accepted)}. The batch is 8 in micro-batches
# of 4, so that total_episodes 7 is less than one batch.
COMMON_EDGES = {"seed": ([-1, 2 ** 32 - 200006], [0, 2 ** 32 - 200007]), "save_every": ([-1], [0]),
                "stop_after_updates": ([0], [1, None]), "stop_after_minutes": ([-0.5, math.inf, math.nan], [0.0, None]),
                "lr": ([0.0, math.inf], [1e-9]), "eps": ([0.0, math.nan], [1e-9]),
                "weight_decay": ([-1e-9, math.inf], [0.0]), "local_eval_batch_size": ([0], [1])}
STAGE_EDGES = {
    "sft.py": {"total_episodes": ([-8, 7], [0, 8, None]), "num_train_epochs": ([0], [1]),
               "num_eval_samples": ([-1], [0, None]), "response_length": ([0], [1]), "temperature": ([0.0], [0.01]),
               "length_groups": ([0], [1])},
    "reward.py": {"total_episodes": ([-8, 7], [0, 8, None]), "num_train_epochs": ([0], [1]),
                  "num_eval_samples": ([0], [1, None]), "length_groups": ([0], [1])},
    "dpo.py": {"total_episodes": ([-8, 7], [0, 8, None]), "num_train_epochs": ([0], [1]),
               "num_eval_samples": ([-1], [0, None]), "response_length": ([0], [1]), "temperature": ([0.0], [0.01]),
               "beta": ([0.0], [0.01]), "label_smoothing": ([-0.1, 0.5], [0.0, 0.49])},
    "ppo.py": {"total_episodes": ([0, 7], [8]), "eval_every": ([-1], [0]), "num_eval_samples": ([-1], [0, None]),
               "response_length": ([0], [1]), "temperature": ([0.0], [0.01]), "eval_temperature": ([0.0], [0.01]),
               "local_rollout_forward_batch_size": ([0], [1]), "length_groups": ([0], [1]),
               "num_ppo_epochs": ([0], [1]), "kl_coef": ([-0.01, math.inf], [0.0]), "gamma": ([-0.1, 1.1], [0.0, 1.0]),
               "lam": ([-0.1, 1.1], [0.0, 1.0]), "cliprange": ([0.0], [0.01]), "cliprange_value": ([0.0], [0.01]),
               "vf_coef": ([-0.1], [0.0]), "penalty_reward_value": ([math.nan, -math.inf], [-1.0, 0.0])},
}


@pytest.mark.parametrize("script", list(STAGES))
def test_every_range_rule_refuses_past_its_edge_and_keeps_the_edge(script):
    """Each flag with a range, one at a time: a value just past the edge is refused on its own line naming it, the
    edge itself starts (a seed whose last rank's seed would pass 2^32, total_episodes below one batch, a NaN
    penalty reward that would turn every score without EOS into NaN, ...)."""
    module, flag_problems = STAGES[script]
    fixed = {"batch_size": 8, "local_micro_batch_size": 4, **({"base_model": BASE} if script == "sft.py" else {})}
    assert flag_problems(module.Args(**fixed), 2) == []
    for flag, (refused, accepted) in {**COMMON_EDGES, **STAGE_EDGES[script]}.items():
        for value in refused:
            problems = flag_problems(module.Args(**fixed, **{flag: value}), 2)
            assert len(problems) == 1 and problems[0].startswith(f"--{flag} {value}: want "), (flag, value, problems)
        for value in accepted:
            assert flag_problems(module.Args(**fixed, **{flag: value}), 2) == [], (flag, value)


def test_a_missing_base_model_is_a_flag_problem():
    """sft.py names a --base_model that is neither a folder nor a Hub id with the other flags, before any input is
    read; reward.py, dpo.py and ppo.py name a missing --sft_model_path / --reward_model_path with the command that
    makes it, also for a relative path that would read as a Hub id (org/name) but lies under models/ or data/."""
    assert sft.sft_flag_problems(sft.Args(base_model="/no/such/folder", lr=-1.0), 1) == [
        "--lr -1.0: want a finite number > 0",
        "--base_model /no/such/folder: no model folder at /no/such/folder, and it is not a Hub id either (org/name): "
        "pass a folder that exists"]
    for module in (sft, reward, dpo, ppo):
        for path in ("models/sft_1", "data/sft"):
            assert module.input_problem(path, "--sft_model_path", "python sft.py") == (
                f"--sft_model_path {path}: no such folder. Create it with `python sft.py`, or pass --sft_model_path "
                "PATH (a folder or a Hub id)"), module.__name__
        assert module.input_problem("EleutherAI/pythia-1b-deduped", "--sft_model_path", "python sft.py") is None
        assert module.input_problem(str(WORLD), "--query_dataset", "python preprocess_tldr.py") is None


class FakeAccelerator:
    """What start_accelerator reads of an Accelerator: a launch of `num_processes` under DeepSpeed ZeRO `zero_stage`
    (None: no DeepSpeed), on a CPU in fp32."""

    def __init__(self, num_processes, zero_stage):
        from types import SimpleNamespace

        import torch

        self.num_processes, self.device, self.mixed_precision = num_processes, torch.device("cpu"), "no"
        plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
        self.state = SimpleNamespace(deepspeed_plugin=plugin)


@pytest.mark.parametrize("script", list(STAGES))
def test_start_refuses_zero_3_with_the_flags_and_derives_the_sizes(script, monkeypatch):
    """start_accelerator (start_ppo_accelerator): a ZeRO-3 launch is refused in the one start-up message, with the
    bad flags; a good launch gets the derived sizes of its world: 16 = 4 micro-batches of 2 x 2 ranks."""
    module, _ = STAGES[script]
    start = ((lambda args: module.start_ppo_accelerator(args)) if script == "ppo.py" else
             (lambda args: module.start_accelerator(args, getattr(module, f"{script[:-3]}_flag_problems"), script)))
    fixed = {"batch_size": 16, "local_micro_batch_size": 2, **({"base_model": BASE} if script == "sft.py" else {}),
             **({"total_episodes": 32} if script == "ppo.py" else {})}
    monkeypatch.setattr(module, "Accelerator", lambda **kwargs: FakeAccelerator(2, 3))
    with pytest.raises(module.SetupError) as refused:
        start(module.Args(**fixed, lr=-1.0))
    message = str(refused.value)
    assert message.startswith(f"{script} cannot start (nothing was loaded or written):\n  --lr -1.0: want"), message
    assert "DeepSpeed ZeRO stage 3" in message and "deepspeed_zero2.yaml" in message
    for stage in (None, 2):
        monkeypatch.setattr(module, "Accelerator", lambda **kwargs: FakeAccelerator(2, stage))
        args = module.Args(**fixed)
        start(args)
        assert (args.world_size, args.gradient_accumulation_steps, args.local_batch_size, args.micro_batch_size) == (
            2, 4, 8, 4), (stage, script)
        if script == "ppo.py":
            assert (args.num_updates, args.mini_batch_size, args.local_mini_batch_size) == (2, 16, 8)

"""Shared test setup: every test runs offline, on CPU, with tracking disabled.

The environment variables are set here (and not only in `.ci/run`) so that a bare `pytest`
behaves like CI: a Hub id fails at once instead of retrying for ~30 s (../shared/ENV_NOTES.md).
"""

import atexit
import contextlib
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "DS_ACCELERATOR": "cpu",
    "NO_PROXY": "127.0.0.1,localhost",
}.items():
    os.environ.setdefault(_key, _value)
# And for every script the tests start: no bytecode written into the repository, no `datasets` cache written
# into ~/.cache. One environment for all (the tests add to it only what a test is about), so that their starts
# share one fork server (`run_python`). Bytecode: where PYTHONPYCACHEPREFIX names a folder (`.ci/run`, whose
# install compiles none and which unsets PYTHONDONTWRITEBYTECODE), every process of the run writes there what it
# compiled, so each module is compiled once per run, not at every start; without it, none is written.
if not os.environ.get("PYTHONPYCACHEPREFIX"):
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="rlhf-tests-datasets-cache-")  # deleted at exit

# Under pytest-xdist each worker gets its share of the cores (1 each for `.ci/run`'s 2 workers on 2
# cores), and so do the stage scripts it launches: two workers with 2 torch threads each would run 4
# busy threads on 2 cores, and oversubscribed OpenMP threads spin and wait on each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# The stage scripts live at the repository root and are imported by the unit tests.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

# `.ci/run`'s two workers (pytest-xdist, --dist loadfile) take whole test files, in collection order.
# xdist's own order (most tests first) left long files with few tests to the end: one worker then ran
# a 50-75 s file alone. Heaviest first instead (longest processing time first), so that the last files
# are short: pytest 504 s against 557-562 s side by side with warm caches; from a fresh clone with cold
# caches (`.ci/run`) 571-574 s against 581 s, where compiling makes test_ppo.py longer and xdist's order
# nearly balanced already. Seconds per file: `pytest tests -n 2 --dist loadfile --durations=0`, setup and
# calls summed (2026-12-02, ac560a0, an Intel Xeon). A stale table only costs balance, never a test; a file not
# in it counts 10 s.
FILE_SECONDS = {"test_ppo.py": 206, "test_real_path.py": 56, "test_forkserver.py": 52, "test_preprocess_kill.py": 42,
                "test_launchers.py": 36, "test_judge_faults.py": 34, "test_tiny_world.py": 28,
                "test_benchmarks.py": 25, "test_faults_pickle.py": 24, "test_faults_kill.py": 22, "test_dpo.py": 20,
                "test_sft.py": 18, "test_reward.py": 17, "test_tiny_resume.py": 16, "test_judge.py": 13,
                "test_tiny_report.py": 13, "test_rm_diagnostics.py": 12, "test_preprocess_bad_rows.py": 11,
                "test_preprocess.py": 11, "test_ppo_gold_reward.py": 10, "test_sweep_report.py": 8,
                "test_conventions.py": 6, "test_faults_nan.py": 3, "test_faults_tokenizer.py": 1,
                "test_preprocess_bad_flags.py": 1, "test_early_exits.py": 0, "test_faults_flags.py": 0}


def pytest_collection_modifyitems(config, items):
    """Test files heaviest first (FILE_SECONDS); within a file, the order it is written in."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 10))  # a stable sort


WORLD = REPO / "assets" / "tiny_world"  # the committed tiny world (tiny_world.py builds it)
TINY_SH = REPO / "benchmark" / "tiny.sh"


def tiny_lengths():
    """The length flags that benchmark/tiny.sh passes to preprocess_tldr.py, as a list of args."""
    block = re.search(r"TINY_LENGTHS=\((.*?)\)", TINY_SH.read_text(), re.S).group(1)
    return [token for line in block.splitlines() for token in line.split("#")[0].split()]


@pytest.fixture(scope="session")
def tiny_tldr(tmp_path_factory):
    """The tiny world preprocessed exactly as benchmark/tiny.sh does it, once per test session.

    Returns the output folder: sft/, preference/ (load_from_disk), args.json, visuals/. Under pytest-xdist
    (`.ci/run`) the workers share one: the first builds it in the run's common temporary folder while the
    others wait on a lock, so it is built once per run, not once per worker. Tests only read it."""
    from filelock import FileLock

    root = run_folder(tmp_path_factory)
    out, built = root / "tiny_tldr", root / "tiny_tldr.built"
    with FileLock(str(out) + ".lock"):
        if not built.is_file():
            shutil.rmtree(out, ignore_errors=True)  # a worker that failed halfway left it
            out.mkdir()
            preprocess_tiny_world(out)
            built.touch()
    return out


def slice_tiny_tldr(tiny_tldr: Path, root: Path, train_pairs: int, sft_split: str, sft_rows: int) -> None:
    """Write into `root` slices of the preprocessed tiny world: `train_pairs` train pairs and 15 + 7 eval pairs
    (preference/), the first `sft_rows` rows of its SFT `sft_split` (sft/), and its args.json (the pad / eos ids of
    the columns). Odd eval sizes: over 2 processes, the last batch of one rank repeats a row that is then dropped."""
    import datasets

    preference = datasets.load_from_disk(str(tiny_tldr / "preference"))
    sizes = {"train": train_pairs, "validation": 15, "validation_cnndm": 7}
    datasets.DatasetDict({split: preference[split].select(range(n)) for split, n in sizes.items()}).save_to_disk(
        str(root / "preference"))
    sft = datasets.load_from_disk(str(tiny_tldr / "sft"))
    datasets.DatasetDict({sft_split: sft[sft_split].select(range(sft_rows))}).save_to_disk(str(root / "sft"))
    shutil.copy(tiny_tldr / "args.json", root / "args.json")


def one_process(rank=0, processes=1, deepspeed=None):
    """What the stages' helpers use of an Accelerator, on the CPU: rank `rank` of a DDP launch of `processes`
    (DeepSpeed: pass a plugin), its collectives those of a single process."""
    from types import SimpleNamespace

    import torch

    kind = "DEEPSPEED" if deepspeed is not None else "MULTI_CPU" if processes > 1 else "NO"
    return SimpleNamespace(device=torch.device("cpu"), is_main_process=rank == 0, process_index=rank,
                           num_processes=processes, wait_for_everyone=lambda: None,
                           distributed_type=SimpleNamespace(value=kind), mixed_precision="no",
                           state=SimpleNamespace(deepspeed_plugin=deepspeed,
                                                 dynamo_plugin=SimpleNamespace(backend=SimpleNamespace(value="NO"))),
                           unwrap_model=lambda model: model,
                           scaler=None, reduce=lambda tensor, reduction="sum": tensor, print=print, step=1,
                           autocast=contextlib.nullcontext)


def sampler_with_junk_after_eos(tokenizer):
    """A stand-in for a stage's `generate`: every row draws " a cat sat", EOS, then " junk after" (to be cut off)."""
    import torch

    summary = tokenizer(" a cat sat", add_special_tokens=False)["input_ids"]
    junk = tokenizer(" junk after", add_special_tokens=False)["input_ids"]

    def generate(model, queries, pad_token_id, config):
        response = torch.tensor(summary + [tokenizer.eos_token_id] + junk).expand(len(queries), -1)
        return torch.cat((queries, response), 1)

    return generate


def generate_with_scores(model, queries, pad_token_id, config):
    """HF generate as sft.py's and dpo.py's `generate` calls it -> (queries ++ sampled ids, (B, T_resp, V) per-step
    scores): the stages keep only the ids; the tests compare the scores too. The same draws from the same seed."""
    import copy

    import torch
    from transformers import GenerationConfig

    config = copy.deepcopy(config)
    config.return_dict_in_generate, config.output_scores = True, True
    attention_mask = queries != pad_token_id
    saved, model.generation_config = model.generation_config, GenerationConfig()  # as `generate`: no model defaults
    try:
        output = model.generate(input_ids=queries.masked_fill(~attention_mask, 0), attention_mask=attention_mask,
                                generation_config=config)
    finally:
        model.generation_config = saved
    return torch.cat((queries, output.sequences[:, queries.shape[1]:]), 1), torch.stack(output.scores, 1)


@contextlib.contextmanager
def multi_process_slot(processes: int = 2):
    """Hold while a launch of `processes` > 1 ranks runs: under pytest-xdist, one such launch at a time per test run.
    Ranks wait on each other at every collective, so each launch needs all its ranks on a core at once; two
    2-rank launches on CI's 2 cores starve each other: measured on one machine, overlapping, the PPO --offload
    test took 147 s and the bf16 DeepSpeed chain 221 s, against 46 s and 86 s alone. The other worker's
    one-process tests go on meanwhile."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if processes < 2 or not run:
        yield
        return

    from filelock import FileLock

    with FileLock(os.path.join(tempfile.gettempdir(), f"rlhf-tests-{run}-multi-process.lock")):
        yield


def run_folder(tmp_path_factory):
    """The test run's temporary folder: under pytest-xdist the one above every worker's own (shared)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


HELP_ENV = {"COLUMNS": "300", "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}


# The scripts whose --help the tests read (test_conventions.py, test_launchers.py): script_help runs them all
# in one interpreter the first time it is asked for one of them.
HELP_SCRIPTS = [REPO / name for name in ("preprocess_tldr.py", "sft.py", "reward.py", "dpo.py", "ppo.py", "judge.py",
                                         "tiny_world.py")]


@pytest.fixture(scope="session")
def script_help(tmp_path_factory):
    """script_help(path) -> `python <path> --help` as {returncode, stdout, stderr}, run once per test run (under
    pytest-xdist the workers share the results through files, as for `tiny_tldr`): each interpreter start costs
    seconds of imports, and test_conventions.py and test_launchers.py both read every stage's help, so the
    first call runs the --help of every HELP_SCRIPTS script in one interpreter (`early_exits`), each in an
    empty folder of its own. Wide and colourless, so that each flag prints whole."""
    import hashlib
    import json

    from filelock import FileLock

    root = run_folder(tmp_path_factory) / "script_help"
    root.mkdir(exist_ok=True)

    def saved_path(path):
        key = hashlib.sha256(str(path.resolve()).encode() + path.read_bytes()).hexdigest()[:16]
        return root / f"{path.stem}-{key}.json"

    def run(path):
        path = Path(path)
        with FileLock(str(root / "help.lock")):
            if not saved_path(path).is_file():
                scripts = [script for script in HELP_SCRIPTS if script.is_file() and not saved_path(script).is_file()]
                scripts += [] if path in scripts else [path]
                workdirs = [root / f"{saved_path(script).stem}.cwd" for script in scripts]
                for workdir in workdirs:
                    workdir.mkdir(exist_ok=True)
                results = early_exits([(workdir, script, ["--help"]) for script, workdir in zip(scripts, workdirs)],
                                        env={**os.environ, **HELP_ENV}, timeout=900)
                for script, result in zip(scripts, results):
                    saved_path(script).write_text(json.dumps({"returncode": result.returncode, "stdout": result.stdout,
                                                              "stderr": result.stderr}))
        return json.loads(saved_path(path).read_text())

    return run


def preprocess_tiny_world(out):
    """preprocess_tldr.py on the committed world into `out`, with tiny.sh's length flags."""
    result = run_python(
        [sys.executable, str(REPO / "preprocess_tldr.py"), "--base_model", str(WORLD / "pythia-tiny"),
         "--sft_dataset", str(WORLD / "tldr_3_filtered"),
         "--preference_dataset", str(WORLD / "summarize_from_feedback"),
         "--output_dir", str(out), *tiny_lengths()], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def early_exits(cases, env=None, timeout=600):
    """[(cwd, script, [args...]), ...] -> one subprocess.CompletedProcess per case, as if each were
    `python script args...` run in its cwd, but all run in ONE start of tests/early_exits.py, itself a fork of an
    interpreter that has imported the libraries (run_python): for starts that stop before a model is loaded (bad
    flags or inputs, --help, imports), whose cost is the ~6-8 s of imports of each interpreter."""
    import json

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        listed = [{"script": str(script), "argv": [str(arg) for arg in argv], "cwd": str(cwd),
                   "stdout": str(scratch / f"{i}.out"), "stderr": str(scratch / f"{i}.err")}
                  for i, (cwd, script, argv) in enumerate(cases)]
        (scratch / "cases.json").write_text(json.dumps(listed))
        driver = run_python([sys.executable, str(REPO / "tests" / "early_exits.py"), str(scratch / "cases.json"),
                             str(scratch / "results.json")], env=env, timeout=timeout)
        assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
        statuses = json.loads((scratch / "results.json").read_text())
        return [subprocess.CompletedProcess([sys.executable, case["script"], *case["argv"]], status,
                                            Path(case["stdout"]).read_text(), Path(case["stderr"]).read_text())
                for case, status in zip(listed, statuses)]


LAUNCHER = "accelerate.commands.launch"  # `accelerate launch` as `python -m` runs it
_FORK_SERVERS = {}  # environment -> (server process, its folder): this pytest process's fork servers
# pytest sets PYTEST_CURRENT_TEST to the running test and phase ("tests/x.py::test_y (call)"), so it differs in every
# test: left in a server's environment, every test would start a server of its own (~10 s of imports each, and each
# kept until the run ends). Only pytest reads it; a start sees the server's environment without it.
PER_TEST_VARIABLES = ("PYTEST_CURRENT_TEST",)
# A server is keyed on the environment without the variables read at run time only (forkserver.RUN_TIME_VARIABLES):
# starts whose environments differ only in these share one; any other variable gets servers of its own.
from forkserver import import_time_variables  # noqa: E402


def run_python(cmd, cwd=None, env=None, timeout=None, started=None):
    """subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout) for a start of
    `python SCRIPT ARGS...` (cmd[0] is sys.executable), run as a forked copy of an interpreter that has imported the
    libraries already (tests/forkserver.py, which says how the copy equals a fresh start; one server per environment,
    PER_TEST_VARIABLES and RUN_TIME_VARIABLES aside, started on first use and kept for the test run): each start's
    ~10 s of imports are paid once. So is a launch, `python -m accelerate.commands.launch ... SCRIPT.py ARGS...`:
    the launcher is forked, and each of its ranks too (tests/rank.py). Other commands (`python -c`, other modules,
    shell scripts) run as subprocess.run runs them. `started(pid)`, if given, is called with the start's process id
    once it runs (a test that kills it at a chosen moment calls run_python in a thread)."""
    import json
    import socket

    cmd = [str(part) for part in cmd]
    if cmd[1:3] == ["-m", LAUNCHER]:
        # The first .py argument is the script (option values are numbers, names and .yaml files): torchrun starts
        # tests/rank.py SCRIPT ARGS for each rank instead of python SCRIPT ARGS.
        script = next(i for i, part in enumerate(cmd) if part.endswith(".py"))
        request = {"module": LAUNCHER, "argv": [*cmd[3:script], "--no_python", str(REPO / "tests" / "rank.py"),
                                               *cmd[script:]]}
    elif len(cmd) < 2 or cmd[0] != sys.executable or cmd[1].startswith("-") or not cmd[1].endswith(".py"):
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        request = {"script": cmd[1], "argv": cmd[2:]}
    environment = {key: value for key, value in (os.environ if env is None else env).items()
                   if key not in PER_TEST_VARIABLES}
    folder = fork_server(import_time_variables(environment))
    with tempfile.TemporaryDirectory() as scratch:
        outputs = Path(scratch) / "stdout", Path(scratch) / "stderr"
        request.update(cwd=str(cwd or os.getcwd()), stdout=str(outputs[0]), stderr=str(outputs[1]), env=environment)
        with socket.socket(socket.AF_UNIX) as connection:
            connection.connect(str(folder / "socket"))
            stream = connection.makefile("rw")
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            pid = json.loads(stream.readline())["pid"]
            if started is not None:
                started(pid)
            connection.settimeout(timeout)
            try:
                status = json.loads(stream.readline())["status"]
            except BaseException as stop:  # timed out (or interrupted): kill it and what it started, as subprocess.run
                try:
                    os.killpg(pid, 9)  # the start leads its own process group
                except ProcessLookupError:
                    os.kill(pid, 9)  # killed before it made its group
                if isinstance(stop, TimeoutError):
                    raise subprocess.TimeoutExpired(cmd, timeout, outputs[0].read_text(), outputs[1].read_text())
                raise
        return subprocess.CompletedProcess(cmd, status, outputs[0].read_text(), outputs[1].read_text())


def fork_server(env: dict) -> Path:
    """The folder (socket, log) of this pytest process's fork server for `env`, started if there is none yet."""
    import time

    key = tuple(sorted(env.items()))
    if key in _FORK_SERVERS and _FORK_SERVERS[key][0].poll() is None:
        return _FORK_SERVERS[key][1]
    folder = Path(tempfile.mkdtemp(prefix="rlhf-tests-forkserver-"))
    with open(folder / "log", "w") as log:
        process = subprocess.Popen([sys.executable, str(REPO / "tests" / "forkserver.py"), str(folder / "socket")],
                                   env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    _FORK_SERVERS[key] = process, folder
    deadline = time.monotonic() + 600
    while "ready" not in (folder / "log").read_text().splitlines():  # after any warning its imports printed
        assert process.poll() is None and time.monotonic() < deadline, (
            f"the fork server did not start:\n{(folder / 'log').read_text()[-3000:]}")
        time.sleep(0.1)
    return folder


@atexit.register
def _clean_up():
    """Stop the fork servers, delete their folders and the tests' datasets cache."""
    for process, folder in _FORK_SERVERS.values():
        process.kill()
        process.wait()
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

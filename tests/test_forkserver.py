"""conftest.run_python starts `python script args...` as a fork of an interpreter that has imported the libraries
(tests/forkserver.py): each start must look exactly as its own fresh interpreter would (exit status, output, working
folder, environment, random state, shutdown), or the tests that use it would pass on runs a user could not repeat."""

import os
import subprocess
import sys
import time

import pytest
from conftest import multi_process_slot, run_python

SCRIPT = '''import atexit, os, sys, threading, time
print("out", sys.argv[1:], os.path.basename(os.getcwd()), os.environ.get("FORK_TEST_VALUE"))
print("err", file=sys.stderr)
print("repo modules loaded:", sorted({"ppo", "sft", "reward", "dpo", "tiny_world"} & set(sys.modules)))
print("path[0]:", sys.path[0])
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "exit3":
    sys.exit(3)
if sys.argv[1] == "message":
    sys.exit("bye")
if sys.argv[1] == "shutdown":  # the interpreter waits for threads, then runs atexit handlers
    threading.Thread(target=lambda: (time.sleep(0.5), open("thread_done", "w").close())).start()
    atexit.register(lambda: open("atexit_ran", "w").write(str(os.path.exists("thread_done"))))
open("written", "w").close()
'''

RANDOM = '''import random, sys
import numpy, torch
print(random.random(), numpy.random.rand(), torch.rand(1).item(), torch.get_num_threads())
torch.manual_seed(0), numpy.random.seed(0), random.seed(0)
print(random.random(), numpy.random.rand(), torch.rand(1).item())
'''


def test_each_start_looks_as_its_own_interpreter_would(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {**os.environ, "FORK_TEST_VALUE": "42"}
    for arg in ("ok", "raise", "exit3", "message", "shutdown"):
        results = []
        for how, run in (("forked", run_python), ("fresh", subprocess.run)):
            cwd = tmp_path / how / arg
            cwd.mkdir(parents=True)
            extra = {} if how == "forked" else {"capture_output": True, "text": True}
            results.append(run([sys.executable, str(tmp_path / "script.py"), arg], cwd=cwd, env=env, timeout=120,
                               **extra))
            written = sorted(path.name for path in cwd.iterdir())
            expected = {"ok": ["written"], "shutdown": ["atexit_ran", "thread_done", "written"]}.get(arg, [])
            assert written == expected, how
            if arg == "shutdown":
                assert (cwd / "atexit_ran").read_text() == "True"  # the thread had ended when atexit ran
        forked, fresh = results
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), arg
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]  # a traceback's last line
        assert f"out ['{arg}'] {arg} 42" in forked.stdout and "repo modules loaded: []" in forked.stdout
    assert [run_python([sys.executable, str(tmp_path / "script.py"), arg], cwd=tmp_path, env=env).returncode
            for arg in ("ok", "raise", "exit3", "message")] == [0, 1, 3, 1]


def test_the_tests_of_a_run_share_a_server(tmp_path, monkeypatch):
    """pytest's per-test variable PYTEST_CURRENT_TEST does not start a server per test (~10 s of imports each): the
    starts of two tests are forks of one server, and a start does not see the variable. Nor do the variables that
    libraries read only when a script runs (RUN_TIME_VARIABLES): a start with other values of those is a fork of the
    same server, and sees its own values."""
    from forkserver import RUN_TIME_VARIABLES

    (tmp_path / "script.py").write_text("import os; print(os.getppid(), os.environ.get('PYTEST_CURRENT_TEST'), "
                                        "os.environ.get('COLUMNS'), 'NO_COLOR' in os.environ, sep='|')")
    monkeypatch.delenv("NO_COLOR", raising=False)
    parents = []
    for test, columns in (("tests/test_a.py::test_one (call)", None), ("tests/test_b.py::test_two (setup)", None),
                          ("tests/test_b.py::test_two (call)", "123")):
        monkeypatch.setenv("PYTEST_CURRENT_TEST", test)
        env = None if columns is None else {**os.environ, "COLUMNS": columns, "NO_COLOR": "1"}
        result = run_python([sys.executable, str(tmp_path / "script.py")], cwd=tmp_path, env=env, timeout=300)
        assert result.returncode == 0, result.stderr
        parent, seen, seen_columns, no_color = result.stdout.strip().split("|")
        parents.append(int(parent))
        assert seen == "None"
        assert (seen_columns, no_color) == (str(columns or os.environ.get("COLUMNS")), str(columns is not None))
    assert parents[0] == parents[1] == parents[2] != os.getpid()
    assert {"COLUMNS", "NO_COLOR"} <= set(RUN_TIME_VARIABLES)


def test_random_state_and_threads_are_a_fresh_interpreters(tmp_path):
    """Unseeded draws differ from start to start (each fresh interpreter seeds from the OS), seeded ones are the same
    as a fresh interpreter's, and the thread count comes from the environment."""
    (tmp_path / "random_state.py").write_text(RANDOM)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(tmp_path / "random_state.py")]
    forked = [run_python(cmd, cwd=tmp_path, env=env).stdout.splitlines() for _ in range(2)]
    fresh = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True).stdout.splitlines()
    first, second = ([float(x) for x in lines[0].split()] for lines in forked)
    assert all(a != b for a, b in zip(first[:3], second[:3])), (first, second)
    assert first[3] == second[3] == float(fresh[0].split()[3]) == 1
    assert forked[0][1] == forked[1][1] == fresh[1]


def test_a_start_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    (tmp_path / "slow.py").write_text('import subprocess, sys, time\n'
                                     'child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])\n'
                                     'open("child_pid", "w").write(str(child.pid))\n'
                                     'time.sleep(60)\n')
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([sys.executable, str(tmp_path / "slow.py")], cwd=tmp_path, timeout=5)
    assert time.monotonic() - start < 30
    child = int((tmp_path / "child_pid").read_text())
    for _ in range(50):  # killed with its process group; reaped by its parent's parent
        if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the start's own child {child} outlived the timeout")
    # The server goes on serving after a timed-out start (a script start: `-c` commands never reach it).
    (tmp_path / "quick.py").write_text("print('quick')\n")
    assert run_python([sys.executable, str(tmp_path / "quick.py")], cwd=tmp_path, timeout=60).stdout == "quick\n"


OUTER = '''import os, subprocess, sys
for name, extra in (("inner", {"COLUMNS": "77"}), ("other", {"FORK_TEST_VALUE": "other"})):
    with open(f"{name}.log", "w") as log:
        status = subprocess.run([sys.executable, "inner.py", "a b", "c"], cwd="sub", stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **extra}).returncode
    print(name, "exited", status)
print("-c:", subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True,
                            text=True).stdout.strip())
'''

INNER = '''import os, sys
print("torch imported before the first line:", "torch" in sys.modules)
print("inner", sys.argv[1:], os.path.basename(os.getcwd()), os.environ.get("COLUMNS"), os.environ.get("FORK_TEST_VALUE"),
      "RLHF_TESTS_FORK_SERVER" in os.environ, "repo modules:", sorted({"ppo", "sft", "reward"} & set(sys.modules)),
      flush=True)  # before the stderr line (a file: stdout is block-buffered)
print("to stderr", file=sys.stderr)
sys.exit(5)
'''


def test_a_starts_own_script_starts_are_forks_that_look_fresh(tmp_path):
    """A forked start that runs `python SCRIPT.py ARGS...` itself (benchmark/ppo_gold_reward.py runs ppo.py) gets a
    fork of the server for it (no ~10 s of imports), which looks as the fresh start would: arguments, working folder,
    environment, output and exit status. One whose environment differs from the server's in a variable that a
    library may read on import (not in RUN_TIME_VARIABLES), and a `python -c` start, stay fresh interpreters."""
    (tmp_path / "outer.py").write_text(OUTER)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.py").write_text(INNER)
    logs, env = {}, {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    for how, run in (("fresh", subprocess.run), ("forked", run_python)):
        extra = {"capture_output": True, "text": True} if how == "fresh" else {}
        result = run([sys.executable, "outer.py"], cwd=tmp_path, env=env, timeout=120, **extra)
        assert result.returncode == 0, result.stderr
        assert result.stdout == "inner exited 5\nother exited 5\n-c: False\n", how
        logs[how] = {name: (tmp_path / f"{name}.log").read_text().splitlines() for name in ("inner", "other")}
    assert logs["fresh"]["inner"][0] == logs["fresh"]["other"][0] == logs["forked"]["other"][0] == (
        "torch imported before the first line: False")
    assert logs["forked"]["inner"][0] == "torch imported before the first line: True"  # a fork of the server
    assert logs["forked"]["inner"][1:] == logs["fresh"]["inner"][1:] == [
        "inner ['a b', 'c'] sub 77 None False repo modules: []", "to stderr"]
    assert logs["forked"]["other"][1:] == logs["fresh"]["other"][1:] == [
        "inner ['a b', 'c'] sub None other False repo modules: []", "to stderr"]


RANKS = '''import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # from torchrun's environment
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)  # both ranks at once, or this hangs
sys.stdout.write(f"rank {os.environ['RANK']} of {dist.get_world_size()} sum {total.item()} threads "
                 f"{torch.get_num_threads()} argv {sys.argv[1:]} in {os.path.basename(os.getcwd())} server named "
                 f"{'RLHF_TESTS_FORK_SERVER' in os.environ}\\n")  # one write: the ranks share the output
sys.stdout.flush()
if sys.argv[1] == "fail" and os.environ["RANK"] == "1":
    sys.exit(7)
if sys.argv[1] == "fail":  # rank 0 waits for a rank that is gone: the launcher must stop it
    dist.all_reduce(total)
dist.destroy_process_group()
'''


def test_a_launch_forks_its_ranks_as_fresh_ones_would_run(tmp_path):
    """`python -m accelerate.commands.launch` through run_python: the launcher and both ranks are forks (tests/rank.py),
    the ranks run side by side with torchrun's environment, and the launch exits and prints as a fresh one does."""
    import socket

    (tmp_path / "ranks.py").write_text(RANKS)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    results = {}
    for how, run in (("forked", run_python), ("fresh", subprocess.run)):
        for arg in ("ok", "fail"):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
                   "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                   str(port), str(tmp_path / "ranks.py"), arg]
            extra = {} if how == "forked" else {"capture_output": True, "text": True}
            with multi_process_slot(2):  # alone: the other worker's 2-rank launch would starve its ranks
                start = time.monotonic()
                results[how, arg] = run(cmd, cwd=tmp_path, env=env, timeout=120, **extra)
                assert time.monotonic() - start < 60, (how, arg)  # a rank left waiting was stopped
    for arg in ("ok", "fail"):
        forked, fresh = results["forked", arg], results["fresh", arg]
        assert forked.returncode == fresh.returncode == (0 if arg == "ok" else 1), forked.stderr[-2000:]
        lines = [sorted(line for line in result.stdout.splitlines() if line.startswith("rank")) for result in
                 (forked, fresh)]
        assert lines[0] == lines[1] == [f"rank {r} of 2 sum 3.0 threads 1 argv ['{arg}'] in {tmp_path.name} server "
                                        "named False" for r in (0, 1)], (forked.stdout, forked.stderr[-2000:])
    assert "exitcode  : 7" in results["forked", "fail"].stderr
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "ranks.py")], capture_output=True, text=True).stdout
    assert leftover == "", leftover


SHM_OP = '''from deepspeed.comm.torch import build_shm_op
print("shm op:", build_shm_op())
'''


def test_a_start_never_builds_deepspeeds_inference_all_reduce(tmp_path):
    """The one thing a start does not do as a fresh interpreter would: build DeepSpeed's CPU shared-memory all-reduce
    (g++, 50-100 s on a fresh machine). DeepSpeed's comm backend then has no such op, as where it cannot be built."""
    (tmp_path / "shm.py").write_text(SHM_OP)
    result = run_python([sys.executable, str(tmp_path / "shm.py")], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "shm op: None" in result.stdout and "built successfully" not in result.stdout + result.stderr

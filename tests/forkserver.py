"""Start stage scripts as forked copies of one interpreter that has already imported their libraries: the
`run_python` of tests/conftest.py starts it as `python tests/forkserver.py SOCKET` and sends it the starts.

Every interpreter start of a stage script pays ~10 s of imports on CI's machine (torch, transformers, datasets,
accelerate, DeepSpeed) before its first line runs, and the tests start ~100 of them: most of CI's time. This server
pays the imports once, then forks a child per start. The child is the start it stands for, as `python SCRIPT
ARGS...` would be, in its own process: the script runs as __main__ (runpy) in its working folder, with the
environment the client gave it (the client starts one server per environment, leaving out pytest's per-test
PYTEST_CURRENT_TEST and the variables that libraries read only when a script runs, which it sends with each start),
stdin from /dev/null, stdout and stderr into files at the file-descriptor level; an uncaught exception prints its
traceback and is exit status 1; at the end it waits for its threads and runs the atexit handlers, as the
interpreter's own shutdown does. It differs from a fresh interpreter only in what it has imported already:
third-party libraries, never a module of this repository (they are imported to find the libraries they need, then
forgotten); and in one DeepSpeed op that it never builds, an inference-only all-reduce (see preload). The random
state is a fresh interpreter's: seeded from the OS, anew in every child (Python's `random` reseeds itself after a
fork; numpy and torch are reseeded here).

Fork safety: the server forks only while it runs no Python thread but its main one (checked at start) and has run
no torch parallel region, so no child inherits a half-made thread pool. The native threads that numpy's OpenBLAS
and pyarrow's jemalloc start on import have fork handlers; datasets' own `num_proc` workers are forks of such a
process too.

Launches: `python -m accelerate.commands.launch ... SCRIPT ARGS` is forked the same way (the launcher runs as
__main__ by runpy.run_module), and so are its ranks: conftest.run_python adds `--no_python tests/rank.py` in front of
SCRIPT, so that torchrun starts tests/rank.py (standard library only, ~30 ms) for each rank, which asks this server
for a fork running `python SCRIPT ARGS` with the rank's environment (torchrun's RANK, MASTER_PORT, ...), working
folder and standard streams, waits for it and exits with its status. Each rank then pays no imports either: a 2-rank
launch costs ~1 s instead of ~12 s of interpreter starts. A rank's environment differs from the server's only in
what the launcher adds; libraries read those variables when a run starts, not on import, and the thread count is set
from the rank's OMP_NUM_THREADS as a fresh interpreter would take it. A start's own starts of `python SCRIPT.py
ARGS...` (benchmark/ppo_gold_reward.py runs ppo.py) go through tests/rank.py the same way (fork_nested_starts).

Protocol: one connection per start; the client sends one JSON line {script or module, argv, cwd, env, stdout,
stderr}, or {script, argv, cwd, env} with its stdin, stdout and stderr passed as file descriptors (SCM_RIGHTS;
tests/rank.py), and reads back {"pid": N}, then {"status": S} (S < 0: killed by signal -S, as subprocess reports
it). The server serves starts side by side (a launch's ranks run at the same time). A client that hangs up before
its start ends (it timed out, or torchrun stopped the rank) gets the start killed with its process group (the child
leads one).
"""

import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback

from early_exits import run_as_main  # tests/ is sys.path[0] of `python tests/forkserver.py`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = os.path.join(REPO, "tests", "rank.py")
# Variables that the libraries read when a script runs, never on import (checked in their sources: accelerate's
# AcceleratorState, rich's Console, openai's client, torch.cuda's device count, inductor's cache_dir; inductor sets its
# data-pointer variable itself before it loads a compiled module, which reads it). A start gets
# its whole environment from its request (`child` sets it before the script runs), so starts whose environments
# differ only in these share one server: each new server costs ~10 s of imports, and the tests' own environments
# (an Accelerator run in pytest sets ACCELERATE_USE_CPU in os.environ) started 15 of them. Any other
# variable (TORCH_LOGS, PYTHONPATH, OMP_NUM_THREADS, which OpenBLAS reads on import, ...) gets servers of its own.
RUN_TIME_VARIABLES = ("COLUMNS", "NO_COLOR", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "OPENAI_API_KEY",
                      "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR", "KILL_AT_CALL_SIGNAL",
                      "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
# Importing these (they import nothing of each other's and run nothing on import: test_conventions checks) brings
# in every library the stage scripts and benchmark scripts use at the top of the file.
PRELOAD_SCRIPTS = ["preprocess_tldr", "sft", "reward", "dpo", "ppo", "judge", "tiny_world"]
# ... and these, imported inside functions of the scripts (plots, DeepSpeed runs, the tiny world's tokenizer).
PRELOAD_LIBRARIES = ["matplotlib", "matplotlib.pyplot", "deepspeed", "tokenizers",
                     "tensorboard.backend.event_processing.event_accumulator"]


def preload():
    """Import the libraries, then forget this repository's modules and restore sys.path."""
    saved_path = list(sys.path)
    sys.path.insert(0, REPO)
    for name in PRELOAD_SCRIPTS + PRELOAD_LIBRARIES:
        importlib.import_module(name)
    sys.path[:] = saved_path
    # One difference from a fresh interpreter, on purpose: DeepSpeed's CPU shared-memory all-reduce is marked
    # unbuildable. A machine's first DeepSpeed launch would compile it with g++ (50-100 s of CI's two cores on
    # every fresh machine, held by one 2-rank test while the other waits). It serves tensor-parallel inference only
    # (deepspeed.comm's inference_all_reduce); ZeRO's collectives go through the process group with or without it.
    sys.modules["deepspeed.ops"].__compatible_ops__["deepspeed_shm_comm"] = False
    for name, module in list(sys.modules.items()):  # the repository's modules, not a virtualenv inside it
        file = os.path.abspath(getattr(module, "__file__", None) or "/")
        if file.startswith(REPO + os.sep) and not file.startswith(os.path.abspath(sys.prefix) + os.sep):
            del sys.modules[name]
    import threading

    assert threading.active_count() == 1, f"threads after the imports: {threading.enumerate()}; forking is not safe"


def child(request, fds: list, socket_path: str) -> int:
    """In the forked child: run one start -> its exit status (the caller exits with it)."""
    os.setsid()  # its own process group, so a timed-out start is killed with everything it started
    if not fds:  # output into the files the client named
        fds = [os.open(os.devnull, os.O_RDONLY), os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
               os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)]
    for target, fd in enumerate(fds):  # stdin, stdout, stderr
        os.dup2(fd, target)
        os.close(fd)
    fork_nested_starts(socket_path)
    torch = sys.modules["torch"]
    # The start's own environment (a rank's: the launcher's and torchrun's variables); every client sends one.
    threads = request["env"].get("OMP_NUM_THREADS")
    if threads and threads != os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))  # what a fresh interpreter reads from it at start
    os.environ.clear()
    os.environ.update(request["env"])
    # Seeded from the OS at import, as in a fresh interpreter: reseed, or every child would draw the same numbers.
    sys.modules["numpy"].random.seed()
    torch.seed()
    if "module" in request:  # a launcher, whose ranks tests/rank.py asks this server for
        os.environ["RLHF_TESTS_FORK_SERVER"] = socket_path
        status = run_as_main(request["module"], request["argv"], request["cwd"], module=True)
    else:
        status = run_as_main(request["script"], request["argv"], request["cwd"])
    # The interpreter's shutdown (Py_FinalizeEx): wait for non-daemon threads, run atexit handlers, flush.
    import atexit
    import threading

    try:
        threading._shutdown()
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    return status


def fork_nested_starts(socket_path: str):
    """In a child (before it takes its start's environment): make its own starts of `python SCRIPT.py ARGS...` (a
    benchmark running the stage scripts) forks of this server too, where their environment differs from this
    server's only in RUN_TIME_VARIABLES. subprocess.Popen runs `python tests/rank.py SCRIPT.py ARGS...` in their
    place, which asks this server for the start with the working folder, environment and standard streams the caller
    gave, as for a launch's ranks; other commands (`python -c`, `python -m`, other programs) start as asked."""
    import subprocess

    popen_init = subprocess.Popen.__init__
    server = import_time_variables(os.environ)

    def init(self, args, *rest, **kwargs):
        environment = os.environ if kwargs.get("env") is None else kwargs["env"]
        if (isinstance(args, (list, tuple)) and len(args) > 1 and args[0] == sys.executable
                and str(args[1]).endswith(".py") and not rest and import_time_variables(environment) == server):
            args = [sys.executable, RANK, *args[1:]]
            kwargs["env"] = {**environment, "RLHF_TESTS_FORK_SERVER": socket_path}  # rank.py takes it out again
        popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = init


def import_time_variables(environment) -> dict:
    """`environment` without RUN_TIME_VARIABLES and this server's RLHF_TESTS_FORK_SERVER: what a server is keyed on
    (conftest.run_python) and what a nested start must share with its server (fork_nested_starts)."""
    return {key: value for key, value in environment.items()
            if key not in RUN_TIME_VARIABLES and key != "RLHF_TESTS_FORK_SERVER"}


def read_request(connection) -> tuple:
    """One JSON line, and the file descriptors sent with it (none, or stdin / stdout / stderr) -> (request, fds)."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while data and not data.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            break
        data += more
    return json.loads(data), list(fds)


def serve(path: str):
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    parent = os.getppid()
    print("ready", flush=True)
    running = {}  # pid -> the connection of its client
    while os.getppid() == parent:  # else the tests ended without closing us
        readable, _, _ = select.select([listener, *running.values()], [], [], 0.05)
        for pid, client in running.items():
            if client in readable:  # a client sends nothing after its request: it hung up
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    os.kill(pid, signal.SIGKILL)  # killed before it made its group
        if listener in readable:
            start(listener, path, running)
        while running:  # the starts that have ended
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = running.pop(pid)
            answer(connection, {"status": os.waitstatus_to_exitcode(wait_status)})
            connection.close()


def start(listener, path: str, running: dict):
    """Accept one client, fork its start, tell it the pid."""
    connection, _ = listener.accept()
    request, fds = read_request(connection)
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close(), connection.close()
        for other in running.values():
            other.close()
        status = 1
        try:
            status = child(request, fds, path)
        finally:
            os._exit(status & 0xFF)
    for fd in fds:
        os.close(fd)
    answer(connection, {"pid": pid})
    running[pid] = connection


def answer(connection, message: dict):
    """Send one JSON line; a client that has gone away (it timed out) is no reason to stop serving."""
    try:
        connection.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1])

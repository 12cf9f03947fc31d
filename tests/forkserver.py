"""Start stage scripts as forked copies of one interpreter that has already imported their libraries: the
`run_python` of tests/conftest.py starts it as `python tests/forkserver.py SOCKET` and sends it the starts.

Every interpreter start of a stage script pays ~10 s of imports on CI's machine (torch, transformers, datasets,
accelerate, DeepSpeed) before its first line runs, and the tests start ~100 of them: most of CI's time. This server
pays the imports once, then forks a child per start. The child is the start it stands for, as `python SCRIPT ARGS...`
would be, in its own process: the script runs as __main__ (runpy) in its working folder, with the environment the
server was started with (the client starts one server per environment), stdin from /dev/null, stdout and stderr
into files at the file-descriptor level; an uncaught exception prints its traceback and is exit status 1; at the end
it waits for its threads and runs the atexit handlers, as the interpreter's own shutdown does. It differs from a fresh
interpreter only in what it has imported already: third-party libraries, never a module of this repository (they
are imported to find the libraries they need, then forgotten). The random state is a fresh interpreter's: seeded
from the OS, anew in every child (Python's `random` reseeds itself after a fork; numpy and torch are reseeded here).

Fork safety: the server forks only while it runs no Python thread but its main one (checked at start) and has run
no torch parallel region, so no child inherits a half-made thread pool. The native threads that numpy's OpenBLAS
and pyarrow's jemalloc start on import have fork handlers; datasets' own `num_proc` workers are forks of such a
process too.

Protocol: one connection per start; the client sends one JSON line {script, argv, cwd, stdout, stderr} and reads
back {"pid": N}, then {"status": S} (S < 0: killed by signal -S, as subprocess reports it). A client that times out
kills the child's process group (the child leads one) and hangs up; the server goes on with the next start.
"""

import importlib
import json
import os
import socket
import sys
import traceback

from early_exits import run_as_main  # tests/ is sys.path[0] of `python tests/forkserver.py`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    for name, module in list(sys.modules.items()):  # the repository's modules, not a virtualenv inside it
        file = os.path.abspath(getattr(module, "__file__", None) or "/")
        if file.startswith(REPO + os.sep) and not file.startswith(os.path.abspath(sys.prefix) + os.sep):
            del sys.modules[name]
    import threading

    assert threading.active_count() == 1, f"threads after the imports: {threading.enumerate()}; forking is not safe"


def child(request) -> int:
    """In the forked child: run one start -> its exit status (the caller exits with it)."""
    os.setsid()  # its own process group, so a timed-out start is killed with everything it started
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0), os.dup2(out, 1), os.dup2(err, 2)
    for fd in (null, out, err):
        os.close(fd)
    # Seeded from the OS at import, as in a fresh interpreter: reseed, or every child would draw the same numbers.
    sys.modules["numpy"].random.seed()
    sys.modules["torch"].seed()
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


def serve(path: str):
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(5.0)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            connection, _ = listener.accept()
        except socket.timeout:
            if os.getppid() != parent:  # the tests ended without closing us
                return
            continue
        connection.settimeout(None)
        with connection:
            request = json.loads(connection.makefile().readline())
            sys.stdout.flush(), sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close(), connection.close()
                status = 1
                try:
                    status = child(request)
                finally:
                    os._exit(status & 0xFF)
            answer(connection, {"pid": pid})
            _, wait_status = os.waitpid(pid, 0)
            answer(connection, {"status": os.waitstatus_to_exitcode(wait_status)})


def answer(connection, message: dict):
    """Send one JSON line; a client that has gone away (it timed out) is no reason to stop serving."""
    try:
        connection.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1])

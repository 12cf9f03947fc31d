"""`python tests/kill_at_call.py NAME N SCRIPT ARGS...`: run SCRIPT ARGS as __main__ and SIGKILL this process at the start
of the N-th call of a function named NAME (test_preprocess_kill.py; run like a script by conftest.run_python).
With KILL_AT_CALL_SIGNAL=SIGINT it sends a Ctrl-C instead (this process alone), its handler Python's own as in a
terminal, and the run goes on to handle it.

NAME `fork`: the N-th fork's child SIGKILLs this process before any fork hook of the script has run in the child, and
only then goes on: a run killed between a fork and the child's first steps."""

import importlib
import os
import runpy
import signal
import sys
import time

for library in ("datasets", "transformers", "tyro"):  # imported before the profiler is on: not under test
    importlib.import_module(library)


SIGNAL = getattr(signal, os.environ.get("KILL_AT_CALL_SIGNAL", "SIGKILL"))
if SIGNAL == signal.SIGINT:  # a test started in the background (CI's) inherits Ctrl-C ignored: as in a terminal
    signal.signal(signal.SIGINT, signal.default_int_handler)


def kill_at_fork(count: int) -> None:
    forks = 0

    def before():
        nonlocal forks
        forks += 1

    def in_child():  # registered before the script's hooks: runs first in the child
        if forks == count:
            parent = os.getppid()
            os.kill(parent, signal.SIGKILL)
            while os.getppid() == parent:  # until the kernel has reparented this child
                time.sleep(0.01)

    os.register_at_fork(before=before, after_in_child=in_child)


def kill_at_call(name: str, count: int) -> None:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_name == name:
            calls += 1
            if calls == count:
                sys.setprofile(None)
                os.kill(os.getpid(), SIGNAL)

    sys.setprofile(profile)


def main():
    name, count = sys.argv[1], int(sys.argv[2])
    sys.argv = sys.argv[3:]
    if name == "fork":
        kill_at_fork(count)
    else:
        kill_at_call(name, count)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

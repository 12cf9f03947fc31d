"""`python tests/kill_at_call.py NAME N SCRIPT ARGS...`: run SCRIPT ARGS as __main__ and SIGKILL this process at the start
of the N-th call of a function named NAME (test_preprocess_kill.py; run like a script by conftest.run_python)."""

import importlib
import os
import runpy
import signal
import sys

for library in ("datasets", "transformers", "tyro"):  # imported before the profiler is on: not under test
    importlib.import_module(library)


def main():
    name, count = sys.argv[1], int(sys.argv[2])
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_name == name:
            calls += 1
            if calls == count:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.argv = sys.argv[3:]
    sys.setprofile(profile)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

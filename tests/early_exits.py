"""Run several early-exiting starts of stage scripts in ONE start (not pytest's process): tests/conftest.py's
`early_exits` runs it as `python tests/early_exits.py CASES_JSON RESULTS_JSON` through its fork server
(`run_python`: a fork of an interpreter that has imported the libraries, which looks as a fresh one would).

Each case is a start that stops before it loads a model (a bad flag, a bad input folder, --help, an
import). Every interpreter start of a stage pays ~6-8 s of imports (torch, transformers, datasets)
before its first check; here they are paid once for all the cases. Each case runs as `python SCRIPT ARGS...` would,
in its own working folder: the script is executed as __main__ (runpy), its stdout and stderr go to
files at the file-descriptor level (so library loggers and progress bars are caught too), and an
uncaught exception prints its traceback and counts as exit status 1, as the interpreter would do.
What a case cannot share with the others (its environment, a second process) needs its own launch.
"""

import json
import os
import runpy
import sys
import traceback


def run_as_main(script: str, argv: list, cwd: str, module: bool = False) -> int:
    """`python SCRIPT ARGV...` (or `python -m SCRIPT ARGV...` if `module`) in `cwd`, in this interpreter -> its exit
    status, as the interpreter gives it. Leaves sys.argv, sys.path[0] and the working folder as the script had them
    (the caller restores them if it goes on)."""
    try:
        os.chdir(cwd)
        sys.argv, sys.path[0] = [script, *argv], os.getcwd() if module else os.path.dirname(os.path.abspath(script))
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:  # sys.exit(code): None is 0, a message is printed and is 1
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        return 1


def run_case(script: str, argv: list, cwd: str, stdout_path: str, stderr_path: str) -> int:
    """One start of `script` with `argv` in `cwd`, its output in the two files -> its exit status."""
    saved_fds = os.dup(1), os.dup(2)
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            return run_as_main(script, argv, cwd)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
            sys.argv, sys.path[:] = saved_argv, saved_path
            os.chdir(saved_cwd)


if __name__ == "__main__":
    cases_path, results_path = sys.argv[1:]
    cases = json.loads(open(cases_path).read())
    statuses = [run_case(case["script"], case["argv"], case["cwd"], case["stdout"], case["stderr"]) for case in cases]
    with open(results_path, "w") as file:
        json.dump(statuses, file)

#!/usr/bin/env python3
"""One rank of a launch that tests/conftest.py's `run_python` forks: `accelerate launch --no_python tests/rank.py
SCRIPT ARGS...` makes torchrun start this file for each rank, in place of `python SCRIPT ARGS...`; a forked start's
own `python SCRIPT.py ARGS...` subprocesses start it too (tests/forkserver.py's fork_nested_starts).

It asks the fork server that runs the launcher (tests/forkserver.py; its socket in RLHF_TESTS_FORK_SERVER) to start
`python SCRIPT ARGS...` as a fork of its interpreter, which has imported the libraries already, with this process's
working folder, environment (torchrun's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_PORT, ...) and standard streams (passed
as file descriptors). Then it waits and exits with the start's status; a SIGTERM or SIGINT from torchrun (another rank
failed) is passed on to the start's process group. Standard library only: it starts in ~30 ms.
"""

import json
import os
import signal
import socket
import sys


def main() -> int:
    environment = dict(os.environ)
    path = environment.pop("RLHF_TESTS_FORK_SERVER")  # the rank's own environment is the launcher's, as without us
    request = {"script": sys.argv[1], "argv": sys.argv[2:], "cwd": os.getcwd(), "env": environment}
    with socket.socket(socket.AF_UNIX) as connection:
        connection.connect(path)
        socket.send_fds(connection, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
        stream = connection.makefile("r")
        pid = json.loads(stream.readline())["pid"]

        def pass_on(signum, frame):
            try:
                os.killpg(pid, signum)
            except ProcessLookupError:
                pass

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, pass_on)
        status = json.loads(stream.readline())["status"]
    if status < 0:  # killed by a signal: die of the same one, as torchrun expects of its worker
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main())

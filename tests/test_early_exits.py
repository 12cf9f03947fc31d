"""conftest.early_exits runs several starts in one interpreter: each must look exactly as its own
`python script args...` would (exit status, stdout, stderr, working folder), or the tests that use it
would pass on starts that did not fail."""

import subprocess
import sys

from conftest import early_exits

SCRIPT = '''import os, sys
print("out", sys.argv[1:], os.path.basename(os.getcwd()))
print("err", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "exit3":
    sys.exit(3)
if sys.argv[1] == "message":
    sys.exit("bye")
open("written", "w").close()
'''


def test_each_start_looks_as_its_own_interpreter_would(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    cases = []
    for arg in ("ok", "raise", "exit3", "message"):
        (tmp_path / arg).mkdir()
        cases.append((tmp_path / arg, tmp_path / "script.py", [arg]))
    batched = early_exits(cases)
    for (cwd, script, argv), result in zip(cases, batched):
        alone = subprocess.run([sys.executable, str(script), *argv], cwd=cwd, capture_output=True, text=True)
        assert (result.returncode, result.stdout) == (alone.returncode, alone.stdout)
        assert result.stderr.splitlines()[-1] == alone.stderr.splitlines()[-1]  # the traceback's last line
    assert [result.returncode for result in batched] == [0, 1, 3, 1]
    assert "ValueError: boom" in batched[1].stderr and batched[0].stdout == "out ['ok'] ok\n"
    assert (tmp_path / "ok" / "written").exists() and not (tmp_path / "written").exists()  # each in its folder

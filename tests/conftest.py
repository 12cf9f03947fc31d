"""Shared test setup: every test runs offline, on CPU, with tracking disabled.

The environment variables are set here (and not only in `.ci/run`) so that a bare `pytest`
behaves like CI: a Hub id fails at once instead of retrying for ~30 s (../shared/ENV_NOTES.md).
"""

import os
import sys
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

# The stage scripts live at the repository root and are imported by the unit tests.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

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

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above every worker's own
    out, built = root / "tiny_tldr", root / "tiny_tldr.built"
    with FileLock(str(out) + ".lock"):
        if not built.is_file():
            shutil.rmtree(out, ignore_errors=True)  # a worker that failed halfway left it
            out.mkdir()
            preprocess_tiny_world(out)
            built.touch()
    return out


def preprocess_tiny_world(out):
    """preprocess_tldr.py on the committed world into `out`, with tiny.sh's length flags."""
    result = subprocess.run(
        [sys.executable, str(REPO / "preprocess_tldr.py"), "--base_model", str(WORLD / "pythia-tiny"),
         "--sft_dataset", str(WORLD / "tldr_3_filtered"),
         "--preference_dataset", str(WORLD / "summarize_from_feedback"),
         "--output_dir", str(out), "--num_proc", "2", *tiny_lengths()],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

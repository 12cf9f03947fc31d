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

#!/usr/bin/env bash
# The wheels benchmark/gpu_check.sh needs on this workplace's GPU machines, fetched here into .whl/ (git-ignored).
# Their image holds torch (a CUDA build), numpy, pandas, pyarrow, matplotlib, tensorboard and more, but not datasets,
# tyro, deepspeed or rouge-score, nor transformers, huggingface-hub and tokenizers at requirements.txt's pins, and it
# reaches no registry. This resolves requirements.txt's pins here (pip's dry run), keeps what the stage scripts and
# their libraries import (not wandb or openai, which gpu_check never starts), drops what the image already holds
# (its package list: /work/.library/device/KINDS.md) unless a pin names it, and downloads those wheels for the
# image's Python 3.12; deepspeed and rouge-score come as sources and are built into wheels here.
#
#   bash benchmark/gpu_wheels.sh          # once, here (~25 MB; a device call carries at most 64 MiB)
#   # then on the device machine, naming .whl in the run's `carry`, before the check:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#       && export PYTHONPATH=/tmp/site && bash benchmark/gpu_check.sh --out $OUT/gpu_check.md
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
kinds=${KINDS:-/work/.library/device/KINDS.md}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python3 -m pip install --dry-run --ignore-installed --quiet --disable-pip-version-check --report "$scratch/report.json" \
  -r requirements.txt -c constraints.txt
python3 - "$scratch/report.json" "$kinds" > "$scratch/wanted.txt" <<'EOF'
import json
import re
import sys

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
report, kinds = json.load(open(sys.argv[1])), open(sys.argv[2]).read()
image = {norm(name) for name in kinds.split("Packages: ", 1)[1].split("\n", 1)[0].rstrip(".").split(", ")}
found = {norm(item["metadata"]["name"]): item for item in report["install"]}
pins = [norm(re.match(r"[\w.-]+", line).group()) for line in open("requirements.txt") if re.match(r"\w", line)]
roots = ["transformers", "tokenizers", "huggingface-hub", "safetensors", "accelerate", "deepspeed", "datasets", "tyro",
         "rouge-score"]  # what gpu_check's stages import (the image's torch, matplotlib, tensorboard are used as they are)
wanted, todo = set(), list(roots)
while todo:  # the roots and everything they need, as resolved here
    name = todo.pop()
    if name in wanted or name not in found:
        continue
    wanted.add(name)
    for requirement in found[name]["metadata"].get("requires_dist") or []:
        if "extra ==" not in requirement:
            todo.append(norm(re.match(r"[\w.-]+", requirement).group()))
for name in sorted(wanted):
    if name == "torch" or name.startswith("nvidia-") or name == "triton":
        continue  # the image's CUDA build stays
    if name in image and name not in pins:
        continue  # the image's own version
    print(f"{name}=={found[name]['metadata']['version']}")
EOF
mkdir -p .whl  # ignored by .gitignore
sources=$(grep -E '^(deepspeed|rouge-score)==' "$scratch/wanted.txt" || true)
binaries=$(grep -vE '^(deepspeed|rouge-score)==' "$scratch/wanted.txt" || true)
# shellcheck disable=SC2086  # one argument a package
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $binaries
if [[ -n $sources ]]; then
  # shellcheck disable=SC2086
  python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w .whl $sources
fi
echo "benchmark/gpu_wheels.sh: $(ls .whl | wc -l) wheels in .whl/ ($(du -sh .whl | cut -f1)):" \
  "$(tr '\n' ' ' < "$scratch/wanted.txt")"

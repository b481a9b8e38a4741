#!/usr/bin/env bash
# The systems `duet bench serve` compares duet with, which are not duet's dependencies:
# NVIDIA Dynamo 1.6.1 in .venv-peers, an environment of its own that sees duet's (its vLLM,
# torch, NIXL) through a .pth file, so Dynamo's vLLM plugin never loads in duet's processes.
# Dynamo 1.6.1 is built for vLLM 0.31; its dependencies are duet's, so it is installed without
# them (plus the two it adds). benchmarks/peer_adapters.py fixes the two imports that fail beside
# vLLM 0.32 in code its text path never runs. (vLLM's own P/D needs nothing more than duet's
# environment.)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
[ -x .venv/bin/python ] || { echo "install duet first: make install" >&2; exit 1; }
[ -x .venv-peers/bin/python ] || python3.11 -m venv .venv-peers
site_packages=".venv-peers/lib/python3.11/site-packages"
printf 'import site; site.addsitedir("%s/.venv/lib/python3.11/site-packages"); import duet.benchmarks.peer_adapters\n' \
  "$root" > "$site_packages/duet_peers.pth"
.venv-peers/bin/pip install -q --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1 redis==8.1.0 zstandard==0.25.0
if ! check=$(.venv-peers/bin/python -c "import dynamo.frontend.main, dynamo.vllm.main" 2>&1); then
  echo "$check" >&2
  exit 1
fi
echo "peers installed: Dynamo 1.6.1 in .venv-peers"

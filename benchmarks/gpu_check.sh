#!/usr/bin/env bash
# GPU check, on one CUDA GPU with no internet, in about 8 minutes:
#   1. library versions;
#   2. the exactness tests (pytest -m exact: layer-0 re-rotation, the mask oracle, reuse off ==
#      generate) on CUDA in float32, then in bfloat16;
#   3. the paper's shape (5 agents, P=512, I=1024, replies of at most 64 tokens, bf16) on a
#      random-weight Llama-3.1-8B: whole graphs per strategy (wall time, tokens forwarded,
#      readers' time to first token; benchmarks profile "gpu", workload a);
#   4. what framed copies cost the sender's decode and save its readers on a GPU (the assumption
#      behind copying on every decode step): benchmarks.framed_decode, workloads (a) and (c);
#   5. batched and drafted decode steps: the tests of tests/test_batched_decode*.py,
#      tests/test_drafting.py and tests/engines/test_growing_cache.py (KV written in place) on CUDA, a decode forward of 1 / 2 / 4 / 8 rows, and of one row
#      feeding 1 / 3 / 5 / 9 ids (a draft), on the paper's shape (benchmarks.batched_steps).
# Each step writes JSON under $OUT (default benchmarks/out/gpu) as soon as it ends.
#
#   bash benchmarks/gpu_check.sh --fetch   # here, with internet: wheels the GPU machine lacks
#   bash benchmarks/gpu_check.sh           # there (the device tool: carry benchmarks/wheels)
#   DEVICE=cpu MODEL=random:tiny PROFILE=smoke bash benchmarks/gpu_check.sh   # rehearsal without a GPU
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=benchmarks/wheels
OUT="${OUT:-benchmarks/out/gpu}"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:-random:llama-3.1-8b}"
PROFILE="${PROFILE:-gpu}"

if [ "${1:-}" = "--fetch" ]; then
  # GPU machines have Python 3.12 and transformers 5.17, but no pydantic, pytest or LangChain.
  "$PYTHON" -m pip download -q -d "$WHEELS" --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    "pydantic>=2.6,<3" "pytest>=8" "tqdm>=4.60"
  ls "$WHEELS"
  exit 0
fi

mkdir -p "$OUT"
SITE="$OUT/site"
step_json() {  # name rc seconds
  printf '{"step": "%s", "rc": %s, "seconds": %s}\n' "$1" "$2" "$3" > "$OUT/step_$1.json"
  echo "== step $1: rc=$2 in $3 s"
}

"$PYTHON" - <<'EOF' | tee "$OUT/versions.json"
import json, platform, importlib
info = {"python": platform.python_version()}
for name in ("torch", "transformers", "tokenizers", "pydantic", "pytest", "tqdm", "matplotlib"):
    try:
        info[name] = importlib.import_module(name).__version__
    except Exception as error:  # missing: installed from the wheels below
        info[name] = None
import torch
info["cuda"] = torch.version.cuda
info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(json.dumps(info))
EOF

missing=""
for module in pydantic pytest tqdm; do
  "$PYTHON" -c "import $module" 2>/dev/null || missing="$missing $module"
done
if [ -n "$missing" ]; then
  echo "installing from $WHEELS:$missing"
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --target "$SITE" $missing || {
    echo "missing wheels for:$missing (run 'bash benchmarks/gpu_check.sh --fetch' where there is internet)"; exit 1; }
fi
export PYTHONPATH="$PWD:$PWD/integrations:$SITE${PYTHONPATH:+:$PYTHONPATH}"

for dtype in float32 bfloat16; do
  start=$(date +%s)
  KVCOMM_TEST_DEVICE=$DEVICE KVCOMM_TEST_DTYPE=$dtype timeout 60 "$PYTHON" -m pytest -q -p no:cacheprovider \
    -m exact tests/engines/test_assembly.py tests/test_engine.py --junitxml "$OUT/exact_$dtype.xml" 2>&1 | tail -5
  step_json "exact_$dtype" "${PIPESTATUS[0]}" $(( $(date +%s) - start ))
done

start=$(date +%s)
timeout 150 "$PYTHON" -m benchmarks --profile "$PROFILE" --model "$MODEL" --device "$DEVICE" --phases a \
  --no-plots --out "$OUT/bench" 2>&1 | grep -v "it/s]$" | tail -40
step_json paper_shape "${PIPESTATUS[0]}" $(( $(date +%s) - start ))
echo "results: $OUT/bench/ (results.json; phase_a.partial.json if it was cut short)"

start=$(date +%s)
FRAMED_DTYPE=$([ "$DEVICE" = cuda ] && echo bfloat16 || echo float32)
timeout 150 "$PYTHON" -m benchmarks.framed_decode --model "$MODEL" --device "$DEVICE" --dtype "$FRAMED_DTYPE" \
  --requests 3 --tokens 64 --workloads a,c --out "$OUT/framed" 2>&1 | grep -v "it/s]$" | tail -10
step_json framed_copies "${PIPESTATUS[0]}" $(( $(date +%s) - start ))
echo "results: $OUT/framed/"

start=$(date +%s)
KVCOMM_TEST_DEVICE=$DEVICE KVCOMM_TEST_DTYPE=float32 timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider \
  -m "not embedded" tests/test_batched_decode.py tests/test_batched_decode_concurrency.py tests/test_drafting.py \
  tests/engines/test_growing_cache.py \
  --junitxml "$OUT/batched_decode.xml" 2>&1 | tail -5
step_json batched_decode_tests "${PIPESTATUS[0]}" $(( $(date +%s) - start ))

start=$(date +%s)
timeout 120 "$PYTHON" -m benchmarks.batched_steps --model "$MODEL" --device "$DEVICE" --dtype "$FRAMED_DTYPE" \
  --lengths 512,2048 --rows 1,2,4,8 --out "$OUT/batched_steps.json" 2>&1 | grep -v "it/s]$" | tail -12
step_json batched_steps "${PIPESTATUS[0]}" $(( $(date +%s) - start ))

start=$(date +%s)
timeout 120 "$PYTHON" -m benchmarks.batched_steps --model "$MODEL" --device "$DEVICE" --dtype "$FRAMED_DTYPE" \
  --lengths 512,2048 --rows 1 --ids 1,3,5,9 --out "$OUT/draft_steps.json" 2>&1 | grep -v "it/s]$" | tail -12
step_json draft_steps "${PIPESTATUS[0]}" $(( $(date +%s) - start ))


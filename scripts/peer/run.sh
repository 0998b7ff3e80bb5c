#!/usr/bin/env bash
# llama.cpp's own server tests (tools/server/tests/unit, unchanged, from the llama.cpp that
# llama-cpp-python 0.3.36 vendors) against actord: issue 28's peer suite. Not part of CI
# (it takes ~13 minutes on 2 cores and needs the sdist). The unit tests come from the
# sdist (pip download; cached under .peer/); this folder's utils.py, conftest.py and
# pytest.ini stand in for llama.cpp's, starting `actord serve --http` on Gemma 3 270M.
#   scripts/peer/run.sh [pytest args, e.g. unit/test_security.py -k cors]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
work="$root/.peer"
src="$work/llama_cpp_python-0.3.36"
if [ ! -d "$src" ]; then
  mkdir -p "$work"
  "$root/.venv/bin/pip" download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$work"
  tar -xzf "$work"/llama_cpp_python-0.3.36.tar.gz -C "$work"
fi
tests="$work/tools/server/tests"
rm -rf "$work/tools" && mkdir -p "$tests"
cp -r "$src/vendor/llama.cpp/tools/server/tests/unit" "$tests/unit"
# fixtures too: test_mcp_servers writes its stand-in MCP servers there before starting one
cp -r "$src/vendor/llama.cpp/tools/server/tests/fixtures" "$tests/fixtures"
cp "$root"/scripts/peer/{utils.py,conftest.py,pytest.ini} "$tests/"
ln -sfn "$src/vendor/llama.cpp/models" "$work/models"  # the tests read ../../../models/templates
cd "$tests"
ACTORD="$root" PEER_TMP="$work/tmp" exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" -rfs \
  "${@:-unit/}"

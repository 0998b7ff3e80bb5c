"""bench/device_check.sh --dry-run: without a GPU it fails at once and says why; with one
(faked here: an nvidia-smi and a CUDA toolkit that are small files) it names what is missing,
or prints the CUDA build it would run. Nothing is built in any of these."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_check.sh"
WHEELS = ("msgspec", "structlog", "sniffio", "starlette", "uvicorn", "httptools", "diskcache", "anyio",
          "scikit_build_core", "gguf")


def no_gpu_path() -> str:
    """PATH without any folder that holds an nvidia-smi (a developer's machine may have one)."""
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not (Path(d) / "nvidia-smi").exists())


def fake_gpu(tmp: Path, with_nvcc: bool = True) -> dict[str, str]:
    bin_ = tmp / "bin"
    bin_.mkdir()
    smi = bin_ / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$*" in\n  *name,compute_cap*) echo "NVIDIA H200, 9.0, 143771 MiB, 143000 MiB";;\n'
                   '  *compute_cap*) echo "9.0";;\n  *) exit 9;;\nesac\n')
    smi.chmod(0o755)
    env = {"PATH": f"{bin_}{os.pathsep}{no_gpu_path()}"}
    if with_nvcc:
        cuda = tmp / "cuda"
        (cuda / "bin").mkdir(parents=True)
        (cuda / "include").mkdir()
        (cuda / "lib64" / "stubs").mkdir(parents=True)
        (cuda / "include" / "cublas_v2.h").touch()
        (cuda / "lib64" / "stubs" / "libcuda.so").touch()
        nvcc = cuda / "bin" / "nvcc"
        nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
        nvcc.chmod(0o755)
        env["ACTORD_NVCC"] = str(nvcc)
    else:
        env["ACTORD_NVCC"] = "none"
    return env


def fake_deps(tmp: Path) -> Path:
    deps = tmp / "deps"
    (deps / "wheels").mkdir(parents=True)
    (deps / "llama_cpp_python-0.3.36-min.tar.xz").touch()
    (deps / "gemma3-270m.skel.xz").touch()
    for w in WHEELS:
        (deps / "wheels" / f"{w}-1.0-py3-none-any.whl").touch()
    return deps


def dry_run(tmp: Path, env: dict[str, str], deps: Path | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHON": sys.executable, "ACTORD_DEVICE_WORK": str(tmp / "work"),
            "ACTORD_DEVICE_DEPS": str(deps or tmp / "no-deps"), **env}
    full.pop("ACTORD_NVIDIA_SMI", None)
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=full, capture_output=True, text=True, timeout=60)


def test_without_a_gpu_it_fails_at_once_and_says_why(tmp_path: Path) -> None:
    r = dry_run(tmp_path, {"PATH": no_gpu_path()})
    assert r.returncode == 2
    assert "device check FAILED: no NVIDIA GPU here" in r.stderr and "nothing was built" in r.stderr
    assert not (tmp_path / "work").exists()


def test_a_real_run_fails_the_same_way_before_building(tmp_path: Path) -> None:
    full = {**os.environ, "PATH": no_gpu_path(), "ACTORD_DEVICE_WORK": str(tmp_path / "work")}
    r = subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no NVIDIA GPU here" in r.stderr and not (tmp_path / "work").exists()


def test_a_gpu_without_nvcc_is_refused_by_the_bootstrap_plan(tmp_path: Path) -> None:
    r = dry_run(tmp_path, fake_gpu(tmp_path, with_nvcc=False), fake_deps(tmp_path))
    assert r.returncode == 2 and "no CUDA build is possible here" in r.stderr and "nvcc" in r.stderr


def test_missing_deps_are_named_with_the_script_that_fetches_them(tmp_path: Path) -> None:
    r = dry_run(tmp_path, fake_gpu(tmp_path))
    assert r.returncode == 2
    assert "llama_cpp_python-0.3.36-min.tar.xz" in r.stderr and "msgspec-*.whl" in r.stderr
    assert "scripts/fetch_device_deps.sh" in r.stderr


def test_with_a_gpu_and_the_deps_the_dry_run_prints_the_cuda_build(tmp_path: Path) -> None:
    r = dry_run(tmp_path, fake_gpu(tmp_path), fake_deps(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "GPU: NVIDIA H200, 9.0" in r.stdout
    assert "-DGGML_CUDA=ON" in r.stdout and "-DCMAKE_CUDA_ARCHITECTURES=90" in r.stdout
    assert "-DGGML_AMX_TILE=OFF" in r.stdout
    assert not (tmp_path / "work").exists()

"""scripts/bootstrap.sh's decision, per kind of machine, without building anything.

`bootstrap.sh --print-plan` prints the backend, the CMake arguments and the stamp it would
build with; the machine is faked through its overrides (a cpuinfo file, `uname -s`, an
nvidia-smi and an nvcc that are small scripts here).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bootstrap.sh"

AMX_CPU = ("flags\t\t: fpu sse avx avx2 fma f16c bmi2 avx512f avx512vbmi avx512_vnni avx512_bf16 "
           "amx_tile amx_int8 amx_bf16\n")
OLD_CPU = "flags\t\t: fpu sse avx\n"


def fake_tool(tmp: Path, name: str, body: str) -> str:
    p = tmp / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return str(p)


def smi(tmp: Path, *caps: str) -> str:
    lines = "\\n".join(caps)
    return fake_tool(tmp, "nvidia-smi", f'case "$*" in *compute_cap*) printf "{lines}\\n";; *) exit 9;; esac')


def plan(tmp: Path, *, cpuinfo: str = AMX_CPU, uname: str = "Linux", nvidia_smi: str = "none",
         nvcc: str = "none", backend: str | None = None, stamp: str | None = None) -> tuple[int, dict[str, str], str]:
    info = tmp / "cpuinfo"
    info.write_text(cpuinfo)
    env = {**os.environ, "ACTORD_CPUINFO": str(info), "ACTORD_UNAME": uname, "ACTORD_NVIDIA_SMI": nvidia_smi,
           "ACTORD_NVCC": nvcc, "ACTORD_STAMP_FILE": str(tmp / "stamp")}
    if backend is not None:
        env["ACTORD_BACKEND"] = backend
    if stamp is not None:
        (tmp / "stamp").write_text(stamp + "\n")
    r = subprocess.run(["bash", str(SCRIPT), "--print-plan"], env=env, capture_output=True, text=True, timeout=30)
    out = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return r.returncode, out, r.stderr


def test_cpu_machine_builds_cpu_flags_and_never_amx(tmp_path: Path) -> None:
    rc, p, _ = plan(tmp_path)
    assert rc == 0 and p["backend"] == "cpu"
    args = p["cmake_args"].split()
    for off in ("-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"):
        assert off in args
    assert "-DGGML_AVX512=ON" in args and "-DGGML_AVX512_BF16=ON" in args
    assert not any("CUDA" in a or "METAL" in a for a in args)
    assert p["stamp"].startswith("0.3.36 backend=cpu ")


def test_cpu_flags_follow_cpuinfo(tmp_path: Path) -> None:
    _, p, _ = plan(tmp_path, cpuinfo=OLD_CPU)
    args = p["cmake_args"].split()
    assert "-DGGML_AVX=ON" in args and "-DGGML_AVX2=OFF" in args and "-DGGML_AVX512=OFF" in args


def test_nvidia_gpu_and_nvcc_build_cuda_for_that_gpu(tmp_path: Path) -> None:
    nvcc = fake_tool(tmp_path, "nvcc", "echo 'Cuda compilation tools, release 13.0'")
    rc, p, _ = plan(tmp_path, nvidia_smi=smi(tmp_path, "9.0"), nvcc=nvcc)
    assert rc == 0 and p["backend"] == "cuda" and p["cuda_architectures"] == "90"
    args = p["cmake_args"].split()
    assert "-DGGML_CUDA=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    assert f"-DCMAKE_CUDA_COMPILER={nvcc}" in args
    # The CPU backend beside it keeps the same flags, AMX off.
    assert "-DGGML_AMX_TILE=OFF" in args and "-DGGML_NATIVE=OFF" in args
    assert p["stamp"].startswith("0.3.36 backend=cuda ")


def test_several_gpus_build_each_architecture_once(tmp_path: Path) -> None:
    nvcc = fake_tool(tmp_path, "nvcc", "true")
    _, p, _ = plan(tmp_path, nvidia_smi=smi(tmp_path, "9.0", "8.6", "9.0"), nvcc=nvcc)
    assert "-DCMAKE_CUDA_ARCHITECTURES=86;90" in p["cmake_args"].split()


def test_gpu_without_nvcc_builds_cpu_and_says_why(tmp_path: Path) -> None:
    rc, p, _ = plan(tmp_path, nvidia_smi=smi(tmp_path, "9.0"), nvcc="none")
    assert rc == 0 and p["backend"] == "cpu" and "nvcc" in p["reason"]


def test_nvcc_without_a_gpu_builds_cpu(tmp_path: Path) -> None:
    nvcc = fake_tool(tmp_path, "nvcc", "true")
    failing = fake_tool(tmp_path, "nvidia-smi", "echo 'NVIDIA-SMI has failed'; exit 9")
    rc, p, _ = plan(tmp_path, nvidia_smi=failing, nvcc=nvcc)
    assert rc == 0 and p["backend"] == "cpu" and p["cuda_architectures"] == ""


def test_macos_builds_metal(tmp_path: Path) -> None:
    rc, p, _ = plan(tmp_path, uname="Darwin", cpuinfo="")
    assert rc == 0 and p["backend"] == "metal"
    assert "-DGGML_METAL=ON" in p["cmake_args"].split() and "CUDA" not in p["cmake_args"]


def test_forced_cuda_without_a_gpu_fails_clearly(tmp_path: Path) -> None:
    rc, _, err = plan(tmp_path, backend="cuda")
    assert rc == 3 and "needs an NVIDIA GPU" in err


def test_forced_backend_must_be_known(tmp_path: Path) -> None:
    rc, _, err = plan(tmp_path, backend="rocm")
    assert rc == 3 and "auto, cpu, cuda or metal" in err


def test_backend_choice_is_in_the_stamp_so_a_change_rebuilds(tmp_path: Path) -> None:
    _, cpu, _ = plan(tmp_path)
    nvcc = fake_tool(tmp_path, "nvcc", "true")
    _, cuda, _ = plan(tmp_path, nvidia_smi=smi(tmp_path, "9.0"), nvcc=nvcc, stamp=cpu["stamp"])
    assert cuda["stamp"] != cpu["stamp"] and cuda["stamp_status"] == "stale"
    _, again, _ = plan(tmp_path, stamp=cpu["stamp"])
    assert again["stamp_status"] == "current"


def test_a_stamp_from_before_backends_is_a_current_cpu_build(tmp_path: Path) -> None:
    _, p, _ = plan(tmp_path)
    legacy = "0.3.36 " + p["cmake_args"]  # what bootstrap wrote before it recorded the backend
    _, again, _ = plan(tmp_path, stamp=legacy)
    assert again["stamp_status"] == "legacy"
    _, changed, _ = plan(tmp_path, cpuinfo=OLD_CPU, stamp=legacy)
    assert changed["stamp_status"] == "stale"


def test_missing_stamp_builds(tmp_path: Path) -> None:
    _, p, _ = plan(tmp_path)
    assert p["stamp_status"] == "missing"

"""bench/device_model.py: a model's skeleton (its header as it is, small tensors, the tensor
table) rebuilt as a GGUF of the very same layout that libllama loads and decodes with."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from actord.vocabulary.config import Config
from actord.service.system import ActorSystem

pytestmark = pytest.mark.slow  # the Gemma-sized stand-in model, built and decoded

ROOT = Path(__file__).resolve().parents[2]


def device_model():
    spec = importlib.util.spec_from_file_location("device_model", ROOT / "bench" / "device_model.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.real_model
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the layout, not the event loop, is under test
async def test_gemma_stand_in_has_the_same_layout_and_decodes(real_model: str, tmp_path: Path,
                                                              anyio_backend: str) -> None:
    dm = device_model()
    skel = tmp_path / "gemma.skel.xz"
    m = dm.skeleton(Path(real_model), skel, preset=0)
    assert skel.stat().st_size < 16 << 20 and m["file_size"] == Path(real_model).stat().st_size
    out = dm.build(skel, tmp_path / "standin.gguf")
    src = Path(real_model).read_bytes()
    got = out.read_bytes()
    assert len(got) == len(src) and got[: m["header_len"]] == src[: m["header_len"]]
    for t in m["tensors"]:
        a, b = t["offset"], t["offset"] + t["n_bytes"]
        if t["carried"]:
            assert got[a:b] == src[a:b], t["name"]  # the norms travel as they are
    assert sum(not t["carried"] for t in m["tensors"]) == 127  # every quantized tensor is rebuilt
    async with ActorSystem(Config(model=str(out), slots=1, ctx=256)) as s:
        r = await s.complete(prompt="The lighthouse keeper", n_predict=4, ignore_eos=True)
        assert len(r.tokens) == 4

"""Seeded simulation: random workloads and faults under the deterministic dispatcher.

One seed fixes everything: the workload (requests across minds and slots, page moves,
spills, saves and restores, gene moves, a tight page ceiling and checkpoint budget), the
fault schedule (a failed fsync or directory sync, a crash mid-publication followed by a
reader, an engine step that fails) and the order of every event. After every event the
invariants are checked; a failure raises `InvariantViolated` with the seed and a one-line
command that reproduces it bit for bit.

Invariants: page charges equal the live pages and never exceed the ceiling; checkpoint
bytes never exceed their budget; no decode runs with a freed gene (the engine refuses
such a step, which would fail a request with GeneNotResident); no idle slot is still
enrolled with the scheduler; every acknowledged publication reads back whole; every
operation gets exactly one final answer (the run never stalls with a client waiting).
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import sniffio

from actord.config import Config
from actord.engine import jobs as J
from actord.engine.core import Engine
from actord.errors import ActordError, EngineError
from actord.replay.scheduler import CLIENT, DeterministicDispatcher, SeededPolicy
from actord.replay.trace import digest
from actord.storage.osfs import Fault, FaultyFs, OsFs, SimulatedCrash
from actord.storage.publish import read_generation
from actord.system import ActorSystem


class InvariantViolated(AssertionError):
    pass


@dataclass
class SimResult:
    seed: int
    trace_hash: str
    events: int
    ops: int
    errors: dict[str, int] = field(default_factory=dict)
    trace: list[Any] = field(default_factory=list, repr=False)


class _FlakyEngine(Engine):
    """An engine whose Step fails on a seeded schedule (a fault, not a bug)."""

    fail_steps: set[int] = set()

    def handle(self, job: J.Job) -> Any:
        if isinstance(job, J.Step) and (self.step_no + 1) in self.fail_steps:
            self.step_no += 1
            raise EngineError("injected step failure", step=self.step_no)
        return super().handle(job)


def repro(seed: int, steps: int, model: str) -> str:
    return f"actord simulate --seed {seed} --steps {steps} --model {model}"


async def simulate(seed: int, steps: int, model: str, lora: str | None = None, *, clients: int = 3,
                   faults: bool = True, work: str | None = None) -> SimResult:
    rng = random.Random(seed)
    reseed: Any = None
    if sniffio.current_async_library() == "trio":
        import trio

        def _reseed(position: int) -> None:  # trio shuffles its run batches: fix each step's shuffle
            trio._core._run._r.seed(seed * 1_000_003 + position)

        reseed = _reseed
    tmp = tempfile.TemporaryDirectory(prefix="actord-sim-") if work is None else None
    root = Path(work or tmp.name)  # type: ignore[union-attr]
    fs: OsFs = FaultyFs()
    if faults and rng.random() < 0.5:
        fs = FaultyFs(faults=[Fault(op=rng.choice(["fsync", "dirsync", "rename", "step"]),
                                    nth=rng.randint(1, 6), action=rng.choice(["fail", "crash"]))])
    _FlakyEngine.fail_steps = {rng.randint(5, 5 + 4 * steps)} if faults and rng.random() < 0.3 else set()
    cfg = Config(model=model, slots=2, ctx=512, batch=32, page_dir=str(root), threads=1,
                 page_ram_bytes=rng.choice([6_000, 20_000, 10**6]), ctx_checkpoints_bytes=rng.choice([0, 4_000, 10**6]),
                 checkpoint_every=8, ctx_checkpoints=3, device_bytes=0)
    events: list[Any] = []
    disp = DeterministicDispatcher(SeededPolicy(seed))
    disp.reseed = reseed
    system = ActorSystem(cfg, dispatcher=disp, engine_factory=_FlakyEngine, trace=events)
    published: dict[str, str] = {}
    errors: dict[str, int] = {}
    pending = {"n": 0}
    ops_done = [0]
    histories = {f"m{i}": [1, 20 + i, 30 + i, 40 + i] for i in range(3)}
    gene_ids: list[int] = []

    async def op(c: int, r: random.Random) -> None:
        kind = r.choice(["complete", "complete", "mind", "mind", "page_out", "page_in", "drop", "spill",
                         "save", "restore", "erase", "gene"])
        slot = r.randrange(cfg.slots)
        try:
            if kind == "complete":
                await system.complete(prompt=[1] + [r.randrange(3, 500) for _ in range(r.randint(1, 24))],
                                      n_predict=r.randint(1, 6), slot=slot, ignore_eos=True,
                                      genes=[{"id": g, "scale": 1.0} for g in gene_ids if r.random() < 0.3])
            elif kind == "mind":
                m = r.choice(sorted(histories))
                res = await system.complete(prompt=histories[m], n_predict=3, mind=m, ignore_eos=True)
                histories[m] = histories[m] + res.tokens + [r.randrange(3, 500)]
            elif kind == "page_out":
                await system.page_out(slot, f"p{r.randrange(3)}")
            elif kind == "page_in":
                await system.page_in(slot, f"p{r.randrange(3)}")
            elif kind == "drop":
                await system.page_drop(f"p{r.randrange(3)}")
            elif kind == "spill":
                name = f"f{r.randrange(3)}.page"
                await system.page_spill(f"p{r.randrange(3)}", name, drop=r.random() < 0.5)
                published[name] = "spill"
            elif kind == "save":
                name = f"f{r.randrange(3)}.page"
                await system.slot_save(slot, name)
                published[name] = "save"
            elif kind == "restore":
                await system.slot_restore(slot, f"f{r.randrange(3)}.page")
            elif kind == "erase":
                await system.slot_erase(slot)
            elif kind == "gene" and gene_ids:
                g = r.choice(gene_ids)
                await (system.gene_page_out(g) if r.random() < 0.5 else system.gene_page_in(g))
        except ActordError as e:
            if e.type == "GeneNotResident":
                raise InvariantViolated(f"seed {seed}: a decode was attempted with a freed gene") from e
            errors[e.type] = errors.get(e.type, 0) + 1
        ops_done[0] += 1

    async def client(c: int) -> None:
        CLIENT.set(f"client{c}")
        r = random.Random(seed * 1000 + c)
        for _ in range(steps):
            await op(c, r)
        pending["n"] -= 1

    def check() -> None:
        ps = system.pages
        if ps.charged != ps.live_bytes() or ps.charged != sum(g.n_bytes for g in ps.gens.values()) + sum(
                n for _, n in ps.reserved.values()):
            raise InvariantViolated(f"seed {seed}: page charge {ps.charged} != live pages {ps.live_bytes()}")
        if ps.charged > ps.ceiling:
            raise InvariantViolated(f"seed {seed}: page charge {ps.charged} over the ceiling {ps.ceiling}")
        cb = system.ckpt_budget
        if cb.used > cb.budget:
            raise InvariantViolated(f"seed {seed}: checkpoint bytes {cb.used} over the budget {cb.budget}")
        for s in system.slots:
            if s.active is None and s.id in system.scheduler.work:
                raise InvariantViolated(f"seed {seed}: idle slot {s.id} is still enrolled")

    crashed = False
    try:
        async with system:
            system.files.fs = fs
            disp.live = True
            if lora:
                gene_ids.append((await _drive_one(disp, system.gene_load(lora))).id)
            pending["n"] = clients
            async with anyio.create_task_group() as tg:
                for c in range(clients):
                    tg.start_soon(client, c)
                while True:
                    progressed = await disp.step()
                    check()
                    if not progressed:
                        if pending["n"] > 0:
                            raise InvariantViolated(f"seed {seed}: stalled with {pending['n']} client(s) waiting")
                        break
            disp.close_actors()
    except BaseExceptionGroup as eg:
        # A simulated crash mid-publication kills the process; anything else is a finding.
        crash, rest = eg.split(SimulatedCrash)
        if rest is not None:
            found, _ = rest.split(InvariantViolated)
            if found is not None:  # report the finding itself, not the task groups around it
                while isinstance(found, BaseExceptionGroup):
                    found = found.exceptions[0]
                raise found from None
            raise rest
        crashed = crash is not None
    except SimulatedCrash:
        crashed = True
    if crashed:  # the next reader must find each file whole (old or new) or absent
        for i in range(3):
            try:
                read_generation(root, f"f{i}.page", OsFs())
            except ActordError as e:
                if e.type != "FileNotFound":
                    raise InvariantViolated(f"seed {seed}: after a crash f{i}.page reads as {e.type}") from e
        for p in root.iterdir():
            if p.name.startswith(".actord-stage"):
                raise InvariantViolated(f"seed {seed}: orphaned stage {p.name} survived a read")
    trace_hash = system.recorder.hash.hexdigest() if system.recorder else digest(events)
    for name in published:  # every acknowledged publication reads back whole
        try:
            read_generation(root, name, OsFs())
        except ActordError as e:
            raise InvariantViolated(f"seed {seed}: published {name} does not read back: {e.type}") from e
    if tmp is not None:
        tmp.cleanup()
    return SimResult(seed=seed, trace_hash=trace_hash, events=len(events), ops=ops_done[0], errors=errors,
                     trace=events)


async def _drive_one(disp: DeterministicDispatcher, aw: Any) -> Any:
    """Run one host call to completion while stepping the dispatcher."""
    box: dict[str, Any] = {}

    async def run() -> None:
        box["v"] = await aw

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while "v" not in box:
            if not await disp.step():
                await anyio.sleep(0)
    return box["v"]

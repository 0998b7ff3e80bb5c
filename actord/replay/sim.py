"""Seeded simulation: random workloads and faults under the deterministic dispatcher.

One seed fixes everything: the workload (requests across minds and slots, page moves,
spills, saves and restores, gene moves, a tight page ceiling and checkpoint budget), the
fault schedule (a failed fsync or directory sync, a crash mid-publication followed by a
reader, an engine step that fails) and the order of every event. After every event the
invariants are checked; a failure raises `InvariantViolated` with the seed and a one-line
command that reproduces it bit for bit.

The workload also hunts for what only concurrency shows: a tight device budget shared by
several genes and the slots' states (so the residency must evict slots, by telling them),
requests with mixed gene sets, mind-addressed requests over few slots, a small shared KV
cache (so the scheduler must make room), and a SIGTERM-like `shutdown` at a seeded point.
The dispatcher's wait-for graph is watched: a refused ask cycle, an upward ask, a timed-out
ask or a crashed actor is a finding.

Invariants: page charges equal the live pages, and `charged - earmarked` (bytes a
replacement under way will free) never exceeds the ceiling; checkpoint bytes in the
budget's mirror never exceed the budget, and at the end every slot's real checkpoints are
what the mirror holds (a full SWA cache's slot: at most the one window a move brought, which
its page was charged for); when no request runs and nothing is pending or being evicted, the
resident genes and slot states fit the device budget; a slot's KV cells as the scheduler
charges them never exceed n_ctx in total; no decode runs with a freed gene (the engine
refuses such a step, which would fail a request with GeneNotResident); no idle slot is
still enrolled with the scheduler; every acknowledged publication reads back whole; every
operation gets exactly one final answer (the run never stalls with a client waiting).

Persistence (issue 34), drawn from a stream of its own so the other draws stay as they
were: write-behind passes at seeded instants of a clock made of the event count (a window
of a seeded number of events), racing the clients; and after a graceful stop with no disk
fault fired, every mind a slot or a RAM page holds reads back from her page file with
exactly her tokens (what a restart would resume from).

The trace hash depends on the seed, the model's bytes and the code, never on where files
live: paths are written relative to their folders.
"""

from __future__ import annotations

import errno
import random
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from actord.serving.messages import RunStep
from actord.serving.page_store import SpillEnd
from actord.vocabulary.config import Config
from actord.engine import jobs as J
from actord.engine.engine import Engine
from actord.engine.step import Stepper
from actord.vocabulary.errors import ActordError, EngineError
from actord.replay.dispatcher import CLIENT, DeterministicDispatcher, SeededPolicy
from actord.replay.sim_oracle import Answered, output_problem
from actord.replay.sim_persist import held_by, persisted_problem, restart_problem
from actord.vocabulary.trace import digest
from actord.storage.osfs import Fault, FaultyFs, OsFs, SimulatedCrash
from actord.storage.publish import read_generation
from actord.service.system import ActorSystem


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
    yields: int = 0  # generations that gave their slot up (policy/yielding.py)


class _FlakyStepper(Stepper):
    """A stepper whose steps numbered in `fail_steps` fail (a fault on a seeded schedule, not a bug)."""

    def __init__(self, *args: Any, fail_steps: set[int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.fail_steps = fail_steps

    def _step(self, job: J.Step) -> Any:
        if (self.step_no + 1) in self.fail_steps:
            self.step_no += 1
            raise EngineError("injected step failure", step=self.step_no)
        return super()._step(job)


FINDINGS = {"AskCycle", "AskOrderViolated", "AskTimeout", "ActorFailed", "GeneNotResident", "KvCacheFull"}


FLOOD_METHODS = ("page_in", "slot_list", "page_list", "gene_list")
STARVED_AFTER = 2  # client deliveries to the scheduler ahead of its queued step, beyond its own messages


async def simulate(seed: int, steps: int, model: str, lora: str | list[str] | None = None, *, clients: int = 3,
                   faults: bool = True, work: str | None = None, device: bool = True, flood: bool = True,
                   draft: str | None = None) -> SimResult:
    """One seeded run; `draft` turns speculative decoding on with that draft model (a seeded
    spec_n_max, and a full SWA cache: speculation needs memory that can be cut back), or
    "mtp" with the model's own MTP head."""
    rng = random.Random(seed)
    loras = [] if lora is None else [lora] if isinstance(lora, str) else list(lora)
    tmp = tempfile.TemporaryDirectory(prefix="actord-sim-") if work is None else None
    root = Path(work or tmp.name)  # type: ignore[union-attr]
    fs = FaultyFs()
    plan: list[Fault] = []
    if faults and rng.random() < 0.5:
        plan.append(Fault(op=rng.choice(["fsync", "dirsync", "rename", "step"]), nth=rng.randint(1, 6),
                          action=rng.choice(["fail", "crash"])))
    if faults and rng.random() < 0.4:
        # A disk that refuses writes: full, read-only or failing, for one call, a few, or from
        # then on (spills with drop and the placer's and evictions' spills must keep the state).
        plan.append(Fault(op=rng.choice(["write", "fsync", "rename"]), nth=rng.randint(1, 8),
                          errno=rng.choice([errno.ENOSPC, errno.EROFS, errno.EIO]), times=rng.choice([1, 3, 0])))
    if plan:
        fs = FaultyFs(faults=plan)
    fail_steps = {rng.randint(5, 5 + 4 * steps)} if faults and rng.random() < 0.3 else set()
    n_slots = rng.choice([2, 2, 3])
    # Device budgets in units of the genes' size (35 kB for the tiny llama's), so they are as
    # tight for a model whose adapters are larger.
    gene_scale = max(35_000, Path(loras[0]).stat().st_size) if loras else 35_000
    # Generations that give their slot up to a waiting mind (policy/yielding.py), soon or
    # never; when soon, minds write longer turns, so that they do (their own stream).
    yield_after = random.Random(f"yield/{seed}").choice([0, 0, 2, 5])
    mind_turn = 12 if yield_after else 3
    persist_rng = random.Random(f"persist/{seed}")
    wb_every = persist_rng.choice([0, 0, 40, 150])  # events between write-behind passes (0: none)
    wb_window = persist_rng.choice([1, 3, 10])  # in units of wb_every: the pass's clock is position / wb_every
    file_bases = persist_rng.random() < 0.5  # page files on a base refer to a base file
    cfg = Config(model=model, slots=n_slots, ctx=rng.choice([160, 256, 512]), batch=32, page_dir=str(root), threads=1,
                 page_ram_bytes=rng.choice([6_000, 20_000, 10**6]), ctx_checkpoints_bytes=rng.choice([0, 4_000, 10**6]),
                 checkpoint_every=8, ctx_checkpoints=3,
                 device_bytes=rng.choice([0, 60_000, 90_000, 150_000]) * gene_scale // 35_000 if device else 0,
                 ask_timeout_s=60, shutdown_grace_s=0.0, write_behind_s=float(wb_window),
                 page_file_bases=file_bases,
                 # Deeper pipelines too (their own stream: the other choices stay as they were).
                 pipeline_depth=random.Random(f"depth/{seed}").choice([0, 0, 3, 4]),
                  yield_after_tokens=yield_after,
                 # The prompt cache (policy/prompt_cache.py) on short prompts too, bounded tight or
                 # not, or off (its own stream).
                 **dict(zip(("prompt_cache_minds", "prompt_cache_min_tokens"),
                            random.Random(f"cache/{seed}").choice([(0, 128), (2, 8), (64, 8), (64, 32)]))),
                 **({} if not draft else {"spec": "mtp", "spec_n_max": rng.choice([1, 2, 4])} if draft == "mtp" else
                    {"spec_draft_model": draft, "spec_n_max": rng.choice([1, 2, 4]), "swa_full": "on"}))
    # A flood client: bursts of many asks of one method in flight at once.
    flooding = flood and rng.random() < 0.5
    flood_method = rng.choice(FLOOD_METHODS)
    flood_width = rng.randint(8, 40)
    flood_bursts = max(1, steps // 6)
    n_clients = clients + (1 if flooding else 0)
    max_events = 400 * steps * clients + (60 * flood_width * flood_bursts if flooding else 0)
    # ~20x a busy run: past it, work goes round without ending
    stop_at = rng.randint(30 * steps, 90 * steps) if rng.random() < 0.25 else None  # late: the work runs first
    events: list[Any] = []
    disp = DeterministicDispatcher(SeededPolicy(seed))
    flaky = partial(_FlakyStepper, fail_steps=fail_steps)
    system = ActorSystem(cfg, dispatcher=disp, engine_factory=lambda c: Engine(c, stepper=flaky), trace=events)
    published: dict[str, str] = {}
    errors: dict[str, int] = {}
    pending = {"n": 0}
    ops_done = [0]
    # Minds and many requests open with one system prompt, as sessions of one agent do: new
    # minds and unnamed requests start from it by cells (serving/prefix_share.py).
    system_prompt = [1] + [3 + (seed * 7 + i * 13) % 490 for i in range(39)]
    histories = {f"m{i}": system_prompt + [20 + i, 30 + i, 40 + i] for i in range(3)}
    fresh = len(system_prompt) + 3
    conversations: dict[int, list[int]] = {}  # a client's unnamed conversation, by client
    gene_ids: list[int] = []
    gene_paths: dict[int, str] = {}  # a loaded gene's id -> its file (the oracle loads genes by file)
    answered: list[Answered] = []  # every completion answered, for the output oracle (sim_oracle.py)
    stopping = {"on": False}

    def genes_of(r: random.Random) -> list[dict[str, Any]]:
        return [{"id": g, "scale": r.choice([1.0, 0.5])} for g in gene_ids if r.random() < 0.35]

    def answer(how: str, prompt: list[int], genes: list[dict[str, Any]], n_predict: int, res: Any,
               think: dict[str, Any] | None = None) -> None:
        answered.append(Answered(prompt=tuple(prompt), genes=tuple((gene_paths[g["id"]], g["scale"]) for g in genes),
                                 n_predict=n_predict, think_key=repr(sorted((think or {}).items())),
                                 think=think or {}, tokens=tuple(res.tokens), n_cached=res.n_cached, how=how))

    def counted(e: ActordError, what: str) -> None:
        """A client's typed error: after a simulated crash the run ends as one (the process
        "died" mid-publication, possibly in an actor's own save: what its clients hear
        afterwards is moot); a finding is a violated invariant; anything else is counted."""
        if any(f.action != "fail" for f in fs.fired):
            raise SimulatedCrash(f"after a simulated crash, {what} got {e.type}") from e
        if e.type in FINDINGS:
            raise InvariantViolated(f"seed {seed}: {what} failed with {e.type}: {e.message}") from e
        errors[e.type] = errors.get(e.type, 0) + 1

    async def op(c: int, r: random.Random) -> None:
        kind = r.choice(["complete", "complete", "mind", "mind", "page_out", "page_in", "drop", "spill",
                         "save", "restore", "erase", "gene", "refill"])
        slot = r.randrange(cfg.slots)
        try:
            if kind == "complete":
                head = system_prompt if r.random() < 0.4 else [1]
                prompt = head + [r.randrange(3, 500) for _ in range(r.randint(1, 60))]
                # A third think under a budget (drawn off the prompt: the seeds' draws stay as they were).
                think = {"thought_budget": {"budget": 1 + prompt[-1] % 7, "start": [5, 6], "end": [7, 8],
                                            "forced": [9, 7, 8], "pieces": [b"x", b"y", b"z"],
                                            "opened": prompt[-1] % 2 == 0}} if prompt[-1] % 3 == 0 else {}
                # Scopes (vocabulary/kv_identity.py), drawn off the prompt too: a salt or another tenant.
                scope = ({"cache_salt": "s1"} if prompt[-1] % 5 == 0 else
                         {"tenant": "uid:7"} if prompt[-1] % 7 == 0 else {})
                # One in four goes on with the client's unnamed conversation, resent whole (the
                # prompt cache finds its mind by its last prompt); drawn off the prompt too.
                goes_on = prompt[-1] % 4 == 1
                if goes_on and c in conversations and len(conversations[c]) + len(prompt) <= cfg.ctx // 3:
                    prompt = conversations[c] + prompt[len(head):]
                n_predict, genes = r.choice([1, 3, 6, 40]), genes_of(r)
                res = await system.complete(prompt=prompt, n_predict=n_predict, ignore_eos=True,
                                            genes=genes, **think, **scope,
                                            **({"slot": slot} if r.random() < 0.8 else {}))
                answer("completion", prompt, genes, n_predict, res, think)
                if goes_on:
                    conversations[c] = prompt + res.tokens
            elif kind == "mind":
                m = r.choice(sorted(histories))
                if len(histories[m]) > cfg.ctx // 3:  # the mind starts over before it outgrows the cache
                    histories[m] = histories[m][:fresh]
                # One mind in three lives under a salt of its own (her name is kept under it).
                salted = {"cache_salt": f"salt-{m}"} if sum(map(ord, m)) % 3 == 0 else {}
                genes, prompt = genes_of(r), histories[m]  # another client's turn of hers may end first
                res = await system.complete(prompt=prompt, n_predict=mind_turn, mind=m, ignore_eos=True,
                                            genes=genes, **salted)
                answer(f"turn of mind {m}", prompt, genes, mind_turn, res)
                histories[m] = histories[m] + res.tokens + [r.randrange(3, 500) for _ in range(r.randint(1, 12))]
            elif kind == "page_out":
                await system.page_out(slot, f"p{r.randrange(3)}")
            elif kind == "refill":  # fill a slot and page it out: names get replaced
                prompt = [1] + [r.randrange(3, 500) for _ in range(r.randint(1, 30))]
                answer("refill", prompt, [], 2, await system.complete(prompt=prompt, n_predict=2, slot=slot,
                                                                       ignore_eos=True))
                await system.page_out(slot, f"p{r.randrange(2)}")
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
            if e.type == "ShuttingDown" and not stopping["on"] and not any(f.action != "fail" for f in fs.fired):
                raise InvariantViolated(f"seed {seed}: {kind} refused as shutting down, but no stop was asked") from e
            counted(e, kind)
        ops_done[0] += 1

    async def client(c: int) -> None:
        CLIENT.set(f"client{c}")
        r = random.Random(seed * 1000 + c)
        for _ in range(steps):
            await op(c, r)
        pending["n"] -= 1

    async def flood_one(i: int, slot: int) -> None:
        CLIENT.set(f"flood{i}")  # distinct: identical inputs from one client are one event each
        try:
            if flood_method == "page_in":
                await system.page_in(slot, f"p{i % 3}")
            elif flood_method == "slot_list":
                await system.slot_list()
            elif flood_method == "page_list":
                await system.page_list()
            else:
                await system.gene_list()
        except ActordError as e:
            counted(e, f"flood {flood_method}")
        ops_done[0] += 1

    wb = {"running": False, "passes": 0}

    async def write_behind_pass(now: float) -> None:
        CLIENT.set("writebehind")
        try:
            await system.write_behind_tick(now)
            wb["passes"] += 1
        except ActordError as e:
            counted(e, "write-behind")
        finally:
            wb["running"] = False

    async def flooder() -> None:
        CLIENT.set("flooder")
        r = random.Random(seed * 1000 + 999)
        for _ in range(flood_bursts):
            if stopping["on"]:
                break
            slot = r.randrange(cfg.slots)
            async with anyio.create_task_group() as burst:
                for i in range(flood_width):
                    burst.start_soon(flood_one, i, slot)
        pending["n"] -= 1

    # Invariants watched as events happen (a hook that raises is removed, so they are noted
    # here and raised by check()).
    violations: list[str] = []
    durable: dict[str, tuple[int, ...]] = {}  # page file -> tokens of its last durable generation
    starve = {"client_deliveries": 0, "control_deliveries": 0}

    def on_delivery(actor: Any, env: Any) -> None:
        m = env.msg
        if actor is system.scheduler:
            # While a step is queued, client calls may be delivered ahead of it only in turn
            # with the scheduler's own messages (each control message may let one client go
            # before it): more than that is generation waiting behind a flood.
            if isinstance(m, RunStep):
                starve["client_deliveries"] = starve["control_deliveries"] = 0
            elif system.scheduler.stepping and system.scheduler.core.reqs:
                starve["client_deliveries" if env.client else "control_deliveries"] += 1
                ahead = starve["client_deliveries"] - starve["control_deliveries"]
                if ahead > STARVED_AFTER:
                    violations.append(f"generation starved: {starve['client_deliveries']} client calls delivered "
                                      "to the scheduler while its next step waited")
        elif actor is system.pages and isinstance(m, SpillEnd) and m.drop:
            g = system.pages.gens.get(m.gen)
            if g is not None and g.page is not None and system.pages.names.get(g.page.name) == m.gen \
                    and tuple(g.page.tokens) not in set(durable.values()):
                violations.append(f"page {g.page.name!r} dropped by a spill without a durable copy")

    def watch_durability() -> None:
        publish = system.files.publish

        async def durable_publish(name: str, image: Any, **kw: Any) -> Any:
            stats = await publish(name, image, **kw)
            durable[name] = tuple(image.tokens)  # publish returns once every file is fsynced
            return stats

        system.files.publish = durable_publish
        for sl in system.slots:
            # An eviction may erase a mind's sequence only once a copy is durable (or whole
            # in the page store): checked at the erase itself, inside the eviction.
            def wrap(sl: Any = sl, evict: Any = sl.evict, erase: Any = sl.memory.erase) -> tuple[Any, Any]:
                evicting: list[tuple[str | None, tuple[int, ...]]] = []

                async def watched_evict(reason: str, **kw: Any) -> int:
                    evicting.append((sl.mind, tuple(sl.kv_tokens)))
                    try:
                        return await evict(reason, **kw)
                    finally:
                        evicting.pop()

                async def watched_erase() -> None:
                    if evicting and evicting[-1][0] is not None:
                        mind, held = evicting[-1]
                        if held and held not in set(durable.values()) and not any(
                                g.page is not None and tuple(g.page.tokens) == held for g in system.pages.gens.values()):
                            violations.append(f"slot {sl.id} evicted mind {mind!r} without a durable copy")
                    await erase()

                return watched_evict, watched_erase
            sl.evict, sl.memory.erase = wrap()

    def check() -> None:
        ps = system.pages
        if ps.charged != ps.live_bytes() or ps.charged != sum(g.n_bytes for g in ps.gens.values()) + sum(
                n for _, n in ps.reserved.values()):
            raise InvariantViolated(f"seed {seed}: page charge {ps.charged} != live pages {ps.live_bytes()}")
        if ps.effective > ps.ceiling:
            raise InvariantViolated(f"seed {seed}: page charge {ps.charged} (earmarked {ps.earmarked}) over the "
                                    f"ceiling {ps.ceiling}")
        cb = system.ckpt_budget
        if cb.used > cb.budget:
            raise InvariantViolated(f"seed {seed}: checkpoint bytes {cb.used} over the budget {cb.budget}")
        for s in system.slots:
            # The scheduler lets go of a request before it tells the slot `Ended`.
            if s.active is None and s.id in system.scheduler.work:
                raise InvariantViolated(f"seed {seed}: idle slot {s.id} is still enrolled")
        sch = system.scheduler
        cells = {s.id: sch.held(s.id) for s in system.slots}
        shared = sch.core.shared_cells()  # cells two sequences hold, charged once
        if sch.n_ctx and sum(cells.values()) - shared > sch.n_ctx:  # n_ctx 0: no cells (pure recurrent)
            raise InvariantViolated(f"seed {seed}: KV cells charged {cells} less {shared} shared exceed n_ctx "
                                    f"{sch.n_ctx}")
        def kv_of(slot: Any) -> list[int] | None:
            # A running request's cells are its record's (the slot hears of them at its end;
            # a twin's share is made in the middle: serving/steps/core.py); None while its
            # `Ended` is on its way (neither knows them then).
            rid = sch.core.by_slot.get(slot.id)
            if rid is not None:
                return sch.core.reqs[rid].tokens[:sch.core.reqs[rid].n_done]
            return None if slot.active is not None and slot.active.enrolled else slot.kv_tokens

        for dst, link in sch.core.links.items():
            # A share is charged once only for cells both sequences hold: the same tokens.
            src, src_epoch, dst_epoch, _ = link
            counted = sch.core._shared(dst, link)
            a, b = system.slots[src], system.slots[dst]
            ka, kb = kv_of(a), kv_of(b)
            if (counted and ka is not None and kb is not None and a.kv_epoch == src_epoch
                    and b.kv_epoch == dst_epoch and ka[:counted] != kb[:counted]):
                raise InvariantViolated(f"seed {seed}: {counted} cells of slots {src} and {dst} charged once "
                                        "hold different tokens")
        res = system.residency
        quiet = res.name in disp._gates  # not in the middle of a handler (a page move under way)
        idle = not any(s.active for s in system.slots)
        if (res.budget and quiet and idle and not (res.running or res.pending or res.evicting or res.kept)
                and res.device_bytes() > res.budget):
            raise InvariantViolated(f"seed {seed}: device bytes {res.device_bytes()} over the budget {res.budget} "
                                    "with nothing running")
        if disp.cycles:
            raise InvariantViolated(f"seed {seed}: wait-for cycle {' -> '.join(disp.cycles[0])}")
        if disp.order_violations:
            raise InvariantViolated(f"seed {seed}: AskOrderViolated: {disp.order_violations[0]}")
        crashed = [a for a in system.actors() if a.failed]
        if crashed:
            raise InvariantViolated(f"seed {seed}: actor {crashed[0].name} crashed: {crashed[0].failure!r}")
        if violations:
            raise InvariantViolated(f"seed {seed}: {violations[0]}")

    def check_end() -> None:
        cb = system.ckpt_budget
        for s in system.slots:
            real = sorted((c.pos, c.n_bytes) for c in s.checkpoints)
            mirror = sorted((m.pos, m.n_bytes) for m in cb.lists.get(s.id, []))
            if s.memory.windowed():  # a full SWA cache's moved-in window: its page's, not the budget's
                if mirror or len(real) > 1:
                    raise InvariantViolated(f"seed {seed}: slot {s.id} (full SWA cache) holds checkpoints {real}, "
                                            f"the budget counts {mirror}")
                continue
            if real != mirror:
                raise InvariantViolated(f"seed {seed}: slot {s.id} holds checkpoints {real}, the budget counts {mirror}")


    held_at_stop: dict[str, list[tuple[tuple[int, ...], tuple[Any, ...]]]] = {}

    def check_persisted() -> None:
        # A file a client wrote by name (save, spill: f0-f2.page) may be written again by a
        # call admitted before the stop, after its persistence: it is the client's to say.
        held_at_stop.update({m: h for m, h in held_by(system).items() if f"{m}.page" not in published})
        problem = persisted_problem(root, held_at_stop)
        if problem is not None:
            raise InvariantViolated(f"seed {seed}: {problem}")

    crashed = False
    try:
        async with system:
            system.files.fs = fs
            disp.hooks.append(on_delivery)
            watch_durability()
            disp.live = True
            for path in loras:
                try:
                    gene_ids.append((await _drive_one(disp, system.gene_load(path))).id)
                    gene_paths[gene_ids[-1]] = path
                except ActordError as e:  # a budget too tight for another gene is a refusal, not a finding
                    errors[e.type] = errors.get(e.type, 0) + 1
            pending["n"] = n_clients
            async with anyio.create_task_group() as tg:
                for c in range(clients):
                    tg.start_soon(client, c)
                if flooding:
                    tg.start_soon(flooder)
                try:
                    while True:
                        if wb_every and not wb["running"] and not stopping["on"] and pending["n"] > 0 \
                                and disp.position % wb_every == 0:
                            wb["running"] = True
                            tg.start_soon(write_behind_pass, disp.position / wb_every)
                        if stop_at is not None and disp.position >= stop_at and not stopping["on"]:
                            stopping["on"] = True  # SIGTERM: no grace, everything in flight is cancelled
                            tg.start_soon(system.shutdown, 0.0)
                        progressed = await disp.step()
                        check()
                        if disp.position > max_events:
                            raise InvariantViolated(f"seed {seed}: livelock: {disp.position} events and "
                                                    f"{pending['n']} client(s) still waiting")
                        if not progressed:
                            if pending["n"] > 0:
                                raise InvariantViolated(f"seed {seed}: stalled with {pending['n']} client(s) waiting")
                            break
                except BaseException:
                    # A finding, or a simulated crash in a client: report it, not a hang
                    # behind it. The clients are cancelled and the dispatcher keeps stepping
                    # so that shielded work (a spill's release) can end.
                    tg.cancel_scope.cancel()
                    with anyio.CancelScope(shield=True):
                        for _ in range(100_000):
                            if not await disp.step():
                                break
                    raise
            check_end()
            persisted = stopping["on"] and not fs.fired and not fail_steps
            if persisted:
                check_persisted()
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
    if not crashed and held_at_stop and not draft:
        await _restart(seed, cfg, root, histories, held_at_stop)
    if not crashed and not fail_steps:  # an injected step failure may end a request mid-answer
        problem = await output_problem(cfg, answered)
        if problem is not None:
            raise InvariantViolated(f"seed {seed}: {problem}")
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
                     trace=events, yields=int(system.metrics.registry.get_sample_value("generations_yielded_total")))


async def _restart(seed: int, cfg: Config, root: Path, histories: dict[str, list[int]],
                   held: dict[str, list[tuple[tuple[int, ...], tuple[Any, ...]]]]) -> None:
    disp = DeterministicDispatcher(SeededPolicy(seed + 1))
    problem = await restart_problem(disp, cfg, histories, held,
                                    lambda aw: _drive_one(disp, aw))  # type: ignore[arg-type]
    if problem is not None:
        raise InvariantViolated(f"seed {seed}: {problem}")


async def _drive_one(disp: DeterministicDispatcher, aw: Any) -> Any:
    """Run one host call to completion while stepping the dispatcher."""
    box: dict[str, Any] = {}

    async def run() -> None:
        try:
            box["v"] = await aw
        except ActordError as e:  # raised to the caller as itself, not inside a group
            box["e"] = e
            box["v"] = None

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while "v" not in box:
            if not await disp.step():
                await anyio.sleep(0)
    if "e" in box:
        raise box["e"]
    return box["v"]

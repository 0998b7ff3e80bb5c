"""Sleep: the engine frees its model and context while the daemon is idle, and loads them
again on the next job that needs libllama (llama-server's `--sleep-idle-seconds`).

Why here and not as a new Engine: the engine thread, the job queue and everything the
actors know (gene ids, the step epoch the scheduler plans against) stay; only libllama's
objects go. A sleep is refused while any sequence holds cells, so no state is ever lost
by it: the daemon pages its minds out first (service/sleep.py). Gene images stay in host
RAM and the genes resident before are resident again after the wake, so GeneResidency's
view holds throughout. Runs only on the engine thread.
"""

from __future__ import annotations

import time
from typing import Any

from actord.engine import jobs as J
from actord.engine.llama import lib
from actord.service.errors import SlotBusy
from actord.service.log import get

log = get("actord.engine")


class Sleeping:
    _asleep: Any = None  # what a wake restores; None while awake

    def sleep(self) -> bool:
        e: Any = self
        if self._asleep is not None:
            return True
        held = [s for s in range(e.n_seq_max + 1) if lib.llama_memory_seq_pos_max(e.mem, s) >= 0]
        if held:
            raise SlotBusy("sequences still hold cells: the engine stays awake", seqs=held)
        t0 = time.perf_counter()
        genes = e.genes.detach()
        kept = (e.epoch, e.step_no, e.before_decode, genes, e.props, e.chat_info())
        e.close()
        self._asleep = kept
        log.info("engine.asleep", t_ms=round((time.perf_counter() - t0) * 1e3, 1))
        return True

    def wake(self) -> None:
        e: Any = self
        epoch, step_no, before, genes, _, _ = self._asleep
        t0 = time.perf_counter()
        type(e).__init__(e, e.config, n_rs_seq=e.n_rs_seq_asked)  # raises with _asleep kept: a later job tries again
        self._asleep = None
        e.epoch, e.step_no, e.before_decode = epoch, step_no, before
        e.genes.attach(genes)
        log.info("engine.awake", t_ms=round((time.perf_counter() - t0) * 1e3, 1), genes=len(genes[1]))

    def asleep_answer(self, job: J.Job) -> Any:
        """A quiet job while asleep: answered from what the engine kept."""
        e: Any = self
        if isinstance(job, J.ModelInfo):
            return self._asleep[4]
        if isinstance(job, J.ChatInfo):
            return self._asleep[5]
        return list(e.records)

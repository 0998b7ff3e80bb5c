"""Sleep: the engine frees its model and context while the daemon is idle, and loads them
again on the next job that needs libllama (llama-server's `--sleep-idle-seconds`).

Why not a new Engine: the engine thread, the job queue and everything the actors know (gene
ids, the step epoch the scheduler plans against) stay; only libllama's objects go. A sleep
is refused while any sequence holds cells, so no state is ever lost by it: the daemon pages
its minds out first (service/sleep.py). Gene images stay in host RAM and the genes resident
before are resident again after the wake, so GeneResidency's view holds throughout.

What a sleeping engine keeps is one `Asleep` record: what the wake carries over into the
collaborators it opens again (engine/engine.py `_open`), and what quiet jobs are answered
from meanwhile. Runs only on the engine thread.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from actord.engine import jobs as J
from actord.engine.genes import DetachedGenes


@dataclass(frozen=True)
class Asleep:
    epoch: int  # the step epoch and count the scheduler planned against go on after the wake
    step_no: int
    records: collections.deque[J.StepRecord]
    before_decode: Any  # the engine thread's hook (engine/thread.py `_announce`)
    genes: DetachedGenes
    props: J.ModelProps  # what quiet jobs are answered from while asleep (ModelInfo, ChatInfo)
    chat: J.ChatTemplateInfo

    def answer(self, job: J.Job) -> Any:
        """A quiet job (J.QUIET) while asleep: answered from what the engine kept."""
        if isinstance(job, J.ModelInfo):
            return self.props
        if isinstance(job, J.ChatInfo):
            return self.chat
        return list(self.records)

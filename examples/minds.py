"""The main job: more minds than slots on one model, each switch a memory copy.

Five minds (long-lived sessions, each with its own persona prompt and gene set) share two
slots of Gemma 3 270M (a sliding-window model). Every turn a mind either still holds its
slot, or is paged in from host RAM, or restored from its spilled page file once the page
RAM ceiling forced a spill; the mind it displaces is paged out first. Some turns rewrite an
early part of the history, so the slot must resume from a context checkpoint (the SWA
window has moved past the divergence). Minds 0, 1 and 2 apply genes A, B and C, mind 3
none and mind 4 gene A again, under a device budget that holds two genes beside the slots: genes page as minds
alternate. Requests name the mind; the daemon places it (`complete(mind=...)`).

Per turn it prints how many prompt tokens were processed vs served from cache, and the
checkpoint placement's choice: where it planned to snapshot this prompt (`plan`, chosen to
minimize the mind's expected re-prefill from where its requests diverged before) and what
the slot holds after the turn (`held`). The device budget below is too small for a full
SWA cache, so `--swa-full auto` chooses checkpoints (the first line says why). At the end,
the metrics. Run: `make demo` (or `.venv/bin/python examples/minds.py --turns 12`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio

from actord.vocabulary import log
from actord.vocabulary.config import Config
from actord.service.system import ActorSystem
from actord.testing.models import gemma3_270m_path, write_tiny_lora

PERSONAS = [
    "You are Ada, a ship's navigator who speaks in careful, numbered steps.",
    "You are Basil, a gardener who answers every question with a plant metaphor.",
    "You are Cora, a retired detective who notices small details in everything.",
    "You are Dev, a cheerful baker who measures everything in cups and spoons.",
    "You are Edda, a ferry captain who distrusts the weather and says so.",
]
LORE = (
    "The harbour town of Veln sits between two cliffs. Its lighthouse has burned for three hundred "
    "years, tended by one family at a time. Fishing boats leave at dawn and return at dusk, and the "
    "market square fills with the smell of salt, bread and tar. Travellers arrive by the coast road, "
    "which floods twice a year, and by ferry from the islands to the west. "
)
QUESTIONS = [
    "What do you see from the lighthouse tonight?",
    "A stranger asks about the coast road. What do you tell them?",
    "Describe the market square at noon.",
    "What would you change about Veln, and why?",
]


class Mind:
    def __init__(self, i: int, genes: list[dict]) -> None:
        self.name = f"mind{i}"
        self.persona = PERSONAS[i]
        self.lore = LORE * 16  # ~1500 tokens: well past the 512-token SWA window
        self.turns: list[str] = []
        self.genes = genes

    def prompt(self) -> str:
        return f"{self.persona}\n{self.lore}\n" + "".join(self.turns)


async def main(args: argparse.Namespace) -> None:
    model = args.model or str(gemma3_270m_path())
    work = Path(args.work or tempfile.mkdtemp(prefix="actord-minds-"))
    genes_dir = work / "genes"
    genes_dir.mkdir(parents=True, exist_ok=True)
    lora_a = write_tiny_lora(genes_dir / "a.gguf", model, seed=1, rank=16, strength=0.05)
    lora_b = write_tiny_lora(genes_dir / "b.gguf", model, seed=2, rank=16, strength=0.05)
    lora_c = write_tiny_lora(genes_dir / "c.gguf", model, seed=3, rank=16, strength=0.05)
    gene_bytes = lora_a.stat().st_size
    cfg = Config(
        model=model, slots=2, ctx=8192, batch=256, page_dir=str(work / "pages"),
        page_ram_bytes=args.page_ram_mb << 20, ctx_checkpoints=4,
        ctx_checkpoints_bytes=128 << 20,
        # Two genes beside two slots' state (~12-13 MB each at ~1.3-1.5k tokens, measured):
        # a third gene pages the unpinned one out, and no slot has to go.
        device_bytes=int(2.4 * gene_bytes) + 2 * (13 << 20),
    )
    async with ActorSystem(cfg) as system:
        ga = (await system.gene_load(str(lora_a))).id
        gb = (await system.gene_load(str(lora_b))).id
        gc = (await system.gene_load(str(lora_c))).id
        minds = [Mind(0, [{"id": ga, "scale": 1.0}]), Mind(1, [{"id": gb, "scale": 1.0}]),
                 Mind(2, [{"id": gc, "scale": 1.0}]), Mind(3, []), Mind(4, [{"id": ga, "scale": 1.0}])]
        print(f"swa_full={system.props.swa_full}: {system.props.swa_full_reason}")
        print(f"{'turn':>4} {'mind':<6} {'slot':>4} {'prompt':>6} {'processed':>9} "
              f"{'cached':>6} {'ckpt':>4} {'genes':<6} {'t_s':>6}  checkpoints: plan | held")
        # Minds 0 and 1 are hot, the others take turns: every switch displaces the least
        # recently used slot, so both page_in from RAM and restores from spilled files occur.
        order = [m for i in range(2, len(minds)) for m in (0, 1, i)]
        for turn in range(args.turns):
            mind = minds[order[turn % len(order)]]
            t0 = time.perf_counter()
            if len(mind.turns) >= 1 and turn % 4 == 3:
                # Rewrite a part of the history ~60% in: the SWA window has moved past it, so
                # the slot resumes from the newest checkpoint below the change.
                cut = int(len(mind.lore) * 0.6)
                mind.lore = mind.lore[:cut] + f" (Note {turn}: the ferry is late today.) " + mind.lore[cut:]
            question = QUESTIONS[(turn // len(minds)) % len(QUESTIONS)]
            mind.turns.append(f"\nQ: {question}\nA:")
            r = await system.complete(prompt=mind.prompt(), n_predict=args.n_predict, mind=mind.name,
                                      genes=mind.genes, seed=turn, temperature=0.7, top_k=40)
            mind.turns[-1] += r.content
            t_s = time.perf_counter() - t0
            info = next(i for i in await system.slot_list() if i.id == r.slot)
            print(f"{turn:>4} {mind.name:<6} {r.slot:>4} {r.n_prompt_tokens:>6} "
                  f"{r.n_prompt_processed:>9} {r.n_cached:>6} {'yes' if r.resumed_from_checkpoint else '':>4} "
                  f"{','.join(str(g['id']) for g in mind.genes) or '-':<6} {t_s:>6.2f}  "
                  f"{','.join(map(str, info.checkpoint_plan)) or '-'} | {','.join(map(str, info.checkpoint_positions))}")
        m = system.metrics.snapshot()
        print("\nmetrics:")
        for key in ("prompt_tokens_total", "prompt_tokens_processed_total", "page_out_total", "page_in_total",
                    "page_spill_total", "page_refused_total", "page_failed_total", "ctx_checkpoint_restores_total", "full_reprefills_total",
                    "ctx_checkpoints_evicted_budget_total", "ctx_checkpoints_skipped_budget_total",
                    "lora_page_out_total", "lora_page_in_total", "lora_page_in_on_demand_total",
                    "lora_device_bytes", "lora_host_bytes", "page_store_bytes", "ctx_checkpoint_bytes"):
            print(f"  {key:<40} {m.get(key, 0):>14,.0f}")
        cached = m["prompt_tokens_total"] - m["prompt_tokens_processed_total"]
        print(f"\n{cached:,.0f} of {m['prompt_tokens_total']:,.0f} prompt tokens came from cache "
              f"({cached / max(1, m['prompt_tokens_total']):.0%}); "
              f"turns resumed from a checkpoint: {m['ctx_checkpoint_restores_total']:.0f}")
        res = system.residency
        print(f"device budget {res.budget:,} B: genes resident {sum(g.n_bytes for g in res.genes.values() if g.resident):,} B, "
              f"slots {sum(res.slot_bytes.values()):,} B")
        print("pages in RAM:", [p.page for p in await system.page_list()],
              "| spilled files:", sorted(p.name for p in (work / "pages").glob("*.page")))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF path (default: Gemma 3 270M from the registry package)")
    ap.add_argument("--turns", type=int, default=15)
    ap.add_argument("--n-predict", type=int, default=24)
    ap.add_argument("--page-ram-mb", type=int, default=110, help="page RAM ceiling: two pages fit, a third spills")
    ap.add_argument("--work", help="folder for genes and page files (default: a temp folder)")
    log.configure(level="warning")
    anyio.run(main, ap.parse_args(), backend_options={"use_uvloop": True})

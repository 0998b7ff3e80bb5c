"""The prompt cache: which mind of its own the daemon runs a request that names none as.

Why: a client that names no mind (most OpenAI and Anthropic clients, and load tools such as
NVIDIA AIPerf without a session header) resends the whole conversation each turn. While
its cells sit in a slot, the next turn resumes them; once another request takes the slot,
they were written over, and the turn prefilled its whole history again (bench/multiturn.py's
unnamed rows: 2.78x the floor of prompt tokens with 16 conversations over 2 slots).
llama-server keeps such states in host RAM (`--cache-ram`) and loads the one a prompt
extends. Here, such a request runs as a mind the daemon names itself (`CACHE_MIND` + a
number), so everything a mind has works for it unchanged: paged out to RAM when its slot
is needed, paged in (or restored from a spill) when its conversation comes back, a new one
started from a base or a peer's cells.

A mind is found by the prompt of its last turn: a request whose prompt begins with it (the
same conversation, one turn on, or the same prompt again) runs as that mind, and resumes
its state; the deepest such prompt wins, then the most recently used. A mind running a
turn is not chosen (its state is about to change; the request starts a mind of its own).
The key is the last prompt rather than prompt + reply because a client's next turn holds
the reply as it rendered it, which may tokenize otherwise: the mind then resumes up to
where they part. A template may render the end of a prompt otherwise too: DeepSeek R1's
generation prompt ends `<think>\n`, Qwen3's without thinking an empty think block, and
neither is in the reply as history renders it. So a request that parts from a last prompt
within its final `GEN_TAIL` tokens finds that mind too, where it is at least `GEN_TAIL`
tokens longer (one turn on: a reply and a user turn more, not a sibling conversation of the
same length). A sibling that passes both takes the mind from its conversation at a bounded
cost: that conversation's last reply and at most `GEN_TAIL` tokens of its prompt, prefilled
again (from a base) on its next turn; an exact find is preferred at equal depth.

A request that holds a mind's first prompt whole and more of her (at least a block past it:
her first reply), yet not her last prompt, is her conversation branched at a later turn: a
message edited, an older reply regenerated, a chat client's other branch. With no mind found
as above, it runs as the one it shares the most blocks with, and she resumes up to where
they part (llama-server's cache loads its most similar prompt alike). Her old branch past
that point is given up for the new one; a sibling conversation never shares her first
reply, so it never takes her this way.

The index chains its block hashes from the request's genes and scope (policy/prefix_index.py),
so a mind is never found across gene sets or tenants.

The minds are bounded as every mind the daemon makes is (policy/lru.py `DaemonMinds`: by
count and bytes, least recently used first); the ones past the bound are the caller's to
forget (`minds.touch` answers them). Pure: no I/O, no actor; the façade holds one (service/system.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from actord.policy.lru import DaemonMinds
from actord.policy.prefix_index import BLOCK, PrefixIndex, common_prefix
from actord.vocabulary.kv_identity import scoped_mind
from actord.vocabulary.names import CACHE_MIND

Genes = Sequence[tuple[int, float]]

GEN_TAIL = 8  # a last prompt's end that a next turn may render otherwise (a generation prompt's)


class PromptCache:
    """The daemon's minds for unnamed requests, each found by the prompt of its last turn."""

    def __init__(self, max_minds: int, max_bytes: int) -> None:
        self.minds = _Listed(max_minds, max_bytes, self._unindex)
        self._index = PrefixIndex()
        # A mind -> its last turn's prompt, as its length and the tokens past its last full
        # block: the index matched the full blocks by their chained hashes already, so a
        # long prompt is not kept twice (the slot and its page hold it).
        self._prompts: dict[str, tuple[int, list[int]]] = {}
        self._used: dict[str, int] = {}  # a mind -> when it was last taken (a tie-break)
        self._first: dict[str, int] = {}  # a mind -> the length of her conversation's first prompt
        self._busy: set[str] = set()
        self._clock = 0
        self._next = 0  # the next new mind's number

    def take(self, prompt: list[int], genes: Genes, scope: str, parted: bool = True) -> tuple[str, bool]:
        """The mind a request of `prompt` under `genes` in `scope` runs as, and whether it is
        one found (else a new name); it is busy until `done` or `failed`. `parted`: a mind
        may be found by a request that parts from her last prompt (at its end, or a branch);
        off where the memory cannot be cut back after a page-in (a sliding window, recurrent
        state): she would then prefill the request whole, where a new mind starts from a base."""
        self._clock += 1
        best: str | None = None
        best_key: tuple[int, bool, int] = (0, False, 0)
        for name in self._index.wholes(prompt, genes, scope):
            if name in self._busy:
                continue
            n, tail = self._prompts[name]
            start = n - len(tail)
            depth = start + common_prefix(prompt[start:n], tail)  # where the request parts from her last prompt
            exact = depth == n
            if not exact and (not parted or n - depth > GEN_TAIL or len(prompt) < n + GEN_TAIL):
                continue
            key = (depth, exact, self._used[name])
            if best is None or key > best_key:
                best, best_key = name, key
        if best is None and parted:
            best = self._branched(prompt, genes, scope)
        found = best is not None
        if best is None:
            best = scoped_mind(f"{CACHE_MIND}{self._next}", scope)
            self._next += 1
        self._busy.add(best)
        self._used[best] = self._clock
        return best, found

    def _branched(self, prompt: list[int], genes: Genes, scope: str) -> str | None:
        """The idle mind whose conversation `prompt` holds past her first reply's first
        block, sharing the most blocks with it (then the most recently used); None: none."""
        holders, depth = self._index.deepest(prompt, genes, scope)
        fits = [m for m in holders if isinstance(m, str) and m not in self._busy
                and depth >= self._first.get(m, depth) + BLOCK]
        return max(fits, key=lambda m: self._used[m], default=None)

    def done(self, mind: str, prompt: list[int], genes: Genes, scope: str) -> None:
        """`mind` ran `prompt`: found by `prompt` from here on. (Its bytes are charged by
        `minds.touch`, which answers the minds past the bound.)"""
        self._busy.discard(mind)
        self._first.setdefault(mind, len(prompt))
        self._prompts[mind] = (len(prompt), list(prompt[len(prompt) // BLOCK * BLOCK:]))
        self._index.add(mind, prompt, genes, scope)

    def failed(self, mind: str) -> None:
        """`mind`'s turn failed or was cancelled. One found before stays found by its last
        prompt (what its cells hold still begins with it, or the slot resumes less: a lookup
        never changes output); a new one is listed as the oldest, so that the bound forgets
        whatever it left."""
        self._busy.discard(mind)
        if mind not in self._prompts:
            self._used.pop(mind, None)
            self.minds.keep(mind, 0)

    def _unindex(self, mind: str) -> None:
        self._index.remove(mind)
        self._prompts.pop(mind, None)
        self._first.pop(mind, None)
        if mind not in self._busy:
            self._used.pop(mind, None)


class _Listed(DaemonMinds):
    """The cache's minds by last use: one past the bound is found no more."""

    def __init__(self, max_minds: int, max_bytes: int, unindex: Callable[[str], None]) -> None:
        super().__init__(max_minds, max_bytes)
        self._unindex = unindex

    def touch(self, mind: str, n_bytes: int) -> list[str]:
        gone = super().touch(mind, n_bytes)
        for old in gone:
            self._unindex(old)
        return gone

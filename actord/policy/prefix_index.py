"""Which held token list shares the longest prefix with a query: content-addressed blocks.

Why a hash chain: a prefix is matched one fixed block of tokens at a time, and each full
block's key is the hash of the previous block's key and the block's tokens (vLLM's block
hashes, LMCache's chunk keys), so a block's key names the whole prefix up to its end. A
holder that has block i's key therefore holds blocks 0..i as well, and "the longest held
prefix of this query" is a walk over the query's own blocks, stopping at the first key
nobody holds: O(blocks of the query), whatever the number of holders. A trailing partial
block is never keyed: a match is found by blocks, and a holder's tokens past its last full
block are compared by whoever asked (`wholes`): a base may end where minds part, mid-block.

The lineage (vocabulary/kv_identity.py: the gene set and the tenant scope) seeds the chain: a
prefix computed under other genes, or held for another tenant, is another state, so it never
matches. The gene set is sorted first, since the adapters' sum does not depend on the order
they were listed in.

Pure: no I/O, no actor; the page store holds one index over its bases and one over its
pages (serving/page_store.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence

BLOCK = 32  # tokens per block

_GENE = struct.Struct("<qd")


def chain_seed(genes: Sequence[tuple[int, float]], scope: str = "") -> bytes:
    h = hashlib.blake2b(b"actord-prefix-v2", digest_size=16)
    for gid, scale in sorted((int(g), float(s)) for g, s in genes):
        h.update(_GENE.pack(gid, scale))
    h.update(b"\0scope:" + scope.encode())
    return h.digest()


def block_keys(tokens: Sequence[int], genes: Sequence[tuple[int, float]] = (), scope: str = "") -> list[bytes]:
    """One key per full block of `tokens`, each naming the prefix up to that block's end."""
    prev = chain_seed(genes, scope)
    keys = []
    for i in range(len(tokens) // BLOCK):
        block = tokens[i * BLOCK:(i + 1) * BLOCK]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(struct.pack(f"<{BLOCK}q", *block))
        prev = h.digest()
        keys.append(prev)
    return keys


class PrefixIndex:
    """Holders (any hashable key) of token lists, by the blocks of their prefixes."""

    def __init__(self) -> None:
        self._by_block: dict[bytes, set[Hashable]] = {}
        self._blocks: dict[Hashable, list[bytes]] = {}
        self._ends: dict[bytes, set[Hashable]] = {}  # a holder's last block -> the holder

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def add(self, key: Hashable, tokens: Sequence[int], genes: Sequence[tuple[int, float]] = (),
            scope: str = "") -> None:
        """Index `key` as holding `tokens` (under `genes`, in `scope`); a key added again is re-indexed."""
        self.remove(key)
        blocks = block_keys(tokens, genes, scope)
        self._blocks[key] = blocks
        for b in blocks:
            self._by_block.setdefault(b, set()).add(key)
        if blocks:
            self._ends.setdefault(blocks[-1], set()).add(key)

    def remove(self, key: Hashable) -> None:
        blocks = self._blocks.pop(key, [])
        if blocks:
            ends = self._ends[blocks[-1]]
            ends.discard(key)
            if not ends:
                del self._ends[blocks[-1]]
        for b in blocks:
            holders = self._by_block[b]
            holders.discard(key)
            if not holders:
                del self._by_block[b]

    def longest(self, tokens: Sequence[int], genes: Sequence[tuple[int, float]] = (),
                exclude: Hashable | None = None, scope: str = "") -> tuple[Hashable | None, int]:
        """The holder with the most leading full blocks in common with `tokens` (ties: any
        of them) and how many tokens those blocks are; (None, 0) when none shares a block.
        `exclude`: a holder not to answer (the query's own entry, say)."""
        best: Hashable | None = None
        n = 0
        for i, b in enumerate(block_keys(tokens, genes, scope)):
            holders = self._by_block.get(b)
            if not holders:
                break
            pick = next((k for k in holders if k != exclude), None)
            if pick is None:
                break
            best, n = pick, (i + 1) * BLOCK
        return best, n

    def deepest(self, tokens: Sequence[int], genes: Sequence[tuple[int, float]] = (),
                scope: str = "") -> tuple[set[Hashable], int]:
        """Every holder of the deepest of `tokens`' leading blocks any holds, and how many
        tokens those blocks are (set(), 0: none shares a block)."""
        found: set[Hashable] = set()
        n = 0
        for i, b in enumerate(block_keys(tokens, genes, scope)):
            holders = self._by_block.get(b)
            if not holders:
                break
            found, n = holders, (i + 1) * BLOCK
        return set(found), n

    def wholes(self, tokens: Sequence[int], genes: Sequence[tuple[int, float]] = (), scope: str = "") -> list[Hashable]:
        """Every holder whose last full block is one of `tokens`' leading blocks, deepest
        first: the candidates for a held list that is a prefix of `tokens` (the caller
        checks a list's tokens past its last full block, which are not keyed)."""
        found: list[Hashable] = []
        for b in block_keys(tokens, genes, scope):
            if b not in self._by_block:
                break
            found.extend(self._ends.get(b, ()))
        return found[::-1]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The tokens two lists share from their start, compared a slice at a time in C."""
    n = min(len(a), len(b))
    a, b = list(a[:n]), list(b[:n])
    if a == b:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo

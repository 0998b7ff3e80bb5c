"""What `--device-bytes` means on the machine at hand: one pure decision, tested with numbers.

The device budget is the one count that resident genes and occupied slots' state share
(serving/gene_residency.py). Given:

* `--device-bytes N > 0`: N, on any backend.
* `--device-bytes 0` on the CPU (no GPU device): unlimited, as always (0): the "device" is
  host memory, which the page RAM ceiling and the OS already bound.
* `--device-bytes 0` with a GPU: what that GPU has free at start, less a margin. "At start"
  is measured once, right after the model and the context are allocated (weights, KV cache
  and compute buffers already taken), because that is the memory genes can still take. The
  slots' state does not take new memory (it lives in the KV cache allocated with the
  context), yet the budget charges it, so the KV cache's bytes are added back: at most what
  the context creation took (free after the model - free after the context), so an estimate
  of the cache never counts more than was really allocated. The margin is
  max(256 MiB, 1/32 of the GPU's total memory) (4.4 GiB on a 141 GB H200): room for what
  CUDA allocates later on its own (cuBLAS workspaces, graph and pool growth, allocator
  fragmentation) and for other processes' small allocations.

`swa_budget` is the same rule before the context exists (a full SWA cache is decided before
the cache is allocated): free after the model loads, less the margin.
"""

from __future__ import annotations

import msgspec

MARGIN_MIN = 256 << 20
MARGIN_DIV = 32


def margin(total_bytes: int) -> int:
    """The free memory a GPU budget leaves untouched."""
    return max(MARGIN_MIN, total_bytes // MARGIN_DIV)


class DeviceBudget(msgspec.Struct, frozen=True):
    bytes: int  # 0 = unlimited
    reason: str


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def device_budget(asked: int, *, gpu: str | None, total_bytes: int = 0, free_after_model: int = 0,
                  free_after_context: int = 0, kv_bytes: int = 0) -> DeviceBudget:
    """The residency's budget. `gpu` names the GPU the context computes on (None: CPU only);
    the free figures are that GPU's, read after the model loaded and after the context was
    created; `kv_bytes` is the KV cache's size (bytes per token x n_ctx, an estimate)."""
    if asked < 0:
        raise ValueError("device_bytes must be >= 0")
    if asked > 0:
        return DeviceBudget(bytes=asked, reason=f"--device-bytes {asked:,}")
    if gpu is None:
        return DeviceBudget(bytes=0, reason="--device-bytes 0 on the CPU: unlimited (state lives in host memory)")
    m = margin(total_bytes)
    kv = max(0, min(kv_bytes, free_after_model - free_after_context))
    budget = max(0, free_after_context + kv - m)
    return DeviceBudget(bytes=budget, reason=(
        f"--device-bytes 0 on {gpu}: {_mib(free_after_context)} free after the model and context "
        f"+ {_mib(kv)} of KV cache (the slots' state lives there) - margin {_mib(m)} "
        f"(max(256 MiB, 1/{MARGIN_DIV} of {_mib(total_bytes)})) = {_mib(budget)}"))


def swa_budget(asked: int, *, gpu: str | None, total_bytes: int = 0, free_after_model: int = 0) -> int:
    """The budget a full SWA cache is weighed against before the context exists (0: none given;
    the caller falls back to host memory)."""
    if asked > 0 or gpu is None:
        return asked
    return max(0, free_after_model - margin(total_bytes))

"""Whether an SWA model gets a full-size KV cache: `--swa-full auto|on|off`.

Why: a sliding-window model whose cache keeps only the window cannot be cut back to an
arbitrary position, so a request that diverges mid-prompt resumes from a context
checkpoint, and pays `d - p` tokens of re-prefill (actord.policy.checkpoint_placement keeps that
small). A full SWA cache keeps every position of every layer: any divergence resumes at
the raw lcp exactly (the floor), no checkpoint is needed, and it costs memory: the state
bytes per token of all layers times the context size. When that fits the memory the user
gave the daemon, it is simply better; when it does not, checkpoints are the way.

"auto" (the default) takes the full cache when bytes_per_token x n_ctx is at most `share`
of the device budget (`--device-bytes`; with none given, the host's physical memory, which
is the device of a CPU build), else checkpoints; "on"/"off" decide outright. The choice and
the figures behind it are reported in `props` and in the startup log.

Pure: the engine measures, this decides.
"""

from __future__ import annotations

import msgspec

from actord.vocabulary.config import SWA_FULL_MODES, SWA_FULL_SHARE


class SwaChoice(msgspec.Struct, frozen=True):
    full: bool
    reason: str
    need_bytes: int = 0  # what a full cache holds at n_ctx (bytes_per_token x n_ctx)
    limit_bytes: int = 0  # share x the device budget it was compared with (auto only)


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def choose_swa_full(mode: str, *, n_swa: int, bytes_per_token: int, n_ctx: int, device_bytes: int,
                    host_bytes: int, share: float = SWA_FULL_SHARE, device_name: str = "--device-bytes") -> SwaChoice:
    """Decide; `device_bytes` 0 means no budget was given (the host's memory stands in).
    `device_name` says what `device_bytes` is (a GPU's free memory when none was given)."""
    if mode not in SWA_FULL_MODES:
        raise ValueError(f"swa_full is one of {SWA_FULL_MODES}, got {mode!r}")
    need = bytes_per_token * n_ctx
    if n_swa <= 0:
        return SwaChoice(full=False, reason="the model has no sliding window: its cache is full anyway",
                         need_bytes=need)
    if mode == "on":
        return SwaChoice(full=True, reason="--swa-full on", need_bytes=need)
    if mode == "off":
        return SwaChoice(full=False, reason="--swa-full off: context checkpoints", need_bytes=need)
    budget, what = (device_bytes, device_name) if device_bytes > 0 else (host_bytes, "host memory")
    limit = int(share * budget)
    figures = (f"{bytes_per_token:,} B/token x n_ctx {n_ctx:,} = {_mb(need)}, "
               f"{share:.0%} of {what} {_mb(budget)} = {_mb(limit)}")
    if need <= limit:
        return SwaChoice(full=True, reason=f"auto: a full SWA cache fits ({figures})", need_bytes=need,
                         limit_bytes=limit)
    return SwaChoice(full=False, reason=f"auto: a full SWA cache does not fit ({figures}): context checkpoints",
                     need_bytes=need, limit_bytes=limit)

"""`actord serve`: the actor system plus the socket server on uvloop, stopped by a signal.

A signal handler only wakes the main task (so does the `stop` verb); shutdown then runs in
order: new requests are refused (`ShuttingDown`), requests in flight get
`--shutdown-grace-s` to finish and are then cancelled (their clients get answers), every mind
is written to her page file within `--shutdown-persist-s` (service/persist.py), the servers
stop, the system stops its actors and engine thread (bounded), the socket is removed;
whatever a thread does, the process is gone `--shutdown-exit-margin-s` after the grace and
the persistence (`_exit_deadline`). Write-behind runs beside the servers (`--write-behind-s`,
unless a trace is recorded). A second SIGTERM or SIGINT exits at once:
page-file publication is crash-safe, so nothing written is left half-done. With `--http
HOST:PORT` the OpenAI-compatible front (actord/frontends/http/) runs in the same event loop, beside
the socket, and stops first (it lets answers in flight end, up to 5 s). Its address is
bound, and its peer check tried, before the model loads, so a refused start is quick.

Under systemd (`systemd.py`, the example units in deploy/systemd/): sockets systemd passed
(socket activation) are served instead of binding the socket's path and the HTTP address
(a passed TCP socket starts the HTTP front without `--http`); `READY=1` is sent once the
model is loaded and the socket serves, `STOPPING=1` at the first signal, and `WATCHDOG=1`
every half `WatchdogSec=` while the event loop runs.

File descriptors: the socket and the HTTP front each cap their connections, and the soft
RLIMIT_NOFILE is raised to hold both caps, the refused connections each may be answering
(`MAX_LINGERING`) and the daemon's own files; where the hard limit is lower, the start-up log
warns, because a flood could then run the process out of fds (accept fails with EMFILE).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import anyio

from actord.service.background import run_background
from actord.vocabulary import log as logcfg
from actord.vocabulary.config import Config
from actord.vocabulary.errors import ActordError
from actord.vocabulary.log import get
from actord.frontends import systemd
from actord.frontends.rpc.peers import raise_fd_limit
from actord.frontends.rpc.server import MAX_LINGERING as RPC_LINGERING, RpcServer
from actord.frontends.shares import Shares
from actord.service.protocol import Service
from actord.service.system import ActorSystem

log = get("actord.frontends.daemon")


FD_RESERVE = 256  # model, page files, gene files, pipes, the event loop's own


def fds_needed(config: Config, http: bool = False) -> int:
    n = config.max_connections + RPC_LINGERING + FD_RESERVE
    if config.http or http:
        from actord.frontends.http.bounds import MAX_LINGERING

        n += config.http_max_connections + config.http_control_connections + MAX_LINGERING
    return n


async def serve(config: Config, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
    inherited = systemd.listen_fds()
    shares = Shares.from_config(config)  # one count of generations for both fronts (frontends/shares.py)
    server = RpcServer(None, config.socket, config, shares)
    if inherited.rpc is not None:
        server.inherit(inherited.rpc)
    else:
        server.claim_path()  # a live daemon on the path: fail now, before the model loads
    front = None
    try:
        want = fds_needed(config, http=inherited.http is not None)
        have = raise_fd_limit(want)
        if have < want:
            log.warning("daemon.fd_limit", soft=have, needed=want,
                        hint="raise the hard RLIMIT_NOFILE or lower --max-connections / --http-max-connections")
        if config.http or inherited.http is not None:
            from actord.frontends.http.app import HttpFront

            front = HttpFront(None, config, shares)
            front.bind(inherited.http)
        # The front's address is known once bound: the system reports it in its props.
        async with ActorSystem(config, http_address=front.address if front is not None else None) as system:
            await _serve(config, system, server, front, task_status)
    finally:
        if front is not None:
            front.close()
        for s in (inherited.rpc, inherited.http):
            if s is not None:
                s.close()
        if server.claim is not None:  # the system failed to start: let go of the path
            server.claim.release()
            server.claim = None


async def _serve(config: Config, system: Service, server: RpcServer, front: Any, task_status: Any) -> None:
    if config.metrics_http:
        from prometheus_client import start_http_server

        host, _, port = config.metrics_http.rpartition(":")
        start_http_server(int(port), addr=host or "127.0.0.1", registry=system.metrics.registry)
    server.system = system
    server.shares.watch(system.metrics)
    system.memory_sources.add("connection_buffers", server.held_bytes)
    if not (config.chat_template or config.chat_template_file or config.trace):
        # A model without a template of its own chats in a built-in one: warned now, at start,
        # not at the first chat. Not in a traced run: the read is an engine job no recorded
        # input explains (the replay would diverge there); the first chat warns instead.
        from actord.chat.turn import template_info

        await template_info(system)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        if front is not None:
            front.attach(system)
            await tg.start(front.serve)
        await tg.start(server.serve)
        tg.start_soon(run_background, system, config)  # memory report, idle sleep, write-behind
        task_status.started(system)
        systemd.notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving on {server.path}")
        interval = systemd.watchdog_interval()
        if interval is not None:
            tg.start_soon(systemd.watchdog, interval)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as first:
                async def on_signal() -> None:
                    async for sig in signals:
                        log.info("daemon.signal", signal=signal.Signals(sig).name, grace_s=config.shutdown_grace_s)
                        break
                    first.cancel_scope.cancel()

                async def on_stop() -> None:
                    if system.stop_requested is None:
                        return
                    await system.stop_requested.wait()
                    log.info("daemon.stop_verb", grace_s=config.shutdown_grace_s)
                    first.cancel_scope.cancel()

                first.start_soon(on_signal)
                first.start_soon(on_stop)
            _exit_deadline(config.shutdown_grace_s + (config.shutdown_persist_s if config.persist_on_stop else 0)
                           + config.shutdown_exit_margin_s)
            systemd.notify("STOPPING=1\nSTATUS=stopping")
            async with anyio.create_task_group() as stopping:
                stopping.start_soon(_exit_at_second_signal, signals)
                counts = await system.shutdown(config.shutdown_grace_s)
                await anyio.sleep(0.1)  # the answers of cancelled requests reach their sockets
                stopping.cancel_scope.cancel()
            log.info("daemon.stopping", **counts)
        tg.cancel_scope.cancel()


def _exit_deadline(seconds: float) -> None:
    """Shutdown is bounded whatever a thread does: a worker stuck in a read (a FIFO, a hung
    network disk) kept the process alive past SIGTERM, its close and the interpreter's exit
    waiting on it for ever. A timer thread, which no blocked loop or worker can hold, ends
    the process `seconds` after the signal if it is still there."""
    def fire() -> None:
        log.error("daemon.exit_forced", after_s=seconds, why="shutdown did not end in time (a thread is stuck)")
        os._exit(1)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


async def _exit_at_second_signal(signals: Any) -> None:
    async for sig in signals:
        log.warning("daemon.exit_now", signal=signal.Signals(sig).name)
        os._exit(128 + int(sig))


def run_daemon(config: Config, *, log_json: bool = False, log_level: str = "info") -> int:
    logcfg.configure(json=log_json, level=log_level)
    if config.malloc_arena_max:  # before the engine and worker threads allocate (service/memory.py)
        from actord.service.memory import limit_arenas

        limit_arenas(config.malloc_arena_max)
    try:
        import uvloop  # noqa: F401

        opts = {"use_uvloop": True}
    except ImportError:
        opts = {}
    try:
        anyio.run(serve, config, backend="asyncio", backend_options=opts)
    except BaseException as e:  # start-up refused: a message, not a traceback
        refusal = _refusal(e)
        if refusal is None:
            raise
        log.error("daemon.refused", error=refusal.to_dict())
        return 1
    return 0


def _refusal(e: BaseException) -> ActordError | None:
    """The start-up refusal in `e`, also when a task group wrapped it: any typed error (a
    live daemon on the socket, a bad flag, a `--gene` file that is missing or not a gene)."""
    if isinstance(e, ActordError):
        return e
    if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        return _refusal(e.exceptions[0])
    return None

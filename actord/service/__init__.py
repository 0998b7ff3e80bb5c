"""The service a host holds: the `ActorSystem` façade and what it is built from (floor 5).

    system.py   the façade: `async with ActorSystem(config) as system`, lifecycle and typed verbs
    protocol.py the `Service` the fronts speak to (chat/host.py: `ChatHost`, what chat is given)
    params.py   the verbs' typed arguments, as every front decodes them (socket, native routes, CLI)
    entry.py    `@entry`: a verb refused while closing, bounded, recorded for traces
    builder.py  the actors and the engine thread, wired once
    inflight.py the requests in flight: their slots, shutdown's drain
    placement.py which slot an unnamed request runs in, n choices' forks, a page-in's room
    text.py     the text verbs: tokenizer, chat template, embeddings
    genes.py    gene files read for `gene.load`
    introspection.py  props, health, the start-up lines, a replay's final state
    memory.py   where the daemon's bytes are (`stats memory`) and its periodic care
    persist.py  a graceful stop's persistence and the write-behind of RAM pages
    sleep.py    an idle daemon frees its model and wakes on the next request
    spill.py    a RAM page spilled to its page file
    slot_ctx.py a slot's share of the context
    tenancy.py  the tenant the front that received a request vouches for

The words every floor speaks (errors, types, config, log, metrics, models, the trace
format) are actord/vocabulary/, at the bottom. Nothing is imported here.
"""

"""The service a host holds: the `ActorSystem` façade and the vocabulary every part speaks.

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
    types.py    request and result shapes (decoded and validated at the edge)
    config.py   all configuration, one typed place
    errors.py   one typed error per failure a caller can act on
    log.py      structlog set-up
    metrics.py  one Prometheus registry per system
    models.py   where the default model comes from
    trace.py    the trace recorder (every input and delivery; the replay package reads them)

Nothing is imported here, so `actord.vocabulary.errors` can be imported from any floor
without pulling the façade in.
"""

"""The service a host holds: the `ActorSystem` façade and the vocabulary every part speaks.

    system.py   the façade: `async with ActorSystem(config) as system`, typed verbs
    types.py    request and result shapes (decoded and validated at the edge)
    config.py   all configuration, one typed place
    errors.py   one typed error per failure a caller can act on
    log.py      structlog set-up
    metrics.py  one Prometheus registry per system
    models.py   where the default model comes from
    hooks.py    the trace recorder seam (the replay package owns the format)

Nothing is imported here, so `actord.service.errors` can be imported from any floor
without pulling the façade in.
"""

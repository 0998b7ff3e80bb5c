"""The HTTP front (`actord serve --http`): OpenAI's API and llama-server's native API on
one Starlette app in the daemon's event loop.

- `app.py`: the front (assembly, key/peer/origin checks, body bounds, serving lifecycle)
- `bounds.py`: the connection-level bounds, in uvicorn's protocol
- `responses.py`: the answer types all routes share, `status_of` (one status per error on
  every API), OpenAI's error object
- `turns.py`: what the chat APIs' routes share: the context a wire reads a turn under, the
  `Turn` each wire's pure `to_turn` returns, the mind a request names, and `fit` (the
  template's roles and folds, then the chat layer's precheck)
- `degraded.py`, `cors.py`, `costs.py`: lesser answers named in a header, browsers, request costs
- `streaming.py`: a generation inside a response, whole or streamed, for both APIs
- `openai/`: OpenAI's wire shapes (`wire.py`, pure: `to_turn`, `from_result`), answers,
  routes, the Responses API (its own `to_turn` and `from_result`), embeddings
- `anthropic/`: Anthropic's Messages API (`wire.py`, pure: `to_turn`, `from_result`; its
  stream and error object), routes
- `native/`: llama-server's route table, text verbs, props, health, metrics; `/completion`,
  sampling fields, `/slots`, `/lora-adapters`
"""

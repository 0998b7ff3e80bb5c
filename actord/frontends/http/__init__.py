"""The HTTP front (`actord serve --http`): OpenAI's API and llama-server's native API on
one Starlette app in the daemon's event loop.

- `app.py`: the front (assembly, key/peer/origin checks, body bounds, serving lifecycle)
- `bounds.py`: the connection-level bounds, in uvicorn's protocol
- `responses.py`: the answer types all routes share, OpenAI's error object
- `streaming.py`: a generation inside a response, whole or streamed, for both APIs
- `openai/`: OpenAI's wire shapes (`wire.py`, pure), answers, routes, the Responses API,
  embeddings
- `native/`: llama-server's route table, text verbs, props, health, metrics; `/completion`,
  sampling fields, `/slots`, `/lora-adapters`
"""

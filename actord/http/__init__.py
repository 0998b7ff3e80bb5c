"""The HTTP front (`actord serve --http`): OpenAI's API and llama-server's native API on
one Starlette app in the daemon's event loop.

- `app.py`: the front (assembly, key/peer/origin checks, body bounds, serving lifecycle)
- `bounds.py`: the connection-level bounds, in uvicorn's protocol
- `responses.py`: the answer types all routes share, OpenAI's error object
- `streaming.py`: a generation inside a response, whole or streamed, for both APIs
- `openai.py`: OpenAI's wire shapes (pure); `openai_routes.py`: its routes;
  `responses_api.py`: its Responses API; `embeddings.py`: its embeddings
- `native.py`: llama-server's route table, text verbs, props, health, metrics;
  `native_base.py` (shared), `native_completion.py`, `native_sampling.py`, `native_slots.py`,
  `native_genes.py`
"""

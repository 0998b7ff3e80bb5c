"""The OpenAI-compatible HTTP front (`actord serve --http`): wire shapes in `openai.py`,
the Starlette app and its in-loop uvicorn server in `app.py`."""

"""OpenAI's API: wire shapes (`wire.py`), answers (`answers.py`), routes (`routes.py`), the
Responses API (`responses_api.py`) and embeddings (`embeddings.py`)."""

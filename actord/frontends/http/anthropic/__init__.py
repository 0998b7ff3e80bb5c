"""Anthropic's Messages API on the HTTP front, as llama-server serves it: `wire.py` (the
request and answer shapes, and their translation to actord's chat), `stream.py` (the
streamed events), `routes.py` (POST /v1/messages and /v1/messages/count_tokens)."""

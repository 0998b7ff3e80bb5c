"""llama-server's native API: its route table (`routes.py`), shared helpers (`base.py`),
`/completion` (`completion.py`), sampling fields (`sampling.py`), `/slots` (`slots.py`) and
`/lora-adapters` (`genes.py`)."""

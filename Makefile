# The two commands the README promises. Both set up .venv first (idempotent).
.PHONY: setup demo test bench

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/python examples/minds.py

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python bench/hot_path.py
	.venv/bin/python bench/decode_overhead.py
	.venv/bin/python bench/page_bandwidth.py
	.venv/bin/python bench/reprefill_sim.py
	.venv/bin/python bench/gene_paging.py
	.venv/bin/python bench/http_overhead.py
	.venv/bin/python bench/reprefill_real.py
	.venv/bin/python bench/text_cost.py
	.venv/bin/python bench/cluster.py

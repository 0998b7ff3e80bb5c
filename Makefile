# The two commands the README promises (demo, test), and docs and bench. Each sets up .venv first (idempotent).
.PHONY: setup demo test bench docs

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
	.venv/bin/python bench/report.py

# The site under docs/ (MkDocs, Material theme), strict: a warning (a broken link or
# anchor, a page out of the nav) fails the build. The configuration, JSON-RPC and HTTP
# route references are generated first (scripts/docs_reference.py).
docs: setup
	.venv/bin/python scripts/docs_reference.py docs/reference
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

# The two commands the README promises (demo, test), the fast tier, and docs and bench. Each sets up .venv first (idempotent).
.PHONY: setup demo test fast bench docs

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/python examples/minds.py

test: setup
	.venv/bin/python -m pytest -q

# The fast tier, for the edit-test loop: the suite but the tests marked slow (pyproject.toml's
# markers), in under 3 minutes on 2 cores. `make test` still runs everything.
fast: setup
	.venv/bin/python -m pytest -q -m "not slow"

# Each benchmark prints its ratios and writes its figures to bench/out/NAME.json; report.py
# draws them into one HTML file, bench/out/report.html. hot_path exits 1 on a missed target
# (these machines are shared and noisy): make goes on, so the report is still written.
bench: setup
	-.venv/bin/python bench/hot_path.py
	.venv/bin/python bench/decode_overhead.py
	.venv/bin/python bench/page_bandwidth.py --sizes 128 512 1024
	.venv/bin/python bench/reprefill_sim.py
	.venv/bin/python bench/gene_paging.py
	.venv/bin/python bench/http_overhead.py
	.venv/bin/python bench/reprefill_real.py
	.venv/bin/python bench/text_cost.py
	.venv/bin/python bench/cluster.py
	.venv/bin/python bench/speculative.py --skip-gemma
	.venv/bin/python bench/shared_prefix.py
	.venv/bin/python bench/soak.py --minutes 1 --sample-s 2
	.venv/bin/python bench/report.py

# The site under docs/ (MkDocs, Material theme), strict: a warning (a broken link or
# anchor, a page out of the nav) fails the build. The configuration, JSON-RPC and HTTP
# route references are generated first (scripts/docs_reference.py).
docs: setup
	.venv/bin/python scripts/docs_reference.py docs/reference
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

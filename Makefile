# The two README commands. Both install everything first (scripts/install.sh, a no-op when
# nothing changed).
.PHONY: install serve test proto peers docs

install:
	@bash scripts/install.sh

serve: install
	.venv/bin/duet serve

test: install
	.venv/bin/python -m pytest

proto: install
	PATH=.venv/bin:$$PATH bash scripts/gen_proto.sh

# Benchmark-only: the peers `duet bench serve` compares duet with (scripts/install_peers.sh).
peers: install
	@bash scripts/install_peers.sh

# The documentation site (mkdocs.yml) into site/: references regenerated from the code first.
docs: install
	.venv/bin/python -m duet.reference_pages
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

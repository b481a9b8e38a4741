# The two README commands. Both install everything first (scripts/install.sh, a no-op when
# nothing changed).
.PHONY: install serve test proto peers

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

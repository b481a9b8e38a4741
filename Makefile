# The two README commands. Both install everything first (scripts/install.sh, a no-op when
# nothing changed).
.PHONY: install serve test proto

install:
	@bash scripts/install.sh

serve: install
	.venv/bin/duet serve

test: install
	.venv/bin/python -m pytest

proto: install
	PATH=.venv/bin:$$PATH bash scripts/gen_proto.sh

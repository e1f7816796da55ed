# The commands a person types. Each does all the set-up it needs on a fresh machine
# and is idempotent: with nothing changed, a second run only re-checks.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check --quiet

DEPS_STAMP  := $(VENV)/.deps-installed
BUILD_STAMP := $(VENV)/.torchkit-built
SOURCES     := setup.py pyproject.toml $(shell find csrc torchkit -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.py' 2>/dev/null)

# Benchmarks: QUICK=1 runs the headline case of each op only (and one small case of
# torchkit.distributed.knn and of the pair losses' group=, which otherwise run two each, on 1
# and 2 processes). CONTENDED=1 runs
# the headline cases with one more CPU-bound process alive the whole time, as a DataLoader
# worker is beside training. Each writes its own report (cpu-quick.*, cpu-contended.*), so that it
# never replaces the full one. The report then rewrites benchmarks/RESULTS.md and README's
# headline table from the latest full runs (benchmarks/report.py).
BENCH_NAME  := $(if $(CONTENDED),cpu-contended,$(if $(QUICK),cpu-quick,cpu))
BENCH_JSON  := benchmarks/results/$(BENCH_NAME).json
BENCH_SEL   := $(if $(QUICK)$(CONTENDED),-m headline,)
# -v: one line per case as it finishes (op, case, implementation, pass).

.PHONY: build test bench cuda-build triton-check gpu-model gpu-model-table cxx17 asan gpu-check compat lint clean

build: $(BUILD_STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch from PyPI is the CUDA build (~5 GB); it runs on the CPU and is what torchvision needs.
$(DEPS_STAMP): requirements-dev.txt requirements-test.txt | $(VENV)/bin/python
	$(PIP) install --upgrade pip
	$(PIP) install torch torchvision
	$(PIP) install -r requirements-dev.txt
	touch $@

# Object files persist under build/temp (see setup.py), so this relinks rather than rebuilds.
$(BUILD_STAMP): $(DEPS_STAMP) $(SOURCES)
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

# The whole suite on every core (pytest-xdist; TEST_WORKERS=0 runs it in this process). Tests
# that start processes of their own share one worker (tests/conftest.py). Each worker keeps
# torch's threads, so that the kernels' parallel paths stay tested; OpenMP's passive wait
# stops the workers' idle threads from spinning on the cores the others need (on 2 cores the
# CPU kernels' tests took 63 s with spinning threads, 47 s without).
TEST_WORKERS ?= auto
test: build
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup

bench: build
	TORCHKIT_BENCH_CONTENDED=$(if $(CONTENDED),1,0) $(PY) -m pytest benchmarks -v -p no:cacheprovider $(BENCH_SEL) --benchmark-json=$(BENCH_JSON) --benchmark-columns=median,iqr,rounds
	$(if $(CONTENDED),,$(PY) benchmarks/distributed_knn.py $(if $(QUICK),--quick,))
	$(if $(CONTENDED),,$(PY) benchmarks/distributed_pair_losses.py $(if $(QUICK),--quick,))
	$(PY) benchmarks/report.py $(BENCH_JSON)

# CUDA build check, no GPU needed: compile and link every .cu with the nvcc that matches
# torch's CUDA, in build/cuda (the default .venv's extension is left alone), then ask the
# dispatcher for each op's CUDA kernel and run a smoke subset of the CPU tests on that build:
# the build tests and every op's and backward's opcheck and gradcheck, which call each kernel
# through the dispatcher, autograd and the fake kernels. The CPU kernels' sources are the same
# as in make test's build, which runs the whole suite on them. Host code at -O0 (FAST_BUILD=1):
# what is checked is that every source compiles and links and every kernel registers, not the
# host optimiser (make test's build compiles the same C++ at -O3). nvcc's -O is the host
# code's: the device code is the release build's (the same registers per kernel).
CUDA_SMOKE := -m "not slow and not triton" -k "test_build or opcheck or gradcheck"
cuda-build: $(DEPS_STAMP)
	mkdir -p build && $(PY) tools/cuda_toolkit.py > build/cuda_home
	CUDA_HOME=$$(cat build/cuda_home) TORCHKIT_CUDA=1 FAST_BUILD=1 TORCH_CUDA_ARCH_LIST="$${TORCH_CUDA_ARCH_LIST:-8.0;9.0}" \
		$(PY) setup.py --quiet build --build-base build/cuda --build-lib build/cuda/lib --build-temp build/cuda/temp
	cd build && PYTHONPATH=$(CURDIR)/build/cuda/lib ../$(PY) ../tools/check_cuda_build.py
	TORCHKIT_EXPECT_CUDA_BUILD=1 PYTHONPATH=$(CURDIR)/build/cuda/lib OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} \
		$(VENV)/bin/pytest tests $(CUDA_SMOKE) -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup

# Triton compile check, no GPU needed: every Triton kernel and launch configuration compiled for
# sm_90, and for sm_80 where it has matrix instructions (tools/triton_check.py: registers, spills,
# shared memory, mma/wgmma), cached in build/triton-cache. Fails on a compile error, spills past 512 bytes, or a tensor-core
# kernel without mma/wgmma. Never under the interpreter, which replaces the compiler. Each build's
# facts are recorded in benchmarks/results/triton-check.json under Triton's cache key of that build
# (commit it with a kernel change): a build whose key is recorded is not compiled again.
triton-check: build
	env -u TRITON_INTERPRET TRITON_CACHE_DIR=$(CURDIR)/build/triton-cache $(PY) tools/triton_check.py

# The offline performance model, no GPU needed (tools/gpu_model.py): each headline Triton case
# counted under the interpreter at small sizes, extrapolated, its launches compiled for sm_90,
# and its predicted H200 time beside the recorded run's, with the launch and resource bounding
# it. Fails where a hot kernel does float64 work per pair or IEEE float32 products without
# saying why, or a case's prediction exceeds benchmarks/results/model.json's past the stated
# factor (REGRESSION). MODEL_CASES: substrings of the case names to take (CI's default: every
# op but the slowest to count, all and semi-hard triplets, multi-similarity and proxy-anchor),
# MODEL_FLAGS: e.g. --gpu h100. gpu-model-table counts every case and rewrites
# benchmarks/results/model.md, model.json, model-counts.json and model-compiled.json (commit them with a kernel change:
# the committed counts seed the cache, so that CI counts only the cases whose kernels changed).
MODEL_CASES ?= supcon ntxent contrastive batch_hard cdist bilinear
MODEL_RUN = TRITON_INTERPRET=1 TRITON_CACHE_DIR=$(CURDIR)/build/triton-cache $(PY) tools/gpu_model.py
gpu-model: build
	$(MODEL_RUN) --check benchmarks/results/model.json $(MODEL_FLAGS) $(MODEL_CASES)
gpu-model-table: build
	$(MODEL_RUN) --launches --output benchmarks/results/model.md $(MODEL_FLAGS)

# C++17, the standard torch 2.8 (the oldest supported) builds extensions with; later torch builds
# them as C++20, so C++20 in csrc passes `make test` and `make cuda-build` and breaks 2.8's build.
# Every .cpp and .cu is parsed against 2.8's headers, with the nvcc of `make cuda-build`
# (tools/cxx17_check.py, the .cpp files after the precompiled header): about three minutes, where `make compat TORCH=2.8` takes ten.
cxx17: $(DEPS_STAMP)
	mkdir -p build && $(PY) tools/cuda_toolkit.py > build/cuda_home
	$(PY) tools/cxx17_check.py --cuda-home "$$(cat build/cuda_home)"

# AddressSanitizer over the CPU kernels' input checks: a CPU build with -fsanitize=address in
# build/asan, then the bad-input tests (every test that hands an op arguments it must refuse,
# and the raw backward ops' checks; not those through the Triton kernels, which are Python) with
# libasan preloaded into the interpreter. Leak
# checking is off: CPython and torch keep allocations alive until exit by design.
# libstdc++ is preloaded too: ASan must find the real __cxa_throw when it intercepts it.
ASAN_CXX   := $(or $(CXX),g++)
ASAN_RUN   = LD_PRELOAD="$$($(ASAN_CXX) -print-file-name=libasan.so) $$($(ASAN_CXX) -print-file-name=libstdc++.so)" \
	ASAN_OPTIONS=detect_leaks=0 PYTHONPATH=$(CURDIR)/build/asan/lib
asan: $(DEPS_STAMP)
	SANITIZE=address TORCHKIT_CUDA=0 $(PY) setup.py --quiet build --build-base build/asan --build-lib build/asan/lib --build-temp build/asan/temp
	cd build && $(ASAN_RUN) ../$(PY) -c "import torchkit._C as c; assert '/build/asan/' in c.__file__, c.__file__"
	$(ASAN_RUN) $(VENV)/bin/pytest tests -q -p no:cacheprovider -m "bad_input and not slow and not triton"

# On a machine with a CUDA GPU (no network needed, its own torch): build for the local GPU,
# the whole suite with CUDA and compute-sanitizer over every kernel, then the GPU benchmarks
# into benchmarks/results/<gpu>/. See tools/gpu_check.sh.
gpu-check:
	GPU_PY=$(or $(GPU_PY),python3) bash tools/gpu_check.sh

# The CPU suite against another torch (make compat TORCH=2.8, the oldest supported): its own
# venv (.venv-torch<X>) with that torch, requirements-test.txt and the matching torchvision
# (0.<minor + 15>) where one is released; the extension is built into build/compat-<X> so that
# the default .venv's build is left alone.
COMPAT_VENV := .venv-torch$(TORCH)
COMPAT_DIR  := build/compat-$(TORCH)
compat:
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=2.8"; exit 1; }
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip --disable-pip-version-check --quiet install --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip --disable-pip-version-check --quiet install "torch==$(TORCH).*" -r requirements-test.txt
	$(COMPAT_VENV)/bin/python -m pip --disable-pip-version-check --quiet install \
		"torchvision==0.$$(( $(word 2,$(subst ., ,$(TORCH))) + 15 )).*" \
		|| echo "make compat: no torchvision for torch $(TORCH) yet; torchkit.transforms' tests skip"
	TORCHKIT_CUDA=0 $(COMPAT_VENV)/bin/python setup.py --quiet build --build-base $(COMPAT_DIR) \
		--build-lib $(COMPAT_DIR)/lib --build-temp $(COMPAT_DIR)/temp
	PYTHONPATH=$(CURDIR)/$(COMPAT_DIR)/lib $(COMPAT_VENV)/bin/pytest tests -q -p no:cacheprovider

lint: $(DEPS_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $$(find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu')

clean:
	rm -rf build torchkit/_C*.so $(BUILD_STAMP) .venv-torch*

# kiln's front door. `make test` and `make demo` work on a fresh Debian/Ubuntu machine.
# CUDA=off: the CPU backend alone, in its own build folder (no nvcc work: ~3 minutes on 2 cores
# instead of ~20 where nvcc is installed), as a machine without nvcc builds it. CI builds and tests
# both (.ci/run).
# CUDA_ARCH="90a;100a": the GPU architectures (KILN_CUDA_ARCH, default 90a), quoted here for the
# shell. A build folder keeps the list it was first configured with: name a new BUILD for another.
# CMAKE_FLAGS given on the command line add to these (override), so none of them is lost.
CUDA ?= on
ifeq ($(CUDA),off)
BUILD ?= build-cpu
override CMAKE_FLAGS += -DKILN_CUDA=OFF
# What a machine without nvcc gets: no CUDA headers fetched either (scripts/install_deps.sh).
export KILN_CUDA := off
endif
BUILD ?= build
JOBS ?= $(shell nproc)
KILN_DEPS ?=
CUDA_ARCH ?=
ifneq ($(KILN_DEPS),)
override CMAKE_FLAGS += -DKILN_DEPS=$(abspath $(KILN_DEPS))
endif
ifneq ($(CUDA_ARCH),)
override CMAKE_FLAGS += '-DKILN_CUDA_ARCH=$(CUDA_ARCH)'
endif

.PHONY: deps build test test-gpu demo offline-deps clean format

deps:
	bash scripts/install_deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# CPU tests always run; gpu-labelled tests skip themselves where no GPU is present.
test: deps
	$(MAKE) build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

# On a GPU host: only the gpu-labelled tests.
test-gpu: build
	cd $(BUILD) && ctest --output-on-failure -L gpu --timeout 900

demo: deps
	$(MAKE) build
	BIN=$(BUILD)/bin bash scripts/demo.sh

offline-deps:
	bash scripts/offline_deps.sh

format:
	clang-format -i $$(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh')

clean:
	rm -rf $(BUILD)

# The two commands of the README:
#   make run   installs what is missing, builds, and runs mrd on the software device
#   make test  installs what is missing, builds, and runs every test
# Both are incremental: a second run rebuilds only what changed.

BUILD_DIR ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
# Extra flags for `make run`, e.g. MRD_FLAGS="--peer_address=127.0.0.1:0"
MRD_FLAGS ?=
CMAKE_ARGS ?=

.PHONY: all deps build run test test-asan test-tsan format clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/build.ninja:
	@mkdir -p $(BUILD_DIR)
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DMRD_WERROR=ON $(CMAKE_ARGS)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS)

run: build
	$(BUILD_DIR)/server/mrd --device=software $(MRD_FLAGS)

test: build
	scripts/run-tests.sh $(BUILD_DIR)

# Sanitizer builds: one CMake option away.
test-asan: deps
	$(MAKE) BUILD_DIR=build-asan CMAKE_ARGS=-DMRD_SANITIZE=address test
test-tsan: deps
	$(MAKE) BUILD_DIR=build-tsan CMAKE_ARGS=-DMRD_SANITIZE=thread test

format:
	git ls-files '*.cc' '*.h' | xargs clang-format -i

clean:
	rm -rf build build-asan build-tsan

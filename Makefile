# The two commands of the README:
#   make run   installs what is missing, builds, and runs mrd on the software device
#   make test  installs what is missing, builds, and runs every test (plain,
#              ASan+UBSan and TSan builds, the integration tests against
#              the TSan build's mrd, the fuzz targets)
# For the edit-build-test loop:
#   make check builds the plain build and runs its unit, integration and
#              device-suite tests (not the lint, model, adversary, image,
#              deploy, install and Python tests: make test runs those)
# Both are incremental: a second run rebuilds only what changed.
#   make fuzz  runs each libFuzzer target (tests/fuzz) for FUZZ_SECONDS
#              (default 600) in build-fuzz (clang-14, ASan+UBSan)
#   make bench runs bench/e2e_bench (the real mrd against a minimal gRPC
#              server, a few minutes; not a test) and plots it into docs/img

BUILD_DIR ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
# Extra flags for `make run`, e.g. MRD_FLAGS="--peer_address=127.0.0.1:0"
MRD_FLAGS ?=
CMAKE_ARGS ?=
# Every build is clang's: it compiles mrd in about 60 % of g++'s time, and
# checks the thread-safety annotations (-Wthread-safety) in every build.
COMPILER_ARGS := -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14
# Seconds per fuzz target for `make fuzz` (make test runs all five at once
# for 60 s).
FUZZ_SECONDS ?= 600
# For long runs: stop each target after FUZZ_RUNS executions; run it in
# FUZZ_JOBS processes (libFuzzer's fork mode). Empty: no limit, one process.
FUZZ_RUNS ?=
FUZZ_JOBS ?=

.PHONY: all deps build run test check test-plain test-asan test-tsan fuzz bench image format clean

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/build.ninja:
	@mkdir -p $(BUILD_DIR)
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DMRD_WERROR=ON $(COMPILER_ARGS) $(CMAKE_ARGS)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Builds only what it runs (mrd and mrctl), so a fresh machine is up sooner.
run: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS) --target mrd mrctl
	$(BUILD_DIR)/server/mrd --device=software $(MRD_FLAGS)

# Every test: plain build, then ASan+UBSan and TSan builds (scripts/test-all.sh).
test: deps
	scripts/test-all.sh

# The quick tier (scripts/run-tests.sh --quick).
check: build
	scripts/run-tests.sh --quick $(BUILD_DIR)

# One build's tests only.
test-plain: build
	scripts/run-tests.sh $(BUILD_DIR)
test-asan: deps
	$(MAKE) BUILD_DIR=build-asan CMAKE_ARGS="-DMRD_SANITIZE=address" test-plain
test-tsan: deps
	$(MAKE) BUILD_DIR=build-tsan CMAKE_ARGS="-DMRD_SANITIZE=thread" test-plain

# Every fuzz target, longer than make test runs them (scripts/fuzz.sh; it
# also reads FUZZ_RUNS and FUZZ_JOBS from the environment).
fuzz: deps
	FUZZ_RUNS=$(FUZZ_RUNS) FUZZ_JOBS=$(FUZZ_JOBS) scripts/fuzz.sh $(FUZZ_SECONDS)

# The end-to-end benchmark (issue 9, part 6): mrd against a minimal gRPC
# server in the same run; the ratio table on stdout, CSVs in
# $(BUILD_DIR)/bench-out, the plots in docs/img (docs/PERFORMANCE.md).
bench: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS) --target mrd e2e_bench
	$(BUILD_DIR)/bench/e2e_bench --out=$(BUILD_DIR)/bench-out
	/usr/bin/python3 bench/plot_bench.py $(BUILD_DIR)/bench-out docs/img

# The container image from Debian packages, without a registry or a daemon
# (root): localhost/mrd:<version> in $(BUILD_DIR)/image/storage and
# $(BUILD_DIR)/image/mrd-<version>.oci.tar (docker/README.md).
image: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(COMPILER_ARGS) $(CMAKE_ARGS) >/dev/null
	cmake --build $(BUILD_DIR) -j $(JOBS) --target mrd mrctl
	docker/build-image.sh $(BUILD_DIR)

format:
	git ls-files '*.cc' '*.h' | xargs clang-format -i

clean:
	rm -rf build build-asan build-tsan build-fuzz

# kvshade developer entry points.
#   make test   install Debian build deps, configure, build, run every test that this
#               machine can run (GPU tests skip themselves without a device and are
#               reported as skipped); the three trees (main, fuzz, TSan) build at once,
#               their compile jobs sharing the cores, then ctest runs
#   make check  the same run without the two extra trees (clang fuzz, ThreadSanitizer) and
#               without the tests that need them: one tree compiled instead of three
#   make demo   the main job (see README)
#   make native regenerate client/python/kvshade/_native_abi.py (the Python package's ctypes
#               declarations) from client/include/kvshade/kvshade.h
BUILD ?= build
JOBS ?= $(shell nproc)
# ctest runs twice as many tests as there are cores: most tests spend their time waiting on
# a daemon, a socket or a timer (on 2 cores the main tree's tests kept 0.9 cores busy at
# -j 2, 339 s, and finished in 190 s at -j 4; bench/RESULTS.md "make test"). The sanitizer
# runs take two slots each (PROCESSORS 2, tests/hardening/CMakeLists.txt).
TEST_JOBS ?= $(shell echo $$((2 * $(JOBS))))
CMAKE_FLAGS ?=

.PHONY: deps configure build fuzz-build sanitize-build trees test check demo native clean

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The libFuzzer targets (clang, ASan + UBSan) in $(BUILD)/fuzz, which ctest's fuzz.<target>
# entries run for 20 s each (tests/README.md "Fuzzing"), and the service unit tests built
# from the same objects.
fuzz-build: deps
	NINJA_STATUS='[fuzz %f/%t] ' ./scripts/fuzz.sh build $(BUILD)/fuzz

# The short sanitizer runs (tests/README.md "Sanitizers"): the service unit tests under
# ASan + UBSan come from the fuzz tree above, under TSan from $(BUILD)/tsan.
sanitize-build: deps
	NINJA_STATUS='[tsan %f/%t] ' ./scripts/sanitize.sh build thread $(BUILD)/tsan service_test

# The three trees at once: each tree's serial stretches (configure, its last translation
# units, its links) overlap the other trees' compiles instead of leaving a core idle.
trees:
	$(MAKE) --no-print-directory -j3 build fuzz-build sanitize-build

# ctest's own summary, then one line: how many tests passed, failed and were skipped, and
# why (tests/ctest-summary.sh). Skipped tests are listed by ctest as "(Skipped)".
test: trees
	rc=0; ctest --test-dir $(BUILD) --output-on-failure -j $(TEST_JOBS) \
	  --output-log $(BUILD)/Testing/make-test.log || rc=$$?; \
	./tests/ctest-summary.sh $(BUILD)/Testing/make-test.log; exit $$rc

# `make test` less the fuzz and sanitizer entries (labels fuzz, sanitize) and their trees.
check: build
	rc=0; ctest --test-dir $(BUILD) --output-on-failure -j $(TEST_JOBS) -LE 'fuzz|sanitize' \
	  --output-log $(BUILD)/Testing/make-check.log || rc=$$?; \
	./tests/ctest-summary.sh $(BUILD)/Testing/make-check.log; exit $$rc

demo: build
	./scripts/demo.sh $(BUILD)

native:
	/usr/bin/python3 scripts/gen_native.py

clean:
	rm -rf $(BUILD)

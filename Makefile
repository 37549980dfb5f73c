# kvshade developer entry points.
#   make test   install Debian build deps, configure, build, run every test that this
#               machine can run (GPU tests skip themselves without a device and are
#               reported as skipped)
#   make demo   the main job (see README)
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: deps configure build test demo clean

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# ctest's own summary, then one line: how many tests passed, failed and were skipped, and
# why (tests/ctest-summary.sh). Skipped tests are listed by ctest as "(Skipped)".
test: build
	rc=0; ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) \
	  --output-log $(BUILD)/Testing/make-test.log || rc=$$?; \
	./tests/ctest-summary.sh $(BUILD)/Testing/make-test.log; exit $$rc

demo: build
	./scripts/demo.sh $(BUILD)

clean:
	rm -rf $(BUILD)

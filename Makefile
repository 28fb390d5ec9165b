# troupe: the two commands a new machine needs.
#   make serve   install what is missing, build, serve the embedded default model
#   make test    install what is missing, build everything, run every test
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
PORT ?= 8000

.PHONY: all setup configure build test serve bench clean

all: build

setup:
	@scripts/setup

$(BUILD)/build.ninja: CMakeLists.txt | setup
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS)

configure: setup
	@cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS) >/dev/null

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 1500

serve: build
	$(BUILD)/bin/troupe serve --port $(PORT)

bench: build
	bench/run.sh

clean:
	rm -rf $(BUILD)

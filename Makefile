# memshim build. `make` builds build/libmemshim.so; `make check` builds and runs every test;
# `make bench` prints the benchmark tables; `make demo` runs the main job on the driver double;
# `make mutants` runs the mutation run (docs/testing.md).
# Needs only the CUDA headers (CUDA_HOME, else /usr/local/cuda) and Debian packages that
# scripts/setup.sh installs. BUILD=build-asan SAN=address,undefined gives a sanitizer build.

BUILD   ?= build
CC      ?= gcc
PREFIX  ?= /usr/local
SAN     ?=
OPT     ?= -O2

CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda) $(wildcard /usr/local/cuda-*))
CUDA_INC  := $(CUDA_HOME)/include
ifeq ($(wildcard $(CUDA_INC)/cuda.h),)
  $(error CUDA headers not found (looked for cuda.h in '$(CUDA_INC)'). Set CUDA_HOME to a CUDA toolkit, or install one (Debian: apt-get install nvidia-cuda-toolkit-headers, or the NVIDIA CUDA toolkit). Only the headers are needed to build)
endif

SANFLAGS := $(if $(SAN),-fsanitize=$(SAN) -fno-omit-frame-pointer -fno-sanitize-recover=undefined,)
CFLAGS  ?= $(OPT) -g
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -fPIC -pthread \
           -fvisibility=hidden -Ishim -Ipolicy -Ipolicy/models -Ireport -Ireport/trace -I$(CUDA_INC) $(SANFLAGS)
LDFLAGS += -pthread $(SANFLAGS)
LIBS    := -ldl -lm

# The preloaded library: hooks + shim + policy + report. Only glibc may be NEEDED.
LIB_SRC  := $(sort $(wildcard shim/*.c hooks/*.c policy/*.c report/*.c))
CORE_SRC := $(sort $(wildcard shim/*.c policy/*.c report/*.c))
# The trace formats (report/trace) and the allocator models replay runs them through (policy/models).
TRACE_SRC := $(sort $(wildcard report/trace/*.c policy/models/*.c))
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
CORE_OBJ := $(CORE_SRC:%.c=$(BUILD)/obj/%.o)
TRACE_OBJ := $(TRACE_SRC:%.c=$(BUILD)/obj/%.o)

DOUBLE_DIR := $(BUILD)/double
UNIT_SRC   := $(sort $(wildcard tests/unit/test_*.c))
UNIT_BIN   := $(UNIT_SRC:tests/unit/%.c=$(BUILD)/tests/%)
PRELOAD_SRC := $(sort $(wildcard tests/preload/*.c))
PRELOAD_BIN := $(PRELOAD_SRC:tests/preload/%.c=$(BUILD)/tests/preload/%)
TOOLS := $(BUILD)/memshim-replay $(BUILD)/memshim-options $(BUILD)/memshim-train-demo

.PHONY: all lib double tests check check-asan check-tsan bench demo install clean mutants
all: $(BUILD)/libmemshim.so $(TOOLS) double

lib: $(BUILD)/libmemshim.so

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libmemshim.so: $(LIB_OBJ) shim/exports.map
	$(CC) -shared -o $@ $(LIB_OBJ) $(LDFLAGS) -Wl,--version-script=shim/exports.map $(if $(SAN),,-Wl,-z,defs) -Wl,-z,nodelete $(LIBS)

$(BUILD)/libmemshim_core.a: $(CORE_OBJ)
	@rm -f $@; ar rcs $@ $^

$(BUILD)/libmemshim_trace.a: $(TRACE_OBJ)
	@rm -f $@; ar rcs $@ $^

# ---- tools -----------------------------------------------------------------------------------
$(BUILD)/memshim-replay: $(BUILD)/obj/report/replay/main.o $(BUILD)/libmemshim_trace.a $(BUILD)/libmemshim_core.a
	$(CC) -o $@ $^ $(LDFLAGS) -ljansson -lz $(LIBS)

$(BUILD)/memshim-options: $(BUILD)/obj/tests/tools/options_main.o $(BUILD)/libmemshim_core.a
	$(CC) -o $@ $^ $(LDFLAGS) $(LIBS)

$(BUILD)/memshim-train-demo: tests/demo/train_loop.c double
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< -L$(DOUBLE_DIR) -Wl,-rpath,'$$ORIGIN/double' -lcudart $(LDFLAGS)

# ---- the CUDA driver and runtime doubles (tests/cudadouble) ------------------------------------
double: $(DOUBLE_DIR)/libcuda.so.1 $(DOUBLE_DIR)/libcudart.so.13

$(DOUBLE_DIR)/libcuda.so.1: tests/cudadouble/cuda_double.c tests/cudadouble/cudbl.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fvisibility=default -shared -Wl,-Bsymbolic -Wl,-soname,libcuda.so.1 -o $@ $< $(LDFLAGS) -lrt $(LIBS)
	ln -sf libcuda.so.1 $(DOUBLE_DIR)/libcuda.so

$(DOUBLE_DIR)/libcudart.so.13: tests/cudadouble/cudart_double.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fvisibility=default -shared -Wl,-Bsymbolic -Wl,-soname,libcudart.so.13 -o $@ $< $(LDFLAGS) $(LIBS)
	ln -sf libcudart.so.13 $(DOUBLE_DIR)/libcudart.so

# ---- tests -------------------------------------------------------------------------------------
tests: all $(UNIT_BIN) $(PRELOAD_BIN)

$(BUILD)/tests/%: tests/unit/%.c $(BUILD)/libmemshim_trace.a $(BUILD)/libmemshim_core.a double tests/harness.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -o $@ $< $(BUILD)/libmemshim_trace.a $(BUILD)/libmemshim_core.a \
	    -L$(DOUBLE_DIR) -Wl,-rpath,'$$ORIGIN/../double' -lcuda $(LDFLAGS) -ljansson -lz $(LIBS)

$(BUILD)/tests/preload/%: tests/preload/%.c double tests/harness.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -Itests/cudadouble -o $@ $< -L$(DOUBLE_DIR) \
	    -Wl,-rpath,'$$ORIGIN/../../double' -lcudart -lcuda $(LDFLAGS) $(LIBS)

check: tests
	BUILD=$(BUILD) bash tests/run.sh

check-asan:
	$(MAKE) BUILD=build-asan SAN=address,undefined OPT=-O1 tests
	BUILD=build-asan MSH_SANITIZER=asan bash tests/run.sh

check-tsan:
	$(MAKE) BUILD=build-tsan CC=clang SAN=thread OPT=-O1 tests
	BUILD=build-tsan MSH_SANITIZER=tsan bash tests/run.sh stress

# The mutation run (docs/testing.md): every mutant of tests/mutants/mutants.txt on a scratch copy
# against the quick suites. Not part of check: it takes most of an hour on 2 cores.
mutants: tests
	python3 tests/mutants/run_mutants.py

bench: all
	BUILD=$(BUILD) bash scripts/bench.sh

demo: all
	BUILD=$(BUILD) bash scripts/demo.sh

install: all
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/memshim/docs \
	    $(DESTDIR)$(PREFIX)/share/memshim/scripts $(DESTDIR)$(PREFIX)/include
	install -m 0755 $(BUILD)/libmemshim.so $(DESTDIR)$(PREFIX)/lib/
	install -m 0755 $(BUILD)/memshim-replay $(BUILD)/memshim-options $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 shim/memshim.h $(DESTDIR)$(PREFIX)/include/
	install -m 0644 docs/*.md README.md $(DESTDIR)$(PREFIX)/share/memshim/docs/
	install -m 0755 scripts/*.py $(DESTDIR)$(PREFIX)/share/memshim/scripts/ 2>/dev/null || true

clean:
	rm -rf build build-asan build-tsan

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

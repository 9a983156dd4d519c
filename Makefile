# memshim build. `make` builds build/libmemshim.so; `make check` builds and runs every test;
# `make bench` prints the benchmark tables; `make demo` runs the main job on the driver double;
# `make mutants` runs the mutation run (docs/testing.md).
# Needs only the CUDA headers (CUDA_HOME, else /usr/local/cuda) and Debian packages that
# scripts/setup.sh installs. BUILD=build-asan SAN=address,undefined gives a sanitizer build.

.DEFAULT_GOAL := all
BUILD   ?= build
CC      ?= gcc
PREFIX  ?= /usr/local
SAN     ?=
OPT     ?= -O2

CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda) $(wildcard /usr/local/cuda-*))
CUDA_INC  ?= $(CUDA_HOME)/include
ifeq ($(wildcard $(CUDA_INC)/cuda.h),)
  $(error CUDA headers not found (looked for cuda.h in '$(CUDA_INC)'). Set CUDA_HOME to a CUDA toolkit, or install one (Debian: apt-get install nvidia-cuda-toolkit-headers, or the NVIDIA CUDA toolkit). Only the headers are needed to build)
endif
# Directories searched after CUDA_INC: PyTorch's CUDA wheels split the headers (torch 2.15's
# nvidia/cu13/include has cuda_runtime_api.h but not the crt/host_defines.h it includes; triton's
# copy has it). Set by the pip build (docs/install.md).
CUDA_INC_AFTER ?=
CUDA_CPPFLAGS := -I$(CUDA_INC) $(addprefix -idirafter ,$(CUDA_INC_AFTER))
# The Python that scripts/torch_flags.py runs with: the one whose PyTorch the glue is built for.
PYTHON ?= python3

# jansson for the JSON reports. dlopen (the default): libjansson.so.4 is loaded at run time when
# the machine has it. static: libjansson.a is linked into libmemshim.so (its symbols stay local:
# shim/exports.map) and into memshim-replay, so reports need nothing on the machine and NEEDED is
# still glibc only; the pip package and the GPU check are built so. A change of mode rebuilds.
JANSSON ?= dlopen
JANSSON_A ?= $(shell $(CC) -print-file-name=libjansson.a)
ifeq ($(JANSSON),static)
  ifeq ($(wildcard $(JANSSON_A)),)
    $(error JANSSON=static: libjansson.a not found (Debian: apt-get install libjansson-dev; or set JANSSON_A))
  endif
  JANSSON_CFLAGS := -DMSH_JANSSON_STATIC
  JANSSON_LIB    := $(JANSSON_A)
  TOOL_JANSSON   := $(JANSSON_A) $(or $(wildcard $(shell $(CC) -print-file-name=libz.a)),-lz)
else ifeq ($(JANSSON),dlopen)
  JANSSON_CFLAGS :=
  JANSSON_LIB    :=
  TOOL_JANSSON   := -ljansson -lz
else
  $(error JANSSON=$(JANSSON): use dlopen or static)
endif
ifeq ($(filter clean,$(MAKECMDGOALS)),)
  $(shell mkdir -p $(BUILD) && { [ "$$(cat $(BUILD)/jansson.mode 2>/dev/null)" = "$(JANSSON)" ] || echo $(JANSSON) > $(BUILD)/jansson.mode; })
endif

SANFLAGS := $(if $(SAN),-fsanitize=$(SAN) -fno-omit-frame-pointer -fno-sanitize-recover=undefined,)
CFLAGS  ?= $(OPT) -g
# A function that falls off its end without a value, or calls one never declared, is never
# meant: refused at build time (on every compiler these flags exist on), not left to run.
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror=return-type -Werror=implicit-function-declaration -fPIC -pthread \
           -fvisibility=hidden -Ishim -Ishim/record -Ipolicy -Ipolicy/base -Ireport -Ireport/trace -Ireport/replay/models $(CUDA_CPPFLAGS) $(JANSSON_CFLAGS) $(SANFLAGS)
# TLS descriptors (x86-64 GCC; arm64 has them by default): a thread-local in the preloaded
# library then costs a load, not a call to __tls_get_addr; the allocation path reads several.
TLS_DIALECT := $(shell $(CC) -mtls-dialect=gnu2 -fPIC -x c -c /dev/null -o /dev/null 2>/dev/null && echo -mtls-dialect=gnu2)
CFLAGS  += $(TLS_DIALECT)
LDFLAGS += -pthread $(SANFLAGS)
LIBS    := -ldl -lm

# The preloaded library: hooks + shim (shim/record: the snapshot history and its writer) + report
# + policy (policy/pool: the pool, one concern a file; policy/base: msh.h, the driver table, the clocks). Only glibc may be NEEDED.
# The pickle writer is one of the trace formats (report/trace) but runs in the library too: the
# snapshot writer writes PyTorch's pickle with it.
LIB_FORMATS := report/trace/pkwrite.c
LIB_SRC  := $(sort $(wildcard shim/*.c shim/record/*.c hooks/*.c policy/*.c policy/pool/*.c policy/base/*.c report/*.c) $(LIB_FORMATS))
CORE_SRC := $(sort $(wildcard shim/*.c shim/record/*.c policy/*.c policy/pool/*.c policy/base/*.c report/*.c) $(LIB_FORMATS))
# The trace formats (report/trace) and the allocator models replay runs them through (report/replay/models).
TRACE_SRC := $(sort $(filter-out $(LIB_FORMATS),$(wildcard report/trace/*.c report/replay/models/*.c)))
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
CORE_OBJ := $(CORE_SRC:%.c=$(BUILD)/obj/%.o)
TRACE_OBJ := $(TRACE_SRC:%.c=$(BUILD)/obj/%.o)

DOUBLE_DIR := $(BUILD)/double
UNIT_SRC   := $(sort $(wildcard tests/unit/test_*.c))
UNIT_BIN   := $(UNIT_SRC:tests/unit/%.c=$(BUILD)/tests/%)
PRELOAD_SRC := $(sort $(wildcard tests/preload/*.c))
PRELOAD_BIN := $(PRELOAD_SRC:tests/preload/%.c=$(BUILD)/tests/preload/%)
TOOLS := $(BUILD)/memshim-replay $(BUILD)/memshim-options $(BUILD)/memshim-train-demo

# ---- PyTorch: the C++ glue (libmemshim_torch.so) and the test extension, only when python3 can
# import torch (scripts/torch_flags.py writes the flags once; a new PyTorch rewrites them). Not
# in sanitizer builds: PyTorch's libraries are not instrumented.
CXX ?= g++
TORCH_MK := $(BUILD)/torch-flags.mk
ifeq ($(SAN),)
ifeq ($(filter clean,$(MAKECMDGOALS)),)
-include $(TORCH_MK)
endif
endif
$(TORCH_MK): scripts/torch_flags.py
	@mkdir -p $(dir $@)
	$(PYTHON) scripts/torch_flags.py $@ > $@.tmp 2>/dev/null && mv $@.tmp $@
GLUE := $(if $(filter 1,$(TORCH_OK)),$(BUILD)/libmemshim_torch.so,)
TORCH_TESTS := $(if $(filter 1,$(TORCH_OK)),$(BUILD)/tests/torch/memshim_oom_probe$(TORCH_PYEXT) \
    $(BUILD)/tests/differential/glue_routing,)

.PHONY: all lib native double tests check layers check-asan check-tsan bench demo install install-python clean mutants
all: $(BUILD)/libmemshim.so $(TOOLS) double $(GLUE)

lib: $(BUILD)/libmemshim.so

# What the pip package carries (setup.py: make BUILD=build/pip/make JANSSON=static native).
native: $(BUILD)/libmemshim.so $(BUILD)/memshim-replay $(BUILD)/memshim-options $(GLUE)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/obj/report/report.o: $(BUILD)/jansson.mode

$(BUILD)/libmemshim.so: $(LIB_OBJ) shim/exports.map $(BUILD)/jansson.mode
	$(CC) -shared -o $@ $(LIB_OBJ) $(JANSSON_LIB) $(LDFLAGS) -Wl,--version-script=shim/exports.map $(if $(SAN),,-Wl,-z,defs) -Wl,-z,nodelete $(LIBS)

$(BUILD)/libmemshim_torch.so: shim/torch_glue.cpp $(TORCH_MK)
	$(CXX) -std=c++17 $(OPT) -g -fPIC -shared -fvisibility=hidden -Wall -Wextra $(TORCH_CXXFLAGS) $(CUDA_CPPFLAGS) \
	    -DMSH_TORCH_VERSION='"$(TORCH_VERSION)"' -o $@ $< -L$(TORCH_LIBDIR) -Wl,-rpath,$(TORCH_LIBDIR) -lc10 -ldl

$(BUILD)/libmemshim_core.a: $(CORE_OBJ)
	@rm -f $@; ar rcs $@ $^

$(BUILD)/libmemshim_trace.a: $(TRACE_OBJ)
	@rm -f $@; ar rcs $@ $^

# ---- tools -----------------------------------------------------------------------------------
$(BUILD)/memshim-replay: $(BUILD)/obj/report/replay/main.o $(BUILD)/obj/report/replay/devtime.o $(BUILD)/libmemshim_trace.a $(BUILD)/libmemshim_core.a
	$(CC) -o $@ $^ $(LDFLAGS) $(TOOL_JANSSON) $(LIBS)

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

$(DOUBLE_DIR)/libcudart.so.13: tests/cudadouble/cudart_double.c tests/cudadouble/cudbl.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fvisibility=default -shared -Wl,-Bsymbolic -Wl,-soname,libcudart.so.13 -o $@ $< $(LDFLAGS) $(LIBS)
	ln -sf libcudart.so.13 $(DOUBLE_DIR)/libcudart.so

# ---- tests -------------------------------------------------------------------------------------
tests: all $(UNIT_BIN) $(PRELOAD_BIN) $(TORCH_TESTS) $(BUILD)/gpu-vmm-cost

# The GPU check's VMM cost probe (tests/gpu/run_gpu_checks.sh): the driver by dlopen, glibc only.
$(BUILD)/gpu-vmm-cost: tests/gpu/vmm_cost.c policy/drvcost.c policy/drvcost.h
	$(CC) $(CFLAGS) -o $@ tests/gpu/vmm_cost.c policy/drvcost.c $(LDFLAGS) $(LIBS)

# A Python extension whose one function calls the glue inside PyTorch's HANDLE_TH_ERRORS, so the
# OOM test goes through PyTorch's own C++ -> Python error translation.
$(BUILD)/tests/torch/memshim_oom_probe$(TORCH_PYEXT): tests/torch/oom_probe.cpp $(TORCH_MK)
	@mkdir -p $(dir $@)
	$(CXX) -std=c++20 -O1 -fPIC -shared $(TORCH_CXXFLAGS) -I$(TORCH_PYINC) $(CUDA_CPPFLAGS) -o $@ $< \
	    -L$(TORCH_LIBDIR) -Wl,-rpath,$(TORCH_LIBDIR) -ltorch_python -lc10 -ldl

# The glue's routing against PyTorch's get_pool (tests/differential): no PyTorch headers, it stands
# in for libmemshim.so's C entry points itself (-rdynamic) and loads the real glue.
$(BUILD)/tests/differential/glue_routing: tests/differential/glue_routing.cpp
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 -O1 -g -Wall -Wextra $(CUDA_CPPFLAGS) -rdynamic -o $@ $< -ldl

$(BUILD)/tests/%: tests/unit/%.c $(BUILD)/libmemshim_trace.a $(BUILD)/libmemshim_core.a double tests/harness.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -o $@ $< $(BUILD)/libmemshim_trace.a $(BUILD)/libmemshim_core.a \
	    -L$(DOUBLE_DIR) -Wl,-rpath,'$$ORIGIN/../double' -lcuda $(LDFLAGS) -ljansson -lz $(LIBS)

# oom_thread defines rename() to see which thread writes each report, never_calls malloc() and
# fsync() to count memshim's calls: memshim's calls must reach them
$(BUILD)/tests/preload/oom_thread $(BUILD)/tests/preload/never_calls: LDFLAGS += -rdynamic
$(BUILD)/tests/preload/%: tests/preload/%.c double tests/harness.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests -Itests/cudadouble -o $@ $< -L$(DOUBLE_DIR) \
	    -Wl,-rpath,'$$ORIGIN/../../double' -lcudart -lcuda $(LDFLAGS) $(LIBS)

check: tests
	BUILD=$(BUILD) bash tests/run.sh

# The floors alone (tests/layers/check_layers.py; check runs it too): every include runs down
# hooks -> shim -> report -> policy, and no product C file is over 1500 lines.
layers:
	python3 tests/layers/check_layers.py

check-asan:
	$(MAKE) BUILD=build-asan SAN=address,undefined OPT=-O1 tests
	BUILD=build-asan MSH_SANITIZER=asan bash tests/run.sh

check-tsan:
	$(MAKE) BUILD=build-tsan CC=clang SAN=thread OPT=-O1 tests
	BUILD=build-tsan MSH_SANITIZER=tsan bash tests/run.sh stress

# The mutation run (docs/testing.md): every mutant of tests/mutants/mutants.txt on a scratch copy
# against the quick suites, then the mutants universalmutator generates (a seeded sample per product
# file, tests/mutants/gen_mutants.py; installed here when missing). Not part of check: each takes
# most of an hour on 2 cores. GEN_MUTANTS=0 runs the hand-written list only, MUTANTS_ONLY_GEN=1 the
# generated ones only.
GEN_MUTANTS ?= 1
MUTANTS_ONLY_GEN ?= 0
mutants: tests
	$(if $(filter 1,$(MUTANTS_ONLY_GEN)),,python3 tests/mutants/run_mutants.py)
	@if [ "$(GEN_MUTANTS)" = 1 ] && ! command -v mutate >/dev/null 2>&1; then \
	    echo "mutants: universalmutator (the generated mutants' tool) is missing: installing it with pip"; \
	    python3 -m pip install --quiet universalmutator || { echo "mutants: could not install universalmutator (pip install universalmutator, or bash scripts/setup.sh --with-mutants)"; exit 1; }; \
	fi
	$(if $(filter 1,$(GEN_MUTANTS)),python3 tests/mutants/gen_mutants.py,)

bench: all
	BUILD=$(BUILD) bash scripts/bench.sh

demo: all
	BUILD=$(BUILD) bash scripts/demo.sh

install: all
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/memshim/docs \
	    $(DESTDIR)$(PREFIX)/include
	install -m 0755 $(BUILD)/libmemshim.so $(DESTDIR)$(PREFIX)/lib/
	install -m 0755 $(BUILD)/memshim-replay $(BUILD)/memshim-options $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 shim/memshim.h $(DESTDIR)$(PREFIX)/include/
	install -m 0644 docs/*.md README.md $(DESTDIR)$(PREFIX)/share/memshim/docs/
	install -m 0755 scripts/memshim-report $(DESTDIR)$(PREFIX)/bin/
	# the Python start-up hook beside the library, where libmemshim.so looks for it
	install -d $(DESTDIR)$(PREFIX)/lib/memshim-python
	cp -R hooks/python/. $(DESTDIR)$(PREFIX)/lib/memshim-python/
	find $(DESTDIR)$(PREFIX)/lib/memshim-python -name __pycache__ -prune -exec rm -rf {} +
	$(if $(GLUE),install -m 0755 $(GLUE) $(DESTDIR)$(PREFIX)/lib/,@echo "install: no PyTorch here: libmemshim_torch.so not built (tensor mode needs it)")

# For python -I/-E and embedded interpreters (they ignore PYTHONPATH): a .pth file in python3's
# site-packages that boots memshim's hook when libmemshim.so is preloaded. After `make install`.
install-python:
	@site=$$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	mkdir -p "$(DESTDIR)$$site" && printf '%s\n%s\n' "$(PREFIX)/lib/memshim-python" \
	    "import os; 'libmemshim' in os.environ.get('LD_PRELOAD', '') and __import__('memshim._boot').\
_boot.from_pth()" > "$(DESTDIR)$$site/memshim.pth" && echo "install-python: wrote $(DESTDIR)$$site/memshim.pth"

clean:
	rm -rf build build-asan build-tsan

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

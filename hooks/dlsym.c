/*
 * dlsym.c: memshim's dlsym, so that a CUDA-graph capture begun through the driver a program
 * loaded itself (dlopen("libcuda.so.1") + dlsym: libcudart 13, NCCL, cudart_static programs,
 * cuda-python, Numba) is seen like one begun through memshim's exported symbols (issue 31 item 1;
 * docs/interposition.md says why this, and only this, is interposed).
 *
 * What it changes, and nothing else: when a dlsym on an explicit handle returns the driver's own
 * cuStreamBeginCapture* / cuStreamEndCapture* (any ABI, per-thread forms included), the program
 * gets memshim's hook for it; when it returns the driver's cuGetProcAddress[_v2], it gets a lookup
 * that does the same for what it is asked (hooks/entry.c, msh_entry_substitute_capture). Every
 * other symbol, every lookup memshim itself makes, and everything in MEMSHIM_MODE=off comes back
 * exactly as glibc's dlsym returns it.
 *
 * What it must never do (the failures of other dlsym interposers: recursion, RTLD_NEXT answered
 * for the wrong object): call the name `dlsym` (it would re-enter), resolve RTLD_DEFAULT or
 * RTLD_NEXT as if memshim were the caller, allocate or take a lock before glibc's dlsym has
 * answered, or depend on memshim being initialized. glibc finds the caller of dlsym from the
 * return address (RTLD_NEXT: the objects after the caller's; RTLD_DEFAULT: the caller's
 * namespace and local scope), so those two handles are passed on by a tail jump that leaves the
 * caller's return address in place: the entry point is a few instructions of assembly (x86-64,
 * AArch64); on other architectures dlsym is not interposed and that route stays unseen. An
 * explicit handle's lookup does not depend on the caller (only LD_AUDIT's bindings name it).
 */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#include "core.h"
#include "hooks.h"
#include "msh.h"

#if defined(__x86_64__) || defined(__aarch64__)

/* glibc's dlsym (or the next interposer's): GLIBC_2.34 where libdl was merged into libc, the
 * architecture's first version before that. dlvsym is not interposed, so this never re-enters. */
MSH_HIDDEN void *msh_dlsym_next;

/* Not instrumented: a sanitizer runtime looks its interceptors up with dlsym(RTLD_NEXT) before
 * its shadow memory exists. */
#define NO_SAN __attribute__((no_sanitize("address", "thread", "undefined")))
MSH_HIDDEN void *msh_dlsym_resolve(void) NO_SAN;
void *msh_dlsym_resolve(void)
{
    void *p = __atomic_load_n(&msh_dlsym_next, __ATOMIC_ACQUIRE);
    if (p) return p;
    static const char *const versions[] = {"GLIBC_2.34",
#if defined(__x86_64__)
                                           "GLIBC_2.2.5",
#else
                                           "GLIBC_2.17",
#endif
    };
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !p; i++) p = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    __atomic_store_n(&msh_dlsym_next, p, __ATOMIC_RELEASE);
    return p;
}

/* The names whose lookups can change: a cheap filter before anything else. */
static bool capture_name(const char *n)
{
    return n && n[0] == 'c' && n[1] == 'u' &&
           (!strncmp(n, "cuStreamBeginCapture", 20) || !strncmp(n, "cuStreamEndCapture", 18) ||
            !strncmp(n, "cuGetProcAddress", 16));
}

/* Whether an address is in libmemshim.so: memshim's own lookups (msh_cu, the entry-point table)
 * must get the driver's functions, whatever thread state they run in. */
static bool from_memshim(const void *ret)
{
    static const void *self_base;
    Dl_info a, b;
    if (!self_base) {
        if (!dladdr((const void *)&msh_dlsym_resolve, &a)) return true; /* cannot tell: leave it alone */
        __atomic_store_n(&self_base, a.dli_fbase, __ATOMIC_RELEASE);
    }
    return !dladdr(ret, &b) || b.dli_fbase == __atomic_load_n(&self_base, __ATOMIC_ACQUIRE);
}

/* Explicit handles, reached by a jump from the entry point below: __builtin_return_address(0) is
 * the program's call site. */
MSH_HIDDEN void *msh_dlsym_handle(void *handle, const char *name) __attribute__((used, noinline)) NO_SAN;
void *msh_dlsym_handle(void *handle, const char *name)
{
    const void *caller = __builtin_return_address(0);
    void *(*next)(void *, const char *) = (void *(*)(void *, const char *))msh_dlsym_resolve();
    if (!next) return NULL;
    void *p = next(handle, name);
    if (!p || !capture_name(name) || from_memshim(caller)) return p;
    msh_entry_substitute_capture(&p);
    return p;
}

/* The exported entry: RTLD_DEFAULT (0) and RTLD_NEXT (-1) go on to glibc by a jump, with the
 * caller's return address where glibc reads it; any other handle to msh_dlsym_handle. */
#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        ".p2align 4\n"
        "dlsym:\n"
        "    .cfi_startproc\n"
        "    endbr64\n"
        "    test %rdi, %rdi\n"
        "    je 1f\n"
        "    cmp $-1, %rdi\n"
        "    je 1f\n"
        "    jmp msh_dlsym_handle\n"
        "1:  mov msh_dlsym_next(%rip), %rax\n"
        "    test %rax, %rax\n"
        "    je 2f\n"
        "    jmp *%rax\n"
        "2:  push %rdi\n" /* resolve once, keeping the arguments (and the stack 16-aligned) */
        "    .cfi_adjust_cfa_offset 8\n"
        "    push %rsi\n"
        "    .cfi_adjust_cfa_offset 8\n"
        "    sub $8, %rsp\n"
        "    .cfi_adjust_cfa_offset 8\n"
        "    call msh_dlsym_resolve\n"
        "    add $8, %rsp\n"
        "    .cfi_adjust_cfa_offset -8\n"
        "    pop %rsi\n"
        "    .cfi_adjust_cfa_offset -8\n"
        "    pop %rdi\n"
        "    .cfi_adjust_cfa_offset -8\n"
        "    test %rax, %rax\n"
        "    je 3f\n"
        "    jmp *%rax\n"
        "3:  ret\n" /* no dlsym to be found: NULL, as a failed lookup */
        "    .cfi_endproc\n"
        ".size dlsym, .-dlsym\n");
#else
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, %function\n"
        ".p2align 4\n"
        "dlsym:\n"
        "    .cfi_startproc\n"
        "    cbz x0, 1f\n"
        "    cmn x0, #1\n"
        "    b.eq 1f\n"
        "    b msh_dlsym_handle\n"
        "1:  adrp x16, msh_dlsym_next\n"
        "    ldr x16, [x16, :lo12:msh_dlsym_next]\n"
        "    cbz x16, 2f\n"
        "    br x16\n"
        "2:  stp x0, x1, [sp, #-32]!\n" /* resolve once, keeping the arguments and the link register */
        "    .cfi_adjust_cfa_offset 32\n"
        "    str x30, [sp, #16]\n"
        "    bl msh_dlsym_resolve\n"
        "    mov x16, x0\n"
        "    ldr x30, [sp, #16]\n"
        "    ldp x0, x1, [sp], #32\n"
        "    .cfi_adjust_cfa_offset -32\n"
        "    cbz x16, 3f\n"
        "    br x16\n"
        "3:  mov x0, #0\n"
        "    ret\n"
        "    .cfi_endproc\n"
        ".size dlsym, .-dlsym\n");
#endif

#endif

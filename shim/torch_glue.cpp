/*
 * torch_glue.cpp: libmemshim_torch.so, the C++ glue between PyTorch's pluggable allocator and
 * libmemshim.so (docs/pytorch.md). C++ is PyTorch's ABI, and two things can only be done in it:
 * throwing c10::OutOfMemoryError (PyTorch does not check a NULL from a pluggable allocator, and
 * only that exception becomes torch.OutOfMemoryError), and calling the std::function filter
 * that begin_allocate_to_pool hands over (which streams allocate into a CUDA-graph pool).
 *
 * Built against the installed PyTorch's headers and libc10 (Makefile: only when `import torch`
 * works). It holds no memory state of its own: every block comes from libmemshim.so's C entry
 * points, resolved in the process at first use. It must never let any exception other than
 * PyTorch's own (the OOM it throws, or one from PyTorch's filter) leave an entry point.
 */
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#define GLUE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using MempoolId = std::pair<unsigned long long, unsigned long long>; /* c10::cuda::MempoolId_t */
using Filter = std::function<bool(cudaStream_t)>;

struct CApi {
    void *(*alloc)(ssize_t, int, void *);
    void *(*alloc_in_pool)(ssize_t, int, void *, unsigned long long, unsigned long long);
    void (*free)(void *, ssize_t, int, void *);
    void (*begin)(int, unsigned long long, unsigned long long, void *);
    void (*end)(int, unsigned long long, unsigned long long);
    void (*release)(int, unsigned long long, unsigned long long);
    void (*retain)(int, unsigned long long, unsigned long long);
    int (*uses)(int, unsigned long long, unsigned long long);
    int (*oom_message)(int, size_t, char *, size_t);
};

CApi c_api;
std::once_flag c_once;

template <typename T> void sym(void *h, const char *name, T &out)
{
    out = reinterpret_cast<T>(h ? dlsym(h, name) : dlsym(RTLD_DEFAULT, name));
}

/* libmemshim.so is preloaded or was loaded by the Python side before this library; failing
 * that, the copy beside this file (dlopen finds an already loaded file by identity). */
void resolve()
{
    void *h = nullptr;
    if (!dlsym(RTLD_DEFAULT, "memshim_torch_alloc")) {
        Dl_info di;
        if (dladdr(reinterpret_cast<void *>(&resolve), &di) && di.dli_fname) {
            std::string p(di.dli_fname);
            auto slash = p.rfind('/');
            p = (slash == std::string::npos ? std::string(".") : p.substr(0, slash)) + "/libmemshim.so";
            h = dlopen(p.c_str(), RTLD_NOW | RTLD_GLOBAL);
        }
    }
    sym(h, "memshim_torch_alloc", c_api.alloc);
    sym(h, "memshim_torch_alloc_in_pool", c_api.alloc_in_pool);
    sym(h, "memshim_torch_free", c_api.free);
    sym(h, "memshim_torch_begin_allocate_to_pool", c_api.begin);
    sym(h, "memshim_torch_end_allocate_to_pool", c_api.end);
    sym(h, "memshim_torch_release_pool", c_api.release);
    sym(h, "memshim_torch_retain_pool", c_api.retain);
    sym(h, "memshim_torch_pool_uses", c_api.uses);
    sym(h, "memshim_torch_oom_message", c_api.oom_message);
}

const CApi &api()
{
    std::call_once(c_once, resolve);
    return c_api;
}

/* Pools being captured into, newest last: (device, id, the filter PyTorch gave). */
struct Active {
    int device;
    MempoolId id;
    Filter filter;
};
std::mutex active_lock;
std::vector<Active> active;
std::atomic<int> nactive{0};

} // namespace

GLUE_EXPORT const char *memshim_glue_torch_version(void)
{
    return MSH_TORCH_VERSION; /* the PyTorch this glue was built against (Makefile) */
}

GLUE_EXPORT int memshim_glue_ready(void)
{
    const CApi &a = api();
    return a.alloc && a.alloc_in_pool && a.free && a.begin && a.end && a.release && a.retain && a.uses &&
           a.oom_message;
}

GLUE_EXPORT void *memshim_glue_malloc(ssize_t size, int device, cudaStream_t stream)
{
    const CApi &a = api();
    if (!a.alloc) TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. memshim: libmemshim.so is not loaded");
    bool in_pool = false;
    MempoolId id{0, 0};
    if (nactive.load(std::memory_order_acquire)) {
        /* PyTorch's order (CUDACachingAllocator.cpp, get_pool): the pools in the order they were
         * begun, the first whose filter claims the stream */
        std::lock_guard<std::mutex> g(active_lock);
        for (auto it = active.begin(); it != active.end(); ++it) {
            if (it->device == device && (!it->filter || it->filter(stream))) {
                in_pool = true;
                id = it->id;
                break;
            }
        }
    }
    void *p = in_pool ? a.alloc_in_pool(size, device, stream, id.first, id.second) : a.alloc(size, device, stream);
    if (!p && size > 0) { /* size 0 is NULL, as PyTorch's own allocator answers it */
        char msg[2048];
        a.oom_message(device, size > 0 ? static_cast<size_t>(size) : 0, msg, sizeof msg);
        TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
    }
    return p;
}

GLUE_EXPORT void memshim_glue_free(void *ptr, ssize_t size, int device, cudaStream_t stream)
{
    const CApi &a = api();
    if (a.free) a.free(ptr, size, device, stream);
}

GLUE_EXPORT void memshim_glue_begin_allocate_to_pool(int device, MempoolId id, Filter filter)
{
    const CApi &a = api();
    if (!a.begin) return;
    a.begin(device, id.first, id.second, nullptr);
    std::lock_guard<std::mutex> g(active_lock);
    active.push_back(Active{device, id, std::move(filter)});
    nactive.store(static_cast<int>(active.size()), std::memory_order_release);
}

/* end: the newest begin of that pool is over (PyTorch's endAllocateToPool erases one entry of
 * captures_underway). A release never ends a capture: another graph may be capturing into the same
 * pool right now (shared pools), and its allocations must keep going there. Only when the pool's
 * last use is gone can no capture route into it: entries left then are stale (a capture abandoned
 * without end by an older PyTorch) and are dropped, so their filters are never called again. */
static void drop_active(int device, MempoolId id, bool all)
{
    std::lock_guard<std::mutex> g(active_lock);
    for (auto it = active.end(); it != active.begin();) {
        --it;
        if (it->device != device || it->id != id) continue;
        it = active.erase(it);
        if (!all) break;
    }
    nactive.store(static_cast<int>(active.size()), std::memory_order_release);
}

GLUE_EXPORT void memshim_glue_end_allocate_to_pool(int device, MempoolId id)
{
    drop_active(device, id, false);
    const CApi &a = api();
    if (a.end) a.end(device, id.first, id.second);
}

GLUE_EXPORT void memshim_glue_release_pool(int device, MempoolId id)
{
    const CApi &a = api();
    if (a.release) a.release(device, id.first, id.second);
    if (a.uses && a.uses(device, id.first, id.second) == 0) drop_active(device, id, true);
}

/* createOrIncrefPool (newer PyTorch, when a graph retains a pool): a use without a capture. */
GLUE_EXPORT void memshim_glue_retain_pool(int device, MempoolId id)
{
    const CApi &a = api();
    if (a.retain) a.retain(device, id.first, id.second);
}

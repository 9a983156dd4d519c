/*
 * report_feed.c: what the shim hands a report besides the pools' figures (core.c's fill_report
 * gathers those): memshim's, the CUDA driver's and the runtime's versions and each device's name,
 * PyTorch's version and the memory_stats() figures the Python side handed over (shim/torch.c), and
 * the allocation sites (shim/sites.c). report/report.c then formats and writes what it was given;
 * it reads nothing of the shim's and never calls back.
 *
 * Called just before each report is written, as report.c once read these itself while writing,
 * and never with a pool lock held: the driver may take its own locks.
 */
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "cuda_real.h"
#include "drvlog.h"
#include "memshim.h"
#include "msh.h"
#include "report.h"
#include "sites.h"
#include "torch.h"

static pthread_mutex_t ver_lock = PTHREAD_MUTEX_INITIALIZER;
static char driver_version[16], runtime_version[16];
static bool versions_read;
static char device_names[MSH_MAX_DEVICES][128];

static void cuda_version_text(int v, char *out, size_t len)
{
    snprintf(out, len, "%d.%d", v / 1000, (v % 1000) / 10);
}

/* The libcudart the process loaded (PyTorch's own copy, or the program's); never memshim's. */
static int find_cudart(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    const char *base = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    base = base ? base + 1 : info->dlpi_name;
    if (base && !strncmp(base, "libcudart.so", 12)) {
        snprintf(arg, PATH_MAX, "%s", info->dlpi_name);
        return 1;
    }
    return 0;
}

/* Driver and runtime versions once; the device's name when first asked. */
static void read_versions(int device)
{
    pthread_mutex_lock(&ver_lock);
    if (!versions_read) {
        versions_read = true;
        int v = 0;
        if (msh_cu.cuDriverGetVersion && MSH_DRV(cuDriverGetVersion, &v) == CUDA_SUCCESS && v > 0)
            cuda_version_text(v, driver_version, sizeof driver_version);
        char path[PATH_MAX] = "";
        if (dl_iterate_phdr(find_cudart, path) && path[0]) {
            void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
            int (*rtv)(int *) = h ? (int (*)(int *))dlsym(h, "cudaRuntimeGetVersion") : NULL;
            v = 0;
            if (rtv && rtv(&v) == 0 && v > 0) cuda_version_text(v, runtime_version, sizeof runtime_version);
            if (h) dlclose(h);
        }
    }
    if (device >= 0 && device < MSH_MAX_DEVICES && !device_names[device][0] && msh_cu.cuDeviceGet &&
        msh_cu.cuDeviceGetName) {
        CUdevice dev;
        char name[128];
        if (MSH_DRV(cuDeviceGet, &dev, device) == CUDA_SUCCESS &&
            MSH_DRV(cuDeviceGetName, name, (int)sizeof name, dev) == CUDA_SUCCESS) {
            name[sizeof name - 1] = 0;
            memcpy(device_names[device], name, sizeof name);
        }
    }
    pthread_mutex_unlock(&ver_lock);
}

void msh_report_feed(struct msh_report *r)
{
    for (int i = 0; i < r->ndev; i++) {
        struct msh_report_device *d = &r->dev[i];
        read_versions(d->device);
        pthread_mutex_lock(&ver_lock);
        if (d->device >= 0 && d->device < MSH_MAX_DEVICES)
            memcpy(d->device_name, device_names[d->device], sizeof d->device_name);
        pthread_mutex_unlock(&ver_lock);
        d->nsites = msh_sites_top(d->device, d->sites, MSH_REPORT_SITES);
        d->ngrowing = msh_sites_growing(d->device, d->growing, MSH_REPORT_SITES);
        d->nspilled_sites = 0;
        d->spilled_unattributed = 0;
        if (d->has_pool && d->st.spilled_bytes)
            d->nspilled_sites = msh_sites_spilled(msh_core_pool_get(d->device), d->spilled_sites, MSH_REPORT_SITES,
                                                  &d->spilled_unattributed);
        d->ntorch_stats = 0;
        while (d->ntorch_stats < MSH_REPORT_TORCH_STATS &&
               msh_torch_report_stat(d->device, d->ntorch_stats, &d->torch_stats[d->ntorch_stats].key,
                                     &d->torch_stats[d->ntorch_stats].val))
            d->ntorch_stats++;
    }
    pthread_mutex_lock(&ver_lock);
    memcpy(r->cuda_driver, driver_version, sizeof r->cuda_driver);
    memcpy(r->cuda_runtime, runtime_version, sizeof r->cuda_runtime);
    pthread_mutex_unlock(&ver_lock);
    r->memshim_version = MEMSHIM_VERSION;
    r->torch_version = msh_torch_version();
    r->sites_note = msh_sites_note();
    r->sites_sample_bytes = msh_sites_sample_bytes();
}

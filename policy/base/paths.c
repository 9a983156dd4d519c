/*
 * paths.c: the directory a job started in, and the file paths memshim's settings name
 * (MEMSHIM_REPORT_DIR, MEMSHIM_LOG_FILE, MEMSHIM_TRACE_FILE, MEMSHIM_SNAPSHOT) resolved against
 * it, so a script that changes directory (Hydra, many training scripts: os.chdir) keeps its
 * reports where the user asked for them.
 *
 * "The job" spans processes: torchrun ranks, multiprocessing `spawn` children and DataLoader
 * workers inherit the environment but may start in another directory (a parent that changed
 * directory before it spawned). So the first CPython process whose settings hold a relative path
 * exports the directory it started in as _MEMSHIM_START_DIR (not MEMSHIM_*: those names are
 * settings), and every memshim below it resolves against that. Shells and other programs export
 * nothing: a wrapper script that does `cd run1 && python train.py` gives train.py its own start
 * directory, as before. The value is read once per process (the first path resolved, or the
 * constructor), so a later change of the process's own environment does not move the reports.
 *
 * It must never fail the host: a directory that cannot be read (getcwd fails, a stale or relative
 * _MEMSHIM_START_DIR) leaves the path as given, relative to wherever the process is. It never
 * allocates after start-up and never calls CUDA or Python.
 */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "msh.h"

#define START_ENV "_MEMSHIM_START_DIR"

static pthread_once_t start_once = PTHREAD_ONCE_INIT;
static char start_dir[PATH_MAX];
static bool start_inherited; /* from _MEMSHIM_START_DIR (a parent process's start) */

static void find_start_dir(void)
{
    const char *e = getenv(START_ENV);
    if (e && e[0] == '/' && strlen(e) < sizeof start_dir) {
        strcpy(start_dir, e);
        start_inherited = true;
        return;
    }
    if (!getcwd(start_dir, sizeof start_dir) || start_dir[0] != '/') start_dir[0] = 0;
}

const char *msh_start_dir(void)
{
    pthread_once(&start_once, find_start_dir);
    return start_dir[0] ? start_dir : NULL;
}

int msh_resolve_path(const char *tmpl, char *out, size_t outlen)
{
    int rc = msh_expand_path(tmpl, out, outlen);
    if (rc || !out[0] || out[0] == '/') return rc;
    const char *dir = msh_start_dir();
    if (!dir) return 0; /* relative to wherever the process is: the best there is */
    size_t dl = strlen(dir), pl = strlen(out);
    const char *rel = out;
    while (rel[0] == '.' && rel[1] == '/') rel += 2, pl -= 2; /* "./x" is "x" */
    if (!strcmp(rel, ".")) pl = 0;
    bool slash = dl > 0 && dir[dl - 1] == '/';
    if (dl + !slash + pl + 1 > outlen) {
        out[0] = 0;
        return ENAMETOOLONG;
    }
    memmove(out + dl + !slash, rel, pl + 1);
    memcpy(out, dir, dl);
    if (!slash) out[dl] = '/';
    if (pl == 0 && !slash) out[dl] = 0; /* "." alone: the directory itself */
    return 0;
}

/* Whether one of the path settings is relative (then children need the start directory). */
static bool any_relative_path(void)
{
    const char *paths[] = {msh_cfg.report_dir, msh_cfg.log_file, msh_cfg.trace_file, msh_cfg.snapshot};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++)
        if (paths[i][0] && paths[i][0] != '/') return true;
    return false;
}

/* Before main: pin this process's start directory (before a script can chdir), and in a CPython
 * process that is about to start, hand it to the processes it will launch. The environment is
 * still the process's own (no thread runs yet), so setenv is safe here. */
__attribute__((constructor)) static void msh_paths_ctor(void)
{
    msh_start_dir();
    if (start_inherited || !start_dir[0]) return;
    if (!dlsym(RTLD_DEFAULT, "Py_BytesMain")) return; /* shells and other programs: untouched */
    int (*is_init)(void);
    *(void **)&is_init = dlsym(RTLD_DEFAULT, "Py_IsInitialized");
    if (is_init && is_init()) return; /* loaded into a running interpreter (ctypes) */
    msh_config_load();
    if (msh_cfg.mode == MSH_MODE_OFF || !any_relative_path()) return;
    setenv(START_ENV, start_dir, 0);
}

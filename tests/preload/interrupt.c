/*
 * interrupt.c: how a run a signal ends keeps its reports (issue 16, shim/watch.c), in a C program
 * under LD_PRELOAD=libmemshim.so. Each test runs this binary again as a child (`interrupt child
 * MODE`, exec'd: a forked child serves nothing) with its own MEMSHIM_REPORT_DIR; the child
 * allocates through cudaMalloc in a loop and says READY on a pipe; the parent sends the signal and
 * checks how the child ended and what it wrote: the epoch in progress (reason interrupted), the
 * summary (interrupted_by), the same end as without memshim; a handler the program installed is
 * run, not replaced; SIG_IGN stays ignored; a second signal ends it at once; a forked child of a
 * started memshim still dies of SIGTERM; MEMSHIM_CATCH_SIGNALS=0 installs nothing.
 */
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

static char self[4096];
static volatile sig_atomic_t handled;

static void own_handler(int sig)
{
    (void)sig;
    handled = 1;
}

/* ---- the child ------------------------------------------------------------------------------- */
static int child(const char *mode, int ready_fd)
{
    if (!strcmp(mode, "handler")) signal(SIGTERM, own_handler); /* before memshim starts */
    if (!strcmp(mode, "nohup")) signal(SIGHUP, SIG_IGN);
    void *keep = NULL;
    if (cudaMalloc(&keep, 8 << 20) != cudaSuccess) return 10; /* memshim starts here */
    if (!strcmp(mode, "fork")) {
        /* A started memshim forks (a DataLoader worker): the worker must die of SIGTERM. */
        pid_t w = fork();
        if (w == 0) {
            for (;;) pause();
        }
        char line[32];
        int n = snprintf(line, sizeof line, "WORKER %d\n", (int)w);
        if (write(ready_fd, line, (size_t)n) != n) return 11;
        int st;
        waitpid(w, &st, 0);
        return WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM ? 0 : 12;
    }
    if (!strcmp(mode, "api")) {
        /* What the Python hook does for an uncaught KeyboardInterrupt: the run is reported as
         * interrupted, then the process exits normally (memshim's exit handler runs after it). */
        int (*interrupted)(int) = (int (*)(int))dlsym(RTLD_DEFAULT, "memshim_run_interrupted");
        if (!interrupted || interrupted(SIGTERM) != 0) return 13;
        return 0;
    }
    for (long i = 0;; i++) {
        void *p = NULL;
        if (cudaMalloc(&p, 1 << 20) == cudaSuccess) cudaFree(p);
        if (i == 20 && write(ready_fd, "READY\n", 6) != 6) return 11;
        if (handled) return 3; /* the program's own handler decided: exit 3 */
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* ---- the parent ------------------------------------------------------------------------------- */
struct run {
    pid_t pid;
    int fd;
    char dir[256];
};

static int start(struct run *r, const char *mode, const char *extra_env)
{
    snprintf(r->dir, sizeof r->dir, "/tmp/msh-interrupt-XXXXXX");
    if (!mkdtemp(r->dir)) return -1;
    int p[2];
    if (pipe(p)) return -1;
    r->pid = fork();
    if (r->pid == 0) {
        close(p[0]);
        char fd[16];
        snprintf(fd, sizeof fd, "%d", p[1]);
        setenv("MEMSHIM_REPORT_DIR", r->dir, 1);
        if (extra_env) putenv((char *)extra_env);
        execl(self, self, "child", mode, fd, (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    r->fd = p[0];
    return 0;
}

/* The child's first line on the pipe ("READY", "WORKER pid"), within 30 s. */
static int ready(struct run *r, char *line, size_t len)
{
    size_t n = 0;
    time_t end = time(NULL) + 30;
    while (n + 1 < len && time(NULL) < end) {
        ssize_t k = read(r->fd, line + n, 1);
        if (k <= 0) break;
        if (line[n++] == '\n') break;
    }
    line[n] = 0;
    return n > 0 ? 0 : -1;
}

static int finish(struct run *r)
{
    int st = 0;
    for (int i = 0; i < 3000; i++) { /* 30 s */
        if (waitpid(r->pid, &st, WNOHANG) == r->pid) return st;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    kill(r->pid, SIGKILL);
    waitpid(r->pid, &st, 0);
    return st;
}

/* The reports of the run: how many of each, and whether they all say interrupted by `sig`. */
static void look(struct run *r, int *epochs, int *summaries, int *interrupted, const char *sig)
{
    *epochs = *summaries = *interrupted = 0;
    DIR *d = opendir(r->dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strstr(e->d_name, ".json") || strstr(e->d_name, ".tmp")) continue;
        char path[600], buf[1 << 16];
        snprintf(path, sizeof path, "%s/%s", r->dir, e->d_name);
        int fd = open(path, O_RDONLY);
        ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
        if (fd >= 0) close(fd);
        buf[n > 0 ? n : 0] = 0;
        char want[64];
        snprintf(want, sizeof want, "\"interrupted_by\":\"%s\"", sig);
        bool intr = strstr(buf, "\"reason\":\"interrupted\"") && strstr(buf, want);
        if (strstr(e->d_name, "-epoch")) *epochs += 1;
        if (strstr(e->d_name, "-summary")) *summaries += 1;
        *interrupted += intr;
        unlink(path);
    }
    closedir(d);
    rmdir(r->dir);
}

static void ends_by(const char *mode, int sig, const char *name)
{
    struct run r;
    char line[64];
    REQUIRE(start(&r, mode, NULL) == 0);
    REQUIRE(ready(&r, line, sizeof line) == 0);
    kill(r.pid, sig);
    int st = finish(&r);
    CHECKF(WIFSIGNALED(st) && WTERMSIG(st) == sig, "status 0x%x", st);
    int ep, su, in;
    look(&r, &ep, &su, &in, name);
    CHECKF(ep == 1 && su == 1 && in == 2, "%d epoch, %d summary, %d saying interrupted by %s", ep, su, in, name);
}

TEST(sigterm_writes_the_open_epoch_and_the_summary_then_ends_by_sigterm)
{
    ends_by("loop", SIGTERM, "SIGTERM");
}

TEST(sigint_in_a_c_program_the_same)
{
    ends_by("loop", SIGINT, "SIGINT");
}

TEST(sighup_the_same)
{
    ends_by("loop", SIGHUP, "SIGHUP");
}

TEST(a_handler_the_program_installed_runs_and_decides)
{
    struct run r;
    char line[64];
    REQUIRE(start(&r, "handler", NULL) == 0);
    REQUIRE(ready(&r, line, sizeof line) == 0);
    kill(r.pid, SIGTERM);
    int st = finish(&r);
    CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 3, "status 0x%x (the program's handler exits 3)", st);
    int ep, su, in;
    look(&r, &ep, &su, &in, "SIGTERM");
    CHECKF(su == 1 && in == ep + su, "%d epoch, %d summary, %d interrupted", ep, su, in);
}

TEST(an_interrupted_run_is_not_reported_again_at_exit)
{
    /* memshim_run_interrupted wrote the summary; the exit handler that follows must leave it (a
     * second writer would replace it with reason exit and no interrupted_by) */
    struct run r;
    REQUIRE(start(&r, "api", NULL) == 0);
    int st = finish(&r);
    CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
    int ep, su, in;
    look(&r, &ep, &su, &in, "SIGTERM");
    CHECKF(ep == 1 && su == 1 && in == 2, "%d epoch, %d summary, %d saying interrupted by SIGTERM", ep, su, in);
}

TEST(an_ignored_signal_stays_ignored)
{
    struct run r;
    char line[64];
    REQUIRE(start(&r, "nohup", NULL) == 0);
    REQUIRE(ready(&r, line, sizeof line) == 0);
    kill(r.pid, SIGHUP);
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, NULL);
    int st = 0;
    CHECK(waitpid(r.pid, &st, WNOHANG) == 0); /* still running */
    kill(r.pid, SIGKILL);
    waitpid(r.pid, &st, 0);
    int ep, su, in;
    look(&r, &ep, &su, &in, "SIGHUP");
    CHECKF(su == 0 && in == 0, "%d summary, %d interrupted", su, in);
}

TEST(a_second_signal_ends_the_process_at_once)
{
    struct run r;
    char line[64];
    REQUIRE(start(&r, "loop", NULL) == 0);
    REQUIRE(ready(&r, line, sizeof line) == 0);
    kill(r.pid, SIGTERM);
    kill(r.pid, SIGTERM);
    int st = finish(&r);
    CHECKF(WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM, "status 0x%x", st);
    int ep, su, in;
    look(&r, &ep, &su, &in, "SIGTERM");
}

TEST(a_forked_child_of_a_started_memshim_dies_of_sigterm)
{
    struct run r;
    char line[64];
    REQUIRE(start(&r, "fork", NULL) == 0);
    REQUIRE(ready(&r, line, sizeof line) == 0);
    int w = 0;
    REQUIRE(sscanf(line, "WORKER %d", &w) == 1 && w > 0);
    kill(w, SIGTERM);
    int st = finish(&r);
    CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x (12: the worker did not die of SIGTERM)", st);
    int ep, su, in;
    look(&r, &ep, &su, &in, "SIGTERM");
}

TEST(catch_signals_off_installs_nothing)
{
    struct run r;
    char line[64];
    REQUIRE(start(&r, "loop", "MEMSHIM_CATCH_SIGNALS=0") == 0);
    REQUIRE(ready(&r, line, sizeof line) == 0);
    kill(r.pid, SIGTERM);
    int st = finish(&r);
    CHECKF(WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM, "status 0x%x", st);
    int ep, su, in;
    look(&r, &ep, &su, &in, "SIGTERM");
    CHECKF(ep == 0 && su == 0, "%d epoch, %d summary: the default action, as without memshim", ep, su);
}

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "child")) return child(argv[2], atoi(argv[3]));
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 2;
    self[n] = 0;
    return th_main(__FILE__, argc, argv);
}

/*
 * openspy.c: libreli-openspy.so, preloaded BEFORE libmemshim.so by tests/reliability/files.py.
 * It interposes open, open64, openat, mkdir and rename, passes each call to the kernel with a raw
 * system call, and for every path that starts with $OPENSPY_PREFIX appends one line to
 * $OPENSPY_LOG:  "open FLAGS MODE RESULT PATH", "mkdir - MODE RESULT PATH" or
 * "rename - - RESULT OLD -> NEW" (FLAGS and MODE in octal, RESULT the fd or -errno). The suite
 * then checks the flags and modes memshim used. It never allocates and never calls stdio.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static int spy_fd = -2;
static const char *spy_prefix;

static void spy_init(void)
{
    if (spy_fd != -2) return;
    const char *log = getenv("OPENSPY_LOG");
    spy_prefix = getenv("OPENSPY_PREFIX");
    spy_fd = log ? (int)syscall(SYS_openat, AT_FDCWD, log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600) : -1;
}

static char *put(char *p, const char *s)
{
    while (*s) *p++ = *s++;
    return p;
}

static char *put_num(char *p, long v, int base)
{
    char tmp[32];
    int n = 0, neg = v < 0;
    unsigned long u = neg ? (unsigned long)-v : (unsigned long)v;
    do tmp[n++] = (char)('0' + u % (unsigned)base); while ((u /= (unsigned)base) && n < 31);
    if (neg) *p++ = '-';
    while (n) *p++ = tmp[--n];
    return p;
}

static void spy(const char *what, long flags, long mode, long rc, const char *path, const char *path2)
{
    spy_init();
    if (spy_fd < 0 || !spy_prefix || !path || strncmp(path, spy_prefix, strlen(spy_prefix)) != 0) return;
    char line[8400], *p = line;
    if (strlen(path) > 4000 || (path2 && strlen(path2) > 4000)) return;
    p = put(p, what);
    *p++ = ' ';
    p = flags < 0 ? put(p, "-") : put_num(p, flags, 8);
    *p++ = ' ';
    p = mode < 0 ? put(p, "-") : put_num(p, mode, 8);
    *p++ = ' ';
    p = put_num(p, rc, 10);
    *p++ = ' ';
    p = put(p, path);
    if (path2) p = put(put(p, " -> "), path2);
    *p++ = '\n';
    ssize_t w = syscall(SYS_write, spy_fd, line, (size_t)(p - line));
    (void)w;
}

#define MODE_ARG(flags, mode)                                   \
    mode_t mode = 0;                                            \
    if ((flags) & (O_CREAT | O_TMPFILE)) {                      \
        va_list ap;                                             \
        va_start(ap, flags);                                    \
        mode = (mode_t)va_arg(ap, int);                         \
        va_end(ap);                                             \
    }

int open(const char *path, int flags, ...)
{
    MODE_ARG(flags, mode);
    long r = syscall(SYS_openat, AT_FDCWD, path, flags, mode);
    int e = errno;
    spy("open", flags, (flags & O_CREAT) ? (long)mode : -1, r < 0 ? -e : r, path, NULL);
    errno = e;
    return (int)r;
}

int open64(const char *path, int flags, ...)
{
    MODE_ARG(flags, mode);
    long r = syscall(SYS_openat, AT_FDCWD, path, flags, mode);
    int e = errno;
    spy("open", flags, (flags & O_CREAT) ? (long)mode : -1, r < 0 ? -e : r, path, NULL);
    errno = e;
    return (int)r;
}

int openat(int dirfd, const char *path, int flags, ...)
{
    MODE_ARG(flags, mode);
    long r = syscall(SYS_openat, dirfd, path, flags, mode);
    int e = errno;
    spy("open", flags, (flags & O_CREAT) ? (long)mode : -1, r < 0 ? -e : r, path, NULL);
    errno = e;
    return (int)r;
}

int mkdir(const char *path, mode_t mode)
{
    long r = syscall(SYS_mkdirat, AT_FDCWD, path, mode);
    int e = errno;
    spy("mkdir", -1, (long)mode, r < 0 ? -e : r, path, NULL);
    errno = e;
    return (int)r;
}

int rename(const char *a, const char *b)
{
    long r = syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, 0);
    int e = errno;
    spy("rename", -1, -1, r < 0 ? -e : r, a, b);
    errno = e;
    return (int)r;
}

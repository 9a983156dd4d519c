/*
 * log.c: memshim's diagnostics ("memshim[PID]: warning: ...") and the monotonic clock.
 *
 * Every line is formatted into a stack buffer and leaves with a single write(2), so lines from
 * concurrent threads never interleave and logging works from any hook path. This file must never
 * call malloc, never use a stdio FILE for output, never take a lock on the write path and never
 * change errno as seen by the caller. Lines longer than MSH_LOG_LINE_MAX are cut at a UTF-8
 * character boundary and end in "..."; every line ends in exactly one newline, and control
 * characters inside a message (a newline in a user's value, say) become '?' so one call is one
 * line. After MSH_LOG_WARN_CAP warnings one line says that further warnings are suppressed.
 *
 * MEMSHIM_LOG_FILE is opened O_APPEND|O_CLOEXEC|O_NOFOLLOW (a symlink planted at the name is
 * refused, the descriptor never leaks into an exec'ed child), mode 0644 before the umask, and
 * O_NONBLOCK so that a FIFO without a reader cannot hang the job's start. It must then be a
 * regular file with a single link (a hard link planted at the name is refused), a FIFO or a
 * character device. If a write to it fails (disk full, /dev/full), the log falls back to stderr
 * with one warning; the job never stops because of its log.
 */
#include "msh.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int msh_log_level = MSH_LOG_WARN;

/* Where lines go. Read with a relaxed atomic load on every line; changed only under log_mu. */
static int log_fd = STDERR_FILENO;
static bool log_fd_owned;          /* opened by msh_log_open (so it may be replaced in place) */
static char log_opened_path[4096]; /* expanded path of the open log file, "" when none */
static char log_failed_path[4096]; /* the last path that could not be opened: warned once */
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long warn_count;

static const char *const level_names[] = {"error", "warning", "info", "debug"};

/* 0, or the errno of a failed write (EIO for a write of 0 bytes). */
static int write_all(int fd, const char *buf, size_t len)
{
    size_t off = 0;
    while (off < len) {
        ssize_t w = write(fd, buf + off, len - off);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return errno;
        if (w == 0) return EIO;
        off += (size_t)w;
    }
    return 0;
}

/* Write one line to the log. When MEMSHIM_LOG_FILE (an fd memshim opened) fails, switch to
 * stderr: the thread that makes the switch says so once, then every line goes to stderr. The
 * failed descriptor is left open, so a thread still writing to it never hits a reused number. */
static void log_line(const char *buf, size_t len)
{
    int fd = __atomic_load_n(&log_fd, __ATOMIC_ACQUIRE);
    int err = write_all(fd, buf, len);
    if (!err || err == EAGAIN || fd == STDERR_FILENO || !__atomic_load_n(&log_fd_owned, __ATOMIC_ACQUIRE))
        return; /* stderr itself failing: nowhere to report it; drop the line */
    int expected = fd;
    if (__atomic_compare_exchange_n(&log_fd, &expected, STDERR_FILENO, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
        char msg[256];
        int k = snprintf(msg, sizeof msg,
                         "memshim[%d]: warning: cannot write MEMSHIM_LOG_FILE '%.120s' (%s); logging to "
                         "stderr from now on\n",
                         (int)getpid(), log_opened_path, strerror(err));
        if (k > 0) write_all(STDERR_FILENO, msg, (size_t)k < sizeof msg ? (size_t)k : sizeof msg - 1);
    }
    write_all(STDERR_FILENO, buf, len);
}

/* Where to cut buf (holding more than `n` bytes) so no UTF-8 sequence is split: back up over
 * continuation bytes to the lead byte of the character that straddles the cut. */
static size_t utf8_boundary(const char *buf, size_t n)
{
    while (n > 0 && ((unsigned char)buf[n] & 0xC0) == 0x80) n--;
    return n;
}

void msh_vlog(int level, const char *fmt, va_list ap)
{
    int saved_errno = errno;
    if (level < MSH_LOG_ERROR) level = MSH_LOG_ERROR;
    if (level > MSH_LOG_DEBUG) level = MSH_LOG_DEBUG;
    if (level > __atomic_load_n(&msh_log_level, __ATOMIC_RELAXED)) return;

    char line[MSH_LOG_LINE_MAX];
    const size_t cap = sizeof line - 1; /* room for the newline */
    int pid = (int)getpid();
    if (level == MSH_LOG_WARN) {
        unsigned long n = __atomic_add_fetch(&warn_count, 1, __ATOMIC_RELAXED);
        if (n > MSH_LOG_WARN_CAP) {
            if (n == MSH_LOG_WARN_CAP + 1) {
                int k = snprintf(line, sizeof line,
                                 "memshim[%d]: warning: more than %d warnings; further warnings "
                                 "are suppressed\n",
                                 pid, MSH_LOG_WARN_CAP);
                if (k > 0) log_line(line, (size_t)k < sizeof line ? (size_t)k : sizeof line - 1);
            }
            errno = saved_errno;
            return;
        }
    }

    int p = snprintf(line, sizeof line, "memshim[%d]: %s: ", pid, level_names[level]);
    if (p < 0) p = 0;
    size_t len = (size_t)p;
    errno = saved_errno; /* so that %m names the caller's error */
    int m = vsnprintf(line + len, sizeof line - len, fmt, ap);
    if (m < 0) m = 0;
    if (len + (size_t)m > cap) {
        /* Truncated: keep whole characters and mark the cut. */
        len = utf8_boundary(line, cap - 3);
        memcpy(line + len, "...", 3);
        len += 3;
    } else {
        len += (size_t)m;
    }
    while (len > (size_t)p && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
    for (size_t i = (size_t)p; i < len; i++)
        if ((unsigned char)line[i] < 0x20 || line[i] == 0x7f) line[i] = '?';
    line[len++] = '\n';
    log_line(line, len);
    errno = saved_errno;
}

void msh_log(int level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    msh_vlog(level, fmt, ap);
    va_end(ap);
}

int msh_expand_path(const char *tmpl, char *out, size_t outlen)
{
    if (!tmpl || !out || outlen == 0) return EINVAL;
    size_t o = 0;
    char piece[300];
    for (const char *s = tmpl; *s; s++) {
        const char *add = piece;
        size_t addlen;
        if (s[0] == '%' && s[1] == 'p') {
            addlen = (size_t)snprintf(piece, sizeof piece, "%d", (int)getpid());
            s++;
        } else if (s[0] == '%' && s[1] == 'h') {
            if (gethostname(piece, 256) != 0) strcpy(piece, "unknown-host");
            piece[255] = '\0';
            addlen = strlen(piece);
            s++;
        } else if (s[0] == '%' && s[1] == '%') {
            add = "%";
            addlen = 1;
            s++;
        } else {
            add = s; /* any other character, including a lone '%', is copied as is */
            addlen = 1;
        }
        if (o + addlen >= outlen) {
            out[0] = '\0';
            return ENAMETOOLONG;
        }
        memcpy(out + o, add, addlen);
        o += addlen;
    }
    out[o] = '\0';
    return 0;
}

void msh_log_open(const char *path_template)
{
    if (!path_template || !path_template[0]) return;
    int saved_errno = errno;
    char path[sizeof log_opened_path];
    if (msh_resolve_path(path_template, path, sizeof path) != 0) {
        msh_warn("MEMSHIM_LOG_FILE='%.200s' is too long once %%p and %%h are expanded; "
                 "logging to stderr",
                 path_template);
        errno = saved_errno;
        return;
    }
    pthread_mutex_lock(&log_mu);
    if (log_fd_owned && strcmp(path, log_opened_path) == 0) {
        /* Already open (the configuration and the core may both ask): not again. */
        pthread_mutex_unlock(&log_mu);
        errno = saved_errno;
        return;
    }
    if (strcmp(path, log_failed_path) == 0) {
        pthread_mutex_unlock(&log_mu);
        errno = saved_errno;
        return;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
    const char *refused = NULL;
    if (fd >= 0) {
        struct stat sb;
        if (fstat(fd, &sb) != 0) refused = "cannot be examined";
        else if (S_ISREG(sb.st_mode) && sb.st_nlink != 1) refused = "is a file with several links";
        else if (!S_ISREG(sb.st_mode) && !S_ISFIFO(sb.st_mode) && !S_ISCHR(sb.st_mode))
            refused = "is not a file, a FIFO or a character device";
        int fl = fcntl(fd, F_GETFL);
        if (!refused && (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)) refused = "cannot be made blocking";
        if (refused) {
            close(fd);
            fd = -1;
        }
    }
    if (fd < 0) {
        int open_errno = errno;
        snprintf(log_failed_path, sizeof log_failed_path, "%s", path);
        pthread_mutex_unlock(&log_mu);
        errno = open_errno;
        if (refused)
            msh_warn("refusing MEMSHIM_LOG_FILE '%.300s': it %s; logging to stderr", path, refused);
        else if (errno == ELOOP)
            msh_warn("refusing MEMSHIM_LOG_FILE '%.300s': it is a symbolic link; logging to stderr", path);
        else
            msh_warn("cannot open MEMSHIM_LOG_FILE '%.300s': %m; logging to stderr", path);
        errno = saved_errno;
        return;
    }
    snprintf(log_opened_path, sizeof log_opened_path, "%s", path);
    int cur = __atomic_load_n(&log_fd, __ATOMIC_ACQUIRE);
    if (log_fd_owned && cur != STDERR_FILENO) {
        /* Replace our previous file in place: a thread writing concurrently sees either file,
         * never a closed or reused descriptor. (After a write failure the log is back on
         * stderr, which must never be replaced.) */
        if (dup3(fd, cur, O_CLOEXEC) >= 0) {
            close(fd);
        } else {
            __atomic_store_n(&log_fd, fd, __ATOMIC_RELEASE); /* the old one leaks; harmless */
        }
    } else {
        __atomic_store_n(&log_fd, fd, __ATOMIC_RELEASE);
        __atomic_store_n(&log_fd_owned, true, __ATOMIC_RELEASE);
    }
    log_failed_path[0] = '\0';
    pthread_mutex_unlock(&log_mu);
    errno = saved_errno;
}

void msh_log_set_fd(int fd)
{
    pthread_mutex_lock(&log_mu);
    __atomic_store_n(&log_fd, fd < 0 ? STDERR_FILENO : fd, __ATOMIC_RELEASE);
    /* the caller owns it; msh_log_open will not replace it in place */
    __atomic_store_n(&log_fd_owned, false, __ATOMIC_RELEASE);
    log_opened_path[0] = '\0';
    log_failed_path[0] = '\0';
    pthread_mutex_unlock(&log_mu);
}

void msh_log_reset_warn_count(void)
{
    __atomic_store_n(&warn_count, 0, __ATOMIC_RELAXED);
}

uint64_t msh_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

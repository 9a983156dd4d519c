/*
 * hostname_double.c: libhostname-double.so, for tests/report_tool/test_launchers.py. Preloaded in
 * front of libmemshim.so, it answers gethostname() with $MSH_TEST_HOSTNAME, so the processes of one
 * multi-node job can run on this one machine and still write reports as the nodes they stand for
 * would (memshim-nodeA-pid..., "host": "nodeA"). Without the variable it is the real gethostname.
 * It must never change anything else a process sees.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int gethostname(char *name, size_t len)
{
    const char *fake = getenv("MSH_TEST_HOSTNAME");
    if (!fake) {
        int (*real)(char *, size_t);
        *(void **)&real = dlsym(RTLD_NEXT, "gethostname");
        if (!real) {
            errno = ENOSYS;
            return -1;
        }
        return real(name, len);
    }
    size_t n = strlen(fake);
    if (n + 1 > len) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(name, fake, n + 1);
    return 0;
}

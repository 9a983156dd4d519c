/*
 * hide_jansson.c: an rtld-audit module (LD_AUDIT, man 7 rtld-audit) that makes libjansson
 * unreachable to every library of the process it is loaded into: ld.so asks la_objsearch for each
 * name and each path it would try, and a NULL answer skips that candidate, so dlopen of
 * libjansson.so.4 (by name or by path) fails as on a machine without the package. Test-only
 * (tests/package/test_package.py): it changes nothing else and searches nothing itself.
 */
#define _GNU_SOURCE
#include <link.h>
#include <stdint.h>
#include <string.h>

unsigned int la_version(unsigned int version)
{
    return version < LAV_CURRENT ? version : LAV_CURRENT;
}

char *la_objsearch(const char *name, uintptr_t *cookie, unsigned int flag)
{
    (void)cookie;
    (void)flag;
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    return strncmp(base, "libjansson", 10) == 0 ? NULL : (char *)name;
}

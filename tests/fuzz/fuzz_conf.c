/*
 * fuzz_conf.c: libFuzzer target for the combined MEMSHIM_CONF string (policy/base/options.c). The
 * input, up to its first NUL, is MEMSHIM_CONF; when it starts with a byte 0xF0 or above, the
 * next byte picks one MEMSHIM_* variable that is also set (to "1"), to exercise precedence.
 * After msh_config_load_from: the invariants of options_checks.h, and a second fixed point: the
 * effective values written as one MEMSHIM_CONF ("key:value,...", keys in lower case) read back
 * to the same values (values with a comma cannot be written in MEMSHIM_CONF and are left out).
 * Build and run: tests/fuzz/run_fuzz.sh fuzz_conf (sources: this file, policy/base/options.c,
 * policy/base/log.c). It must keep no state between inputs.
 */
#include <ctype.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "msh.h"
#include "options_checks.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_conf_fixed_point(void)
{
    static struct oc_snapshot before, after;
    static char conf[sizeof "MEMSHIM_CONF=" + 8192];
    oc_take(&before);
    size_t o = (size_t)snprintf(conf, sizeof conf, "MEMSHIM_CONF=");
    int entries = 0;
    for (int i = 0; i < before.n; i++) {
        const char *name, *src;
        char v[8];
        msh_config_iter(i, &name, v, sizeof v, &src);
        if (strcmp(name, "MEMSHIM_CONF") == 0 || strchr(before.val[i], ',')) continue;
        if (!before.val[i][0] || isspace((unsigned char)before.val[i][0])) continue; /* "" is the default */
        char key[64];
        size_t k = 0;
        for (const char *p = name + 8; *p && k + 1 < sizeof key; p++) key[k++] = (char)tolower((unsigned char)*p);
        key[k] = '\0';
        int w = snprintf(conf + o, sizeof conf - o, "%s%s:%s", entries ? "," : "", key, before.val[i]);
        if (w < 0 || (size_t)w >= sizeof conf - o) return; /* too long for MEMSHIM_CONF: nothing to compare */
        o += (size_t)w;
        entries++;
    }
    char *envp[] = {conf, NULL};
    oc_log_reset();
    msh_config_load_from(envp);
    oc_check_ranges();
    oc_check_log();
    oc_take(&after);
    for (int i = 0; i < before.n; i++) {
        const char *name, *src;
        char v[8];
        msh_config_iter(i, &name, v, sizeof v, &src);
        if (strcmp(name, "MEMSHIM_CONF") == 0 || strchr(before.val[i], ',')) continue;
        if (!before.val[i][0] || isspace((unsigned char)before.val[i][0])) continue;
        if (oc_exponent_form(before.val[i])) continue; /* known issue, see options_checks.h */
        if (strcmp(before.val[i], after.val[i]) != 0) {
            fprintf(stderr, "MEMSHIM_CONF fixed point broken: %s printed '%s', read back it prints '%s'\n", name,
                    before.val[i], after.val[i]);
            abort();
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    oc_setup();
    static char conf[sizeof "MEMSHIM_CONF=" + 16384];
    static char extra[128];
    char *envp[3];
    int n = 0;
    size_t skip = 0;
    if (size >= 2 && data[0] >= 0xF0) {
        const char *name, *src;
        char v[8];
        int count = 0;
        while (msh_config_iter(count, &name, v, sizeof v, &src)) count++;
        msh_config_iter(data[1] % count, &name, v, sizeof v, &src);
        snprintf(extra, sizeof extra, "%s=1", name);
        envp[n++] = extra;
        skip = 2;
    }
    size_t len = size - skip;
    const uint8_t *nul = memchr(data + skip, 0, len);
    if (nul) len = (size_t)(nul - (data + skip));
    if (len > sizeof conf - sizeof "MEMSHIM_CONF=") len = sizeof conf - sizeof "MEMSHIM_CONF=";
    memcpy(conf, "MEMSHIM_CONF=", sizeof "MEMSHIM_CONF=" - 1);
    memcpy(conf + sizeof "MEMSHIM_CONF=" - 1, data + skip, len);
    conf[sizeof "MEMSHIM_CONF=" - 1 + len] = '\0';
    envp[n++] = conf;
    envp[n] = NULL;

    oc_log_reset();
    msh_config_load_from(envp);
    oc_check_ranges();
    oc_check_log();
    oc_check_fixed_point();
    check_conf_fixed_point();
    return 0;
}

/*
 * fuzz_options.c: libFuzzer target for memshim's option parser (policy/base/options.c): the input is a
 * list of environment entries, one per line. A line whose first byte is below 0x80 sets option
 * (byte % number of options) to the rest of the line; other lines are taken whole as
 * "MEMSHIM_<rest>" (unknown names, names with '=' inside, ...). The list goes through
 * msh_config_load_from, every value also through each public parser, then the invariants of
 * options_checks.h. Build and run: tests/fuzz/run_fuzz.sh fuzz_options (sources: this file,
 * policy/base/options.c, policy/base/log.c, policy/base/paths.c). It must keep no state between inputs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "msh.h"
#include "options_checks.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_ENTRIES 32

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    oc_setup();
    static const char *names[OC_MAX_OPTS];
    static int nnames;
    if (!nnames) {
        const char *src;
        char v[8];
        while (nnames < OC_MAX_OPTS && msh_config_iter(nnames, &names[nnames], v, sizeof v, &src)) nnames++;
    }
    static char store[MAX_ENTRIES][8192];
    char *envp[MAX_ENTRIES + 1];
    int n = 0;
    size_t i = 0;
    while (i < size && n < MAX_ENTRIES) {
        size_t j = i;
        while (j < size && data[j] != '\n') j++;
        const uint8_t *line = data + i;
        size_t len = j - i;
        i = j + 1;
        if (len == 0) continue;
        int w;
        if (line[0] < 0x80)
            w = snprintf(store[n], sizeof store[n], "%s=", names[line[0] % nnames]);
        else
            w = snprintf(store[n], sizeof store[n], "MEMSHIM_");
        size_t rest = len - 1, room = sizeof store[n] - (size_t)w - 1;
        if (rest > room) rest = room;
        memcpy(store[n] + w, line + 1, rest);
        store[n][(size_t)w + rest] = '\0'; /* an embedded NUL just ends the value early */
        envp[n] = store[n];
        n++;
    }
    envp[n] = NULL;

    /* each value through each public parser */
    for (int k = 0; k < n; k++) {
        const char *v = strchr(envp[k], '=');
        v = v ? v + 1 : envp[k];
        uint64_t u;
        double d;
        bool b;
        int sig;
        if (msh_parse_fraction(v, &d) == 0 && !(d >= 0 && d <= 1)) abort();
        if (msh_parse_seconds(v, &d) == 0 && !(d >= 0 && d < 1e300)) abort();
        if (msh_parse_signal(v, &sig) == 0 && (sig < 1 || sig > 64 || sig == 9 || sig == 19)) abort();
        msh_parse_size(v, &u);
        msh_parse_bool(v, &b);
    }

    oc_log_reset();
    msh_config_load_from(envp);
    oc_check_ranges();
    oc_check_log();
    oc_check_fixed_point();
    oc_check_log();
    return 0;
}

/*
 * options_main.c: memshim-options, the command-line face of policy/base/options.c.
 *
 *   memshim-options --markdown   print docs/configuration.md, generated from the option table
 *   memshim-options --check      read MEMSHIM_* from this environment as libmemshim.so would,
 *                                print the effective value and source of every option, exit 1
 *                                if any value was invalid or any name unknown
 *   memshim-options --help
 *
 * It must never abort on a bad setting (MEMSHIM_STRICT=1 is reported, not obeyed) and never
 * open MEMSHIM_LOG_FILE: diagnostics go to stderr, results to stdout.
 */
#include "msh.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int strict_would_abort;
static void note_strict_abort(void)
{
    strict_would_abort = 1;
}

static void usage(FILE *f)
{
    fputs("usage: memshim-options --markdown | --check | --help\n"
          "  --markdown  print the configuration reference (docs/configuration.md)\n"
          "  --check     parse the MEMSHIM_* variables of this environment and print the\n"
          "              effective configuration; exit status 1 if any setting is invalid\n"
          "  --help      this text\n",
          f);
}

static int check(void)
{
    msh_config_abort_fn = note_strict_abort;
    /* load_from, not load: same parsing, but the log stays on stderr. */
    int problems = msh_config_load_from(environ);
    char val[4096];
    const char *name, *source;
    for (int i = 0; msh_config_iter(i, &name, val, sizeof val, &source); i++)
        printf("%s=%s\t# %s\n", name, val, source);
    if (problems)
        fprintf(stderr,
                "memshim-options: %d invalid or unknown setting%s (see the warnings above)%s\n",
                problems, problems == 1 ? "" : "s",
                strict_would_abort ? "; with MEMSHIM_STRICT=1 libmemshim.so would abort" : "");
    return problems ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--markdown") == 0) {
        msh_config_print_markdown(stdout);
        return fflush(stdout) == 0 ? 0 : 1;
    }
    if (argc == 2 && strcmp(argv[1], "--check") == 0) return check();
    if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        usage(stdout);
        return 0;
    }
    usage(stderr);
    return 2;
}

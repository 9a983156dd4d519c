/*
 * stepfig.c: min, median and max of a figure noted once per step (stepfig.h).
 *
 * Must stay cheap at each step (a compare and a store; halving the kept set when it fills runs
 * once per MSH_STEPFIG_KEEP/2 steps at most) and never allocate there: the summary sorts a copy on
 * the caller's stack when a report is built.
 */
#include "stepfig.h"

#include <stdlib.h>
#include <string.h>

void msh_stepfig_reset(struct msh_stepfig *s)
{
    s->n = 0;
    s->nkept = 0;
    s->stride = 1;
    s->min = s->max = 0;
}

void msh_stepfig_note(struct msh_stepfig *s, double v)
{
    if (s->stride == 0) msh_stepfig_reset(s);
    if (s->n == 0 || v < s->min) s->min = v;
    if (s->n == 0 || v > s->max) s->max = v;
    if (s->n % s->stride == 0) {
        if (s->nkept == MSH_STEPFIG_KEEP) {
            /* keep the even positions: steps 0, 2k, 4k... of those kept at 0, k, 2k... */
            for (uint32_t i = 0; i < MSH_STEPFIG_KEEP / 2; i++) s->kept[i] = s->kept[2 * i];
            s->nkept = MSH_STEPFIG_KEEP / 2;
            s->stride *= 2;
        }
        if (s->n % s->stride == 0) s->kept[s->nkept++] = v;
    }
    s->n++;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void msh_stepfig_summarize(const struct msh_stepfig *s, struct msh_stepfig_summary *out)
{
    memset(out, 0, sizeof *out);
    if (s->stride == 0 || s->n == 0 || s->nkept == 0) return;
    double v[MSH_STEPFIG_KEEP];
    memcpy(v, s->kept, s->nkept * sizeof v[0]);
    qsort(v, s->nkept, sizeof v[0], cmp_double);
    uint32_t m = s->nkept / 2;
    out->steps = s->n;
    out->min = s->min;
    out->max = s->max;
    out->median = s->nkept % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

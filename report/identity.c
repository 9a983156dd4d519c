/*
 * identity.c: which process of which job wrote a report: its rank, local rank, world size, node,
 * restart count and the launcher's job id, read from the variables each launcher really sets, in
 * the order of the table below (docs/reports.md, "Who wrote a report", gives the table with its
 * sources). Every report, its file name and the snapshot's `%r` take their figures from here, so
 * they always agree, and memshim-report groups processes into runs by the same fields.
 *
 * It reads the environment at each call (a launcher sets it before the process starts; a script
 * that sets RANK itself before its first report is seen too) and never guesses: a figure no
 * launcher variable gives is -1 (unknown), and a variable that is not a plain non-negative integer
 * is ignored as if unset. It must never mix rows: a row is chosen by the variable only its launcher
 * sets, and all of its figures come from that row, so a variable another launcher left in the
 * environment (Slurm's SLURM_PROCID under torchrun or mpirun, a wrapper's LOCAL_RANK under mpirun)
 * never becomes the rank.
 */
#include "report.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One launcher: the variable only it sets (the row is taken when that variable holds a valid rank
 * of its own), then where each figure comes from (NULL: this launcher does not say). */
static const struct launcher_row {
    const char *name, *key;
    const char *rank, *local_rank, *world_size, *node_rank, *restart;
} LAUNCHERS[] = {
    /* torchrun, python -m torch.distributed.run/.launch, Accelerate's multi-GPU launch (it runs
     * torchrun's agent in process): torch/distributed/elastic/agent/server/local_elastic_agent.py */
    {"torchrun", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"},
    /* the deepspeed command's per-node launcher: deepspeed/launcher/launch.py */
    {"deepspeed", "CROSS_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", NULL},
    /* Open MPI's mpirun/mpiexec (also inside Slurm, where its ranks inherit a daemon's SLURM_*) */
    {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
     NULL, NULL},
    /* MPICH's (and Intel MPI's) Hydra mpiexec: src/pm/hydra/proxy/pmip_cb.c */
    {"mpich", "PMI_RANK", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", NULL, NULL},
    /* Slurm's srun (and the batch script's own task 0) */
    {"slurm", "SLURM_PROCID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_RESTART_COUNT"},
    /* PyTorch's environment convention set by hand or by a launcher not named above */
    {"env", "RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", NULL},
    /* LOCAL_RANK alone: one node, where the local rank is the rank (memshim's rule before issue 32) */
    {"env", "LOCAL_RANK", "LOCAL_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", NULL, NULL},
};

/* A variable holding a plain non-negative integer below a million, else -1. */
static long env_num(const char *name)
{
    if (!name) return -1;
    const char *v = getenv(name);
    if (!v || !*v) return -1;
    char *end;
    long n = strtol(v, &end, 10);
    return !*end && n >= 0 && n < 1000000 ? n : -1;
}

static void printable(char *s)
{
    for (char *p = s; *p; p++) /* printable ASCII only: it goes into JSON, file names and tables */
        if (*p < 0x20 || *p > 0x7e) *p = '?';
}

void msh_report_identity(struct msh_identity *id)
{
    memset(id, 0, sizeof *id);
    id->rank = id->local_rank = id->world_size = id->node_rank = id->restart = -1;
    for (size_t i = 0; i < sizeof LAUNCHERS / sizeof *LAUNCHERS; i++) {
        const struct launcher_row *l = &LAUNCHERS[i];
        if (!getenv(l->key) || env_num(l->rank) < 0) continue;
        id->launcher = l->name;
        id->rank = env_num(l->rank);
        id->local_rank = env_num(l->local_rank);
        id->world_size = env_num(l->world_size);
        id->node_rank = env_num(l->node_rank);
        id->restart = env_num(l->restart);
        break;
    }
    /* The job id every rank of one job shares. torchrun's own, except "none": its default
     * --rdzv-id, which every multi-node job with the static rendezvous carries (torch/distributed/
     * run.py), so it names no job; then Slurm's job (and step) id, as under torchrun inside Slurm. */
    const char *te = getenv("TORCHELASTIC_RUN_ID"), *sj = getenv("SLURM_JOB_ID"), *ss = getenv("SLURM_STEP_ID");
    if (te && *te && strcmp(te, "none") != 0)
        snprintf(id->run_id, sizeof id->run_id, "torchelastic:%.64s", te);
    else if (sj && *sj)
        snprintf(id->run_id, sizeof id->run_id, "slurm:%.32s%s%.16s", sj, ss && *ss ? "." : "", ss && *ss ? ss : "");
    printable(id->run_id);
}

long msh_report_rank(void)
{
    struct msh_identity id;
    msh_report_identity(&id);
    return id.rank;
}

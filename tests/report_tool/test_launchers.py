#!/usr/bin/env python3
"""Identity as launchers set it (issue 32 item 3). For each launcher, the processes of a job are
started as that launcher starts them: the demo workload (build/memshim-train-demo) under
LD_PRELOAD=libmemshim.so over the driver double, each with exactly the variables the launcher sets
for that process (and nothing else of any launcher: the variables this script runs with are
removed first), several nodes stood in for by libhostname-double.so (gethostname answers
$MSH_TEST_HOSTNAME). Then:

  - every report's identity fields (host, pid, rank, local_rank, world_size, node_rank, restart,
    launcher, run_id) equal what the process really is in its job: the truth each scenario starts
    from, from which it writes the launcher's variables; and every file name is
    memshim-HOST-pidPID[-rankR]-devD-KIND.json with the same host, pid and rank;
  - memshim-report --json groups the processes into runs as the jobs were: each job one run
    (an elastic restart: one run per attempt), with its processes, ranks and job id, and every
    process without a rank a run of its own.

What each launcher sets, with its source, is docs/reports.md's table "Who wrote a report"; the
scenarios below write the same variables. Ends with "N passed, N failed, N skipped"."""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyharness import BUILD, ROOT, case, finish, skip, step  # noqa: E402

DEMO = os.path.join(BUILD, "memshim-train-demo")
LIB = os.path.join(BUILD, "libmemshim.so")
TOOL = os.path.join(ROOT, "scripts", "memshim-report")
HOSTDBL_SRC = os.path.join(ROOT, "tests", "report_tool", "hostname_double.c")
HOSTDBL = os.path.join(BUILD, "report_tool", "libhostname-double.so")
# Every variable a launcher of the table sets, or that a scenario sets: removed from this script's
# own environment first (a CI runner inside Slurm or mpirun must not leak its own identity in).
LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_.*|"
                           r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|TORCH_NCCL_.*|SLURM_.*|SLURMD_.*|OMPI_.*|"
                           r"PMIX_.*|PMI_.*|MPI_LOCAL.*|CROSS_.*|LOCAL_SIZE|ACCELERATE_.*|MSH_TEST_HOSTNAME)$")


def build_hostname_double():
    if os.path.exists(HOSTDBL) and os.path.getmtime(HOSTDBL) >= os.path.getmtime(HOSTDBL_SRC):
        return None
    os.makedirs(os.path.dirname(HOSTDBL), exist_ok=True)
    p = subprocess.run([os.environ.get("CC", "gcc"), "-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-fPIC",
                        "-shared", "-o", HOSTDBL, HOSTDBL_SRC, "-ldl"], capture_output=True, text=True)
    return None if p.returncode == 0 else p.stderr[-600:]


# ---- the truth of each process, and the variables its launcher gives it ------------------------------

def truth(host, rank=None, local=None, world=None, node=None, restart=None, launcher=None, run_id=None):
    return {"host": host, "rank": -1 if rank is None else rank, "local_rank": local, "world_size": world,
            "node_rank": node, "restart": restart, "launcher": launcher, "run_id": run_id}


def slurm_vars(job, step, node, ntasks, nnodes, procid, localid, host, restart=None):
    """What srun gives one task of a step (srun(1), OUTPUT ENVIRONMENT VARIABLES)."""
    v = {"SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_STEP_ID": str(step), "SLURM_STEPID": str(step),
         "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(node),
         "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks), "SLURM_NNODES": str(nnodes),
         "SLURM_JOB_NUM_NODES": str(nnodes), "SLURMD_NODENAME": host, "SLURM_TOPOLOGY_ADDR": host,
         "SLURM_CLUSTER_NAME": "test", "SLURM_SUBMIT_DIR": "/tmp"}
    if restart is not None:
        v["SLURM_RESTART_COUNT"] = str(restart)
    return v


def torchrun_job(hosts, nproc, rdzv_id, restarts=None, outer=None, extra=None):
    """torchrun's workers: local_elastic_agent.py's worker_env (one agent per host). `restarts`: each
    agent's TORCHELASTIC_RESTART_COUNT; `outer(g, host)`: what the agent itself inherited (srun's
    variables when Slurm started it); `extra`: what a wrapper adds (Accelerate's ACCELERATE_*)."""
    procs, world = [], len(hosts) * nproc
    for g, host in enumerate(hosts):
        rc = (restarts or [0] * len(hosts))[g]
        for loc in range(nproc):
            r = g * nproc + loc
            env = dict(outer(g, host) if outer else {})
            env.update({"RANK": str(r), "GROUP_RANK": str(g), "ROLE_RANK": str(r), "ROLE_NAME": "default",
                        "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": str(len(hosts)),
                        "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": hosts[0], "MASTER_PORT": "29500",
                        "TORCHELASTIC_RESTART_COUNT": str(rc), "TORCHELASTIC_MAX_RESTARTS": "3",
                        "TORCHELASTIC_RUN_ID": rdzv_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "LOCAL_RANK": str(loc), "OMP_NUM_THREADS": "1"})
            env.update(extra or {})
            if rdzv_id != "none":
                rid = "torchelastic:" + rdzv_id
            elif "SLURM_JOB_ID" in env:
                rid = f"slurm:{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
            else:
                rid = None
            procs.append((env, truth(host, r, loc, world, g, rc, "torchrun", rid)))
    return procs


def srun_job(hosts, per_node, job, step):
    procs, world = [], len(hosts) * per_node
    for n, host in enumerate(hosts):
        for loc in range(per_node):
            r = n * per_node + loc
            procs.append((slurm_vars(job, step, n, world, len(hosts), r, loc, host),
                          truth(host, r, loc, world, n, None, "slurm", f"slurm:{job}.{step}")))
    return procs


def openmpi_job(hosts, per_node, wrapper_local_rank=False, slurm_job=None):
    """mpirun's ranks (Open MPI, "Environment variables set for MPI applications"); inside a Slurm
    allocation its daemons are one srun step (one task per node) whose SLURM_* the ranks inherit;
    a wrapper script of the kind many jobs use exports LOCAL_RANK for torch.cuda.set_device."""
    procs, world = [], len(hosts) * per_node
    for n, host in enumerate(hosts):
        for loc in range(per_node):
            r = n * per_node + loc
            env = slurm_vars(slurm_job, 0, n, len(hosts), len(hosts), n, 0, host) if slurm_job else {}
            env.update({"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(world),
                        "OMPI_COMM_WORLD_LOCAL_RANK": str(loc), "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node),
                        "OMPI_COMM_WORLD_NODE_RANK": str(loc), "OMPI_UNIVERSE_SIZE": str(world),
                        "PMIX_RANK": str(r), "PMIX_NAMESPACE": "prterun-test@1"})
            if wrapper_local_rank:
                env["LOCAL_RANK"] = str(loc)
            procs.append((env, truth(host, r, loc, world, None, None, "openmpi",
                                     f"slurm:{slurm_job}.0" if slurm_job else None)))
    return procs


def mpich_job(hosts, per_node, slurm_job=None):
    """Hydra's ranks (src/pm/hydra/proxy/pmip_cb.c: MPI_LOCALNRANKS, MPI_LOCALRANKID, PMI_RANK,
    PMI_FD, PMI_SIZE); inside Slurm, Hydra starts its proxies with srun, one task per node."""
    procs, world = [], len(hosts) * per_node
    for n, host in enumerate(hosts):
        for loc in range(per_node):
            r = n * per_node + loc
            env = slurm_vars(slurm_job, 0, n, len(hosts), len(hosts), n, 0, host) if slurm_job else {}
            env.update({"PMI_RANK": str(r), "PMI_SIZE": str(world), "PMI_FD": "7", "MPI_LOCALRANKID": str(loc),
                        "MPI_LOCALNRANKS": str(per_node)})
            procs.append((env, truth(host, r, loc, world, None, None, "mpich",
                                     f"slurm:{slurm_job}.0" if slurm_job else None)))
    return procs


def deepspeed_job(hosts, per_node):
    """deepspeed/launcher/launch.py, one per node (pdsh starts them): MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE, CROSS_RANK, CROSS_SIZE, LOCAL_SIZE, then RANK and LOCAL_RANK per process."""
    procs, world = [], len(hosts) * per_node
    for n, host in enumerate(hosts):
        for loc in range(per_node):
            r = n * per_node + loc
            env = {"MASTER_ADDR": hosts[0], "MASTER_PORT": "29500", "WORLD_SIZE": str(world), "CROSS_RANK": str(n),
                   "CROSS_SIZE": str(len(hosts)), "LOCAL_SIZE": str(per_node), "RANK": str(r), "LOCAL_RANK": str(loc),
                   "CUDA_VISIBLE_DEVICES": str(loc)}
            procs.append((env, truth(host, r, loc, world, n, None, "deepspeed", None)))
    return procs


ACCELERATE = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default",
              "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False", "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
              "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False", "ACCELERATE_USE_CPU": "False"}


def slurm_outer(job, nnodes):
    """srun --ntasks-per-node=1 torchrun ...: the agent on node g is task g of the step."""
    return lambda g, host: slurm_vars(job, 0, g, nnodes, nnodes, g, 0, host)


# Each scenario: a name and its jobs, started together (or one after the other: "sequential");
# a job is its processes, each (launcher's variables, truth), and one run of the report tool
# unless its processes have no rank (each its own run).
SCENARIOS = [
    ("torchrun --standalone, 4 ranks", [torchrun_job(["node0"], 4, "3f1c9a2e-0b7d-4c55-9e51-7a0d2b6c8e11")], False),
    ("torchrun, 2 nodes, c10d rendezvous, then an elastic restart (agent A failed: count 1, B re-joined: 0)",
     [torchrun_job(["nodeA", "nodeB"], 2, "job7"), torchrun_job(["nodeA", "nodeB"], 2, "job7", restarts=[1, 0])],
     True),
    ("torchrun inside Slurm (srun, one agent per node, static rendezvous: --rdzv-id none), two jobs at once",
     [torchrun_job(["n1", "n2"], 2, "none", outer=slurm_outer(1001, 2)),
      torchrun_job(["n3", "n4"], 2, "none", outer=slurm_outer(1002, 2))], False),
    ("srun, 2 nodes x 2 tasks", [srun_job(["cn01", "cn02"], 2, 4242, 0)], False),
    ("Open MPI mpirun, 2 nodes x 2", [openmpi_job(["h1", "h2"], 2)], False),
    ("Open MPI mpirun inside Slurm, with a wrapper that exports LOCAL_RANK",
     [openmpi_job(["h1", "h2"], 2, wrapper_local_rank=True, slurm_job=555)], False),
    ("MPICH mpiexec (Hydra), 2 nodes x 2", [mpich_job(["m1", "m2"], 2)], False),
    ("MPICH mpiexec (Hydra) inside Slurm", [mpich_job(["m1", "m2"], 2, slurm_job=556)], False),
    ("accelerate launch --multi_gpu (torchrun's agent in process), 2 processes",
     [torchrun_job(["acc"], 2, "5a0e7c3b-1f2d-4e6a-8b9c-0d1e2f3a4b5c", extra=ACCELERATE)], False),
    ("accelerate launch, one process (no rank)", [[(dict(ACCELERATE), truth("acc"))]], False),
    ("deepspeed, 2 nodes x 2 (pdsh, one launch.py per node)", [deepspeed_job(["d1", "d2"], 2)], False),
    ("plain python, two processes", [[({}, truth("py"))], [({}, truth("py"))]], False),
]


def start(env, rdir):
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEMSHIM_") and not LAUNCHER_VARS.match(k)}
    base.update({"LD_LIBRARY_PATH": os.path.join(BUILD, "double"), "LD_PRELOAD": HOSTDBL + ":" + LIB,
                 "CUDBL_CAPACITY": "2G", "MEMSHIM_REPORT_DIR": rdir})
    base.update(env)
    return subprocess.Popen([DEMO, "--epochs", "2", "--steps", "1", "--scale", "0.05"], env=base,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_jobs(jobs, rdir, sequential):
    """Start every process (jobs interleaved rank by rank, as two launchers racing would), return
    [(pid, truth, job index)]."""
    out, waves = [], [jobs] if not sequential else [[j] for j in jobs]
    for w, wave in enumerate(waves):
        running = []
        for i in range(max(len(j) for j in wave)):
            for j, job in enumerate(wave):
                if i < len(job):
                    env, t = job[i]
                    p = start(dict(env, MSH_TEST_HOSTNAME=t["host"]), rdir)
                    running.append((p, t, w + j))
        for p, t, j in running:
            _, err = p.communicate(timeout=120)
            if p.returncode != 0:
                raise RuntimeError(f"demo exited {p.returncode}: {err[-400:]}")
            out.append((p.pid, t, j))
    return out


NAME = re.compile(r"^memshim-(?P<host>.+)-pid(?P<pid>\d+)(?:-rank(?P<rank>\d+))?-dev(?P<dev>\d+)-"
                  r"(?P<kind>epoch\d{4}|summary|oom\d{4})\.json$")
FIELDS = ("host", "rank", "local_rank", "world_size", "node_rank", "restart", "launcher", "run_id")


def check_reports(name, rdir, procs):
    by_pid = {pid: t for pid, t, _ in procs}
    bad, seen, nfiles = [], set(), 0
    for f in sorted(os.listdir(rdir)):
        nfiles += 1
        m = NAME.match(f)
        r = json.load(open(os.path.join(rdir, f)))
        t = by_pid.get(r.get("pid"))
        if t is None:
            bad.append(f"{f}: pid {r.get('pid')} is none of the job's")
            continue
        seen.add(r["pid"])
        for k in FIELDS:
            if r.get(k, "absent") != t[k]:
                bad.append(f"{f}: {k} {r.get(k, 'absent')!r}, the process is {t[k]!r}")
        if not m:
            bad.append(f"{f}: not memshim-HOST-pidPID[-rankR]-devD-KIND.json")
        elif (m["host"], int(m["pid"]), int(m["rank"]) if m["rank"] else -1) != (t["host"], r["pid"], t["rank"]):
            bad.append(f"{f}: the name says host {m['host']}, pid {m['pid']}, rank {m['rank']}; the process is "
                       f"host {t['host']}, rank {t['rank']}")
    missing = sorted(set(by_pid) - seen)
    case(f"{name}: every report ({nfiles} files of {len(procs)} processes) carries the process's identity and its "
         "file name says the same", not bad and not missing and nfiles >= 3 * len(procs),
         "; ".join(bad[:6]) + (f"; and {len(bad) - 6} more" if len(bad) > 6 else "") +
         (f"; no report from pids {missing}" if missing else ""))


def check_runs(name, rdir, procs):
    p = subprocess.run([sys.executable, TOOL, "--json", rdir], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        case(f"{name}: memshim-report reads the reports", False, p.stderr[-500:])
        return
    doc = json.loads(p.stdout)
    got = sorted(sorted((x["host"], x["pid"]) for x in run["ranks"]) for run in doc["runs"])
    want = {}
    for pid, t, j in procs:
        key = j if t["rank"] >= 0 else ("alone", pid)
        want.setdefault(key, []).append((t["host"], pid))
    want = sorted(sorted(v) for v in want.values())
    detail = []
    for run in doc["runs"]:
        ids = {(x["host"], x["pid"]) for x in run["ranks"]}
        ts = [t for pid, t, _ in procs if (t["host"], pid) in ids]
        ranks = sorted(x["rank"] for x in run["ranks"] if x["rank"] is not None)
        want_ranks = sorted(t["rank"] for t in ts if t["rank"] >= 0)
        want_id = {t["run_id"] for t in ts}
        if ranks != want_ranks or {run["run_id"]} != want_id:
            detail.append(f"run {run['run']}: ranks {ranks} job id {run['run_id']!r}; its processes are ranks "
                          f"{want_ranks} of job {sorted(want_id, key=str)}")
    case(f"{name}: memshim-report groups the processes into runs as the jobs were ({len(want)} run"
         f"{'s' if len(want) > 1 else ''})", got == want and not detail,
         f"runs by (host, pid): {got}, the jobs: {want}; " + "; ".join(detail))


def main():
    for exe in (DEMO, LIB):
        if not os.path.exists(exe):
            case("built", False, f"{exe} missing (make)")
            finish()
    err = build_hostname_double()
    if err:
        skip("every launcher", f"libhostname-double.so does not build: {err}")
        finish()
    with tempfile.TemporaryDirectory(prefix="memshim-launchers-") as tmp:
        for i, (name, jobs, sequential) in enumerate(SCENARIOS):
            step(f"{name}: the job's processes")
            rdir = os.path.join(tmp, f"s{i}")
            os.makedirs(rdir)
            try:
                procs = run_jobs(jobs, rdir, sequential)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                case(f"{name}: the processes run", False, str(e))
                continue
            check_reports(name, rdir, procs)
            check_runs(name, rdir, procs)
    finish()


main()

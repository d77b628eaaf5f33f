"""Stand-ins for SLURM's `srun` and `scontrol` on the simulated hosts of tests/reliability/hosts.py.

``python -m tests.reliability.slurm_standin srun [options] command...`` starts the job step's tasks as SLURM does:
SLURM_NTASKS_PER_NODE tasks (or ``--ntasks-per-node``) on each of the job's SLURM_NNODES nodes, each task in its
node's network namespace with the node's hostname, and the variables slurmstepd sets: SLURM_PROCID (block
distribution: node 0 holds ranks 0..n-1), SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS, SLURM_NNODES, SLURM_NODELIST /
SLURM_STEP_NODELIST / SLURM_JOB_NODELIST in the compressed form (``node[01-02]``), SLURM_JOB_ID, SLURM_STEP_ID,
SLURMD_NODENAME, SLURM_TASKS_PER_NODE (``2(x2)``). The nodes are given by MH_CLUSTER (``node01=<netns>,...``), which
the test sets for the batch script. Like srun it forwards SIGTERM/SIGINT/SIGUSR1/SIGUSR2 to every task; with
``--kill-on-bad-exit=1`` a task that exits non-zero gets the others SIGKILLed. A task killed by a signal from
outside (its node lost) is reported as a node failure, as slurmctld would, and the others are left to finish (they
see the loss themselves); srun then exits non-zero. Tasks on a node whose cluster interface is down cannot be
reached: srun says so and leaves them to end on their own, and their exits are not seen (nor acted on) while other
tasks run, as a real srun cannot reach that node's slurmd. The tasks of the nodes named in MH_STALLED_NODES
(``node02``) hang before the command starts (a node that never arrives at the rendezvous: a stuck file system, a
slow boot); srun kills them like any other task.

``scontrol show hostnames LIST`` prints the job's hosts one a line (LIST must be the job's node list);
``scontrol requeue JOBID`` appends its arguments to $MH_SCONTROL_LOG.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def _cluster() -> list[tuple[str, str]]:
    return [tuple(item.split("=", 1)) for item in os.environ["MH_CLUSTER"].split(",")]


def expand_nodelist(nodelist: str) -> list[str]:
    """The one compressed form the stand-in writes, ``prefix[01-02]`` (or a plain comma list)."""
    m = re.fullmatch(r"([A-Za-z]+)\[(\d+)-(\d+)\]", nodelist)
    if m is None:
        return nodelist.split(",")
    width = len(m.group(2))
    return [f"{m.group(1)}{i:0{width}d}" for i in range(int(m.group(2)), int(m.group(3)) + 1)]


def parse_srun(argv: list[str]) -> tuple[dict, list[str]]:
    """srun's options this stand-in honours (the rest are accepted and ignored) and the command."""
    opts = {"kill_on_bad_exit": False, "ntasks_per_node": int(os.environ.get("SLURM_NTASKS_PER_NODE", "1")),
            "nodes": int(os.environ.get("SLURM_NNODES", "1"))}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        name, _, value = arg.partition("=")
        if name in ("-N", "--nodes", "--ntasks-per-node") and not value:
            i, value = i + 1, argv[i + 1]
        if name == "--kill-on-bad-exit" or name == "-K":
            opts["kill_on_bad_exit"] = value in ("", "1")
        elif name in ("-N", "--nodes"):
            opts["nodes"] = int(value)
        elif name == "--ntasks-per-node":
            opts["ntasks_per_node"] = int(value)
        i += 1
    return opts, argv[i:]


def task_env(node: int, local: int, name: str, opts: dict) -> dict:
    """The environment of task `local` on node `node` (named `name`): this one's plus what slurmstepd sets."""
    per_node, nodes = opts["ntasks_per_node"], opts["nodes"]
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    env = dict(os.environ)
    env.update({"SLURM_PROCID": str(node * per_node + local), "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(node), "SLURM_NTASKS": str(nodes * per_node), "SLURM_NPROCS": str(nodes * per_node),
                "SLURM_NNODES": str(nodes), "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
                "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(nodes * per_node),
                "SLURM_STEP_ID": "0", "SLURMD_NODENAME": name, "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})"})
    return env


def reachable(netns: str) -> bool:
    """Whether the node's cluster interface is up (srun reaches its tasks over the network)."""
    out = subprocess.run(["ip", "-n", netns, "-j", "link", "show", "hostnet0"], capture_output=True, text=True).stdout
    return bool(out) and json.loads(out)[0].get("operstate") == "UP"


def srun(argv: list[str]) -> int:
    """Start the step's tasks on the job's nodes; return srun's exit code."""
    opts, command = parse_srun(argv)
    cluster = _cluster()[: opts["nodes"]]
    stalled = set(filter(None, os.environ.get("MH_STALLED_NODES", "").split(",")))
    tasks = []
    for node, (name, netns) in enumerate(cluster):
        for local in range(opts["ntasks_per_node"]):
            run = ["sleep", "3600"] if name in stalled else command  # the node never arrives at the rendezvous
            launch = ["ip", "netns", "exec", netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                      name, *run]
            tasks.append((name, netns, subprocess.Popen(launch, env=task_env(node, local, name, opts))))

    def forward(signum: int, _frame: object) -> None:
        for _, _, proc in tasks:
            if proc.poll() is None:
                proc.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    code, pending, here, killed = 0, list(tasks), os.environ.get("SLURMD_NODENAME"), set()
    while pending:
        up = {netns: name == here or reachable(netns) for name, netns, _ in pending}
        # An unreachable node's task exits are not known here until nothing else runs (slurmctld's verdict).
        for task in [t for t in pending if up[t[1]]] or list(pending):
            name, _, proc = task
            rc = proc.poll()
            if rc is None:
                continue
            pending.remove(task)
            if rc < 0 and proc.pid not in killed:
                print(f"srun: error: Node failure on {name} (task killed by signal {-rc})", file=sys.stderr,
                      flush=True)
                code = code or 1
            elif rc > 0:
                print(f"srun: error: {name}: task exited with exit code {rc}", file=sys.stderr, flush=True)
                code = code or rc
                if opts["kill_on_bad_exit"]:
                    for other_name, other_netns, other in pending:
                        if up[other_netns]:
                            other.kill()
                            killed.add(other.pid)
                        else:
                            print(f"srun: error: {other_name} is unreachable: its tasks are not killed",
                                  file=sys.stderr, flush=True)
        time.sleep(0.2)  # polling the tasks' exits (srun's wait loop)
    return code


def scontrol(argv: list[str]) -> int:
    """`show hostnames LIST` and `requeue JOBID` (logged to MH_SCONTROL_LOG)."""
    if argv[:2] == ["show", "hostnames"]:
        nodelist = argv[2] if len(argv) > 2 else os.environ["SLURM_JOB_NODELIST"]
        for host in expand_nodelist(nodelist):  # a line at a time, as a long list reaches a pipe
            print(host, flush=True)
        return 0
    if argv[:1] == ["requeue"]:
        with open(os.environ["MH_SCONTROL_LOG"], "a") as f:
            f.write(" ".join(argv) + "\n")
        return 0
    print(f"scontrol stand-in: unsupported command {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit({"srun": srun, "scontrol": scontrol}[sys.argv[1]](sys.argv[2:]))

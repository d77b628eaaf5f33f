# Set-up shared by the examples/slurm scripts (sourced after examples/*_common.sh, in the batch script, which SLURM
# runs on the job's first node): the master node, the network interface the ranks talk over and a bounded start-up.
#
#   MASTER_ADDR    the first host of SLURM_JOB_NODELIST (unless set); it must resolve here, else one line and exit 1.
#   MASTER_PORT    6000 unless set.
#   SOCKET_IFNAME  the interface for gloo and NCCL's sockets (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME; either set
#                  by you wins for its library). Unset: the interface that holds MASTER_ADDR's address on this node
#                  (the master), or, when that is the loopback (a hostname mapped to 127.0.1.1 in /etc/hosts), the
#                  interface of the default route. torch's gloo otherwise binds to whatever the hostname resolves
#                  to, which the other nodes may not reach.
#   RDZV_TIMEOUT   seconds a node waits at start-up for the others: torchrun's --rdzv-conf join_timeout
#                  (pretrain_gpt_srun_torchrun.slurm; 600, torchrun's default, when unset) and, when set,
#                  MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS (the ranks' own wait before the process group starts; unset:
#                  --distributed-timeout-minutes, 10). A node that never arrives then ends the job with one line
#                  naming it. Without SLURM_JOB_NODELIST (not a SLURM job) only MASTER_PORT and this are set.
# `multinode_env` prints one "multinode: ..." line saying what it chose (stderr).

# resolve_ipv4 HOST: its IPv4 address as this node resolves it (the resolver torch uses), or nothing.
resolve_ipv4() {
  python -c "import socket, sys
try:
    print(socket.gethostbyname(sys.argv[1]))
except OSError:
    pass" "$1"
}

# interface_of ADDR: the interface that holds ADDR on this node, or nothing.
interface_of() {
  ip -o -4 addr show 2>/dev/null | awk -v a="$1" '{split($4, p, "/"); if (p[1] == a) {print $2; exit}}'
}

# default_route_interface: the interface of this node's default route, or nothing.
default_route_interface() {
  ip -o -4 route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}'
}

multinode_env() {
  local first addr iface
  export MASTER_PORT="${MASTER_PORT:-6000}"
  if [ -n "${RDZV_TIMEOUT:-}" ]; then
    export MEGATRON_RENDEZVOUS_TIMEOUT_SECONDS="$RDZV_TIMEOUT"
  fi
  if [ -z "${MASTER_ADDR:-}" ] && [ -z "${SLURM_JOB_NODELIST:-}" ]; then
    echo "multinode: no SLURM_JOB_NODELIST (not a SLURM job) and no MASTER_ADDR: one node, nothing chosen" >&2
    return 0
  fi
  if [ -z "${MASTER_ADDR:-}" ]; then
    if command -v scontrol >/dev/null 2>&1; then
      # (not `| head -n 1`: under pipefail scontrol's SIGPIPE on a long node list would end the script)
      first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
    else
      first=$(python -c "import sys; from megatron.launcher import parse_slurm_nodelist as p; print(p(sys.argv[1])[0])" \
        "$SLURM_JOB_NODELIST")
    fi
    MASTER_ADDR=$first
  fi
  export MASTER_ADDR
  addr=$(resolve_ipv4 "$MASTER_ADDR")
  if [ -z "$addr" ]; then
    echo "error: the master node $MASTER_ADDR (first host of SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-}) does not" \
      "resolve on $(hostname): fix the cluster's DNS or /etc/hosts, or export MASTER_ADDR=<its IP address>" >&2
    exit 1
  fi
  iface=${SOCKET_IFNAME:-}
  if [ -z "$iface" ]; then
    iface=$(interface_of "$addr")
    if [ -z "$iface" ] || [ "$iface" = lo ]; then
      iface=$(default_route_interface)
    fi
  fi
  if [ -n "$iface" ]; then
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$iface}"
    export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$iface}"
  fi
  echo "multinode: MASTER_ADDR=$MASTER_ADDR ($addr) MASTER_PORT=$MASTER_PORT" \
    "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-}" \
    "RDZV_TIMEOUT=${RDZV_TIMEOUT:-unset}" >&2
}

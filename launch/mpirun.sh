#!/usr/bin/env bash
# cvllm under Open MPI: one rank per GPU, on one node or many.
#
#   launch/mpirun.sh NP [HOSTFILE] -- <cvllm serve args>
#   launch/mpirun.sh 8 hostfiles/two_nodes -- --w /models/QwQ-32B
#   launch/mpirun.sh 2 -- --cpu --w /models/tiny        # 2 CPU ranks on this machine
#
# Rank, world size and local rank come from Open MPI's environment; rank 0 picks the
# torch.distributed rendezvous address and port and sends them to every rank over MPI;
# the control plane runs over MPI (mpi4py). Rank r drives GPU local_rank (or
# --d's entry local_rank). Rank 0 serves HTTP on its node.
#
# Environment: IFACE (default: unset) binds MPI's TCP traffic, NCCL, gloo and cvllm's
# control plane to one interface (e.g. IFACE=eth1); PYTHON (default python3).
set -euo pipefail
NP=${1:?usage: mpirun.sh NP [HOSTFILE] -- <cvllm serve args>}; shift
HOSTS=()
if [[ $# -gt 0 && "$1" != "--" ]]; then HOSTS=(-hostfile "$1"); shift; fi
[[ "${1:-}" == "--" ]] && shift
PY=${PYTHON:-python3}
IFOPTS=()
if [[ -n "${IFACE:-}" ]]; then
  IFOPTS=(--mca btl_tcp_if_include "$IFACE" --mca oob_tcp_if_include "$IFACE"
          -x NCCL_SOCKET_IFNAME="$IFACE" -x GLOO_SOCKET_IFNAME="$IFACE"
          -x CVLLM_BIND_ADDR="$IFACE")
fi
# --bind-to none: cvllm pins each rank to its GPU's NUMA node itself (MAP_NUMA_NODE or
# sysfs). NCCL_NVLS_ENABLE=0: NVLink multicast off. Running as root needs
# --allow-run-as-root (or OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1).
exec mpirun -np "$NP" "${HOSTS[@]}" --bind-to none "${IFOPTS[@]}" \
  -x NCCL_NVLS_ENABLE=0 -x PATH -x LD_LIBRARY_PATH -x HF_HOME -x MAP_NUMA_NODE \
  "$PY" -m cvllm serve "$@"

#!/usr/bin/env bash
# cvllm on PBS Pro / OpenPBS: 2 nodes x 4 GPUs = tensor parallel over 8 ranks.
#
#   qsub -v MODEL=/models/QwQ-32B launch/pbs.sh
#
# $PBS_NODEFILE lists each node once per MPI slot; mpirun reads it as a hostfile.
# Rank 0 (the first node in the file) serves HTTP on port 2000.
#PBS -N cvllm
#PBS -l select=2:ncpus=64:ngpus=4:mpiprocs=4
#PBS -l walltime=04:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-$PWD}"
MODEL=${MODEL:?qsub -v MODEL=/path/to/model launch/pbs.sh}
NP=$(wc -l < "$PBS_NODEFILE")
export NCCL_NVLS_ENABLE=0
IFOPTS=()
if [[ -n "${IFACE:-}" ]]; then
  IFOPTS=(--mca btl_tcp_if_include "$IFACE" -x NCCL_SOCKET_IFNAME="$IFACE"
          -x GLOO_SOCKET_IFNAME="$IFACE" -x CVLLM_BIND_ADDR="$IFACE")
fi
echo "cvllm: rank 0 on $(head -n1 "$PBS_NODEFILE"):2000"
mpirun -np "$NP" -hostfile "$PBS_NODEFILE" --bind-to none "${IFOPTS[@]}" \
  -x NCCL_NVLS_ENABLE -x PATH -x LD_LIBRARY_PATH \
  python3 -m cvllm serve --w "$MODEL" --host 0.0.0.0 --port 2000 --log "cvllm-${PBS_JOBID:-job}.log"

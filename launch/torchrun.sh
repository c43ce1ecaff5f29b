#!/usr/bin/env bash
# cvllm under torchrun: one rank per GPU on one machine (or per node with --nnodes).
#
#   launch/torchrun.sh NPROC -- <cvllm serve args>
#   launch/torchrun.sh 4 -- --w /models/QwQ-32B
#   launch/torchrun.sh 2 -- --cpu --w /models/tiny      # 2 CPU ranks (gloo)
#
# torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; cvllm joins
# its rendezvous store (env://), rank r drives GPU LOCAL_RANK, rank 0 serves HTTP.
# Several nodes: run on each node with --nnodes N --node-rank i --master-addr NODE0
# (TORCHRUN_ARGS="--nnodes 2 --node-rank 1 --master-addr 10.0.0.1").
set -euo pipefail
NPROC=${1:?usage: torchrun.sh NPROC -- <cvllm serve args>}; shift
[[ "${1:-}" == "--" ]] && shift
export NCCL_NVLS_ENABLE=0
# shellcheck disable=SC2086
exec torchrun --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} -m cvllm serve "$@"

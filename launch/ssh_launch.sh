#!/usr/bin/env bash
# Start one `cvllm serve` job over several nodes with ssh (no MPI needed).
#
#   launch/ssh_launch.sh HOSTFILE -- <cvllm serve args>
#   launch/ssh_launch.sh hostfiles/two_nodes -- --w /models/QwQ-32B --d 0,1,2,3
#
# HOSTFILE: one host per line (Open MPI style "host slots=N" lines work too; only the
# host is read; '#' starts a comment). The first host is node 0: it runs rank 0, the
# scheduler and the HTTP server, and its address is the rendezvous (--master-addr).
# Every node runs `cvllm serve --num-nodes N --node-rank i --master-addr FIRST ...` and
# spawns one rank per --device-ids entry. Nodes 1..N-1 start in the background over ssh,
# node 0 last, in the foreground; when node 0 exits (or on Ctrl-C) the others are killed.
#
# Environment:
#   CVLLM_CMD          the command on every node (default: cvllm); the same path everywhere
#   CVLLM_MASTER_ADDR  address the nodes reach node 0 on (default: the first host)
#   CVLLM_MASTER_PORT  rendezvous port (default 29500; the health link uses port + 1)
#   SSH                ssh command (default: ssh -o BatchMode=yes)
#   CVLLM_BIND_ADDR, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, MAP_NUMA_NODE, HF_HOME,
#   CVLLM_CACHE_DIR    passed on to every node when set
set -euo pipefail

usage() { sed -n '2,8p' "$0" >&2; exit 2; }
[[ $# -ge 2 && "$2" == "--" ]] || usage
HOSTFILE=$1; shift 2
[[ -r "$HOSTFILE" ]] || { echo "ssh_launch.sh: cannot read $HOSTFILE" >&2; exit 2; }

mapfile -t HOSTS < <(sed -e 's/#.*//' -e 's/[[:space:]].*//' "$HOSTFILE" | grep -v '^$')
N=${#HOSTS[@]}
(( N >= 1 )) || { echo "ssh_launch.sh: no host in $HOSTFILE" >&2; exit 2; }
CMD=${CVLLM_CMD:-cvllm}
MASTER=${CVLLM_MASTER_ADDR:-${HOSTS[0]}}
PORT=${CVLLM_MASTER_PORT:-29500}
read -r -a SSH_CMD <<< "${SSH:-ssh -o BatchMode=yes}"

# Variables that must be the same on every node.
ENV_FWD=""
for v in CVLLM_BIND_ADDR NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME MAP_NUMA_NODE HF_HOME \
         CVLLM_CACHE_DIR CVLLM_NO_PROGRESS; do
  [[ -n "${!v:-}" ]] && ENV_FWD+="$v=$(printf '%q' "${!v}") "
done
ARGS=$(printf '%q ' "$@")
node_cmd() {  # node_cmd RANK -> the remote command line of node RANK
  echo "cd $(printf '%q' "$PWD") && exec env ${ENV_FWD}NCCL_NVLS_ENABLE=0 $CMD serve $ARGS" \
       "--num-nodes $N --node-rank $1 --master-addr $MASTER --master-port $PORT"
}

PIDS=()
NODE0=""
cleanup() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  # ssh -tt: killing the local ssh hangs up the remote session, which ends its cvllm.
  wait 2>/dev/null || true
}
forward() {  # SIGTERM / Ctrl-C: rank 0 drains its requests, then stops every rank
  [[ -n "$NODE0" ]] && kill -TERM "$NODE0" 2>/dev/null || true
}
trap cleanup EXIT
trap forward INT TERM

for ((i = 1; i < N; i++)); do
  echo "ssh_launch.sh: node $i on ${HOSTS[$i]}" >&2
  # $! must be ssh itself (not a pipeline's last command) so cleanup can hang it up.
  "${SSH_CMD[@]}" -tt "${HOSTS[$i]}" "$(node_cmd "$i")" < /dev/null \
      > >(sed -u "s/^/[node $i] /" >&2) 2>&1 &
  PIDS+=($!)
done
echo "ssh_launch.sh: node 0 (rank 0, server) on ${HOSTS[0]}" >&2
case "${HOSTS[0]}" in
  localhost|127.0.0.1|"$(hostname)"|"$(hostname -f 2>/dev/null)") bash -c "$(node_cmd 0)" & ;;
  *) "${SSH_CMD[@]}" -tt "${HOSTS[0]}" "$(node_cmd 0)" < /dev/null & ;;
esac
NODE0=$!
rc=0
while kill -0 "$NODE0" 2>/dev/null; do
  wait "$NODE0" && rc=0 || rc=$?   # returns early when a trapped signal arrives
done
exit "$rc"

"""Who am I: this process's place in the job, read from the launcher's environment.

Built once per process by the composition root (``cli.py``) with ``detect_launch_env``
before anything else distributed happens; the frozen ``LaunchEnv`` is then passed
explicitly to ``init_distributed`` (``rendezvous.py``), the control plane, the health link
and the NUMA pinning. Under ``--multithread`` the main thread builds one ``LaunchEnv``
(rank 0) and each rank thread its own copy with
``dataclasses.replace(env, rank=r, local_rank=r)``.

Modes, first match wins:

- ``mpirun``: Open MPI (``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``), or the
  PMI/PMIx variables of other MPIs. The torch.distributed rendezvous address is agreed
  over MPI in ``init_distributed`` (rank 0 picks a free port on its bind address).
- ``torchrun``: ``TORCHELASTIC_RUN_ID`` or ``RANK`` + ``WORLD_SIZE`` + ``LOCAL_RANK``.
- ``spawn`` / ``ssh`` children: ``CVLLM_RANK``, ``CVLLM_WORLD_SIZE``, ``CVLLM_LOCAL_RANK``,
  ``CVLLM_MASTER_ADDR``, ``CVLLM_MASTER_PORT``, ``CVLLM_LAUNCH_MODE`` set by the parent
  (``child_environ``).
- ``ssh``: ``--num-nodes > 1``: this process is node-local rank 0 of node ``node_rank``
  and spawns the node's other ranks; world = num_nodes * len(device_ids).
- ``multithread``: ranks are threads of this process.
- ``spawn``: ``len(device_ids) > 1``: this process is rank 0 and spawns ranks 1..N-1.
- ``single``: one process, one device.

The health side channel (``health.py``) listens on the rendezvous port + 1 by default.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

from cvllm.config import ConfigError

MODES = ("single", "spawn", "torchrun", "mpirun", "ssh", "multithread")
TRANSPORTS = ("mpi", "gloo", "inprocess", "none")
DEFAULT_MASTER_PORT = 29500
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LaunchEnv:
    """This rank's place in the job (owned by the composition root, one per rank)."""

    mode: str
    """How the job was launched: one of ``MODES``."""
    rank: int
    """Global rank (0 hosts the server and the scheduler)."""
    world_size: int
    """Number of ranks in the job (= tensor-parallel size)."""
    local_rank: int
    """Rank on this node: indexes ``--device-ids`` and ``MAP_NUMA_NODE``."""
    local_world_size: int
    """Ranks on this node."""
    node_rank: int
    """Index of this node."""
    num_nodes: int
    """Number of nodes."""
    master_addr: str
    """Rendezvous address of torch.distributed ("" under mpirun until agreed over MPI)."""
    master_port: int
    """Rendezvous port (0 under mpirun until agreed over MPI); health uses port + 1."""
    transport: str
    """Control-plane transport: one of ``TRANSPORTS``."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown launch mode {self.mode!r}; expected one of {MODES}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"unknown transport {self.transport!r}; expected one of {TRANSPORTS}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(
                f"local rank {self.local_rank} is outside {self.local_world_size} local ranks"
            )
        if self.num_nodes < 1 or not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(f"node rank {self.node_rank} is outside {self.num_nodes} nodes")
        if not 0 <= self.master_port < 65536:
            raise ConfigError(f"master port {self.master_port} is not a TCP port")

    @property
    def is_driver(self) -> bool:
        """Rank 0: hosts the server and the scheduler, broadcasts every step."""
        return self.rank == 0

    @property
    def health_port(self) -> int:
        """Port of rank 0's health monitor: the rendezvous port + 1."""
        return self.master_port + 1


def _int(environ: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        text = environ.get(name)
        if text is not None and text.strip() != "":
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"{name}={text!r} is not an integer") from None
    return None


def _require(environ: Mapping[str, str], name: str) -> str:
    text = environ.get(name)
    if not text:
        raise ConfigError(f"{name} is not set; the launcher must set it")
    return text


def _mpi_env(environ: Mapping[str, str], master_addr: Optional[str],
             master_port: Optional[int]) -> Optional[LaunchEnv]:
    rank = _int(environ, "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
    if rank is None:
        return None
    size = _int(environ, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
    if size is None:
        from mpi4py import MPI  # lazy: only under an MPI launcher that hides the size

        size = MPI.COMM_WORLD.Get_size()
    local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK")
    local_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE")
    if local_rank is None or local_size is None:
        local_rank, local_size = rank, size  # no node information: assume one node
    # Informational: exact for the default by-slot mapping with equal ranks per node.
    num_nodes = max(1, -(-size // local_size))
    return LaunchEnv("mpirun", rank, size, local_rank, local_size,
                     min(rank // local_size, num_nodes - 1), num_nodes,
                     master_addr or environ.get("MASTER_ADDR", ""),
                     master_port or _int(environ, "MASTER_PORT") or 0, "mpi")


def _torchrun_env(environ: Mapping[str, str]) -> Optional[LaunchEnv]:
    has_triplet = all(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if "TORCHELASTIC_RUN_ID" not in environ and not has_triplet:
        return None
    rank, size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    local_rank = _int(environ, "LOCAL_RANK")
    if rank is None or size is None or local_rank is None:
        raise ConfigError("torchrun launch without RANK / WORLD_SIZE / LOCAL_RANK")
    local_size = _int(environ, "LOCAL_WORLD_SIZE") or size
    num_nodes = max(1, -(-size // local_size))
    node_rank = _int(environ, "GROUP_RANK")
    node_rank = rank // local_size if node_rank is None else node_rank
    return LaunchEnv("torchrun", rank, size, local_rank, local_size, node_rank, num_nodes,
                     environ.get("MASTER_ADDR", LOOPBACK),
                     _int(environ, "MASTER_PORT") or DEFAULT_MASTER_PORT, "gloo")


def _child_env(environ: Mapping[str, str], device_ids: Sequence[int], num_nodes: int,
               node_rank: int) -> Optional[LaunchEnv]:
    if "CVLLM_RANK" not in environ:
        return None
    mode = environ.get("CVLLM_LAUNCH_MODE", "spawn")
    if mode not in ("spawn", "ssh"):
        raise ConfigError(f"CVLLM_LAUNCH_MODE={mode!r}; expected spawn or ssh")
    local_size = _int(environ, "CVLLM_LOCAL_WORLD_SIZE") or len(device_ids)
    nodes = _int(environ, "CVLLM_NUM_NODES") or num_nodes
    node = _int(environ, "CVLLM_NODE_RANK")
    return LaunchEnv(mode, _int(environ, "CVLLM_RANK"), int(_require(environ, "CVLLM_WORLD_SIZE")),
                     int(_require(environ, "CVLLM_LOCAL_RANK")), local_size,
                     node_rank if node is None else node, nodes,
                     _require(environ, "CVLLM_MASTER_ADDR"),
                     int(_require(environ, "CVLLM_MASTER_PORT")), "gloo")


def detect_launch_env(environ: Optional[Mapping[str, str]] = None, *,
                      device_ids: Sequence[int] = (0,), num_nodes: int = 1, node_rank: int = 0,
                      master_addr: Optional[str] = None, master_port: Optional[int] = None,
                      multithread: bool = False) -> LaunchEnv:
    """Read this process's ``LaunchEnv`` from ``environ`` (default ``os.environ``) and the
    CLI values; bad combinations raise ``ConfigError`` saying which flags clash."""
    environ = os.environ if environ is None else environ
    n_dev = len(device_ids)
    if n_dev < 1:
        raise ConfigError("--device-ids names no device")
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ConfigError(f"--node-rank {node_rank} must be in [0, --num-nodes {num_nodes})")
    try:
        child = _child_env(environ, device_ids, num_nodes, node_rank)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad CVLLM_* launch variables: {e}") from None
    if child is not None:
        return child
    launched = _mpi_env(environ, master_addr, master_port) or _torchrun_env(environ)
    if launched is not None:
        _check_launcher_flags(launched, n_dev, num_nodes, multithread)
        return launched
    return _own_launch(n_dev, num_nodes, node_rank, master_addr, master_port, multithread)


def _check_launcher_flags(launched: LaunchEnv, n_dev: int, num_nodes: int,
                          multithread: bool) -> None:
    """mpirun and torchrun set the world themselves: the flags that would set it clash."""
    if multithread:
        raise ConfigError(f"--multithread runs ranks as threads of one process; it "
                          f"cannot be combined with {launched.mode}")
    if num_nodes > 1:
        raise ConfigError(f"--num-nodes is for SSH-driven runs; under {launched.mode} "
                          "the launcher already sets the world")
    if n_dev > 1 and n_dev != launched.local_world_size:
        raise ConfigError(
            f"{launched.mode} starts {launched.local_world_size} ranks on this node but "
            f"--device-ids names {n_dev} devices; give one per local rank (or one)"
        )


def _own_launch(n_dev: int, num_nodes: int, node_rank: int, master_addr: Optional[str],
                master_port: Optional[int], multithread: bool) -> LaunchEnv:
    """No launcher: cvllm starts the ranks itself (threads, SSH nodes, spawned processes)
    or runs one process."""
    if multithread:
        if num_nodes > 1:
            raise ConfigError("--multithread runs on one node; it cannot take --num-nodes > 1")
        return LaunchEnv("multithread", 0, n_dev, 0, n_dev, 0, 1, LOOPBACK, 0, "inprocess")
    if num_nodes > 1:
        if not master_addr:
            raise ConfigError("--num-nodes > 1 needs --master-addr (the address of node 0)")
        return LaunchEnv("ssh", node_rank * n_dev, num_nodes * n_dev, 0, n_dev, node_rank,
                         num_nodes, master_addr, master_port or DEFAULT_MASTER_PORT, "gloo")
    if n_dev > 1:
        addr = master_addr or LOOPBACK
        return LaunchEnv("spawn", 0, n_dev, 0, n_dev, 0, 1, addr,
                         master_port or find_free_port_pair(addr), "gloo")
    return LaunchEnv("single", 0, 1, 0, 1, 0, 1, master_addr or LOOPBACK, master_port or 0,
                     "none")


def child_environ(env: LaunchEnv, local_rank: int,
                  base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment of the process for ``local_rank`` that node-local rank 0 spawns
    (spawn and ssh modes): what ``detect_launch_env`` reads back in the child."""
    if env.mode not in ("spawn", "ssh"):
        raise ValueError(f"only spawn and ssh parents start children, not {env.mode}")
    out = dict(os.environ if base is None else base)
    out.update({
        "CVLLM_RANK": str(env.node_rank * env.local_world_size + local_rank),
        "CVLLM_WORLD_SIZE": str(env.world_size),
        "CVLLM_LOCAL_RANK": str(local_rank),
        "CVLLM_LOCAL_WORLD_SIZE": str(env.local_world_size),
        "CVLLM_NODE_RANK": str(env.node_rank),
        "CVLLM_NUM_NODES": str(env.num_nodes),
        "CVLLM_MASTER_ADDR": env.master_addr,
        "CVLLM_MASTER_PORT": str(env.master_port),
        "CVLLM_LAUNCH_MODE": env.mode,
        "NCCL_NVLS_ENABLE": "0",
    })
    return out


def local_device_id(env: LaunchEnv, device_ids: Sequence[int]) -> int:
    """The device this rank drives: ``device_ids[local_rank]`` when one id per local rank
    is given, else ``device_ids[0] + local_rank`` (torchrun / mpirun with the default)."""
    if len(device_ids) == env.local_world_size:
        return int(device_ids[env.local_rank])
    if len(device_ids) == 1:
        return int(device_ids[0]) + env.local_rank
    raise ConfigError(f"--device-ids names {len(device_ids)} devices for "
                      f"{env.local_world_size} local ranks")


def find_free_port_pair(addr: str = LOOPBACK, attempts: int = 50) -> int:
    """A port ``p`` such that ``p`` (rendezvous) and ``p + 1`` (health) are both free on
    ``addr`` right now."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a, \
                    socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b:
                a.bind((addr, port))
                b.bind((addr, port + 1))
            return port
        except OSError:
            continue
    raise OSError(f"no two consecutive free TCP ports on {addr} after {attempts} tries")

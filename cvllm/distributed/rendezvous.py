"""Joining the job and leaving it: the bind address, the rendezvous (agreed over MPI under
mpirun), torch.distributed's process groups and the model-parallel state.

Called once per process rank after ``detect_launch_env`` (``launch_env.py``): by
``runtime/spmd.py`` (``init_distributed``; ``resolve_bind`` for the health link's
address) and, when the job is over, ``runtime/supervisor.leave_groups``
(``shutdown_distributed``). ``--multithread`` rank threads join through their shared
``InProcessGroup`` instead.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping, Optional

from cvllm.config import ConfigError
from cvllm.distributed.launch_env import LOOPBACK, LaunchEnv, find_free_port_pair

logger = logging.getLogger("cvllm.distributed")


def resolve_bind(bind: Optional[str] = None, environ: Optional[Mapping[str, str]] = None
                 ) -> tuple[Optional[str], Optional[str]]:
    """``--bind-interface`` / ``CVLLM_BIND_ADDR`` (an interface name like ``eth1`` or an
    IPv4 address) as ``(interface name or None, IPv4 address)``; ``(None, None)`` unset."""
    environ = os.environ if environ is None else environ
    bind = bind or environ.get("CVLLM_BIND_ADDR") or None
    if bind is None:
        return None, None
    import psutil

    interfaces = psutil.net_if_addrs()
    if bind in interfaces:
        addrs = [a.address for a in interfaces[bind] if a.family == socket.AF_INET]
        if not addrs:
            raise ConfigError(f"interface {bind!r} has no IPv4 address")
        return bind, addrs[0]
    try:
        socket.inet_aton(bind)
    except OSError:
        raise ConfigError(f"bind {bind!r} is neither a network interface "
                          f"({', '.join(sorted(interfaces))}) nor an IPv4 address") from None
    owner = next((name for name, addrs in interfaces.items()
                  if any(a.family == socket.AF_INET and a.address == bind for a in addrs)), None)
    return owner, bind


def apply_bind_environment(ifname: Optional[str]) -> None:
    """Environment every cvllm process sets before NCCL / gloo start: NVLink multicast
    off, and the socket interface when one is known."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if ifname:
        os.environ["NCCL_SOCKET_IFNAME"] = ifname
        os.environ["GLOO_SOCKET_IFNAME"] = ifname


def _routable_address(env: LaunchEnv) -> str:
    if env.num_nodes == 1:
        return LOOPBACK
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = LOOPBACK
    if addr.startswith("127."):
        raise ConfigError("cannot tell which address the other nodes reach this one on; "
                          "pass --bind-interface (or CVLLM_BIND_ADDR)")
    return addr


_ADDR_BUF = 256


def agree_master_over_mpi(env: LaunchEnv, bind_addr: Optional[str]) -> tuple[str, int]:
    """Rank 0 picks the rendezvous address and a free port pair, then broadcasts them
    with mpi4py as a fixed-size ASCII buffer (no pickle) to every rank."""
    from mpi4py import MPI  # lazy: libmpi only under mpirun

    comm = MPI.COMM_WORLD
    buf = bytearray(_ADDR_BUF)
    if comm.Get_rank() == 0:
        addr = env.master_addr or bind_addr or _routable_address(env)
        port = env.master_port or find_free_port_pair(addr)
        text = f"{addr} {port}".encode("ascii")
        if len(text) > _ADDR_BUF:
            raise ConfigError(f"rendezvous address {addr!r} is too long")
        buf[:len(text)] = text
    comm.Bcast([buf, MPI.BYTE], root=0)
    addr, port = bytes(buf).rstrip(b"\0").decode("ascii").split(" ")
    return addr, int(port)


def init_distributed(env: LaunchEnv, device, *, bind: Optional[str] = None,
                     inprocess_group=None, timeout_s: float = 600.0) -> LaunchEnv:
    """Join the job's process groups, then ``initialize_model_parallel`` (TP = world).

    gloo on the CPU; NCCL on CUDA plus a gloo cpu group. Under mpirun the rendezvous
    address is agreed over MPI first. Under --multithread pass the shared
    ``inprocess_group`` (each rank thread calls this with its own env). Returns ``env``
    with the rendezvous address and port filled in (the health port is port + 1)."""
    from dataclasses import replace

    from cvllm.distributed import parallel_state

    if env.mode == "single":
        parallel_state.initialize_model_parallel(0, 1)
        return env
    if env.mode == "multithread":
        if inprocess_group is None or inprocess_group.world_size != env.world_size:
            raise ValueError("--multithread needs the shared InProcessGroup of its world size")
        view = inprocess_group.rank_view(env.rank)
        parallel_state.initialize_model_parallel(env.rank, env.world_size, view, view,
                                                 thread_local=True)
        return env
    ifname, bind_addr = resolve_bind(bind)
    apply_bind_environment(ifname)
    if env.mode == "mpirun":
        addr, port = agree_master_over_mpi(env, bind_addr)
        env = replace(env, master_addr=addr, master_port=port)
    _init_torch_groups(env, device, timeout_s)
    return env


def _init_torch_groups(env: LaunchEnv, device, timeout_s: float) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from cvllm.distributed import parallel_state

    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    logger.info("rank %d/%d joining %s rendezvous at %s:%d (%s)", env.rank, env.world_size,
                backend, env.master_addr, env.master_port, env.mode)
    # torchrun's agent already serves the store on MASTER_PORT: join it through env://.
    init = "env://" if env.mode == "torchrun" else f"tcp://{host}:{env.master_port}"
    dist.init_process_group(backend, init_method=init,
                            rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s))
    world = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else world
    parallel_state.initialize_model_parallel(env.rank, env.world_size, world, cpu_group)
    if backend == "nccl" and env.world_size > 1:
        from cvllm.distributed import custom_allreduce

        custom_allreduce.maybe_enable(world, cpu_group, device, env.rank, env.world_size,
                                      single_node=env.num_nodes == 1)


def shutdown_distributed() -> None:
    """Leave the process groups (clean exit) and reset the model-parallel state."""
    from cvllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    from cvllm.distributed import custom_allreduce

    custom_allreduce.disable()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            # Destroying NCCL communicators waits for peers that may already have gone
            # (an H200 run hung here after SHUTDOWN); the driver frees them at exit.
            return
        dist.destroy_process_group()


def abort_job(env: LaunchEnv, code: int = 1) -> None:
    """End the whole job after a fatal error on this rank instead of letting the others
    hang in a collective: MPI Abort under mpirun, else exit this process at once (the
    other ranks notice through the control plane or the health link)."""
    logging.shutdown()
    if env.transport == "mpi":
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    os._exit(code)

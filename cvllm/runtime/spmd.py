"""The per-rank pieces of the SPMD job, and rank 0's side of the lockstep.

``runtime/job.run_job`` (called once per process by ``cli.py``) detects the launch and
picks the mode; this module runs a rank that is a process (``run_process_rank``) and
holds what the ``--multithread`` mode (``runtime/threads.py``) shares with it
(``ParallelOptions``, ``SPMDRunner``, ``Rank0``, ``run_rank0``; ``JobSupervisor`` is
``runtime/supervisor.py``). It imports neither ``job.py`` nor ``threads.py``: the imports
go job -> threads -> spmd -> worker_rank -> supervisor -> launcher.
A process rank: (spawn / ssh: node-local rank 0 starts the node's other ranks,
``runtime/launcher.py``) -> NUMA pinning (logged) -> the health link (rank 0 listens,
the others report) -> ``init_distributed`` -> the control plane -> rank 0 builds the
``LLMEngine`` around an ``SPMDRunner`` and runs ``rank0_main``; every other rank builds
its ``ModelRunner`` and runs ``worker/worker_loop.py`` (``runtime/worker_rank.py``).

Faults (docs/distributed.md): ``JobSupervisor`` turns any failure into the end of the
whole job: rank 0 marks its engine failed (``/health`` 503), waits ``grace_s`` so load
balancers see it, then ``launcher.abort_job`` (MPI Abort under mpirun, else kill the
spawned ranks and ``os._exit``). A worker that fails reports the traceback over the
health link and aborts at once; rank 0's ``HealthMonitor`` notices a worker that dies or
goes silent. After rank 0's main returns, SHUTDOWN reaches every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from cvllm.config import ConfigError
from cvllm.core.wire_format import MessageKind
from cvllm.runtime.launcher import LocalRanks
from cvllm.runtime.supervisor import SHUTDOWN_WAIT_S, JobSupervisor, abort_after, leave_groups
from cvllm.runtime.worker_rank import run_worker_rank
from cvllm.worker.worker_loop import FaultInjector

logger = logging.getLogger("cvllm.spmd")


@dataclass(frozen=True)
class ParallelOptions:
    """The launch flags of ``cvllm serve`` / ``generate`` (identical on every rank)."""

    device_ids: Tuple[int, ...] = (0,)
    cpu: bool = False
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    multithread: bool = False
    bind: Optional[str] = None
    """``--bind-interface``: an interface name (eth0) or an address for the control plane,
    the health link and NCCL / gloo; exported as ``CVLLM_BIND_ADDR``."""
    argv: Tuple[str, ...] = ()
    """This process's arguments after ``cvllm``: spawned ranks rerun them."""
    log_file: Optional[str] = None
    log_level: str = "INFO"
    shutdown_timeout_s: Optional[float] = None
    """``serve --shutdown-timeout``: how long rank 0 drains after SIGTERM; bounds how
    long a signalled worker waits for SHUTDOWN (None: ``worker_rank.WORKER_SIGTERM_WAIT_S``)."""


class SPMDRunner:
    """Rank 0's ``ModelRunner`` wrapper: every ``execute`` / ``launch`` first broadcasts
    the step to the other ranks, then runs it here; anything else passes through. A
    failing step is reported to the supervisor (which ends the job) and re-raised."""

    _STEP_METHODS = ("execute", "launch")

    def __init__(self, runner: Any, control: Any, supervisor: "JobSupervisor",
                 fault: Optional[FaultInjector] = None) -> None:
        self._runner = runner
        self._control = control
        self._supervisor = supervisor
        self._fault = fault if fault is not None else FaultInjector.from_env()
        self._last_step_id = 0

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._runner, name)  # AttributeError when the runner has none
        if name in self._STEP_METHODS and callable(target):
            return lambda step, *args, **kw: self._run_step(target, step, *args, **kw)
        return target

    def execute(self, step, sampling=None):
        return self._run_step(self._runner.execute, step, sampling)

    def _run_step(self, method: Callable, step, *args, **kw):
        try:
            self._fault.check(0, step.step_id)
            self._control.broadcast(MessageKind.STEP, step.step_id, step.pack())
            self._last_step_id = step.step_id
            return method(step, *args, **kw)
        except BaseException as e:
            self._supervisor.fail(f"rank 0: step {step.step_id} failed: {e!r}")
            raise

    def shutdown(self) -> None:
        """SHUTDOWN to every rank (after the engine thread stopped)."""
        self._control.broadcast(MessageKind.SHUTDOWN, self._last_step_id)


@dataclass
class Rank0:
    """What rank 0's main function gets: build the engine, watch it, and the job."""

    env: Any
    engine_options: Dict[str, Any]
    supervisor: Optional[JobSupervisor] = None
    control: Any = None
    device: Any = None
    _runner: Optional[SPMDRunner] = field(default=None, repr=False)

    @property
    def tp_size(self) -> int:
        return self.env.world_size if self.env is not None else 1

    def build_engine(self):
        """(LLMEngine, sampling defaults); with several ranks the runner broadcasts."""
        from cvllm.engine import builder

        if self.tp_size == 1:
            return builder.build_llm_engine(**self.engine_options)

        def wrap(runner):
            self._runner = SPMDRunner(runner, self.control, self.supervisor)
            return self._runner

        return builder.build_llm_engine(**self.engine_options, rank=0, tp_size=self.tp_size,
                                        device=self.device, wrap_runner=wrap)

    def watch(self, async_engine: Any) -> None:
        """A failure anywhere marks ``async_engine`` failed (``/health`` 503)."""
        if self.supervisor is not None:
            self.supervisor.add_listener(async_engine.fail)

    def shutdown(self) -> None:
        if self.control is None:
            return
        if self._runner is not None:
            self._runner.shutdown()
        else:
            self.control.broadcast(MessageKind.SHUTDOWN, 0)


def rank_device(env, par: ParallelOptions):
    from cvllm.distributed.launch_env import local_device_id
    from cvllm.engine.builder import pick_device

    return pick_device(par.cpu, [local_device_id(env, par.device_ids)])


def _is_spawner(env) -> bool:
    return env.mode in ("spawn", "ssh") and "CVLLM_RANK" not in os.environ


def run_process_rank(env, par: ParallelOptions, engine_options: Dict[str, Any],
                      rank0_main: Callable[[Rank0], None]) -> None:
    from cvllm.engine.builder import build_engine_config

    device = rank_device(env, par)
    if env.rank == 0:  # a flag or model that cannot work fails before any rank starts
        build_engine_config(**engine_options, tp_size=env.world_size, device=device)
    children = LocalRanks() if _is_spawner(env) else None
    supervisor = JobSupervisor(env.transport, children)
    if children is not None:
        children._on_exit = supervisor.child_exited
        _spawn_local_ranks(env, par, children)
    try:
        _pin_numa(env, device)
        link = _start_health(env, supervisor) if env.transport != "mpi" else None
        env = _init_distributed(env, device)
        if link is None:  # under mpirun the port is agreed in init_distributed
            link = _start_health(env, supervisor)
        from cvllm.distributed.control_plane import make_control_plane

        control = make_control_plane(env)
    except ConfigError:
        if children is not None:
            children.kill()
        raise
    except BaseException as e:
        abort_after(env, supervisor, f"rank {env.rank}: start-up failed: {e!r}", e)
    if env.rank == 0:
        run_rank0(env, engine_options, rank0_main, supervisor, control, device, link)
    else:
        run_worker_rank(env, engine_options, control, device, link, supervisor,
                        par.shutdown_timeout_s)


def _spawn_local_ranks(env, par: ParallelOptions, children: LocalRanks) -> None:
    from cvllm.distributed.launch_env import child_environ

    for local_rank in range(1, env.local_world_size):
        environ = child_environ(env, local_rank)
        children.spawn(int(environ["CVLLM_RANK"]), par.argv, environ)


def _pin_numa(env, device) -> None:
    """Pin to the NUMA node of this rank's GPU (or MAP_NUMA_NODE). CPU ranks share the
    node's cores: each takes an equal part for its intra-op threads (unless
    OMP_NUM_THREADS says otherwise), so N ranks do not run N x cores threads."""
    from cvllm.distributed import numa

    dev = f"cuda:{device.device_ids[0]}" if device.device == "cuda" else "cpu"
    logger.info("rank %d: %s", env.rank, numa.pin_to_numa_node(env.local_rank, dev))
    if device.device == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        import torch

        threads = max(1, len(os.sched_getaffinity(0)) // env.local_world_size)
        torch.set_num_threads(threads)
        logger.info("rank %d: %d CPU threads", env.rank, threads)


def _init_distributed(env, device):
    """Join the process groups; returns ``env`` with the agreed rendezvous address."""
    import torch

    from cvllm.distributed.rendezvous import init_distributed

    dev = torch.device(device.device, device.device_ids[0]) if device.device == "cuda" \
        else torch.device("cpu")
    return init_distributed(env, dev)


def _start_health(env, supervisor: JobSupervisor):
    """Rank 0: the monitor (a dead or silent worker fails the job), bound to
    ``--bind-interface`` or the rendezvous address; others: a reporter that forwards its
    WARNING+ records (and, unless its stderr is already relayed by a spawning parent, its
    stderr lines) to rank 0's log."""
    from cvllm.distributed import health, health_reporter
    from cvllm.distributed.rendezvous import resolve_bind

    if env.rank == 0:
        bind = resolve_bind()[1] or env.master_addr or "127.0.0.1"
        monitor = health.HealthMonitor(bind, env.health_port, env.world_size)
        monitor.on_failure(lambda reason: supervisor.fail(f"worker failure: {reason}"))
        return monitor
    reporter = health_reporter.HealthReporter(env.master_addr, env.health_port, env.rank)
    if "CVLLM_RANK" not in os.environ:  # mpirun / torchrun: nobody else relays stderr
        reporter.install_log_handler()
        reporter.forward_stderr()
    return reporter


def run_rank0(env, engine_options, rank0_main, supervisor, control, device,
              monitor) -> None:
    """Rank 0 after start-up: its main, then SHUTDOWN to every rank (also --multithread)."""
    rank0 = Rank0(env, engine_options, supervisor, control, device)
    try:
        rank0_main(rank0)
    except SystemExit as e:
        if e.code:
            abort_after(env, supervisor, f"rank 0 exited with status {e.code}", e)
    except BaseException as e:  # noqa: BLE001 - any failure ends the job
        abort_after(env, supervisor, f"rank 0 failed: {e!r}", e)
    if supervisor.failure is not None:  # the abort thread is on its way
        time.sleep(supervisor.grace_s + 5)
    if monitor is not None:
        monitor.stopping()
    rank0.shutdown()
    control.close()
    if supervisor.children is not None and not supervisor.children.wait(SHUTDOWN_WAIT_S):
        logger.warning("spawned ranks did not exit %.0f s after SHUTDOWN: killing them",
                       SHUTDOWN_WAIT_S)
        supervisor.children.terminate()
    if monitor is not None:
        monitor.close()
    leave_groups()


def thread_env(env, rank: int):
    """The ``LaunchEnv`` of rank thread ``rank`` under --multithread."""
    return dataclasses.replace(env, rank=rank, local_rank=rank)

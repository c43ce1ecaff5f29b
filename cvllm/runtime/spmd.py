"""The per-rank pieces of the SPMD job, and rank 0's side of the lockstep.

``runtime/job.run_job`` (called once per process by ``cli.py``) detects the launch and
picks the mode; this module runs a rank that is a process (``run_process_rank``) and
holds what the ``--multithread`` mode (``runtime/threads.py``) shares with it
(``ParallelOptions``, ``SPMDRunner``, ``JobSupervisor``, ``Rank0``, ``run_rank0``). It
imports neither ``job.py`` nor ``threads.py``: the imports go job -> threads -> spmd.
A process rank: (spawn / ssh: node-local rank 0 starts the node's other ranks,
``runtime/launcher.py``) -> NUMA pinning (logged) -> the health link (rank 0 listens,
the others report) -> ``init_distributed`` -> the control plane -> rank 0 builds the
``LLMEngine`` around an ``SPMDRunner`` and runs ``rank0_main``; every other rank builds
its ``ModelRunner`` and runs ``worker/worker_loop.py``.

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
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from cvllm.config import ConfigError
from cvllm.core.wire_format import MessageKind
from cvllm.runtime.launcher import LocalRanks, abort_job
from cvllm.worker.worker_loop import FaultInjector

logger = logging.getLogger("cvllm.spmd")

FAILURE_GRACE_S = 5.0
"""Rank 0 keeps answering ``/health`` with 503 this long before it ends the job."""
SHUTDOWN_WAIT_S = 30.0
"""After SHUTDOWN, how long rank 0 waits for the ranks it spawned to exit."""
WORKER_SIGTERM_WAIT_S = 90.0
"""A worker that got SIGTERM / SIGINT waits this long for rank 0's SHUTDOWN (rank 0
drains first, ``server/lifecycle.py``), then leaves; with ``--shutdown-timeout`` (serve)
it waits that timeout plus WORKER_GRACE_S instead."""
WORKER_GRACE_S = 3.0
"""Rank 0 aborts what is left at the shutdown timeout and sends SHUTDOWN about a second
later; a worker waits this long past the timeout (the bound is 5 s)."""
WORKER_SECOND_SIGNAL_WAIT_S = 2.5
"""After a second SIGTERM / SIGINT a worker waits this much more for SHUTDOWN (rank 0,
signalled too, aborts and sends it at once), then leaves."""
EXIT_DEADLINE_S = 4.5
"""A signalled rank is gone this long after its shutdown timeout (or after a second
signal) whatever hangs (``utils/exit_deadline.py``); after SHUTDOWN a worker is gone
within EXIT_AFTER_SHUTDOWN_S."""
EXIT_AFTER_SHUTDOWN_S = 2.0


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
    long a signalled worker waits for SHUTDOWN (None: WORKER_SIGTERM_WAIT_S)."""


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


class JobSupervisor:
    """Rank 0 (and any spawner): the first failure ends the whole job, once. Failures
    reported during the grace period are named in the final message too: when a worker
    dies, rank 0's own transport error often arrives before the news of the death."""

    MAX_LATER = 4
    """Later failures kept for the final message."""

    def __init__(self, transport: str, children: Optional[LocalRanks] = None,
                 grace_s: float = FAILURE_GRACE_S) -> None:
        self.transport = transport
        self.children = children
        self.grace_s = grace_s
        self.failure: Optional[str] = None
        self.later: List[str] = []
        self._listeners: List[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def add_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(reason)`` runs at the first failure (e.g. ``AsyncEngine.fail``)."""
        self._listeners.append(fn)
        if self.failure is not None:
            fn(self.failure)

    def fail(self, reason: str, code: int = 1, grace_s: Optional[float] = None) -> None:
        with self._lock:
            if self.failure is not None:
                first_line = reason.splitlines()[0] if reason else reason
                if len(self.later) < self.MAX_LATER and first_line not in self.later:
                    self.later.append(first_line)
                return
            self.failure = reason
        logger.error("job failure: %s", reason.splitlines()[0] if reason else reason)
        for fn in self._listeners:
            try:
                fn(reason)
            except Exception:  # noqa: BLE001 - the job ends anyway
                logger.exception("failure listener raised")
        wait = self.grace_s if grace_s is None else grace_s
        threading.Thread(target=self._abort_later, args=(reason, code, wait), daemon=True,
                         name="cvllm-abort").start()

    def _abort_later(self, reason: str, code: int, wait: float) -> None:
        time.sleep(wait)
        abort_job(self.transport, self.final_reason(), code, self.children)

    def final_reason(self) -> str:
        """The first failure, then any reported after it ('; also: ...')."""
        with self._lock:
            later = list(self.later)
        reason = self.failure or ""
        return reason + "".join(f"; also: {r}" for r in later)

    def child_exited(self, rank: int, code: int) -> None:
        if code != 0:
            self.fail(f"rank {rank} exited with status {code}")


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
        _abort_after(env, supervisor, f"rank {env.rank}: start-up failed: {e!r}", e)
    if env.rank == 0:
        run_rank0(env, engine_options, rank0_main, supervisor, control, device, link)
    else:
        _worker(env, engine_options, control, device, link, supervisor,
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

    from cvllm.distributed.launch_env import init_distributed

    dev = torch.device(device.device, device.device_ids[0]) if device.device == "cuda" \
        else torch.device("cpu")
    return init_distributed(env, dev)


def _start_health(env, supervisor: JobSupervisor):
    """Rank 0: the monitor (a dead or silent worker fails the job), bound to
    ``--bind-interface`` or the rendezvous address; others: a reporter that forwards its
    WARNING+ records (and, unless its stderr is already relayed by a spawning parent, its
    stderr lines) to rank 0's log."""
    from cvllm.distributed import health
    from cvllm.distributed.launch_env import resolve_bind

    if env.rank == 0:
        bind = resolve_bind()[1] or env.master_addr or "127.0.0.1"
        monitor = health.HealthMonitor(bind, env.health_port, env.world_size)
        monitor.on_failure(lambda reason: supervisor.fail(f"worker failure: {reason}"))
        return monitor
    reporter = health.HealthReporter(env.master_addr, env.health_port, env.rank)
    if "CVLLM_RANK" not in os.environ:  # mpirun / torchrun: nobody else relays stderr
        reporter.install_log_handler()
        reporter.forward_stderr()
    return reporter


def _exit_code(err: BaseException) -> int:
    """2 for a mistake the user can fix (printed as one ``cvllm: error:`` line, as a
    single process does), the status of a ``SystemExit``, else 1."""
    from cvllm.loader.errors import ModelLoadError
    from cvllm.models.registry import UnsupportedArchitectureError

    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else 1
    if isinstance(err, (ConfigError, ModelLoadError, UnsupportedArchitectureError)):
        print(f"cvllm: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 1


def _abort_after(env, supervisor: JobSupervisor, reason: str, err: BaseException,
                 link: Any = None) -> None:
    """Log ``err`` with its traceback (and send it over the health link), then end the
    job now (never returns)."""
    code = _exit_code(err)
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    logger.error("%s\n%s", reason, text)
    if link is not None and hasattr(link, "error"):
        try:
            link.error(text)  # rank 0 logs it as "rank N failed: <traceback>"
        except Exception:  # noqa: BLE001 - aborting anyway
            pass
    abort_job(env.transport, reason, code or 1, supervisor.children)


def run_rank0(env, engine_options, rank0_main, supervisor, control, device,
              monitor) -> None:
    """Rank 0 after start-up: its main, then SHUTDOWN to every rank (also --multithread)."""
    rank0 = Rank0(env, engine_options, supervisor, control, device)
    try:
        rank0_main(rank0)
    except SystemExit as e:
        if e.code:
            _abort_after(env, supervisor, f"rank 0 exited with status {e.code}", e)
    except BaseException as e:  # noqa: BLE001 - any failure ends the job
        _abort_after(env, supervisor, f"rank 0 failed: {e!r}", e)
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
    _leave_groups()


def _leave_groups() -> None:
    from cvllm.distributed.launch_env import shutdown_distributed

    try:
        shutdown_distributed()
    except Exception as e:  # noqa: BLE001 - the job is over; only say why
        logger.warning("leaving the process groups failed: %s", e)


def _worker(env, engine_options, control, device, reporter, supervisor,
            shutdown_timeout_s: Optional[float] = None) -> None:
    from cvllm.engine.builder import build_engine_config
    from cvllm.utils.exit_deadline import exit_by
    from cvllm.worker.worker_loop import run_worker

    stop_requested = _defer_termination(shutdown_timeout_s)
    try:
        setup = build_engine_config(**engine_options, tp_size=env.world_size, device=device)
        run_worker(env, setup.config, setup.source, control, stop_requested=stop_requested)
    except BaseException as e:  # noqa: BLE001 - any failure ends the job
        _abort_after(env, supervisor, f"rank {env.rank} failed: {e!r}", e, reporter)
    # The job is over: leaving (health link, process groups, MPI) must not hang.
    exit_by(EXIT_AFTER_SHUTDOWN_S, f"rank {env.rank} after SHUTDOWN", code=0)
    if reporter is not None:
        reporter.close()
    control.close()
    if supervisor.children is not None and not supervisor.children.wait(SHUTDOWN_WAIT_S):
        supervisor.children.terminate()
    if getattr(device, "type", device) == "cuda" and env.transport != "inprocess":
        _exit_now(env)  # NCCL teardown can block on a peer that already left
    _leave_groups()


def _exit_now(env) -> None:
    """A worker's clean exit on GPUs after SHUTDOWN: flush, finalize MPI, leave without
    destroying the NCCL communicators (the driver frees them with the process)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if env.transport == "mpi":
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(0)


def _defer_termination(shutdown_timeout_s: Optional[float] = None) -> Callable[[], bool]:
    """Workers: SIGTERM / SIGINT (mpirun and torchrun forward them to every rank) do not
    stop the rank at once; it waits for rank 0's SHUTDOWN, at most the shutdown timeout
    plus WORKER_GRACE_S (WORKER_SIGTERM_WAIT_S without one), or WORKER_SECOND_SIGNAL_WAIT_S
    after a second signal; the exit deadline bounds the rest. Returns ``stop_requested``
    for the worker loop: true once the rank should give up waiting."""
    times: List[float] = []
    wait = WORKER_SIGTERM_WAIT_S if shutdown_timeout_s is None \
        else shutdown_timeout_s + WORKER_GRACE_S

    def handler(signum, _frame) -> None:
        from cvllm.utils.exit_deadline import exit_by

        name = signal.Signals(signum).name
        times.append(time.monotonic())
        if len(times) == 1:
            logger.info("%s: waiting for rank 0's SHUTDOWN (at most %.0f s)", name, wait)
            if shutdown_timeout_s is not None:
                exit_by(shutdown_timeout_s + EXIT_DEADLINE_S, f"{name} on a worker")
        elif len(times) == 2:
            logger.warning("second %s: waiting at most %.1f s more for SHUTDOWN", name,
                           WORKER_SECOND_SIGNAL_WAIT_S)
            exit_by(EXIT_DEADLINE_S, f"second {name} on a worker")

    def stop_requested() -> bool:
        now = time.monotonic()
        return bool(times) and (now - times[0] > wait or (
            len(times) > 1 and now - times[1] > WORKER_SECOND_SIGNAL_WAIT_S))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop_requested


def thread_env(env, rank: int):
    """The ``LaunchEnv`` of rank thread ``rank`` under --multithread."""
    return dataclasses.replace(env, rank=rank, local_rank=rank)

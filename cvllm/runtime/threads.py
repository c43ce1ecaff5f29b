"""``--multithread``: every rank is a thread of this one process (candle-vllm's debugging
mode; no sockets, no torch.distributed).

Called by ``runtime/job.run_job`` on the main thread. The main thread is rank 0: it joins
the process-wide TP group (``parallel_state`` without ``thread_local``, so the engine
thread that runs its forwards sees the same group); ranks 1..N-1 are threads with
thread-local groups, all views of one ``InProcessGroup``, and receive rank 0's steps on
an ``InProcessControlPlane``. A failing rank thread fails the job like a failing worker
process (``JobSupervisor``): the group is aborted (no thread stays stuck in a
collective), ``/health`` turns 503, and the process exits non-zero after the grace.
"""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Any, Callable, Dict, List

from cvllm.runtime.spmd import ParallelOptions, Rank0, rank_device, run_rank0, thread_env
from cvllm.runtime.supervisor import JobSupervisor

logger = logging.getLogger("cvllm.spmd")

JOIN_TIMEOUT_S = 30.0


def run_threads(env, par: ParallelOptions, engine_options: Dict[str, Any],
                rank0_main: Callable[[Rank0], None]) -> None:
    from cvllm.distributed import parallel_state
    from cvllm.distributed.control_plane import make_control_plane
    from cvllm.distributed.inprocess import InProcessGroup
    from cvllm.engine.builder import build_engine_config

    device = rank_device(env, par)
    build_engine_config(**engine_options, tp_size=env.world_size, device=device)
    group = InProcessGroup(env.world_size)
    supervisor = JobSupervisor(env.transport)
    supervisor.add_listener(lambda _reason: group.abort())
    threads: List[threading.Thread] = []
    for rank in range(1, env.world_size):
        t = threading.Thread(target=_rank_thread, name=f"cvllm-rank{rank}", daemon=True,
                             args=(thread_env(env, rank), par, engine_options, group, supervisor))
        t.start()
        threads.append(t)
    view = group.rank_view(0)
    parallel_state.initialize_model_parallel(0, env.world_size, view, view)
    control = make_control_plane(env, inprocess_group=group)
    run_rank0(env, engine_options, rank0_main, supervisor, control, device, None)
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    parallel_state.destroy_model_parallel()


def _rank_thread(env, par: ParallelOptions, engine_options: Dict[str, Any], group,
                 supervisor: JobSupervisor) -> None:
    from cvllm.distributed import parallel_state
    from cvllm.distributed.control_plane import make_control_plane
    from cvllm.engine.builder import build_engine_config
    from cvllm.worker.worker_loop import run_worker

    try:
        view = group.rank_view(env.rank)
        parallel_state.initialize_model_parallel(env.rank, env.world_size, view, view,
                                                 thread_local=True)
        control = make_control_plane(env, inprocess_group=group)
        device = rank_device(env, par)
        setup = build_engine_config(**engine_options, tp_size=env.world_size, device=device)
        run_worker(env, setup.config, setup.source, control)
    except BaseException as e:  # noqa: BLE001 - any failure ends the job
        if supervisor.failure is None:
            logger.error("rank %d failed: %r\n%s", env.rank, e, traceback.format_exc())
        supervisor.fail(f"rank {env.rank} failed: {e!r}")

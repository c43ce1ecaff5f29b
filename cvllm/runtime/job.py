"""The entry of every rank: ``run_job``, called once per process by ``cli.py``.

Detects the launch (``detect_launch_env``), starts per-rank logging, then picks the
mode: a single process runs rank 0's main directly; ``--multithread`` runs the ranks as
threads of this process (``runtime/threads.py``); every other launch runs this process
as one rank (``runtime/spmd.run_process_rank``). Both modes import their shared pieces
from ``runtime/spmd.py``, never this module, so the imports have no circle.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict

from cvllm.runtime.spmd import ParallelOptions, Rank0, run_process_rank
from cvllm.runtime.threads import run_threads

logger = logging.getLogger("cvllm.spmd")


def run_job(par: ParallelOptions, engine_options: Dict[str, Any],
            rank0_main: Callable[[Rank0], None]) -> None:
    """Run this process's part of the job (see the module docstring). Returns on rank 0
    after its main returned and the other ranks were shut down; on other ranks it
    returns after SHUTDOWN. Failures end the job (``JobSupervisor``)."""
    from cvllm.distributed.launch_env import detect_launch_env
    from cvllm.logger import init_logging

    if par.bind:
        os.environ["CVLLM_BIND_ADDR"] = par.bind
    env = detect_launch_env(device_ids=par.device_ids, num_nodes=par.num_nodes,
                            node_rank=par.node_rank, master_addr=par.master_addr,
                            master_port=par.master_port, multithread=par.multithread)
    init_logging(env.rank, par.log_file, par.log_level)
    if env.mode == "single":
        rank0_main(Rank0(None, engine_options))
        return
    logger.info("rank %d of %d (%s, local rank %d of %d, node %d of %d)", env.rank,
                env.world_size, env.mode, env.local_rank, env.local_world_size,
                env.node_rank, env.num_nodes)
    if env.mode == "multithread":
        run_threads(env, par, engine_options, rank0_main)
        return
    run_process_rank(env, par, engine_options, rank0_main)

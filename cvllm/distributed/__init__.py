"""Tensor parallelism across processes, nodes and threads: who am I (``launch_env``),
joining the job (``rendezvous``), process groups (``parallel_state``), collectives
(``comm``), the rank-0 control plane (``control_plane``), the worker liveness link
(``health``, ``health_reporter``) and NUMA pinning (``numa``).

Nothing is imported here so that ``import cvllm`` never loads torch.distributed or libmpi.
"""

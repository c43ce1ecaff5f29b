"""detect_launch_env: every launch mode from its environment, and the clashes."""

import socket

import pytest

from cvllm.config import ConfigError
from cvllm.distributed.launch_env import (
    LaunchEnv, child_environ, detect_launch_env, find_free_port_pair, local_device_id,
)
from cvllm.distributed.rendezvous import resolve_bind

OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "10.0.0.5",
            "MASTER_PORT": "29400"}


def test_single():
    env = detect_launch_env({})
    assert (env.mode, env.rank, env.world_size, env.transport) == ("single", 0, 1, "none")
    assert env.is_driver


def test_open_mpi():
    env = detect_launch_env(OMPI)
    assert (env.mode, env.rank, env.world_size, env.local_rank, env.local_world_size) == \
        ("mpirun", 3, 4, 1, 2)
    assert (env.node_rank, env.num_nodes, env.transport) == (1, 2, "mpi")
    assert (env.master_addr, env.master_port) == ("", 0)  # agreed over MPI later


def test_pmi_fallback():
    env = detect_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                             "MPI_LOCALNRANKS": "2"})
    assert (env.mode, env.rank, env.world_size, env.local_rank) == ("mpirun", 1, 2, 1)
    env = detect_launch_env({"PMIX_RANK": "0", "PMI_SIZE": "2"})
    assert (env.rank, env.world_size, env.local_world_size, env.num_nodes) == (0, 2, 2, 1)


def test_torchrun():
    env = detect_launch_env(TORCHRUN)
    assert (env.mode, env.rank, env.world_size, env.local_rank, env.transport) == \
        ("torchrun", 1, 2, 1, "gloo")
    assert (env.master_addr, env.master_port, env.health_port) == ("10.0.0.5", 29400, 29401)
    plain = detect_launch_env({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                               "LOCAL_WORLD_SIZE": "2"})
    assert (plain.mode, plain.num_nodes, plain.node_rank) == ("torchrun", 2, 0)


def test_spawn_parent_and_child_round_trip():
    parent = detect_launch_env({}, device_ids=(0, 1, 2))
    assert (parent.mode, parent.rank, parent.world_size, parent.transport) == \
        ("spawn", 0, 3, "gloo")
    assert parent.master_addr == "127.0.0.1" and 0 < parent.master_port < 65535
    for local in (1, 2):
        child_env = child_environ(parent, local, base={})
        assert child_env["NCCL_NVLS_ENABLE"] == "0"
        child = detect_launch_env(child_env, device_ids=(0, 1, 2))
        assert child.mode == "spawn" and child.rank == local and child.local_rank == local
        assert (child.master_addr, child.master_port) == (parent.master_addr, parent.master_port)


def test_ssh_node_and_children():
    node1 = detect_launch_env({}, device_ids=(0, 1), num_nodes=2, node_rank=1,
                              master_addr="10.0.0.1", master_port=30000)
    assert (node1.mode, node1.rank, node1.world_size, node1.local_rank, node1.node_rank) == \
        ("ssh", 2, 4, 0, 1)
    child = detect_launch_env(child_environ(node1, 1, base={}), device_ids=(0, 1),
                              num_nodes=2, node_rank=1, master_addr="10.0.0.1")
    assert (child.mode, child.rank, child.local_rank, child.node_rank, child.num_nodes) == \
        ("ssh", 3, 1, 1, 2)


def test_multithread():
    env = detect_launch_env({}, device_ids=(0, 1), multithread=True)
    assert (env.mode, env.world_size, env.transport) == ("multithread", 2, "inprocess")


@pytest.mark.parametrize("environ, kwargs, match", [
    (OMPI, {"multithread": True}, "cannot be combined with mpirun"),
    (TORCHRUN, {"num_nodes": 2, "master_addr": "a"}, "--num-nodes is for SSH"),
    (TORCHRUN, {"device_ids": (0, 1, 2)}, "names 3 devices"),
    ({}, {"num_nodes": 2}, "needs --master-addr"),
    ({}, {"num_nodes": 2, "node_rank": 2, "master_addr": "a"}, "--node-rank 2"),
    ({}, {"device_ids": ()}, "names no device"),
    ({}, {"multithread": True, "num_nodes": 2, "master_addr": "a"}, "one node"),
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, {}, "not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, {}, "outside a world"),
    ({"CVLLM_RANK": "1", "CVLLM_LAUNCH_MODE": "spawn"}, {}, "CVLLM_WORLD_SIZE is not set"),
    ({"CVLLM_RANK": "1", "CVLLM_LAUNCH_MODE": "bogus"}, {}, "expected spawn or ssh"),
])
def test_bad_combinations(environ, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        detect_launch_env(environ, **kwargs)


def test_local_device_id():
    env = detect_launch_env(TORCHRUN)
    assert local_device_id(env, [4, 5]) == 5
    assert local_device_id(env, [0]) == 1
    with pytest.raises(ConfigError):
        local_device_id(env, [0, 1, 2])


def test_launch_env_validates():
    with pytest.raises(ConfigError, match="unknown launch mode"):
        LaunchEnv("bogus", 0, 1, 0, 1, 0, 1, "", 0, "none")
    with pytest.raises(ConfigError, match="not a TCP port"):
        LaunchEnv("single", 0, 1, 0, 1, 0, 1, "", 70000, "none")


def test_free_port_pair_is_free():
    port = find_free_port_pair()
    for p in (port, port + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_resolve_bind():
    assert resolve_bind(None, environ={}) == (None, None)
    assert resolve_bind("lo", environ={}) == ("lo", "127.0.0.1")
    assert resolve_bind(None, environ={"CVLLM_BIND_ADDR": "127.0.0.1"}) == ("lo", "127.0.0.1")
    with pytest.raises(ConfigError, match="neither a network interface"):
        resolve_bind("no-such-if0", environ={})


def test_init_distributed_single_and_multithread():
    from cvllm.distributed import comm, parallel_state
    from cvllm.distributed.inprocess import run_ranks
    from cvllm.distributed.rendezvous import init_distributed

    single = detect_launch_env({})
    assert init_distributed(single, "cpu") == single
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    parallel_state.destroy_model_parallel()

    main_env = detect_launch_env({}, device_ids=(0, 1), multithread=True)

    def rank_body(rank, group):
        import dataclasses

        env = dataclasses.replace(main_env, rank=rank, local_rank=rank)
        init_distributed(env, "cpu", inprocess_group=group)
        try:
            return (parallel_state.get_tensor_model_parallel_rank(),
                    comm.agree_min(10 + rank))
        finally:
            parallel_state.destroy_model_parallel()

    assert run_ranks(2, rank_body, timeout_s=30) == [(0, 10), (1, 10)]
    with pytest.raises(ValueError, match="InProcessGroup"):
        init_distributed(main_env, "cpu")

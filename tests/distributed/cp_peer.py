"""One rank of the 2-rank control-plane tests, launched by test_control_plane.py under
``mpirun -np 2`` or ``torchrun --nproc-per-node 2`` (never imported by cvllm).

    python cp_peer.py OUT_DIR {normal,corrupt}

Rank 0 joins the process groups (``init_distributed``: MPI address agreement under
mpirun, gloo rendezvous), checks comm.py's collectives, then broadcasts real StepInputs,
idles so heartbeats flow, and sends SHUTDOWN (``normal``) or a STEP whose body was
corrupted after sealing (``corrupt``). Rank 1 records what it received in OUT_DIR.
"""

import hashlib
import json
import os
import sys
import time

import torch

from cvllm.core.block_manager import BlockManager
from cvllm.core.scheduler_output import ScheduledSeq, SchedulerOutput
from cvllm.core.sequence import Sequence
from cvllm.core.step_builder import build_step_input
from cvllm.core.step_input import StepInput
from cvllm.core.wire_format import HEADER_SIZE, MessageKind
from cvllm.distributed import comm
from cvllm.distributed.control_plane import ControlPlaneError, make_control_plane
from cvllm.distributed.launch_env import detect_launch_env
from cvllm.distributed.rendezvous import init_distributed, shutdown_distributed
from cvllm.sampling_params import SamplingParams

BS = 4
NUM_STEPS = 3


def make_step(step_id: int) -> StepInput:
    """A real, valid StepInput (a decode and a prefill chunk) that varies with step_id."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    dec = Sequence(0, "a", list(range(10, 19 + step_id)), SamplingParams(temperature=0.5,
                                                                         seed=step_id))
    dec.num_computed_tokens = len(dec.token_ids) - 1
    bm.allocate(dec, 1)
    pre = Sequence(1, "b", list(range(100, 110 + 3 * step_id)), SamplingParams(top_k=3))
    bm.allocate(pre, len(pre.token_ids))
    out = SchedulerOutput(step_id, [ScheduledSeq(dec, 1, True),
                                    ScheduledSeq(pre, len(pre.token_ids), True)])
    return build_step_input(out, BS)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def check_comm(rank: int) -> dict:
    x = torch.tensor([1.0 + rank, 10.0 * rank])
    comm.tensor_model_parallel_all_reduce(x)
    g = comm.tensor_model_parallel_all_gather(torch.tensor([[rank, rank + 10]]), dim=-1)
    b = comm.tensor_model_parallel_broadcast(torch.tensor([rank + 5]), src=1)
    comm.barrier()
    return {"all_reduce": x.tolist(), "all_gather": g.tolist(), "broadcast": b.tolist(),
            "min": comm.agree_min(100 + rank), "max": comm.agree_max(100 + rank)}


def run_rank0(plane, scenario: str, out: dict) -> None:
    sent = []
    for step_id in range(1, NUM_STEPS + 1):
        body = make_step(step_id).pack()
        plane.broadcast(MessageKind.STEP, step_id, body)
        sent.append(sha(body))
    time.sleep(0.7)  # idle: the heartbeat thread (0.2 s) speaks
    out["sent"] = sent
    if scenario == "corrupt":
        body = bytearray(make_step(NUM_STEPS + 1).pack())
        body[HEADER_SIZE + 10] ^= 0xFF  # after sealing: crc32 no longer matches
        plane._send_frame(bytes(body[:HEADER_SIZE]), bytes(body[HEADER_SIZE:]))
    else:
        plane.broadcast(MessageKind.SHUTDOWN, NUM_STEPS)


def run_worker(plane, out: dict) -> int:
    got, heartbeats = [], 0
    while True:
        try:
            msg = plane.recv(timeout_s=10)
        except ControlPlaneError as e:
            out["error"] = f"{type(e).__name__}: {e}"
            return 3
        if msg.kind == MessageKind.STEP:
            step = StepInput.unpack(msg.body)
            assert step == make_step(msg.step_id) and step.step_id == msg.step_id
            got.append(sha(msg.body))
        elif msg.kind == MessageKind.HEARTBEAT:
            heartbeats += 1
        elif msg.kind == MessageKind.SHUTDOWN:
            out["shutdown_step_id"] = msg.step_id
            return 0
        out.update(got=got, heartbeats=heartbeats)


def main() -> int:
    out_dir, scenario = sys.argv[1], sys.argv[2]
    env = detect_launch_env()
    env = init_distributed(env, "cpu", timeout_s=60)
    out = {"mode": env.mode, "transport": env.transport, "rank": env.rank,
           "master_port": env.master_port, "comm": check_comm(env.rank)}
    plane = make_control_plane(env, heartbeat_interval_s=0.2)
    code = 0
    try:
        if env.rank == 0:
            run_rank0(plane, scenario, out)
        else:
            code = run_worker(plane, out)
    finally:
        with open(os.path.join(out_dir, f"rank{env.rank}.json"), "w") as f:
            json.dump(out, f)
    if code != 0 or scenario == "corrupt":
        sys.stdout.flush()
        os._exit(code)  # a broken plane may hold a posted receive: do not wait for it
    plane.close()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

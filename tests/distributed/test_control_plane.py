"""The control plane: framing and rejection (in one process), and 2 real ranks under
``mpirun`` (mpi4py transport) and ``torchrun`` (gloo transport) running cp_peer.py."""

import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from cvllm.core.step_input import StepInput
from cvllm.core.wire_format import HEADER_SIZE, MAGIC, VERSION, MessageKind
from cvllm.distributed.control_plane import (
    ControlPlaneError, ControlPlaneTimeout, InProcessControlPlane, Message, encode_frame,
    make_control_plane,
)
from cvllm.distributed.inprocess import InProcessGroup
from cvllm.distributed.launch_env import LaunchEnv, find_free_port_pair
from cvllm.utils import tuning
from tests.distributed.cp_peer import make_step

REPO = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("cp_peer.py")
_HEADER = struct.Struct("<4sHHQQI")


class _SpyPlane(InProcessControlPlane):
    """Records how many bytes each receive asked for (to see nothing big was allocated)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asked = []

    def _recv_bytes(self, n, timeout_s):
        self.asked.append(n)
        return super()._recv_bytes(n, timeout_s)


def _pair(max_body_bytes=1 << 20):
    group = InProcessGroup(2)
    return (InProcessControlPlane(group, 0, max_body_bytes),
            _SpyPlane(group, 1, max_body_bytes), group)


def test_round_trip_of_every_kind():
    sender, worker, _ = _pair()
    body = make_step(5).pack()
    sender.broadcast(MessageKind.STEP, 5, body)
    for kind in (MessageKind.HEARTBEAT, MessageKind.ABORT, MessageKind.SHUTDOWN):
        sender.broadcast(kind, 5)
    msg = worker.recv(timeout_s=1)
    assert msg == Message(MessageKind.STEP, 5, body)
    assert StepInput.unpack(msg.body) == make_step(5)
    kinds = [worker.recv(timeout_s=1) for _ in range(3)]
    assert [(m.kind, m.step_id, m.body) for m in kinds] == [
        (MessageKind.HEARTBEAT, 5, b""), (MessageKind.ABORT, 5, b""),
        (MessageKind.SHUTDOWN, 5, b"")]


def test_recv_timeout_keeps_plane_usable():
    sender, worker, _ = _pair()
    t0 = time.monotonic()
    with pytest.raises(ControlPlaneTimeout):
        worker.recv(timeout_s=0.2)
    assert 0.15 < time.monotonic() - t0 < 2
    sender.broadcast(MessageKind.SHUTDOWN, 1)
    assert worker.recv(timeout_s=1).kind == MessageKind.SHUTDOWN


def test_poll_yields_while_hot_then_backs_off(monkeypatch):
    """Within the hot window the poll never sleeps (a STEP is due within a step's time);
    past it, the sleeps grow from 20 us to at most 1 ms."""
    from cvllm.distributed import control_plane as cp

    slept = []
    monkeypatch.setattr(cp.time, "sleep", slept.append)
    calls = iter([False] * 5 + [True])
    cp._poll(lambda: next(calls), 5.0, "x", hot_until=time.monotonic() + 60)
    assert slept == [0, 0, 0, 0, 0]
    slept.clear()
    calls = iter([False] * 9 + [True])
    cp._poll(lambda: next(calls), 5.0, "x", hot_until=0.0)
    assert slept[0] == pytest.approx(20e-6) and slept[-1] == pytest.approx(1e-3)
    assert all(b >= a for a, b in zip(slept, slept[1:]))
    with pytest.raises(ControlPlaneTimeout):  # the deadline holds while hot too
        cp._poll(lambda: False, 0.0, "x", hot_until=time.monotonic() + 60)


def test_a_step_makes_the_next_receive_hot_a_heartbeat_does_not():
    """The hot window opens when the worker comes back for the message after a STEP
    (however long that step ran), not while it waits after a HEARTBEAT."""
    sender, worker, _ = _pair()
    seen = []

    class Spy(type(worker)):
        def _recv_bytes(self, n, timeout_s):
            seen.append(self._hot_until - time.monotonic())
            return super()._recv_bytes(n, timeout_s)

    worker.__class__ = Spy
    sender.broadcast(MessageKind.STEP, 1, make_step(1).pack())
    worker.recv(timeout_s=1)  # header cold (nothing before it), body hot
    assert seen[0] < 0 < seen[1]
    time.sleep(0.15)  # a step longer than the window
    sender.broadcast(MessageKind.HEARTBEAT, 1)
    seen.clear()
    worker.recv(timeout_s=1)
    assert seen[0] > 0  # the receive after a STEP starts hot
    sender.broadcast(MessageKind.SHUTDOWN, 1)
    seen.clear()
    worker.recv(timeout_s=1)
    assert seen[0] < 0  # after a heartbeat: cold


def test_hot_window_setting():
    from cvllm.distributed import control_plane as cp

    with tuning.configure(tuning.from_environ({})):
        assert cp.hot_window_s() == cp.HOT_WINDOW_S
    with tuning.configure(tuning.from_environ({"CVLLM_HOT_POLL_S": "0"})):
        sender, worker, _ = _pair()
    assert worker.hot_window_s == 0.0
    sender.broadcast(MessageKind.STEP, 1, make_step(1).pack())
    worker.recv(timeout_s=1)
    sender.broadcast(MessageKind.SHUTDOWN, 1)
    assert worker.recv(timeout_s=1).kind == MessageKind.SHUTDOWN  # works without hot polls
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ValueError, match="CVLLM_HOT_POLL_S"):
            tuning.from_environ({"CVLLM_HOT_POLL_S": bad})


def test_sender_checks_bodies():
    sender, worker, _ = _pair()
    with pytest.raises(ControlPlaneError, match="carries no body"):
        sender.broadcast(MessageKind.HEARTBEAT, 1, b"x")
    with pytest.raises(ControlPlaneError, match="expected the packed StepInput of step 2"):
        sender.broadcast(MessageKind.STEP, 2, make_step(1).pack())
    with pytest.raises(ControlPlaneError, match="cannot send STEP"):
        sender.broadcast(MessageKind.STEP, 1, b"not a step input at all, no magic here!!")
    with pytest.raises(ControlPlaneError, match="only rank 0"):
        worker.broadcast(MessageKind.SHUTDOWN, 1)
    with pytest.raises(ControlPlaneError, match="does not receive"):
        sender.recv(timeout_s=0.1)


def _inject(group, header: bytes, payload: bytes = b""):
    group.control_queues[1].put(header)
    if payload:
        group.control_queues[1].put(payload)


def test_corrupt_checksum_rejected_and_plane_broken():
    _, worker, group = _pair()
    header, payload = encode_frame(MessageKind.STEP, 3, make_step(3).pack())
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0x01
    _inject(group, header, bytes(bad))
    with pytest.raises(ControlPlaneError, match="crc32 mismatch"):
        worker.recv(timeout_s=1)
    with pytest.raises(ControlPlaneError, match="broken"):
        worker.recv(timeout_s=1)


@pytest.mark.parametrize("field, value, match", [
    ("magic", b"XXXX", "bad magic"),
    ("version", 99, "unsupported wire version 99"),
    ("kind", 42, "unknown message kind 42"),
])
def test_bad_header_rejected(field, value, match):
    _, worker, group = _pair()
    fields = dict(magic=MAGIC, version=VERSION, kind=int(MessageKind.SHUTDOWN), step=1, length=0,
                  crc=zlib.crc32(b""))
    fields[field] = value
    _inject(group, _HEADER.pack(*fields.values()))
    with pytest.raises(ControlPlaneError, match=match):
        worker.recv(timeout_s=1)
    assert worker.asked == [HEADER_SIZE]  # nothing read after the header


def test_oversized_length_rejected_before_allocating():
    _, worker, group = _pair(max_body_bytes=1 << 20)
    _inject(group, _HEADER.pack(MAGIC, VERSION, int(MessageKind.STEP), 1, 1 << 40, 0))
    with pytest.raises(ControlPlaneError, match="exceeds the limit"):
        worker.recv(timeout_s=1)
    assert worker.asked == [HEADER_SIZE]  # the 1 TiB body was never asked for


def test_truncated_body_rejected():
    _, worker, group = _pair()
    header, payload = encode_frame(MessageKind.STEP, 3, make_step(3).pack())
    _inject(group, header, payload[:-1])
    with pytest.raises(ControlPlaneError, match="expected"):
        worker.recv(timeout_s=1)


def test_heartbeat_when_idle_and_multithread_factory():
    group = InProcessGroup(2)
    env0 = LaunchEnv("multithread", 0, 2, 0, 2, 0, 1, "127.0.0.1", 0, "inprocess")
    env1 = LaunchEnv("multithread", 1, 2, 1, 2, 0, 1, "127.0.0.1", 0, "inprocess")
    sender = make_control_plane(env0, inprocess_group=group, heartbeat_interval_s=0.1)
    worker = make_control_plane(env1, inprocess_group=group, heartbeat_interval_s=0.1)
    try:
        sender.broadcast(MessageKind.STEP, 7, make_step(7).pack())
        assert worker.recv(timeout_s=1).kind == MessageKind.STEP
        beat = worker.recv(timeout_s=2)
        assert (beat.kind, beat.step_id) == (MessageKind.HEARTBEAT, 7)
    finally:
        sender.close()
    with pytest.raises(ValueError, match="InProcessGroup"):
        make_control_plane(env1)


def test_single_rank_plane():
    env = LaunchEnv("single", 0, 1, 0, 1, 0, 1, "127.0.0.1", 0, "none")
    plane = make_control_plane(env)
    plane.broadcast(MessageKind.SHUTDOWN, 0)  # nobody to tell: no error, no thread
    plane.close()


# ----- two real ranks -----------------------------------------------------------------


def _run_peers(cmd, out_dir, timeout=60):
    environ = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=timeout)
    results = {}
    for r in (0, 1):
        path = Path(out_dir) / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        results[r] = json.loads(path.read_text())
    return proc, results


def _mpirun(out_dir, scenario):
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (mpirun missing)")
    return ["mpirun", "-np", "2", "--oversubscribe", sys.executable, str(PEER), str(out_dir),
            scenario]


def _torchrun(out_dir, scenario):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(find_free_port_pair()),
            str(PEER), str(out_dir), scenario]


def _check_comm(results):
    for r in (0, 1):
        assert results[r]["comm"] == {"all_reduce": [3.0, 10.0], "all_gather": [[0, 10, 1, 11]],
                                      "broadcast": [6], "min": 100, "max": 101}


@pytest.mark.mpi
@pytest.mark.parametrize("launcher, transport", [(_mpirun, "mpi"), (_torchrun, "gloo")])
def test_two_ranks_receive_identical_steps(tmp_path, launcher, transport):
    proc, res = _run_peers(launcher(tmp_path, "normal"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert res[1]["transport"] == transport and res[0]["master_port"] == res[1]["master_port"]
    _check_comm(res)
    assert len(res[0]["sent"]) == 3 and res[1]["got"] == res[0]["sent"]  # identical bytes
    assert res[1]["heartbeats"] >= 1 and res[1]["shutdown_step_id"] == 3


@pytest.mark.mpi
@pytest.mark.parametrize("launcher", [_mpirun, _torchrun])
def test_corrupt_message_on_the_wire_is_rejected(tmp_path, launcher):
    proc, res = _run_peers(launcher(tmp_path, "corrupt"), tmp_path)
    assert proc.returncode != 0  # the worker exited with an error
    assert res[1]["got"] == res[0]["sent"]  # the good steps before it arrived intact
    assert res[1]["error"].startswith("ControlPlaneError") and "crc32 mismatch" in res[1]["error"]

"""The worker -> rank 0 health link: frames, and real reporter processes that die,
stop, fail or leave cleanly."""

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cvllm.distributed.health import (
    HEADER_SIZE, MAX_PAYLOAD_BYTES, FrameDecoder, FrameKind, HealthMonitor,
    HealthProtocolError, encode_frame,
)
from cvllm.distributed.health_reporter import HealthReporter

REPO = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("health_peer.py")


def _wait(pred, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _spawn(monitor, mode, rank=1, interval=0.3):
    proc = subprocess.Popen(
        [sys.executable, str(PEER), "127.0.0.1", str(monitor.port), str(rank), mode,
         str(interval)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


@pytest.fixture
def monitor():
    m = HealthMonitor("127.0.0.1", 0, world_size=2, silence_s=2.0)
    yield m
    m.close()


def test_frames_round_trip_and_truncate():
    dec = FrameDecoder()
    data = encode_frame(FrameKind.HELLO, 3) + encode_frame(FrameKind.LOG, 3, "héllo")
    frames = dec.feed(data[:5]) + dec.feed(data[5:20]) + dec.feed(data[20:])
    assert [(f.kind, f.rank, f.text) for f in frames] == [
        (FrameKind.HELLO, 3, ""), (FrameKind.LOG, 3, "héllo")]
    big = encode_frame(FrameKind.ERROR, 1, "é" * MAX_PAYLOAD_BYTES)
    assert len(big) - HEADER_SIZE <= MAX_PAYLOAD_BYTES
    assert FrameDecoder().feed(big)[0].text == "é" * (MAX_PAYLOAD_BYTES // 2)


@pytest.mark.parametrize("raw, match", [
    (b"XXXX" + encode_frame(FrameKind.HELLO, 1)[4:], "bad magic"),
    (encode_frame(FrameKind.HELLO, 1)[:4] + bytes([9]) + encode_frame(FrameKind.HELLO, 1)[5:],
     "unsupported version"),
    (encode_frame(FrameKind.HELLO, 1)[:5] + bytes([77]) + encode_frame(FrameKind.HELLO, 1)[6:],
     "unknown frame kind"),
    (encode_frame(FrameKind.LOG, 1)[:8] + (1 << 30).to_bytes(4, "little"), "exceeds"),
])
def test_decoder_rejects(raw, match):
    with pytest.raises(HealthProtocolError, match=match):
        FrameDecoder().feed(raw)  # the oversized one is rejected from its header alone


def test_monitor_binds_the_given_address_only(monitor):
    assert monitor.address[0] == "127.0.0.1" and monitor.port > 0
    assert monitor.healthy and monitor.failure is None
    assert not monitor.wait_for_workers(0.2)


def test_sigkilled_reporter_detected(monitor):
    proc = _spawn(monitor, "sleep")
    try:
        assert monitor.wait_for_workers(5) and monitor.connected_ranks() == [1]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        assert _wait(lambda: monitor.failure is not None, 10)
        assert time.monotonic() - t0 < 10
        assert monitor.failure == "rank 1: connection lost" and not monitor.healthy
    finally:
        proc.kill()
        proc.wait()


def test_stopped_reporter_detected_as_silent(monitor):
    seen = []
    monitor.on_failure(seen.append)
    proc = _spawn(monitor, "sleep")
    try:
        assert monitor.wait_for_workers(5)
        time.sleep(1.0)
        assert monitor.healthy  # heartbeats every 0.3 s keep it alive past silence_s / 2
        proc.send_signal(signal.SIGSTOP)
        assert _wait(lambda: monitor.failure is not None, 10)
        assert monitor.failure.startswith("rank 1 silent for ")
        assert 2.0 <= float(monitor.failure.split()[-2]) < 5.0
        assert seen == [monitor.failure]  # the callback ran once
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_error_frame_and_log_reach_rank0(monitor, caplog):
    caplog.set_level(logging.WARNING, logger="cvllm.distributed")
    proc = _spawn(monitor, "error")
    try:
        assert proc.wait(10) == 1
        assert _wait(lambda: monitor.failure is not None, 5)
        assert monitor.failure.startswith("rank 1: Traceback")
        assert "RuntimeError: boom on the worker" in monitor.failure
        assert any("rank 1: WARNING cvllm.worker: worker 1 is up" in r.getMessage()
                   for r in caplog.records)
    finally:
        proc.kill()


def test_clean_bye_is_not_a_failure(monitor):
    proc = _spawn(monitor, "bye")
    assert proc.wait(10) == 0
    time.sleep(2.5)  # past silence_s too
    assert monitor.healthy


def test_oversized_frame_from_a_worker_is_a_failure(monitor):
    with socket.create_connection(monitor.address) as s:
        s.sendall(encode_frame(FrameKind.HELLO, 1))
        assert monitor.wait_for_workers(2)
        s.sendall(encode_frame(FrameKind.LOG, 1)[:8] + (10 << 20).to_bytes(4, "little"))
        assert _wait(lambda: monitor.failure is not None, 5)
    assert monitor.failure.startswith("rank 1: protocol error: frame of 10485760 bytes")


def test_bad_hello_rank_rejected(monitor):
    with socket.create_connection(monitor.address) as s:
        s.sendall(encode_frame(FrameKind.HELLO, 5))
        assert _wait(lambda: monitor.failure is not None, 5)
    assert "HELLO from rank 5" in monitor.failure


def test_stopping_silences_departures(monitor):
    rep = HealthReporter("127.0.0.1", monitor.port, 1, interval_s=0.2)
    assert monitor.wait_for_workers(5)
    monitor.stopping()
    rep._stop.set()  # vanish without BYE, as a worker ended by SIGTERM would
    rep._thread.join(5)
    time.sleep(0.5)
    assert monitor.healthy


def test_reporter_gives_up_when_rank0_is_absent():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    rep = HealthReporter("127.0.0.1", port, 1, connect_timeout_s=0.5)
    assert _wait(lambda: rep.failure is not None, 5)
    assert "cannot reach rank 0" in rep.failure and not rep.connected.is_set()

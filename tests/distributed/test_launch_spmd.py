"""The SPMD composition pieces, in one process and in seconds: the rank-0 runner wrapper
broadcasts each step before running it and passes everything else through; the worker
loop runs steps in order, rejects a gap, ends on SHUTDOWN and fails when rank 0 goes
quiet; fault injection parsing; the tensor-parallel size check; per-rank log names;
spawned ranks' stderr relayed with a rank prefix; the supervisor fails once."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from cvllm.config import ConfigError
from cvllm.core.step_input import StepInput
from cvllm.core.wire_format import MessageKind
from cvllm.distributed.control_plane import ControlPlaneTimeout, Message
from cvllm.runtime.launcher import LocalRanks
from cvllm.runtime.spmd import SPMDRunner
from cvllm.runtime.supervisor import JobSupervisor
from cvllm.logger import rank_log_path
from cvllm.worker.worker_loop import (
    FaultInjector, InjectedFault, WorkerError, serve_steps, step_from_message,
)


def _step(step_id: int) -> StepInput:
    return StepInput.empty(step_id)


class _Control:
    """A control plane that records broadcasts and replays queued messages."""

    def __init__(self, messages=()):
        self.sent, self.messages = [], list(messages)

    def broadcast(self, kind, step_id, body=b""):
        self.sent.append((kind, step_id, body))

    def recv(self, timeout_s=None):
        if not self.messages:
            raise ControlPlaneTimeout("quiet")
        return self.messages.pop(0)


class _Runner:
    num_blocks = 7

    def __init__(self):
        self.ran = []

    def execute(self, step, seqs=None):
        self.ran.append((step.step_id, seqs))
        return "result"

    def launch(self, step, seqs=None):
        self.ran.append(("launch", step.step_id))
        return "launched"


def _msg(kind, step_id=0):
    body = _step(step_id).pack() if kind == MessageKind.STEP else b""
    return Message(kind, step_id, body)


def test_spmd_runner_broadcasts_before_running_and_passes_through():
    control, runner = _Control(), _Runner()
    wrapped = SPMDRunner(runner, control, JobSupervisor("none"), fault=FaultInjector())
    assert wrapped.execute(_step(1), ["seq"]) == "result"
    assert wrapped.launch(_step(2)) == "launched"  # a method the runner may grow
    assert [(k, i) for k, i, _ in control.sent] == [(MessageKind.STEP, 1), (MessageKind.STEP, 2)]
    assert StepInput.unpack(control.sent[0][2]).step_id == 1
    assert runner.ran == [(1, ["seq"]), ("launch", 2)]
    assert wrapped.num_blocks == 7
    with pytest.raises(AttributeError):
        wrapped.no_such_method  # noqa: B018
    wrapped.shutdown()
    assert control.sent[-1][:2] == (MessageKind.SHUTDOWN, 2)


def test_spmd_runner_reports_a_failing_step():
    failures = []
    sup = JobSupervisor("none", grace_s=3600)
    sup.add_listener(failures.append)
    wrapped = SPMDRunner(_Runner(), _Control(), sup, fault=FaultInjector(rank=0, step=3))
    wrapped.execute(_step(2))
    with pytest.raises(InjectedFault):
        wrapped.execute(_step(3))
    assert len(failures) == 1 and "step 3" in failures[0]
    sup.fail("a second failure")  # only the first one counts
    assert len(failures) == 1


def test_final_message_names_failures_seen_after_the_first():
    sup = JobSupervisor("none", grace_s=3600)
    sup.fail("rank 0: step 7 failed: RuntimeError('Connection reset by peer')")
    sup.fail("rank 1 exited with status -9\n(traceback)")
    sup.fail("rank 1 exited with status -9")  # the same news twice is named once
    for i in range(10):
        sup.fail(f"health: rank {i}: connection lost")
    assert sup.final_reason() == (
        "rank 0: step 7 failed: RuntimeError('Connection reset by peer'); also: rank 1 "
        "exited with status -9; also: health: rank 0: connection lost; also: health: rank "
        "1: connection lost; also: health: rank 2: connection lost")


def test_worker_runs_steps_in_order_until_shutdown():
    runner = _Runner()
    control = _Control([_msg(MessageKind.STEP, 1), _msg(MessageKind.HEARTBEAT, 1),
                        _msg(MessageKind.STEP, 2), _msg(MessageKind.SHUTDOWN, 2),
                        _msg(MessageKind.STEP, 3)])
    assert serve_steps(runner, control, 1, fault=FaultInjector()) == 0
    assert runner.ran == [(1, None), (2, None)]  # workers never sample
    assert len(control.messages) == 1


@pytest.mark.parametrize("messages, error", [
    ([_msg(MessageKind.STEP, 1), _msg(MessageKind.STEP, 3)], "step 3 after step 1"),
    ([_msg(MessageKind.STEP, 1)], "no message from rank 0"),
    ([_msg(MessageKind.ABORT, 1)], "aborted"),
])
def test_worker_fails_on_gap_silence_or_abort(messages, error):
    with pytest.raises(WorkerError, match=error):
        serve_steps(_Runner(), _Control(messages), 1, idle_timeout_s=0.01,
                    fault=FaultInjector())


def test_worker_injected_fault_and_signal_bound():
    with pytest.raises(InjectedFault, match="rank 1 at step 2"):
        serve_steps(_Runner(), _Control([_msg(MessageKind.STEP, 1), _msg(MessageKind.STEP, 2)]),
                    1, fault=FaultInjector(rank=1, step=2))
    with pytest.raises(WorkerError, match="no SHUTDOWN"):
        serve_steps(_Runner(), _Control([_msg(MessageKind.HEARTBEAT)] * 3), 1,
                    fault=FaultInjector(), stop_requested=lambda: True)


def test_step_message_must_agree_with_its_header():
    with pytest.raises(ValueError, match="carries step 4"):
        step_from_message(Message(MessageKind.STEP, 5, _step(4).pack()))


def test_fault_inject_parsing():
    assert FaultInjector.from_env({}) == FaultInjector()
    assert FaultInjector.from_env({"CVLLM_FAULT_INJECT": "rank=1, step=5"}) == FaultInjector(1, 5)
    for bad in ("rank=1", "rank=1,step=x", "node=1,step=2"):
        with pytest.raises(ValueError, match="CVLLM_FAULT_INJECT"):
            FaultInjector.from_env({"CVLLM_FAULT_INJECT": bad})


def test_tensor_parallel_size_must_split_the_heads():
    from cvllm.engine.builder import check_tensor_parallel

    model = SimpleNamespace(architecture="LlamaForCausalLM", num_heads=9, num_kv_heads=3)
    check_tensor_parallel(model, 3)
    check_tensor_parallel(model, 9)  # 9 ranks: each KV head replicated 3 times
    check_tensor_parallel(model, 2)  # Llama: a balanced uneven split, 4 and 5 heads
    with pytest.raises(ConfigError, match=r"9 attention heads: 10 ranks"):
        check_tensor_parallel(model, 10)
    even_only = SimpleNamespace(architecture="Qwen3NextForCausalLM", num_heads=9, num_kv_heads=3)
    with pytest.raises(ConfigError, match=r"9 attention heads.*\(3, 9\)"):
        check_tensor_parallel(even_only, 2)
    odd = SimpleNamespace(architecture="X", num_heads=12, num_kv_heads=4)
    with pytest.raises(ConfigError, match="4 KV heads"):
        check_tensor_parallel(odd, 6)


def test_rank_log_paths():
    assert rank_log_path("serve.log", 0) == "serve.log"
    assert rank_log_path("/var/log/cvllm/serve.log", 2) == "/var/log/cvllm/serve.rank2.log"
    assert rank_log_path("serve", 1) == "serve.rank1"
    assert rank_log_path("./logs.d/serve", 1) == "./logs.d/serve.rank1"


def test_spawned_stderr_is_relayed_with_the_rank(capfd):
    exits = []
    ranks = LocalRanks(on_exit=lambda rank, code: exits.append((rank, code)))
    code = ("import sys; sys.stderr.write('hello\\n[rank 3] tagged\\n'); "
            "sys.stderr.flush(); sys.exit(4)")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    ranks.procs.append(proc)
    ranks._relay(3, proc)  # what the relay thread of spawn() runs
    err = capfd.readouterr().err
    assert "[rank 3] hello" in err and "[rank 3] [rank 3]" not in err
    assert exits == [(3, 4)]


def test_supervisor_aborts_after_the_grace(monkeypatch):
    import cvllm.runtime.supervisor as supervisor

    aborted = []
    monkeypatch.setattr(supervisor, "abort_job", lambda *a: aborted.append(a))
    sup = JobSupervisor("gloo", grace_s=0.05)
    seen = []
    sup.add_listener(seen.append)
    sup.child_exited(1, 0)  # a clean exit is no failure
    assert sup.failure is None
    sup.child_exited(1, -9)
    deadline = time.time() + 5
    while not aborted and time.time() < deadline:
        time.sleep(0.01)
    assert seen == ["rank 1 exited with status -9"]
    assert aborted and aborted[0][0] == "gloo" and aborted[0][2] == 1

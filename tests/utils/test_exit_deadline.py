"""The exit deadline ends a process that hangs while stopping, and only moves earlier."""

import subprocess
import sys
import time

SCRIPT = """
import time
from cvllm.utils.exit_deadline import exit_by
exit_by(30, "far", code=4)
exit_by({first}, "first", code=3)
exit_by(60, "later calls never postpone it", code=5)
time.sleep(30)  # a hang
"""


def test_a_hanging_process_exits_at_the_deadline():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(first=0.3)],
                          capture_output=True, text=True, timeout=20)
    took = time.monotonic() - started
    assert proc.returncode == 3, proc.stderr
    assert took < 10, took
    assert "first: still running at the exit deadline" in proc.stderr

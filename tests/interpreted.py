"""Run a test's CPU cases under Triton's interpreter, in a fresh Python process.

``TRITON_INTERPRET`` must be set before triton compiles anything, and other tests in the
same pytest process have already imported triton with it unset; so the kernel tests run
their small-shape cases in a subprocess through here.
"""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(code: str, timeout: float = 300, tail: int = 4000) -> None:
    """Run ``code`` (Python source, e.g. ``"from tests.x import run_cpu_cases;
    run_cpu_cases()"``) with ``TRITON_INTERPRET=1``; fail with its stderr's tail unless it
    exits 0."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-tail:]

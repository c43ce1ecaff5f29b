"""A worker's health reporter in a process of its own, for test_health.py.

    python health_peer.py HOST PORT RANK {sleep,error,bye} INTERVAL_S

``sleep``: heartbeat until killed (the test sends SIGKILL or SIGSTOP); ``error``: fail
with a traceback sent as an ERROR frame; ``bye``: exit cleanly. A WARNING log record is
forwarded first, and "ready" printed once connected.
"""

import logging
import sys
import time
import traceback

from cvllm.distributed.health_reporter import HealthReporter


def main() -> int:
    host, port, rank, mode, interval = sys.argv[1:6]
    reporter = HealthReporter(host, int(port), int(rank), interval_s=float(interval),
                              connect_timeout_s=10)
    reporter.install_log_handler()
    if not reporter.connected.wait(10):
        return 2
    logging.getLogger("cvllm.worker").warning("worker %s is up", rank)
    print("ready", flush=True)
    if mode == "error":
        try:
            raise RuntimeError("boom on the worker")
        except RuntimeError:
            reporter.error(traceback.format_exc())
        return 1
    if mode == "bye":
        reporter.close()
        return 0
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())

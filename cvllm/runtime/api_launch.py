"""Starting the API-server process (``docs/adr/serving-process.md``) and serving through
it until it exits.

``cvllm serve`` (``cli.py``) builds the engine on rank 0, then ``make_hello`` exports its
tokenizer for the API process and ``serve_with_api_process`` starts the API program it is
given (``python -m cvllm.server.api_process``: a process boundary, not an import) with
one end of a Unix socket pair, hands the other to an ``ApiHost`` (``runtime/api_host.py``)
and waits on the main thread of rank 0: each SIGTERM / SIGINT is passed on as a SIGNAL
frame (the API process drains or aborts as one process did, and ignores signals sent to
it directly) until the API process exits, with this process's own exit deadline armed.
Nothing here runs on other ranks.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from cvllm.engine.api_messages import Hello
from cvllm.engine.async_engine import AsyncEngine
from cvllm.runtime.api_host import ApiHost
from cvllm.utils.exit_deadline import exit_by, wait_budget

logger = logging.getLogger("cvllm.runtime")

START_TIMEOUT_S = 120.0
"""The API process must be listening within this (it imports, loads the tokenizer and
binds the port)."""
EXIT_GRACE_S = 5.0
SECOND_SIGNAL_EXIT_S = 4.5
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_")
PROBE_TEXT = "Hello, world! 1234 <think>ünïcödé 日本語</think>\n\t  end"
"""Encoded on both sides at start-up: the API process's tokenizer must give these ids."""


class ApiProcessStartError(RuntimeError):
    """The API process could not start serving (the port is taken, its tokenizer copy
    disagrees): a start-up error the user can act on."""


class ApiProcessDiedError(RuntimeError):
    """The API process ended while serving without being asked to."""


class TokenizerStaysError(RuntimeError):
    """The engine's tokenizer cannot be handed to another process (saved and loaded back,
    it encodes differently, or cannot be): rank 0 serves in its own process."""


def export_tokenizer(tokenizer: Any, folder: str) -> Dict[str, Any]:
    """The tokenizer saved to ``folder`` as the API process loads it, loaded back once to
    check that it encodes the probe text as the original does (``TokenizerStaysError``
    if not), and the probe the API process checks again."""
    from transformers import PreTrainedTokenizerFast

    probe_ids = tokenizer.encode(PROBE_TEXT)
    try:
        tokenizer.hf.save_pretrained(folder)
        copy = PreTrainedTokenizerFast.from_pretrained(folder)
        same = list(copy.encode(PROBE_TEXT, add_special_tokens=True)) == probe_ids
    except Exception as e:  # a tokenizer that cannot be saved or loaded back
        raise TokenizerStaysError(f"the tokenizer cannot be saved and loaded back "
                                  f"({type(e).__name__}: {e})") from None
    if not same:
        raise TokenizerStaysError("a saved copy of the tokenizer encodes differently")
    return {"tokenizer_dir": folder, "chat_template": tokenizer.chat_template_source,
            "probe_text": PROBE_TEXT, "probe_ids": probe_ids}


def make_hello(async_engine: AsyncEngine, settings: Dict[str, Any], mcp: Dict[str, Any],
               shutdown_timeout_s: float) -> Hello:
    """The HELLO of this engine, its tokenizer exported to a temporary folder (removed
    by ``serve_with_api_process`` once the API process listens, having read it); raises
    ``TokenizerStaysError``."""
    folder = tempfile.mkdtemp(prefix="cvllm-api-")
    try:
        tok = export_tokenizer(async_engine.engine.tokenizer, folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return Hello(model_name=async_engine.model_name, max_model_len=async_engine.max_model_len,
                 default_params=async_engine.default_params(), settings=settings,
                 shutdown_timeout_s=shutdown_timeout_s, mcp=mcp, **tok)


def serve_with_api_process(async_engine: AsyncEngine, hello: Hello, command: Sequence[str],
                           log_args: Sequence[str] = ()) -> None:
    """Blocking, on rank 0's main thread: start the API process (``command`` + ``--fd N``
    + ``log_args``) with ``hello`` (``make_hello``) and serve through it until it exits
    (after a drain on SIGTERM, as ``server/lifecycle.py`` runs it there). Raises
    ``ApiProcessStartError`` if it cannot start, ``ApiProcessDiedError`` if it ends unasked."""
    ours, theirs = socket.socketpair()
    proc: Optional[subprocess.Popen] = None
    host: Optional[ApiHost] = None
    listening = False
    try:
        host = ApiHost(async_engine, ours, hello)
        proc = spawn(command, theirs, log_args)
        theirs.close()
        host.start()
        async_engine.start()
        wait_listening(host, proc)
        listening = True
        # read by the API process before it listens: gone now, so that a server killed
        # with SIGKILL later leaves no copy of the tokenizer in the temporary folder
        shutil.rmtree(hello.tokenizer_dir, ignore_errors=True)
        logger.info("serving %s on http://%s/v1 (API process %d)", async_engine.model_name,
                    host.address, proc.pid)
        _forward_signals_until_exit(proc, host, hello.shutdown_timeout_s)
    finally:
        # The engine's daemon thread must be out of torch before the interpreter tears
        # down (a thread still inside it then can abort the exit: SIGABRT, not the
        # error's 2). After a signal the wait ends 2 s before the exit deadline; without
        # one (the API process left by itself, a failed start) it is bounded on its own.
        async_engine.shutdown(timeout=wait_budget() if listening else 10.0)
        if proc is not None and proc.poll() is None:
            proc.kill()
        if host is not None:
            host.close()
        for end in (ours, theirs):
            end.close()
        shutil.rmtree(hello.tokenizer_dir, ignore_errors=True)


def spawn(command: Sequence[str], sock: socket.socket,
          log_args: Sequence[str] = ()) -> subprocess.Popen:
    """The API process, in a session of its own (a terminal's Ctrl-C reaches rank 0 only,
    which passes it on once). Not a rank: it leaves the MPI launcher's variables behind
    (tools that find ranks by them, and MPI itself, would take it for rank 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["CVLLM_API_PROCESS"] = "1"
    return subprocess.Popen([*command, "--fd", str(sock.fileno()), *log_args],
                            pass_fds=(sock.fileno(),), start_new_session=True, env=env)


def wait_listening(host: ApiHost, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not host.listening.wait(0.2):
        if proc.poll() is not None:
            raise ApiProcessStartError(f"the API process exited with {proc.returncode} "
                                       "at start-up")
        if time.monotonic() > deadline:
            raise ApiProcessStartError(f"the API process was not listening within "
                                       f"{START_TIMEOUT_S:.0f} s")
    if host.fatal is not None or host.address is None:
        raise ApiProcessStartError(host.fatal or "the API process closed the channel at "
                                   "start-up")


def _forward_signals_until_exit(proc: subprocess.Popen, host: ApiHost,
                                shutdown_timeout_s: float) -> None:
    received: List[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            exit_by(shutdown_timeout_s + EXIT_GRACE_S - 0.25,
                    f"{name} {shutdown_timeout_s:.0f} s ago")
        else:
            exit_by(SECOND_SIGNAL_EXIT_S, f"second {name}")
        host.signal(name)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    try:
        while proc.poll() is None:
            if host.closed.wait(0.2) and proc.poll() is None:
                try:
                    proc.wait(2.0)  # it exits once its channel is gone
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5.0)
        if proc.returncode and not received:
            raise ApiProcessDiedError(f"the API process exited with {proc.returncode}")
    finally:
        # From here on (the engine stopping, SHUTDOWN to the ranks) a signal only brings
        # the exit closer.
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, _late_signal)


def _late_signal(signum: int, _frame: Any) -> None:
    exit_by(SECOND_SIGNAL_EXIT_S, f"{signal.Signals(signum).name} while stopping")

"""The API-server process: ``python -m cvllm.server.api_process --fd N``.

Started by rank 0 (``runtime/api_launch.serve_with_api_process``) with one end of a Unix
socket pair as file descriptor N; never started by hand. It ignores SIGTERM / SIGINT sent
to it: rank 0 passes on the ones it gets as SIGNAL frames. It reads the engine's HELLO
(model, limits, default sampling values, server settings, the tokenizer's files and a
probe), loads the tokenizer and checks that it encodes the probe as the engine does,
builds the same aiohttp application as an in-process server around a ``RemoteEngine``
and serves it with ``server/lifecycle.py``: SIGTERM (forwarded by rank 0) drains, aborts
on time and exits. It reports LISTENING once the port is bound, or FATAL with the reason
if it cannot start, and exits when the engine side closes the channel. Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import Any, Optional

from cvllm.engine.api_messages import Hello
from cvllm.utils import channel as ch

logger = logging.getLogger("cvllm.server")

HELLO_TIMEOUT_S = 60.0


class StartError(RuntimeError):
    """The API process cannot serve (reported to the engine side as FATAL)."""


def load_tokenizer(hello: Hello) -> Any:
    """The engine's tokenizer from the files it wrote, checked on the probe text."""
    from transformers import PreTrainedTokenizerFast

    from cvllm.engine.tokenizer import Tokenizer

    hf = PreTrainedTokenizerFast.from_pretrained(hello.tokenizer_dir)
    tok = Tokenizer(hf, hello.chat_template)
    got = tok.encode(hello.probe_text)
    if got != hello.probe_ids:
        raise StartError(f"the tokenizer copy encodes the probe text differently from the "
                         f"engine's ({got[:12]} vs {hello.probe_ids[:12]})")
    return tok


def _build_app(engine: Any, hello: Hello):
    from cvllm.server.agent_setup import build_mcp
    from cvllm.server.app import build_app
    from cvllm.server.context import ServerSettings

    settings = ServerSettings(**hello.settings)
    mcp = build_mcp(hello.mcp.get("mcp_config"), hello.mcp.get("mcp_command"),
                    hello.mcp.get("mcp_args"), float(hello.mcp.get("mcp_call_timeout") or 60.0))
    app = build_app(engine, settings, mcp)
    if mcp is not None:
        async def start_mcp(_app) -> None:  # blocks until each server is up or failed once
            await asyncio.get_running_loop().run_in_executor(None, mcp.start)

        async def stop_mcp(_app) -> None:
            await asyncio.get_running_loop().run_in_executor(None, mcp.close, 2.0)

        app.on_startup.append(start_mcp)
        app.on_cleanup.append(stop_mcp)
    return app, settings


async def _read_hello(reader: asyncio.StreamReader) -> Hello:
    frame = await asyncio.wait_for(ch.read_frame_async(reader), HELLO_TIMEOUT_S)
    if frame is None or frame[0] != ch.HELLO:
        raise StartError("the engine side sent no HELLO")
    return Hello.from_wire(ch.decode_json(ch.HELLO, frame[1]))


async def run(sock: socket.socket) -> int:
    """Serve until told to stop; the exit status: 0 after a drain or abort rank 0 asked
    for, 1 if it could not start, 3 if the engine went away first."""
    from cvllm.server.lifecycle import serve_app
    from cvllm.server.remote_engine import RemoteEngine
    from cvllm.utils.gc_freeze import freeze_startup_objects

    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        hello = await _read_hello(reader)
        tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, hello)
        engine = RemoteEngine(reader, writer, hello, tokenizer)
        app, settings = _build_app(engine, hello)
    except Exception as e:
        logger.error("the API process cannot start: %s", e)
        writer.write(ch.encode_json(ch.FATAL, {"message": str(e)}))
        await writer.drain()
        return 1
    reading = asyncio.get_running_loop().create_task(engine.run())

    def listening(runner: Any) -> None:
        host, port = runner.addresses[0][:2]
        writer.write(ch.encode_json(ch.LISTENING, {"address": f"{host}:{port}"}))

    freeze_startup_objects()
    try:
        await serve_app(app, settings, engine, hello.shutdown_timeout_s,
                        on_listening=listening, engine_gone=engine.closed_event,
                        signal_source=engine.on_signal)
    except OSError as e:  # the port is taken, or the address is not ours
        message = f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}"
        logger.error("%s", message)
        writer.write(ch.encode_json(ch.FATAL, {"message": message}))
        await writer.drain()
        return 1
    finally:
        reading.cancel()
    return 3 if engine.closed_event.is_set() else 0


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description="cvllm's API-server process (started by rank 0)")
    ap.add_argument("--fd", type=int, required=True, help="the channel's socket")
    ap.add_argument("--log-file", default=None)
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    from cvllm.logger import init_logging

    init_logging("api", args.log_file, args.log_level)
    # Signals come from rank 0 over the channel (SIGNAL frames): one sent to every process
    # of the job (systemd, pkill) must count once, not twice (a second one aborts at once).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=args.fd)
    return asyncio.run(run(sock))


if __name__ == "__main__":
    sys.exit(main())

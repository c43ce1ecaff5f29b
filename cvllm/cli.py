"""The ``cvllm`` command line: the composition root.

Parses flags into the config dataclasses, builds the engine (loader -> runner ->
``LLMEngine``) and either serves it over HTTP (``serve``) or runs prompts offline
(``generate``). Candle-vllm's short flag names are kept as aliases (``--w``, ``--f``, ...).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Callable, Dict, List, Optional

import click

from cvllm import __version__
from cvllm.cli_options import (
    agent_options, job_options, model_options, sampling_options, server_options,
)
from cvllm.config import ConfigError
from cvllm.sampling_params import DEFAULTABLE_SAMPLING_KEYS

logger = logging.getLogger("cvllm")


def _check_agent_flags(kw: Dict[str, Any]) -> None:
    """Fail in a second on a bad parser name or MCP configuration, before the model loads."""
    from cvllm.chat.reasoning import get_reasoning_parser
    from cvllm.chat.tool_parsers import get_tool_parser
    from cvllm.server.agent_setup import build_mcp

    try:
        if kw["tool_call_parser"] != "auto":
            get_tool_parser(kw["tool_call_parser"])
        if kw["reasoning_parser"] != "auto":
            get_reasoning_parser(kw["reasoning_parser"])
        build_mcp(kw["mcp_config"], kw["mcp_command"], kw["mcp_args"], kw["mcp_call_timeout"])
    except ValueError as exc:
        _fail(str(exc))


def _parse_device_ids(text: str) -> List[int]:
    try:
        ids = [int(x) for x in str(text).split(",") if x.strip() != ""]
    except ValueError:
        raise ConfigError(f"--device-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ConfigError("--device-ids is empty")
    return ids


def engine_options(kw: Dict[str, Any]) -> Dict[str, Any]:
    """Flags -> the keyword arguments of ``builder.build_llm_engine`` (every rank)."""
    return dict(
        weight_path=kw["weight_path"], weight_file=kw["weight_file"], model_id=kw["model_id"],
        dtype=kw["dtype"], cpu=kw["cpu"], device_ids=_parse_device_ids(kw["device_ids"]),
        kvcache_mem_mb=kw["kvcache_mem"], gpu_memory_fraction=kw["gpu_memory_fraction"],
        max_num_seqs=kw["max_num_seqs"], block_size=kw["block_size"],
        max_model_len=kw["max_model_len"], prefill_chunk_size=kw["prefill_chunk_size"],
        max_num_batched_tokens=kw.get("max_num_batched_tokens"),
        max_gen_tokens=kw["max_gen_tokens"], seed=kw["seed"], load_format=kw["load_format"],
        served_model_name=kw.get("served_model_name"),
        yarn_scaling_factor=kw.get("yarn_scaling_factor"),
        disable_cuda_graph=kw.get("disable_cuda_graph", False),
        cuda_graph_max_tokens=kw.get("cuda_graph_max_tokens", 512),
        fp8_kvcache=kw.get("fp8_kvcache", False),
        disable_prefix_cache=kw.get("disable_prefix_cache", False),
        prefix_cache_max_tokens=kw.get("prefix_cache_max_tokens"),
        isq=kw.get("isq"), dequantize=kw.get("dequantize", False),
        cpu_dense_gb=kw.get("cpu_dense_gb"),
        attention_backend=kw.get("attention_backend") or "auto",
        sampling_overrides={k: kw.get(k) for k in DEFAULTABLE_SAMPLING_KEYS},
    )


def parallel_options(kw: Dict[str, Any]):
    """Flags -> ``spmd.ParallelOptions`` (who runs where; spawned ranks rerun argv)."""
    from cvllm.runtime.spmd import ParallelOptions

    return ParallelOptions(
        device_ids=tuple(_parse_device_ids(kw["device_ids"])), cpu=kw["cpu"],
        num_nodes=kw["num_nodes"], node_rank=kw["node_rank"], master_addr=kw["master_addr"],
        master_port=kw["master_port"], multithread=kw["multithread"], bind=kw["bind"],
        argv=tuple(sys.argv[1:]), log_file=kw["log_file"], log_level=kw["log_level"],
        shutdown_timeout_s=kw.get("shutdown_timeout"),
    )


def _run_job(kw: Dict[str, Any], rank0_main: Callable) -> None:
    """Every rank of the job runs this; rank 0 also runs ``rank0_main(rank0)``."""
    from cvllm.runtime.job import run_job
    from cvllm.utils import tuning

    try:  # a bad CVLLM_* switch stops every rank here, not at its first use
        tuning.current()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    run_job(parallel_options(kw), engine_options(kw), rank0_main)


def _fail(msg: str) -> None:
    click.echo(f"cvllm: error: {msg}", err=True)
    sys.exit(2)


def _run_guarded(fn: Callable[[], None]) -> None:
    """Start-up errors a user can fix end the program with one clear line, no traceback."""
    from cvllm.loader.errors import ModelLoadError
    from cvllm.models.registry import UnsupportedArchitectureError

    try:
        fn()
    except (ConfigError, ModelLoadError, UnsupportedArchitectureError) as e:
        _fail(str(e))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="cvllm")
def main() -> None:
    """cvllm: serve large language models over an OpenAI-compatible API."""


@main.command()
@model_options
@job_options
@sampling_options
@agent_options
@server_options
def serve(**kw: Any) -> None:
    """Serve a model over the OpenAI API (chat, completions, models, health, metrics)."""
    from cvllm.logger import init_logging

    init_logging(0, None, kw["log_level"])  # run_job opens the per-rank --log file
    if not 0 < kw["port"] < 65536:
        _fail(f"--port must be in 1..65535, got {kw['port']}")
    _check_agent_flags(kw)
    _run_guarded(lambda: _run_job(kw, lambda rank0: _serve(kw, rank0)))


def _serve(kw: Dict[str, Any], rank0) -> None:
    import asyncio

    from cvllm.engine.async_engine import AsyncEngine
    from cvllm.server.agent_setup import build_mcp
    from cvllm.server.app import build_app
    from cvllm.server.lifecycle import serve_until_signal
    from cvllm.utils.exit_deadline import wait_budget
    from cvllm.utils.gc_freeze import freeze_startup_objects

    engine, defaults = rank0.build_engine()
    name = engine.config.served_model_name
    async_engine = AsyncEngine(engine, name, defaults)
    rank0.watch(async_engine)  # a dead or silent rank turns /health 503
    settings = _server_settings(kw, engine)
    if kw["api_process"] and _serve_in_api_process(kw, async_engine, settings):
        return
    mcp = build_mcp(kw["mcp_config"], kw["mcp_command"], kw["mcp_args"], kw["mcp_call_timeout"])
    app = build_app(async_engine, settings, mcp)

    async def on_startup(_app) -> None:
        async_engine.start()
        if mcp is not None:  # blocks until each server is up or failed once: off the loop
            await asyncio.get_running_loop().run_in_executor(None, mcp.start)
            logger.info("MCP tools: %s", ", ".join(t["function"]["name"]
                                                   for t in mcp.openai_tools()) or "none yet")

    async def on_cleanup(_app) -> None:
        async_engine.shutdown(timeout=wait_budget())  # bounded: the exit deadline is running
        if mcp is not None:  # stops the MCP server processes
            await asyncio.get_running_loop().run_in_executor(None, mcp.close, 2.0)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    freeze_startup_objects()  # the engine, the model and the app live as long as we do
    # SIGTERM / Ctrl-C: new requests get 503 while those in flight run on for at most
    # --shutdown-timeout, then are aborted; the engine stops and run_job sends SHUTDOWN.
    serve_until_signal(app, settings, async_engine, shutdown_timeout_s=kw["shutdown_timeout"],
                       on_listening=lambda _runner: logger.info(
                           "serving %s on http://%s:%d/v1", name, kw["host"], kw["port"]))


def _server_settings(kw: Dict[str, Any], engine):
    """The flags -> ``ServerSettings``, the tool-call and reasoning parsers chosen for
    the model (``auto``: from its architecture and chat template)."""
    from cvllm.server.agent_setup import choose_parsers
    from cvllm.server.app import ServerSettings

    tool_parser, reasoning_parser = choose_parsers(
        kw["tool_call_parser"], kw["reasoning_parser"], engine.config.model.architecture,
        engine.tokenizer.chat_template_source)
    return ServerSettings(host=kw["host"], port=kw["port"], api_key=kw["api_key"],
                          served_model_name=engine.config.served_model_name,
                          keepalive_timeout_s=kw["keepalive_timeout"],
                          header_timeout_s=kw["header_timeout"],
                          body_timeout_s=kw["body_timeout"],
                          max_connections=kw["max_connections"],
                          tool_call_parser=tool_parser, reasoning_parser=reasoning_parser,
                          mcp_max_rounds=kw["mcp_max_rounds"])


def _serve_in_api_process(kw: Dict[str, Any], async_engine, settings) -> bool:
    """Serve through the API process (``runtime/api_launch.py`` runs
    ``python -m cvllm.server.api_process``); False, with a warning, when the engine's
    tokenizer cannot be handed to another process (then this process serves)."""
    import dataclasses

    from cvllm.runtime import api_launch
    from cvllm.utils.gc_freeze import freeze_startup_objects

    mcp = {k: kw[k] for k in ("mcp_config", "mcp_command", "mcp_args", "mcp_call_timeout")}
    try:
        hello = api_launch.make_hello(async_engine, dataclasses.asdict(settings), mcp,
                                      kw["shutdown_timeout"])
    except api_launch.TokenizerStaysError as e:
        logger.warning("serving from this process (as --no-api-process): %s", e)
        return False
    log_args = ["--log-level", kw["log_level"]] + (["--log-file", kw["log_file"]]
                                                   if kw["log_file"] else [])
    freeze_startup_objects()
    try:
        api_launch.serve_with_api_process(
            async_engine, hello, [sys.executable, "-m", "cvllm.server.api_process"], log_args)
    except api_launch.ApiProcessStartError as e:
        _fail(str(e))
    except api_launch.ApiProcessDiedError as e:
        click.echo(f"cvllm: error: {e}", err=True)
        sys.exit(1)
    return True


@main.command()
@model_options
@job_options
@sampling_options
@click.option("--prompt", "prompts", multiple=True, help="A prompt; repeat for several. '-' reads lines from stdin.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap each prompt as a user chat message.")
@click.option("--max-tokens", type=int, default=None, help="New tokens per prompt.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt instead of plain text.")
@click.option("--logprobs", "num_logprobs", type=click.IntRange(0, 20), default=0, show_default=True,
              help="With --json: each token's log-probability and the N most likely [id, logprob].")
def generate(prompts, chat, max_tokens, as_json, num_logprobs, **kw: Any) -> None:
    """Run prompts offline (no server) and print the completions."""
    from cvllm.logger import init_logging

    kw["served_model_name"] = None

    init_logging(0, None, kw["log_level"])  # run_job opens the per-rank --log file
    # Prompts are read on rank 0 only (stdin belongs to it), before the model loads.
    _run_guarded(lambda: _run_job(kw, lambda rank0: _generate(
        _collect_prompts(prompts), chat, max_tokens, as_json, kw, rank0, num_logprobs)))


def _collect_prompts(prompts) -> List[str]:
    texts: List[str] = []
    for p in prompts or ("-",):
        if p == "-":
            texts.extend(line.rstrip("\n") for line in sys.stdin if line.strip())
        else:
            texts.append(p)
    if not texts:
        _fail("no prompt given (use --prompt TEXT or pipe lines on stdin)")
    return texts


def _generate(texts: List[str], chat: bool, max_tokens: Optional[int], as_json: bool,
              kw: Dict[str, Any], rank0, num_logprobs: int = 0) -> None:
    from cvllm.engine.llm import LLM
    from cvllm.sampling_params import SamplingParams, SamplingParamsError

    engine, defaults = rank0.build_engine()
    llm = LLM.from_engine(engine)
    try:
        sampling = {k: v for k, v in defaults.items() if k in DEFAULTABLE_SAMPLING_KEYS}
        params = SamplingParams(**sampling, max_tokens=max_tokens or engine.config.max_gen_tokens,
                                logprobs=num_logprobs or None)
    except SamplingParamsError as e:
        _fail(str(e))
    results = llm.chat([[{"role": "user", "content": t}] for t in texts], params) if chat \
        else llm.generate(texts, params)
    for text, res in zip(texts, results):
        if as_json:
            row = {"prompt": text, "text": res.text, "finish_reason": res.finish_reason,
                   "num_tokens": len(res.token_ids), "token_ids": [int(t) for t in res.token_ids]}
            if num_logprobs:
                row["logprobs"] = [lp.logprob for lp in res.logprobs]
                row["top_logprobs"] = [[[t, v] for t, v in lp.top_ids.items()]
                                       for lp in res.logprobs]
            click.echo(json.dumps(row))
        else:
            click.echo(res.text)

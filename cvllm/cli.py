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
from cvllm.config import ConfigError
from cvllm.sampling_params import DEFAULTABLE_SAMPLING_KEYS

logger = logging.getLogger("cvllm")


def _model_options(f: Callable) -> Callable:
    """Flags shared by ``serve`` and ``generate``: where the model comes from and how the
    engine is sized."""
    opts = [
        click.option("--w", "--weight-path", "weight_path", default=None,
                     help="Hugging Face model folder (config.json, *.safetensors, tokenizer)."),
        click.option("--f", "--weight-file", "weight_file", default=None,
                     help="A .gguf model file."),
        click.option("--m", "--model-id", "model_id", default=None,
                     help="Hugging Face model id, downloaded into the HF cache."),
        click.option("--dtype", type=click.Choice(["bf16", "f16", "f32"]), default=None,
                     help="Compute dtype (default: bf16 on GPU, f32 on CPU)."),
        click.option("--d", "--device-ids", "device_ids", default="0",
                     help="Comma-separated GPU ids; several ids run tensor parallel, one "
                          "process per id (with --cpu: that many CPU ranks)."),
        click.option("--cpu", is_flag=True, help="Run on the CPU."),
        click.option("--mem", "--kvcache-mem-gpu", "kvcache_mem", type=int, default=None,
                     help="KV cache size in MB."),
        click.option("--gpu-memory-fraction", type=float, default=0.7, show_default=True,
                     help="Fraction of the GPU memory left after the weights, the profiled "
                          "largest step and the CUDA graphs given to the KV cache."),
        click.option("--max-num-seqs", type=int, default=256, show_default=True),
        click.option("--block-size", type=int, default=16, show_default=True),
        click.option("--max-model-len", type=int, default=0,
                     help="Context length (default: the model's own)."),
        click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
                     help="Token budget of one step, shared by the decodes (scheduled "
                          "first, one token each) and the prompt chunks; bounds the gap "
                          "between a stream's tokens while long prompts are prefilled. "
                          "Default: 8192 on GPU, 128 on CPU (or --prefill-chunk-size)."),
        click.option("--prefill-chunk-size", type=click.IntRange(min=0), default=None,
                     help="Most prompt tokens of one sequence per step, under the step "
                          "budget (default: the budget); 0 disables chunking."),
        click.option("--isq", default=None,
                     help="Quantize a Hugging Face folder's float weights while loading: "
                          "q4_0, q4_1, q5_0, q5_1, q8_0, q2k, q3k, q4k, q5k or q6k."),
        click.option("--dequantize", is_flag=True,
                     help="Dequantize a GGUF file's weights to --dtype at load instead of "
                          "keeping them quantized (comparisons; more memory, slower)."),
        click.option("--cpu-dense-gb", type=float, default=None,
                     help="CPU: GiB of bf16 copies kept beside two-plane quantized "
                          "weights (Q5_*, Q8_0, IQ4, Q2_K/Q3_K) for decode batches of 3+ "
                          "rows (8+ without AMX). Default: a quarter of the free memory "
                          "where the CPU has AMX or AVX-512 BF16, else 0; 0 turns them off."),
        click.option("--fp8-kvcache", is_flag=True,
                     help="Keep attention K/V in FP8 e4m3 with per-layer scales: half the "
                          "KV memory of bf16."),
        click.option("--disable-prefix-cache", is_flag=True,
                     help="Compute every prompt in full instead of reusing the KV blocks of "
                          "a prefix computed before."),
        click.option("--prefix-cache-max-tokens", type=click.IntRange(min=0), default=None,
                     help="Most tokens' worth of cached prefix blocks kept while no request "
                          "uses them (default: until the free blocks run out)."),
        click.option("--disable-cuda-graph", is_flag=True,
                     help="Launch every step eagerly instead of replaying CUDA graphs (CPU: "
                          "decode steps through the modules, not the flat decode loop)."),
        click.option("--cuda-graph-max-tokens", type=click.IntRange(min=0), default=512,
                     show_default=True,
                     help="CUDA: steps with prompt tokens (new prompts' chunks, prefix-cache "
                          "hits' suffixes, and the decodes beside them) of at most this many "
                          "tokens replay CUDA graphs captured around the attention; 0 runs "
                          "them eagerly."),
        click.option("--attention-backend", type=click.Choice(["auto", "triton", "torch_ref"]),
                     default="auto", show_default=True,
                     help="auto: Triton on CUDA, the torch reference on the CPU."),
        click.option("--yarn-scaling-factor", type=float, default=None,
                     help="Override the model's rope scaling with YaRN at this factor; the "
                          "context becomes factor x max_position_embeddings."),
        click.option("--max-gen-tokens", type=int, default=0,
                     help="Default max_tokens (default max_model_len/5 in [128, 16384])."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--load-format", type=click.Choice(["auto", "dummy"]), default="auto",
                     show_default=True, help="dummy: random weights from config.json alone."),
        click.option("--log", "log_file", default=None,
                     help="Also log to this file; rank N > 0 writes NAME.rankN.EXT."),
        click.option("--log-level", default="INFO", show_default=True),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _job_options(f: Callable) -> Callable:
    """Flags shared by ``serve`` and ``generate``: how the ranks of a multi-node or
    threaded job find each other."""
    opts = [
        click.option("--num-nodes", type=int, default=1, show_default=True,
                     help="Nodes of an SSH-driven run (launch/ssh_launch.sh); each node "
                          "runs one rank per --device-ids entry."),
        click.option("--node-rank", type=int, default=0, show_default=True,
                     help="This node's index in an SSH-driven run (0 hosts the server)."),
        click.option("--master-addr", default=None,
                     help="Address of node 0 (rank 0): rendezvous of every rank."),
        click.option("--master-port", type=int, default=None,
                     help="Rendezvous port on --master-addr (default 29500 with "
                          "--num-nodes, a free one with spawn); the health link uses +1."),
        click.option("--multithread", is_flag=True,
                     help="Run the --device-ids ranks as threads of this one process "
                          "(debugging)."),
        click.option("--bind-interface", "bind", default=None, envvar="CVLLM_BIND_ADDR",
                     help="Network interface (eth0) or address that the control plane, "
                          "the health link and NCCL / gloo bind to."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _sampling_options(f: Callable) -> Callable:
    """Server-wide sampling defaults; a request's own values win."""
    opts = [
        click.option("--temperature", type=float, default=None),
        click.option("--top-p", type=float, default=None),
        click.option("--top-k", type=int, default=None),
        click.option("--min-p", type=float, default=None),
        click.option("--frequency-penalty", type=float, default=None),
        click.option("--presence-penalty", type=float, default=None),
        click.option("--repetition-penalty", type=float, default=None),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f




def _agent_options(f: Callable) -> Callable:
    """``serve`` flags of the agent API: tool-call and reasoning parsers, MCP servers."""
    opts = [
        click.option("--enforce-parser", "--tool-call-parser", "tool_call_parser",
                     default="auto", show_default=True,
                     help="Tool-call format of the model: hermes (qwen), qwen3_coder, "
                          "mistral, llama3_json, deepseek_v3, glm45, json, passthrough; "
                          "auto detects it from the chat template and architecture."),
        click.option("--reasoning-parser", default="auto", show_default=True,
                     help="Reasoning split: qwen3, glm45, deepseek_r1, none; auto detects "
                          "it from the chat template and architecture."),
        click.option("--mcp-config", default=None,
                     help="JSON file of MCP servers ({\"mcpServers\": {name: {command, "
                          "args, env}}}) whose tools the model is offered."),
        click.option("--mcp-command", default=None,
                     help="One MCP server (stdio) to start, named 'mcp'."),
        click.option("--mcp-args", default=None,
                     help="Comma-separated arguments of --mcp-command."),
        click.option("--mcp-max-rounds", type=click.IntRange(min=0), default=8,
                     show_default=True,
                     help="Most rounds of MCP tool calls the server runs for one answer."),
        click.option("--mcp-call-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=60.0, show_default=True,
                     help="Seconds one MCP tool call may take; then the model gets an "
                          "error result."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


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
@_model_options
@_job_options
@_sampling_options
@_agent_options
@click.option("--h", "--host", "host", default="127.0.0.1", show_default=True)
@click.option("--p", "--port", "port", type=int, default=2000, show_default=True)
@click.option("--served-model-name", default=None, help="Model name in the API (default: from the weights).")
@click.option("--api-key", default=None, envvar="CVLLM_API_KEY", help="Require 'Authorization: Bearer KEY'.")
@click.option("--keepalive-timeout", type=click.FloatRange(min=0, min_open=True), default=75.0,
              show_default=True, help="Seconds an idle HTTP connection stays open.")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds from a request's first byte to the end of its "
                                      "headers; else 408 and close (slowloris).")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="Seconds for a request's whole body to arrive after "
                                      "its headers; else 408 and close.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Most open HTTP connections; beyond it new ones get a 503 and are closed.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds that requests in flight may run on after SIGTERM / Ctrl-C; then "
                   "they are aborted and every rank exits within 5 s more.")
@click.option("--api-process/--no-api-process", default=True, show_default=True,
              help="Run HTTP, tokenizing and chat templates in a process of their own beside "
                   "rank 0's engine (each with its own GIL); off: one process.")
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
    from cvllm.server.agent_setup import build_mcp, choose_parsers
    from cvllm.server.app import ServerSettings, build_app
    from cvllm.server.lifecycle import serve_until_signal
    from cvllm.utils.exit_deadline import wait_budget
    from cvllm.utils.gc_freeze import freeze_startup_objects

    engine, defaults = rank0.build_engine()
    name = engine.config.served_model_name
    async_engine = AsyncEngine(engine, name, defaults)
    rank0.watch(async_engine)  # a dead or silent rank turns /health 503
    tool_parser, reasoning_parser = choose_parsers(
        kw["tool_call_parser"], kw["reasoning_parser"], engine.config.model.architecture,
        engine.tokenizer.chat_template_source)
    settings = ServerSettings(host=kw["host"], port=kw["port"], api_key=kw["api_key"],
                              served_model_name=name,
                              keepalive_timeout_s=kw["keepalive_timeout"],
                              header_timeout_s=kw["header_timeout"],
                              body_timeout_s=kw["body_timeout"],
                              max_connections=kw["max_connections"],
                              tool_call_parser=tool_parser, reasoning_parser=reasoning_parser,
                              mcp_max_rounds=kw["mcp_max_rounds"])
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
@_model_options
@_job_options
@_sampling_options
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

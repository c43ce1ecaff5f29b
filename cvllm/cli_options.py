"""The flags of ``cvllm serve`` and ``cvllm generate``, one click decorator per group.

Used by ``cli.py`` (the composition root) only: each decorator adds its group's options
in the order ``--help`` lists them; ``cli.py`` turns the parsed values into the
builder's and the job's options. Candle-vllm's short flag names are kept as aliases
(``--w``, ``--f``, ...).
"""

from __future__ import annotations

from typing import Callable, List

import click


def _apply(opts: List[Callable], f: Callable) -> Callable:
    """``opts`` on ``f``, the first of them listed first."""
    for opt in reversed(opts):
        f = opt(f)
    return f


def model_options(f: Callable) -> Callable:
    """Flags shared by ``serve`` and ``generate``: where the model comes from and how the
    engine is sized."""
    return _apply([*_source_options(), *_device_options(), *_batch_options(),
                   *_storage_options(), *_reuse_options(), *_run_options()], f)


def _source_options() -> List[Callable]:
    """Where the weights come from, and the compute dtype."""
    return [
        click.option("--w", "--weight-path", "weight_path", default=None,
                     help="Hugging Face model folder (config.json, *.safetensors, tokenizer)."),
        click.option("--f", "--weight-file", "weight_file", default=None,
                     help="A .gguf model file."),
        click.option("--m", "--model-id", "model_id", default=None,
                     help="Hugging Face model id, downloaded into the HF cache."),
        click.option("--dtype", type=click.Choice(["bf16", "f16", "f32"]), default=None,
                     help="Compute dtype (default: bf16 on GPU, f32 on CPU)."),
    ]


def _device_options() -> List[Callable]:
    """Which devices run the ranks, and the KV cache's memory."""
    return [
        click.option("--d", "--device-ids", "device_ids", default="0",
                     help="Comma-separated GPU ids; several ids run tensor parallel, one "
                          "process per id (with --cpu: that many CPU ranks)."),
        click.option("--cpu", is_flag=True, help="Run on the CPU."),
        click.option("--mem", "--kvcache-mem-gpu", "kvcache_mem", type=int, default=None,
                     help="KV cache size in MB."),
        click.option("--gpu-memory-fraction", type=float, default=0.7, show_default=True,
                     help="Fraction of the GPU memory left after the weights, the profiled "
                          "largest step and the CUDA graphs given to the KV cache."),
    ]


def _batch_options() -> List[Callable]:
    """How many sequences and tokens one step runs, in blocks of which size."""
    return [
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
    ]


def _storage_options() -> List[Callable]:
    """How weights and K/V are stored: quantized, dequantized, dense copies, FP8."""
    return [
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
    ]


def _reuse_options() -> List[Callable]:
    """The prefix cache, CUDA graphs and the attention backend."""
    return [
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
    ]


def _run_options() -> List[Callable]:
    """The model's context override, generation defaults, dummy weights, logs."""
    return [
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


def job_options(f: Callable) -> Callable:
    """Flags shared by ``serve`` and ``generate``: how the ranks of a multi-node or
    threaded job find each other."""
    return _apply([
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
    ], f)


def sampling_options(f: Callable) -> Callable:
    """Server-wide sampling defaults; a request's own values win."""
    return _apply([
        click.option("--temperature", type=float, default=None),
        click.option("--top-p", type=float, default=None),
        click.option("--top-k", type=int, default=None),
        click.option("--min-p", type=float, default=None),
        click.option("--frequency-penalty", type=float, default=None),
        click.option("--presence-penalty", type=float, default=None),
        click.option("--repetition-penalty", type=float, default=None),
    ], f)


def agent_options(f: Callable) -> Callable:
    """``serve`` flags of the agent API: tool-call and reasoning parsers, MCP servers."""
    return _apply([
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
    ], f)


def server_options(f: Callable) -> Callable:
    """``serve`` flags of the HTTP server: address, name, key, timeouts, the API process."""
    return _apply([
        click.option("--h", "--host", "host", default="127.0.0.1", show_default=True),
        click.option("--p", "--port", "port", type=int, default=2000, show_default=True),
        click.option("--served-model-name", default=None,
                     help="Model name in the API (default: from the weights)."),
        click.option("--api-key", default=None, envvar="CVLLM_API_KEY",
                     help="Require 'Authorization: Bearer KEY'."),
        click.option("--keepalive-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=75.0, show_default=True,
                     help="Seconds an idle HTTP connection stays open."),
        click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=30.0, show_default=True,
                     help="Seconds from a request's first byte to the end of its "
                          "headers; else 408 and close (slowloris)."),
        click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True),
                     default=60.0, show_default=True,
                     help="Seconds for a request's whole body to arrive after "
                          "its headers; else 408 and close."),
        click.option("--max-connections", type=click.IntRange(min=1), default=1024,
                     show_default=True,
                     help="Most open HTTP connections; beyond it new ones get a 503 and are "
                          "closed."),
        click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0,
                     show_default=True,
                     help="Seconds that requests in flight may run on after SIGTERM / "
                          "Ctrl-C; then they are aborted and every rank exits within 5 s "
                          "more."),
        click.option("--api-process/--no-api-process", default=True, show_default=True,
                     help="Run HTTP, tokenizing and chat templates in a process of their "
                          "own beside rank 0's engine (each with its own GIL); off: one "
                          "process."),
    ], f)

"""GPU smoke run (not a test): a 1B-Llama-shaped model with random weights, the KV cache
sized from the profile (default --gpu-memory-fraction), decode speed with CUDA graphs
on and off at a few batch sizes, and identical tokens. Prints one JSON line per case.

    python -m tests.worker.gpu_cuda_graph_smoke [--layers 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from tests.worker.tiny_llama import LLAMA_CFG, word_tokenizer

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, vocab_size=32000, max_position_embeddings=4096)


def write_folder(folder: Path, layers: int) -> Path:
    cfg = dict(LLAMA_CFG, **SHAPE, num_hidden_layers=layers)
    (folder / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16")))
    word_tokenizer(512).save_pretrained(folder)
    return folder


def run(folder: Path, graphs: bool, batches, new_tokens: int):
    from cvllm.engine.llm import LLM
    from cvllm.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(weight_path=str(folder), load_format="dummy", max_num_seqs=64, max_model_len=2048,
              disable_cuda_graph=not graphs)
    runner = llm.engine.runner
    print(json.dumps(dict(graphs=graphs, build_s=round(time.perf_counter() - t0, 2),
                          kv_blocks=runner.num_blocks,
                          captured=sorted(runner.graphs.graphs) if runner.graphs else None)))
    out = {}
    for b in batches:
        prompts = [[5 + i, 6, 7, 8] for i in range(b)]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = llm.generate(prompts, params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        out[b] = [r.token_ids for r in res]
        print(json.dumps(dict(graphs=graphs, batch=b, tok_per_s=round(b * new_tokens / dt, 1),
                              step_ms=round(1000 * dt / new_tokens, 3))))
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(json.dumps(dict(gpu=torch.cuda.get_device_name())))
    folder = write_folder(Path(tempfile.mkdtemp()), args.layers)
    batches = [1, 8, 32, 64]
    on = run(folder, True, batches, args.new_tokens)
    off = run(folder, False, batches, args.new_tokens)
    print(json.dumps(dict(identical={b: on[b] == off[b] for b in batches})))


if __name__ == "__main__":
    main()

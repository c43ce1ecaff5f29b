#!/usr/bin/env python3
"""The peer of ``tools/bench.py``'s decode figures: the same workload through Hugging Face
transformers' own continuous batching (``model.generate_batch``, paged sdpa attention).

    python tools/bench_hf_peer.py --model-dir DIR --batches 64,16 --tokens 1024 --prompt-len 128

``DIR`` is a folder ``bench.py`` wrote (config.json only; the weights are random: speed
does not depend on their values). ``bench.py`` runs this in a child process, before its
own engine starts, so the two never share GPU memory, and kills it at its time limit.
Each batch size prints one line ``BENCH_HF_RESULT {json}`` as soon as it is measured.

Timing: the requests record a timestamp per generated token (``record_timestamps``). The
decode window starts when every request has its first token (prefill over) and ends at the
first request's last token; throughput is the tokens generated inside it over its length,
as ``bench.py`` measures cvllm. EOS is disabled (``eos_token_id=-1``) so every request
generates exactly ``--tokens`` tokens; the script checks that it did.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

RESULT_TAG = "BENCH_HF_RESULT"


def log(msg: str) -> None:
    print(f"[hf-peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(model_dir: str, dtype_name: str, device: str) -> Any:
    """Random-weight model from config.json on ``device``; paged sdpa attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype_name]
    cfg = AutoConfig.from_pretrained(model_dir)
    last: Optional[Exception] = None
    # transformers 5.17 wants the "paged|" prefix; later versions deprecate it.
    for attn in ("paged|sdpa", "sdpa"):
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
            return model.eval()
        except (ValueError, KeyError, TypeError) as e:
            last = e
    raise RuntimeError(f"cannot build the model with paged sdpa attention: {last}")


def cb_config(small: bool) -> Any:
    """Continuous-batching settings: transformers' own defaults on a GPU. On the CPU its
    automatic sizing allocates for minutes, so a tiny run fixes a small cache."""
    if not small:
        return None
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return None
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    wanted = {"num_blocks": 256, "max_batch_tokens": 512}
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in names})


def decode_window(outputs: List[Any], tokens: int) -> Dict[str, Any]:
    """Decode-only throughput from per-token timestamps (see module doc)."""
    stamps = [list(o.timestamps or []) for o in outputs]
    counts = [len(o.generated_tokens) for o in outputs]
    res: Dict[str, Any] = {"generated_tokens_min": min(counts), "generated_tokens_max": max(counts),
                           "all_full_length": all(c == tokens for c in counts)}
    if not all(len(s) >= 2 for s in stamps):
        res["error"] = "no per-token timestamps (record_timestamps unsupported?)"
        return res
    t0 = max(s[0] for s in stamps)
    t1 = min(s[-1] for s in stamps)
    n = sum(sum(1 for t in s if t0 < t <= t1) for s in stamps)
    dt = t1 - t0
    res.update({"decode_window_s": dt, "decode_tokens": n,
                "tokens_per_s": n / dt if dt > 0 else 0.0,
                "tokens_per_s_per_seq": n / dt / len(outputs) if dt > 0 else 0.0,
                "ms_per_step": 1000.0 * dt / (n / len(outputs)) if n else 0.0})
    return res


def run_batch(model: Any, batch: int, prompt_len: int, tokens: int, vocab: int, seed: int,
              small: bool) -> Dict[str, Any]:
    import numpy as np
    from transformers import GenerationConfig

    rng = np.random.default_rng(seed + batch)
    inputs = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]
    gen = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kwargs: Dict[str, Any] = {"generation_config": gen, "record_timestamps": True,
                              "max_new_tokens": tokens}
    cb = cb_config(small)
    if cb is not None:
        kwargs["continuous_batching_config"] = cb
    if small:
        kwargs["warmup"] = False  # CUDA-graph warm-up; minutes of nothing on a CPU
    t = time.perf_counter()
    out = model.generate_batch(inputs, **kwargs)
    wall = time.perf_counter() - t
    results = list(out.values())
    failed = [r.error for r in results if getattr(r, "error", None)]
    res: Dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "output_tokens": tokens,
                           "wall_s": wall, "num_results": len(results)}
    if len(results) != batch or failed:
        res["error"] = f"{len(results)}/{batch} results, errors: {failed[:3]}"
        return res
    res.update(decode_window(results, tokens))
    return res


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batches", default="64,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default=None, help="bf16 (GPU default) | f16 | f32 (CPU default)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # "paged|" prefix deprecation
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = args.dtype or ("bf16" if device == "cuda" else "f32")
    torch.manual_seed(args.seed)
    t = time.perf_counter()
    model = build_model(args.model_dir, dtype, device)
    info = {"transformers": transformers.__version__, "torch": torch.__version__, "device": device,
            "dtype": dtype, "attn_implementation": model.config._attn_implementation,
            "build_s": time.perf_counter() - t}
    log(f"model built in {info['build_s']:.1f}s: {info}")
    print(f"{RESULT_TAG} {json.dumps({'info': info})}", flush=True)
    vocab = int(model.config.vocab_size)
    for batch in [int(b) for b in args.batches.split(",") if b.strip()]:
        log(f"batch {batch}: {args.prompt_len}-token prompts, {args.tokens} tokens each")
        try:
            res = run_batch(model, batch, args.prompt_len, args.tokens, vocab, args.seed,
                            small=device == "cpu")
        except Exception as e:  # report and go on with the next batch size
            res = {"batch": batch, "error": f"{type(e).__name__}: {e}"}
        log(f"batch {batch}: {res.get('tokens_per_s', 0):.1f} tok/s "
            f"({res.get('error') or 'ok'})")
        print(f"{RESULT_TAG} {json.dumps({'result': res})}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Decode speed of llama.cpp (through llama-cpp-python) on a GGUF file: the peer that
``tools/bench_decode.py --peer llama.cpp`` runs side by side with cvllm.

    echo '{"gguf": "model.gguf", "prompt_ids": [1, 2, 3], "tokens": 128}' \\
        | python tools/peer_llama_cpp.py --threads 2

Reads one JSON request on stdin, prints one JSON result on stdout. Run as a subprocess so
that llama.cpp's OpenMP threads and torch's never share a process. Greedy decoding of a
fixed number of tokens (EOS is not a stop: ``Llama.generate`` only yields tokens, the
caller decides when to stop); the prefill and the first token are not timed.

Install (a plain CPU build from the source distribution; needs a C/C++ compiler and
cmake, and takes about 10 minutes on two cores):

    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_OPENMP=ON" \\
        pip install --no-binary llama-cpp-python llama-cpp-python

On a Xeon with AMX, the native build (0.3.36) segfaults in ``ggml_backend_amx_mul_mat``
at the first decode (seen in a Firecracker VM); build without AMX instead:
``-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON`` (add
``--no-cache-dir --force-reinstall`` to replace a built wheel).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from typing import Dict, List, Optional

INSTALL_HINT = ("llama-cpp-python is not installed; build it from source with\n"
                "  CMAKE_ARGS=\"-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_OPENMP=ON\" "
                "pip install --no-binary llama-cpp-python llama-cpp-python\n"
                "(on an AMX Xeon, see tools/peer_llama_cpp.py: build without AMX)")


def missing() -> Optional[str]:
    """None when llama_cpp can be imported, else a message saying how to get it."""
    return None if importlib.util.find_spec("llama_cpp") else INSTALL_HINT


def measure(gguf: str, prompt_ids: List[int], tokens: int, threads: int,
            rounds: int = 1) -> Dict:
    """Greedy-decode ``tokens`` tokens after ``prompt_ids``, ``rounds`` times; the best
    round's decode tok/s (other processes only ever slow a round down)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(prompt_ids) + tokens + 8, n_batch=512, verbose=False)
    runs = []
    for _ in range(rounds + 1):  # the first round warms up caches and the thread pool
        llm.reset()
        t_first = t_last = None
        n = 0
        t0 = time.perf_counter()
        for _tok in llm.generate(prompt_ids, temp=0.0, reset=True):
            now = time.perf_counter()
            n += 1
            if t_first is None:
                t_first = now
            t_last = now
            if n >= tokens:
                break
        runs.append({"prefill_and_first_token_s": t_first - t0,
                     "decode_tokens": n - 1,
                     "tokens_per_s": (n - 1) / (t_last - t_first) if n > 1 else 0.0})
    best = max(runs[1:], key=lambda r: r["tokens_per_s"])
    return {"peer": "llama.cpp", "llama_cpp_python": llama_cpp.__version__,
            "n_threads": threads, "streams": 1, **best,
            "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs[1:]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    msg = missing()
    if msg:
        print(json.dumps({"peer": "llama.cpp", "error": msg}))
        sys.exit(3)
    req = json.load(sys.stdin)
    print(json.dumps(measure(req["gguf"], [int(t) for t in req["prompt_ids"]],
                             int(req["tokens"]), args.threads, args.rounds)))


if __name__ == "__main__":
    main()

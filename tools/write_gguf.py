"""Write a GGUF file of a Hugging Face model folder, quantized by cvllm's quantizer.

Usage::

    python tools/write_gguf.py HF_FOLDER OUT.gguf --type q4k
    python tools/write_gguf.py HF_FOLDER OUT.gguf --type q4k --keep-embeddings-type q8_0
    python tools/write_gguf.py HF_FOLDER OUT.gguf --type f16 --device cpu

Loads the folder with transformers (``AutoModelForCausalLM``, float32), picks the
exporter of its architecture in ``tools/gguf_export`` (llama.cpp's tensor names, metadata
and tensor rewrites) and writes the weights as ``--type``: an ``--isq`` name (q4_0, q4_1,
q5_0, q5_1, q8_0, q2k, q3k, q4k, q5k, q6k; ``q4_k`` spellings too) or f32 / f16 / bf16.
Which tensors are quantized follows llama-quantize (``QuantPlan.type_for``): matrices and
expert stacks along their rows; vectors, norms and MoE routers stay F32; a row that is not
whole blocks falls back to a 32-element-block type (Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0), or F32 if even that does not fit.
``--keep-embeddings-type`` writes ``token_embd`` and ``output`` as another type, the way
llama.cpp keeps them at higher precision. Blocks are byte-identical to llama.cpp's
reference quantizers (see ``cvllm/quantization/ggml_quantizer.py``).

The tokenizer is not embedded: cvllm reads it from the Hugging Face folder, as it does
for the tests' GGUF files. The exporters hold the whole model as float32 in memory.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path
from typing import List, Optional

import torch

from cvllm.kernels.quant.ggml_types import GgmlType, parse_isq
from gguf_export import exporter_for
from gguf_export.common import QuantPlan

FLOAT_NAMES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


def type_name(name: str) -> str:
    """``--type`` / ``--keep-embeddings-type`` value -> gguf type name (``Q4_K``, ``F16``)."""
    key = name.strip().lower()
    if key in FLOAT_NAMES:
        return FLOAT_NAMES[key]
    return GgmlType(parse_isq(key)).name  # GgmlType names are gguf-py's


def build_plan(weights: str, keep_embeddings: Optional[str], device: str) -> QuantPlan:
    overrides = {}
    if keep_embeddings:
        kept = type_name(keep_embeddings)
        overrides = {"token_embd.weight": kept, "output.weight": kept}
    return QuantPlan(weights=type_name(weights), overrides=overrides, device=device)


def write(folder: Path, out: Path, plan: QuantPlan) -> Path:
    """Load ``folder`` with transformers and write ``out`` as ``plan`` says."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return exporter_for(model.config)(model, Path(out), plan=plan)


def summary(path: Path) -> str:
    """One line: tensor count per type and the file size."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    counts = collections.Counter(t.tensor_type.name for t in reader.tensors)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    return f"{path}: {len(reader.tensors)} tensors ({kinds}), {path.stat().st_size / 2**20:.1f} MiB"


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="Hugging Face model folder")
    ap.add_argument("out", type=Path, help="GGUF file to write")
    ap.add_argument("--type", default="q8_0", help="weight type: an --isq name or f32/f16/bf16")
    ap.add_argument("--keep-embeddings-type", default=None,
                    help="type of token_embd and output (default: --type)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the quantizer runs (default: cuda when available)")
    args = ap.parse_args(argv)
    try:
        plan = build_plan(args.type, args.keep_embeddings_type, args.device)
    except ValueError as exc:
        ap.error(str(exc))
    start = time.perf_counter()
    path = write(args.folder, args.out, plan)
    print(f"{summary(path)}; {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

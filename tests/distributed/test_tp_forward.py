"""Tensor-parallel forwards on real gloo process groups (CPU) against the 1-rank model.

The test process builds tiny random Hugging Face models (saved with ``save_pretrained``)
and computes the 1-rank prefill logits itself; then it starts one subprocess per rank
(``python -m tests.distributed.test_tp_forward SPEC``, a gloo group rendezvousing through
a ``file://`` in the test's temp folder). Every rank calls ``initialize_model_parallel``,
builds the model, loads its shards from the (lazy) checkpoint, runs one batched prefill
(its collectives go through ``distributed/comm.py``) and writes its logits, its resident
parameter bytes and the bytes its lazy reads materialised to an ``.npz`` (plain arrays,
no pickle). Logits must match the 1-rank ones (float32, atol 1e-4) on every rank.

Cases: Llama and Qwen3-MoE at tp=2, a Llama whose 2 KV heads meet tp=3 (rank 1's two
query heads use different KV heads, so it holds both), and the default SmolLM2 GGUF
(9 heads, 3 KV heads, Q4_1 with llama.cpp's Q/K permutation) at tp=3 and at tp=2 (an
uneven head split: 4 and 5 query heads, padded to 5 slots). The other
families run the same check with their ranks as threads of this process
(``InProcessGroup``, the ``--multithread`` collectives): cheap, and every family's own
sharding code (fused qkv, per-head norms, MoE shared experts, DeltaNet, MLA) is covered.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
PROMPTS: List[List[int]] = [[3, 17, 99, 4, 250, 31, 8], [7, 7, 1, 200, 45, 13, 8, 91, 120, 64, 5]]
BLOCK_SIZE = 16
ATOL = 1e-4
RANK_TIMEOUT_S = 240


# ------------------------------------------------------------------ what every rank runs
def prefill_logits(model, prompts: Sequence[List[int]] = PROMPTS) -> torch.Tensor:
    """One batched prefill of ``prompts`` through ``model`` with a paged cache of this
    rank's KV heads: logits of every token ``[T, V]`` float32."""
    from cvllm.attention.kv_cache import CacheSizing, allocate_kv_caches, plan_kv_cache
    from cvllm.attention.metadata import AttentionMetadata
    from cvllm.attention.specs import FullAttentionSpec
    from cvllm.layers.attention import Attention

    if hasattr(model, "cache_specs"):
        specs = list(model.cache_specs())
    else:
        specs = [FullAttentionSpec(m.num_kv_heads, m.head_size, torch.float32)
                 for m in model.modules() if isinstance(m, Attention)]
    per_seq = max(math.ceil(len(p) / BLOCK_SIZE) for p in prompts)
    sizing = CacheSizing(block_size=BLOCK_SIZE, max_num_seqs=len(prompts),
                         max_model_len=per_seq * BLOCK_SIZE,
                         max_num_batched_tokens=sum(map(len, prompts)),
                         max_chunk=max(map(len, prompts)))
    layout = plan_kv_cache(specs, sizing, num_blocks=per_seq * len(prompts))
    caches = allocate_kv_caches(specs, layout, "cpu")
    tables = np.arange(per_seq * len(prompts)).reshape(len(prompts), per_seq)  # [B, M]
    slots = [tables[b, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
             for b, p in enumerate(prompts) for t in range(len(p))]
    meta = AttentionMetadata.build(
        slot_mapping=np.array(slots), query_start_loc=np.cumsum([0] + [len(p) for p in prompts]),
        seq_lens=np.array([len(p) for p in prompts]), block_tables=tables, device="cpu")
    ids = torch.tensor([t for p in prompts for t in p])  # [T]
    positions = torch.cat([torch.arange(len(p)) for p in prompts])  # [T]
    with torch.inference_mode():
        hidden = model(ids, positions, meta, caches)  # [T, hidden]
        return model.compute_logits(hidden)  # [T, V]


def resident_weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (a tied weight counted once)."""
    seen: Dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def load_and_run(case: Dict, max_model_len: int = 64) -> Dict[str, np.ndarray]:
    """Build ``case``'s model as this rank (whatever ``initialize_model_parallel`` said),
    load it and prefill: logits, resident bytes, bytes the loader materialised."""
    from cvllm import loader
    from cvllm.loader.lazy import materialized_bytes, reset_materialized_bytes
    from cvllm.models.registry import get_model_class

    source = loader.resolve_model_source(case.get("weights"), case.get("file"))
    mc = loader.load_model_config(source, "f32", max_model_len)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = get_model_class(mc.architecture)(mc)
    finally:
        torch.set_default_dtype(prev)
    reset_materialized_bytes()
    model.load_weights(loader.iter_weights(source))
    read = materialized_bytes()
    return dict(logits=prefill_logits(model.eval()).numpy(),
                resident=np.int64(resident_weight_bytes(model)), materialized=np.int64(read))


def rank_main(spec_path: str) -> None:
    """Entry point of one rank: join the gloo group, run every case, write results."""
    import torch.distributed as dist

    from cvllm.distributed.parallel_state import destroy_model_parallel, initialize_model_parallel

    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["TP_TEST_RANK"]), int(spec["world_size"])
    torch.set_num_threads(1)  # several ranks share the CI box's 2 cores
    dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank,
                            world_size=world)
    try:
        initialize_model_parallel(rank, world, dist.group.WORLD)
        for case in spec["cases"]:
            out = load_and_run(case)
            np.savez(Path(case["out"]) / f"rank{rank}.npz", **out)
        dist.barrier()
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


# ------------------------------------------------------------------ the test's side
def run_ranks(world_size: int, cases: List[Dict], tmp: Path) -> List[List[Dict]]:
    """Run ``cases`` on ``world_size`` ranks (one subprocess each); per case, per rank,
    its results."""
    tmp.mkdir(parents=True, exist_ok=True)
    for i, case in enumerate(cases):
        case["out"] = str(tmp / f"case{i}")
        Path(case["out"]).mkdir(exist_ok=True)
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"world_size": world_size, "cases": cases,
                                "init_method": f"file://{tmp / 'rendezvous'}"}))
    env = dict(os.environ, OMP_NUM_THREADS="1", CVLLM_NO_PROGRESS="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "tests.distributed.test_tp_forward", str(spec)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=dict(env, TP_TEST_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world_size)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=RANK_TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{text[-4000:]}"
    return [[dict(np.load(Path(c["out"]) / f"rank{r}.npz")) for r in range(world_size)]
            for c in cases]


def tiny_llama(folder: Path, seed: int = 0, **kw) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.family_harness import randomize_

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=128,
                attention_bias=True, mlp_bias=True)
    base.update(kw)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**base))
    randomize_(hf, seed)
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def tiny_qwen3_moe(folder: Path, seed: int = 0, mlp_only_layers=(1,)) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.models.family_harness import randomize_

    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=list(mlp_only_layers),
        vocab_size=512,
        max_position_embeddings=128))
    randomize_(hf, seed)
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def single_rank(case: Dict) -> Dict[str, np.ndarray]:
    from cvllm.distributed import parallel_state

    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    return load_and_run(dict(case))


def check_logits(ranks: List[Dict], reference: Dict, what: str, atol: float = ATOL) -> None:
    for r, got in enumerate(ranks):
        assert got["logits"].shape == reference["logits"].shape, what
        err = float(np.abs(got["logits"] - reference["logits"]).max())
        assert err <= atol, f"{what}, rank {r}: max |logit diff| {err:.2e} > {atol:.0e}"
        assert (got["logits"].argmax(-1) == reference["logits"].argmax(-1)).all(), what


@pytest.mark.mpi
def test_tp2_llama_and_qwen3_moe_match_one_rank(tmp_path):
    cases = [{"weights": str(tiny_llama(tmp_path / "llama"))},
             {"weights": str(tiny_qwen3_moe(tmp_path / "qwen3moe"))}]
    refs = [single_rank(c) for c in cases]
    results = run_ranks(2, cases, tmp_path / "run")
    for name, ranks, ref in zip(("llama", "qwen3-moe"), results, refs):
        check_logits(ranks, ref, f"{name} tp=2")
        for r, got in enumerate(ranks):
            # Every weight is split but the norms, the router and the q/k norms (tiny).
            share = int(got["resident"]) / int(ref["resident"])
            assert 0.45 <= share <= 0.6, f"{name} rank {r} holds {share:.2f} of the weights"
            read = int(got["materialized"]) / int(ref["materialized"])
            assert 0.45 <= read <= 0.6, f"{name} rank {r} read {read:.2f} of the checkpoint"


@pytest.mark.mpi
def test_tp3_replicated_kv_heads_and_default_gguf(tmp_path, default_gguf):
    """tp=3 over 6 query / 2 KV heads (KV heads [0, 0], [0, 1], [1, 1]; a vocabulary whose
    last shard is part padding), and SmolLM2's GGUF: 9 heads, 3 KV heads, Q4_1 blocks
    sliced per rank, Q/K rows un-permuted per slice of heads."""
    llama = tiny_llama(tmp_path / "llama6", seed=3, hidden_size=96, intermediate_size=192,
                       num_attention_heads=6, num_key_value_heads=2, vocab_size=320,
                       tie_word_embeddings=True)
    cases = [{"weights": str(llama)}, {"weights": None, "file": str(default_gguf)}]
    refs = [single_rank(c) for c in cases]
    results = run_ranks(3, cases, tmp_path / "run")
    check_logits(results[0], refs[0], "llama 6/2 heads tp=3")
    # 30 layers of logits near 15 summed in another order: float32 noise of ~1e-5 relative.
    check_logits(results[1], refs[1], "SmolLM2 GGUF tp=3", atol=1e-3)
    for r, got in enumerate(results[1]):
        share = int(got["resident"]) / int(refs[1]["resident"])
        assert 0.3 <= share <= 0.4, f"SmolLM2 rank {r} holds {share:.2f} of the weights"
        read = int(got["materialized"]) / int(refs[1]["materialized"])
        assert 0.3 <= read <= 0.4, f"SmolLM2 rank {r} dequantized {read:.2f} of the file"


@pytest.mark.mpi
def test_tp2_default_gguf_uneven_head_split(tmp_path, default_gguf):
    """SmolLM2's 9 heads over 2 ranks: query heads 0-3 (plus one padding slot) and 4-8,
    5 KV slots each ([0, 0, 0, 1, 1] and [1, 1, 2, 2, 2]); o_proj takes the matching
    uneven input columns. Logits equal the 1-rank ones."""
    case = {"weights": None, "file": str(default_gguf)}
    ref = single_rank(case)
    ranks = run_ranks(2, [case], tmp_path / "run")[0]
    check_logits(ranks, ref, "SmolLM2 GGUF tp=2 (uneven heads)", atol=1e-3)
    for r, got in enumerate(ranks):
        # MLP, embeddings and most of attention halve; replicated KV heads add a little.
        share = int(got["resident"]) / int(ref["resident"])
        assert 0.5 <= share <= 0.62, f"SmolLM2 rank {r} holds {share:.2f} of the weights"



# ------------------------------------------------------------------ every family, in threads
def _family_models():
    """Tiny random HF models of the families with their own TP-relevant code: fused
    checkpoint qkv (Phi-3), per-head q/k norms over replicated KV heads (StableLM 6/2
    heads at tp=3), soft-caps and sliding windows (Gemma 2), a shared expert (Qwen2-MoE),
    gated attention + gated DeltaNet (Qwen3-Next), MLA (DeepSeek V3)."""
    import transformers as tr

    from tests.models import deepseek_tiny

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    six = dict(base, hidden_size=96, intermediate_size=192, num_attention_heads=6)
    return {
        "phi3": (2, lambda: tr.Phi3ForCausalLM(tr.Phi3Config(**base, pad_token_id=0))),
        "stablelm": (3, lambda: tr.StableLmForCausalLM(tr.StableLmConfig(
            **six, qk_layernorm=True, use_qkv_bias=True, use_parallel_residual=True))),
        "gemma2": (2, lambda: tr.Gemma2ForCausalLM(tr.Gemma2Config(
            **base, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
            final_logit_softcapping=30.0, attn_logit_softcapping=50.0))),
        "qwen2moe": (2, lambda: tr.Qwen2MoeForCausalLM(tr.Qwen2MoeConfig(
            **dict(base, intermediate_size=96), moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2))),
        "qwen3next": (2, lambda: tr.Qwen3NextForCausalLM(tr.Qwen3NextConfig(
            **dict(base, num_hidden_layers=4), head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[1]))),
        "deepseek_v3": (2, lambda: deepseek_tiny.build(deepseek_tiny.v3_config())),
    }


def run_in_threads(tp: int, case: Dict) -> List[Dict]:
    """``case`` on ``tp`` ranks that are threads of this process (``--multithread``'s
    ``InProcessGroup``), each with its own thread-local TP group."""
    import threading

    from cvllm.distributed.inprocess import InProcessGroup
    from cvllm.distributed.parallel_state import destroy_model_parallel, initialize_model_parallel

    group, out, errors = InProcessGroup(tp, timeout_s=60), [None] * tp, []

    def rank(r: int) -> None:
        try:
            initialize_model_parallel(r, tp, group.rank_view(r), thread_local=True)
            out[r] = load_and_run(dict(case))
        except BaseException as e:  # noqa: B902 - reported below, after every thread ends
            errors.append(f"rank {r}: {e!r}")
            group.abort()
        finally:
            destroy_model_parallel()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


@pytest.mark.parametrize("family", list(_family_models()))
def test_family_tp_in_threads_matches_one_rank(tmp_path, family):
    from tests.models.family_harness import randomize_

    tp, make = _family_models()[family]
    torch.manual_seed(0)
    hf = make()
    randomize_(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    case = {"weights": str(tmp_path)}
    ref = single_rank(case)
    ranks = run_in_threads(tp, case)
    check_logits(ranks, ref, f"{family} tp={tp}")
    for r, got in enumerate(ranks):
        share = int(got["resident"]) / int(ref["resident"])
        assert share < 1.25 / tp, f"{family} rank {r} holds {share:.2f} of the weights"


if __name__ == "__main__":
    rank_main(sys.argv[1])

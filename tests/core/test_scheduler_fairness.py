"""The step token budget under long prompts (issue 14 item 4): decodes are never held back
by a prefill, a request that arrives while a long prompt is prefilled is admitted at the
next step and starts its prefill beside it, and every step stays within the budget."""

import random

from cvllm.core.block_manager import BlockManager
from cvllm.core.kv_cache_manager import KVCacheManager
from cvllm.core.scheduler import Scheduler
from cvllm.config import SchedulerConfig
from tests.core.test_scheduler import check_invariants, make_scheduler, make_seq, run_all, step


def _rows(out):
    return [(e.seq.seq_id, e.num_new_tokens, e.samples) for e in out.scheduled]


def _decoding(sched, seq_id, prompt_len=4, max_tokens=50):
    s = make_seq(seq_id, prompt_len, max_tokens=max_tokens)
    sched.add(s)
    step(sched)  # its whole prompt: it decodes from the next step on
    return s


def test_decodes_run_every_step_while_a_long_prompt_is_prefilled():
    sched = make_scheduler(num_blocks=128, chunk=None, budget=16, max_model_len=256)
    a = _decoding(sched, 0)
    long = make_seq(1, 200, max_tokens=1)
    sched.add(long)
    steps = 0
    while long.num_computed_tokens < 200:
        out, _ = step(sched)
        steps += 1
        assert out.scheduled[0].seq is a and out.scheduled[0].num_new_tokens == 1
        assert out.num_batched_tokens <= 16
    # 15 prompt tokens a step beside the decode: the budget is used in full
    assert steps == -(-200 // 15)
    assert a.num_output_tokens == steps + 1


def test_new_request_starts_its_prefill_beside_a_long_one_at_the_next_step():
    sched = make_scheduler(num_blocks=128, chunk=None, budget=32, max_model_len=256)
    a = _decoding(sched, 0)
    long = make_seq(1, 200, max_tokens=1)
    sched.add(long)
    out, _ = step(sched)
    assert _rows(out) == [(0, 1, True), (1, 31, False)]
    short = make_seq(2, 6, max_tokens=3)
    sched.add(short)
    out, _ = step(sched)
    # the decode, the long prompt's next chunk (what the short one left), the short
    # prompt whole: it samples its first token in this very step
    assert _rows(out) == [(0, 1, True), (1, 25, False), (2, 6, True)]
    assert long.num_computed_tokens == 56 < long.num_tokens
    out, _ = step(sched)
    assert _rows(out) == [(0, 1, True), (2, 1, True), (1, 30, False)]  # decodes first
    assert short.num_output_tokens == 2


def test_two_long_prompts_share_the_budget():
    sched = make_scheduler(num_blocks=256, chunk=None, budget=32, max_model_len=512)
    first, second = make_seq(0, 300, max_tokens=1), make_seq(1, 300, max_tokens=1)
    sched.add(first)
    out, _ = step(sched)
    assert _rows(out) == [(0, 32, False)]
    sched.add(second)
    out, _ = step(sched)
    # the running one keeps half, the new one gets the other half
    assert _rows(out) == [(0, 16, False), (1, 16, False)]
    out, _ = step(sched)  # both running now: oldest first, as in vLLM
    assert _rows(out) == [(0, 32, False)]


def test_prefill_chunk_size_caps_each_sequence_under_the_budget():
    sched = make_scheduler(num_blocks=256, chunk=8, budget=32, max_model_len=512)
    seqs = [make_seq(i, 40, max_tokens=1) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched)
    assert _rows(out) == [(0, 8, False), (1, 8, False), (2, 8, False), (3, 8, False)]


def test_decodes_are_scheduled_past_the_budget_and_prefills_wait():
    sched = make_scheduler(num_blocks=128, chunk=None, budget=16, max_num_seqs=8)
    for i in range(6):
        sched.add(make_seq(i, 2, max_tokens=20))
    step(sched)
    sched.config.max_num_batched_tokens = 4  # fewer than the streams now decoding
    out, _ = step(sched)
    assert all(e.num_new_tokens == 1 for e in out.scheduled) and out.num_seqs == 6
    late = make_seq(9, 10, max_tokens=2)
    sched.add(late)
    out, _ = step(sched)
    assert out.num_seqs == 6 and late.num_computed_tokens == 0  # no budget left for it
    _, finished = run_all(sched)
    assert late in finished and late.num_output_tokens == 2


def test_the_share_a_new_request_cannot_use_goes_back_to_the_long_prompt():
    # 11 blocks of 4 tokens; after two steps the long prompt holds 8 and 3 are free.
    sched = make_scheduler(num_blocks=11, block_size=4, chunk=None, budget=16,
                           max_model_len=128)
    long = make_seq(0, 44, max_tokens=1)
    sched.add(long)
    step(sched)
    step(sched)
    sched.add(make_seq(1, 40, max_tokens=1))
    out, _ = step(sched)
    # 8 tokens kept for the new one; once the long chunk took its 2 blocks, the new one
    # does not fit in the 1 left, so the long chunk gets the rest of its prompt in it.
    assert _rows(out) == [(0, 12, True)] and not out.preempted
    assert sched.num_waiting == 1


def test_a_prefix_hit_leaves_its_share_to_the_long_prompt():
    kv = KVCacheManager([BlockManager(128, 4, enable_caching=True)])
    cfg = SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=32)
    sched = Scheduler(cfg, kv)
    system = make_seq(0, 24, max_tokens=1)
    sched.add(system)
    run_all(sched)  # 24 tokens cached (6 full blocks)
    long = make_seq(1, 200, max_tokens=1)
    sched.add(long)
    step(sched)
    again = make_seq(2, 24, max_tokens=1)
    again.token_ids[:] = system.prompt_token_ids  # the same prompt: 20 tokens hit
    sched.add(again)
    out, _ = step(sched)
    rows = {sid: n for sid, n, _ in _rows(out)}
    assert rows[2] == 4 and again.num_cached_tokens == 20
    assert out.num_batched_tokens == 32  # what the hit did not need went to the long one


def test_random_arrivals_keep_every_invariant_and_finish():
    rng = random.Random(5)
    for trial in range(20):
        budget = rng.choice([8, 16, 24, 64])
        chunk = rng.choice([None, 0, 4, 16])
        sched = make_scheduler(num_blocks=rng.choice([24, 48, 200]), block_size=4,
                               max_num_seqs=rng.choice([2, 4, 8]), chunk=chunk,
                               budget=budget, max_model_len=96)
        seqs, next_id = [], 0
        for _ in range(400):
            if next_id < 12 and rng.random() < 0.3:
                s = make_seq(next_id, rng.choice([3, 10, 40, 80]),
                             max_tokens=rng.randint(1, 8))
                sched.add(s)
                seqs.append(s)
                next_id += 1
            if sched.has_unfinished():
                out = sched.schedule()
                check_invariants(sched, out)
                sched.update(out, {e.seq.seq_id: 1000 + e.seq.seq_id for e in out.scheduled
                                   if e.samples})
            elif next_id >= 12:
                break
        _, finished = run_all(sched, token_fn=lambda s: 1000 + s.seq_id)
        assert all(s.is_finished() for s in seqs), trial
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


# ---- chunks cut by the context they attend over (chunk_context_tokens; the CPU default) --

def _cap_config(budget=128, c=3072, chunk=None, max_model_len=16384):
    return SchedulerConfig(max_num_seqs=8, max_model_len=max_model_len, prefill_chunk_size=chunk,
                           max_num_batched_tokens=budget, chunk_context_tokens=c)


def test_chunk_cap_fits_the_budget_and_shrinks_with_the_context():
    cfg = _cap_config()
    caps = [cfg.chunk_cap(ctx) for ctx in (0, 1000, 3000, 8000, 16000, 10**6)]
    assert caps == sorted(caps, reverse=True) and caps[0] < 128 and caps[-1] == 128 // 8
    for ctx, n in zip((0, 1000, 3000, 8000), caps):
        work = lambda k: k * (1 + (ctx + k / 2) / 3072)  # noqa: E731
        assert work(n) <= 128 < work(n + 1)  # the most tokens whose work fits the budget
    assert _cap_config(c=0).chunk_cap(8000) == cfg.chunk_limit  # off
    no_chunks = _cap_config(chunk=0, max_model_len=256)
    assert no_chunks.chunk_cap(8000) == no_chunks.chunk_limit  # all or nothing stays so
    assert _cap_config(chunk=40).chunk_cap(0) == 40  # never past --prefill-chunk-size


def test_a_long_prompts_chunks_shrink_while_decodes_and_a_new_request_still_run():
    sched = Scheduler(_cap_config(budget=128, c=512, max_model_len=4096),
                      BlockManager(512, 16))
    _decoding(sched, 0, max_tokens=1000)
    long = make_seq(1, 3000, max_tokens=1)
    sched.add(long)
    chunks, short = [], None
    while long.num_computed_tokens < 3000:
        if len(chunks) == 5:
            short = make_seq(2, 20, max_tokens=2)
            sched.add(short)
        out, _ = step(sched)
        rows = {e.seq.seq_id: e.num_new_tokens for e in out.scheduled}
        assert rows[0] == 1  # the stream decodes every step
        chunks.append((rows[1] if 1 in rows else 0, out.scheduled))
        ctx = long.num_computed_tokens - chunks[-1][0]
        assert chunks[-1][0] <= sched.config.chunk_cap(ctx)
    sizes = [n for n, _ in chunks if n]
    assert sizes[0] > 2 * sizes[-1] and sizes[-1] >= 128 // 8  # shrinking, never starved
    assert short.num_computed_tokens >= 20  # admitted beside the long prompt


def test_parity_context_comes_from_the_config_and_is_set_on_the_cpu(tmp_path):
    from cvllm.config import ModelConfig
    from cvllm.engine.builder import attention_parity_context, build_engine_config
    from tests.worker.tiny_llama import write_tiny_llama

    def cfg(**hf):
        return ModelConfig("LlamaForCausalLM", dict(num_hidden_layers=2, vocab_size=64, **hf))

    smol = cfg(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3)
    llama8b = cfg(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8)
    assert attention_parity_context(smol) == 3072
    assert attention_parity_context(llama8b) == 26624
    moe = cfg(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_experts_per_tok=2, shared_expert_intermediate_size=48,
              num_attention_heads=4, num_key_value_heads=2)
    assert attention_parity_context(moe) == (64 * (2 * 64 + 2 * 32) + 3 * 64 * 112) // 128
    setup = build_engine_config(weight_path=str(write_tiny_llama(tmp_path)), cpu=True)
    sched = setup.config.scheduler
    assert sched.chunk_context_tokens == attention_parity_context(setup.config.model) > 0

"""CPU prefill attention (kernels/csrc/cpu_prefill_attention.cpp, the torch path beside it) and which rows of a step
it takes (prompt rows, not decode rows) against the reference."""

import pytest
import torch

from pagedcore.kernels.cpu_attention import cpu_paged_attention
from pagedcore.kernels.reference import ref_paged_attention
from pagedcore.kernels.testing import make_paged_batch, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_prefill_pads_prompts_for_sdpa(dtype, monkeypatch):
    """Plain bf16/fp16 prompts reach SDPA zero-padded to a multiple of SDPA_ALIGN rows (its fast lengths),
    fp32 ones unpadded; outputs match the reference with NaN in every unwritten cache slot. (The torch path: on
    AVX-512 and AVX2 CPUs the C++ prefill kernel takes fp32/bf16 prompts first, tested below.)"""
    from pagedcore.kernels import cpu_attention

    lengths = [2, 31, 32, 33, 63, 146]
    seen = []
    sdpa = cpu_attention.F.scaled_dot_product_attention

    def recording(q, k, v, **kw):
        seen.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(cpu_attention.F, "scaled_dot_product_attention", recording)
    b = make_paged_batch(lengths, lengths, 9, 3, 64, 16, dtype, "cpu", seed=5)
    b.write_new_tokens()
    out = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, use_ext=False)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
    if dtype == torch.float32:  # runs no faster aligned: exactly the context
        assert seen == [(n, n) for n in lengths]
    else:
        assert seen == [(cpu_attention._padded_len(n),) * 2 for n in lengths]
        assert all(p % cpu_attention.SDPA_ALIGN == 0 and p - n < cpu_attention.SDPA_ALIGN
                   for (p, _), n in zip(seen, lengths))
    assert not out.isnan().any()
    assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 2e-2)


def _prefill_kernel_or_skip(head_dim=64):
    from pagedcore.kernels import cpu_ext

    ext = cpu_ext.load()
    if ext is None or not ext.paged_prefill_supported(head_dim):
        pytest.skip("the C++ prefill kernel runs on AVX-512 and AVX2 + FMA CPUs only")
    return ext


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# head_dim 80 and 48: 16 dims past a multiple of 32 (bf16 on AVX512-BF16 took a path packing 32 at a time)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 32), (4, 2, 80), (6, 3, 48)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_cpu_prefill_kernel_matches_reference(dtype, heads, kv_heads, head_dim, block_size, monkeypatch):
    """Prompts (whole, and chunks after a cached context) through the C++ kernel, never SDPA, against the
    reference; unwritten cache slots hold NaN and never reach the output; padding rows stay zero."""
    _prefill_kernel_or_skip(head_dim)
    from pagedcore.kernels import cpu_attention

    def fail(*a, **k):
        raise AssertionError("SDPA ran: the kernel should have taken every prompt")

    monkeypatch.setattr(cpu_attention.F, "scaled_dot_product_attention", fail)
    query_lens = [2, 7, 31, 64, 1, 100, 13]
    seq_lens = [2, 7, 40, 64, 20, 230, 200]  # 40/230/200: a chunk after a cached context; 1: a decode row
    b = make_paged_batch(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, "cpu", seed=11,
                         num_padding_tokens=2)
    b.write_new_tokens()
    out = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, head_dim**-0.5)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, head_dim**-0.5)
    assert not out.isnan().any()
    assert out[-2:].abs().max() == 0  # padding rows
    assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 2e-2)


def test_cpu_prefill_kernel_leaves_windowed_and_softcapped_prompts_to_torch():
    """A window shorter than the context, or a softcap, is not the kernel's: those prompts take the torch path
    (and still match the reference); the rest of the batch takes the kernel."""
    _prefill_kernel_or_skip()
    b = make_paged_batch([50, 20, 9], [120, 20, 9], 6, 2, 64, 16, torch.float32, "cpu", seed=3)
    b.write_new_tokens()
    for window, softcap in [(30, None), (None, 5.0), (25, 5.0)]:
        out = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap)
        ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap)
        assert not out.isnan().any() and rel_err(out, ref) < 2e-5


def test_cpu_prefill_kernel_refuses_bad_ranges():
    ext = _prefill_kernel_or_skip()
    q = torch.randn(8, 2, 64)
    cache = torch.zeros(4, 16, 2, 64)
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        ext.paged_prefill(q, torch.empty_like(q), cache, cache, table, [0], [0], [9], [9], 0.125)  # rows past T
    with pytest.raises(RuntimeError, match="out of range"):
        ext.paged_prefill(q, torch.empty_like(q), cache, cache, table, [0], [0], [8], [100], 0.125)  # > 4 blocks
    with pytest.raises(RuntimeError, match="the query.s dtype"):
        ext.paged_prefill(q, torch.empty_like(q), cache.bfloat16(), cache.bfloat16(), table, [0], [0], [8], [8], 0.125)


def test_short_prompt_chunks_stay_prompt_rows_where_the_prefill_kernel_runs():
    """split_short_queries: a short chunk of generated tokens (speculative verification) becomes decode rows either
    way; a short chunk of prompt tokens stays one prompt with keep_prompts (the C++ prefill kernel's), so that a
    prompt's tail after a prefix hit is computed as the whole prompt is."""
    from pagedcore.attention.backend import AttentionMetadata
    from pagedcore.attention.torch_backend import split_short_queries

    qsl, lens, prompts = [0, 8, 12, 13, 53], [72, 100, 30, 40], [72, 50, 20, 40]  # tail, verify, decode, prompt
    md = AttentionMetadata(
        num_tokens=53, query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.arange(4 * 8, dtype=torch.int32).view(4, 8), slot_mapping=torch.zeros(53, dtype=torch.long),
        max_query_len=40, max_seq_len=100, query_start_loc_cpu=qsl, seq_lens_cpu=lens, block_size=16,
        num_prompt_tokens_cpu=prompts)
    kept = split_short_queries(md, keep_prompts=True)
    assert kept.query_start_loc_cpu == [0, 8, 9, 10, 11, 12, 13, 53]
    assert kept.seq_lens_cpu == [72, 97, 98, 99, 100, 30, 40]
    assert kept.num_prompt_tokens_cpu == [72, 50, 50, 50, 50, 20, 40]
    assert kept.block_table[1:5].eq(md.block_table[1]).all()
    split = split_short_queries(md)
    assert split.query_start_loc_cpu == list(range(14)) + [53]
    assert split.seq_lens_cpu == list(range(65, 73)) + [97, 98, 99, 100, 30, 40]


def test_a_prompts_one_token_is_not_a_decode_row():
    """A row of one query token inside its prompt (its last token alone after a prefix-cache hit) is a prompt row:
    the decode plan leaves it out, so the prefill kernel computes it as it does the whole prompt."""
    from pagedcore.attention.backend import AttentionMetadata
    from pagedcore.kernels.ext_decode_plan import one_token_prompt_rows, plan_ext_decode

    qsl, lens, prompts = [0, 1, 2, 3, 11], [33, 40, 1, 20], [33, 30, 1, 20]  # tail, decode, 1-token prompt, prompt
    md = AttentionMetadata(
        num_tokens=11, query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.arange(4 * 4, dtype=torch.int32).view(4, 4), slot_mapping=torch.zeros(11, dtype=torch.long),
        max_query_len=8, max_seq_len=40, query_start_loc_cpu=qsl, seq_lens_cpu=lens, block_size=16,
        num_prompt_tokens_cpu=prompts)
    assert one_token_prompt_rows(md) == [0, 2]
    assert plan_ext_decode(md, one_token_prompt_rows(md)).rows.tolist() == [1]
    assert plan_ext_decode(md).rows.tolist() == [0, 1, 2]


def test_a_prompt_whose_last_token_alone_follows_a_prefix_hit_gets_what_it_gets_whole(tiny_model_dir):
    """Prompts of 17, 33 and 81 tokens (block 16) run twice beside others: the second time every full block is a
    prefix-cache hit and the last token runs alone. Its logprobs are the same floats as the first time's (the
    decode kernel, which had taken it, differs from the prefill kernel in last bits)."""
    from pagedcore import LLMEngine, SamplingParams
    from pagedcore.kernels import cpu_ext

    ext = cpu_ext.load()
    if ext is None or not ext.paged_prefill_supported(16):
        pytest.skip("the C++ prefill kernel runs on AVX-512 and AVX2 + FMA CPUs only")
    engine = LLMEngine(model=str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=8, num_kv_blocks=128,
                       enable_prefix_caching=True)
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((17, 33, 81, 40, 25))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)

    def run():
        ids = [engine.add_request(None, p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
        return [done[i] for i in ids]

    first, second = run(), run()
    assert [o.num_cached_tokens for o in second[:3]] == [16, 32, 80]  # the last token alone
    for a, b in zip(first, second):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        assert [sorted((t, lp.logprob) for t, lp in s.items()) for s in a.logprobs] == \
            [sorted((t, lp.logprob) for t, lp in s.items()) for s in b.logprobs]


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_prompts_with_and_without_amx_tiles(amx, monkeypatch):
    """bf16 prompts take AMX tiles where AMX runs, the vdpbf16ps products elsewhere (or with AMX turned off): both
    against the reference, over whole prompts, chunks after a cached context and lengths off the 16-row and 32-key
    steps (unwritten cache slots hold NaN)."""
    ext = _prefill_kernel_or_skip(64)
    from pagedcore.kernels import cpu_attention

    monkeypatch.setattr(cpu_attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: pytest.fail("SDPA ran: the kernel should have taken every prompt"))
    before = ext.set_prefill_amx(amx)
    try:
        query_lens, seq_lens = [17, 33, 1, 100, 5], [17, 70, 20, 130, 37]
        b = make_paged_batch(query_lens, seq_lens, 9, 3, 64, 16, torch.bfloat16, "cpu", seed=5)
        b.write_new_tokens()
        out = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
        ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
        assert not out.isnan().any() and rel_err(out, ref) < 2e-2
    finally:
        ext.set_prefill_amx(before)

"""Vectorised CPU paged attention vs the torch reference."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedcore.kernels.cpu_attention import cpu_paged_attention
from pagedcore.kernels.reference import ref_paged_attention
from pagedcore.kernels.testing import draw_batch_spec, make_paged_batch, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_cpu_attention_matches_reference(data):
    mode = data.draw(st.sampled_from(["decode", "prefill", "mixed"]), label="mode")
    query_lens, seq_lens = draw_batch_spec(data.draw, mode, max_seqs=6)
    num_kv_heads = data.draw(st.integers(1, 2), label="num_kv_heads")
    group = data.draw(st.sampled_from([1, 3, 4]), label="gqa_group")
    head_dim = data.draw(st.sampled_from([64, 80, 96, 128]), label="head_dim")
    block_size = data.draw(st.sampled_from([8, 16, 32]), label="block_size")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    window = data.draw(st.one_of(st.none(), st.integers(1, 200)), label="sliding_window")
    softcap = data.draw(st.one_of(st.none(), st.floats(1.0, 30.0)), label="softcap")
    padding = data.draw(st.integers(0, 2), label="padding_tokens")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")

    b = make_paged_batch(query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype,
                         "cpu", seed, num_padding_tokens=padding)
    b.write_new_tokens()  # unused slots stay NaN: the CPU path must never let them leak
    scale = head_dim**-0.5
    out = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, scale, window, softcap)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, scale, window, softcap)
    assert not out.isnan().any()
    assert out.dtype == dtype and out.shape == b.query.shape
    assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_attention_decode_lengths_bucketed(dtype):
    """Very different decode lengths (several length buckets) plus a prefix-hit chunk."""
    ql = [1] * 7 + [12]
    sl = [1, 2, 9, 16, 17, 150, 600, 60]
    b = make_paged_batch(ql, sl, 9, 3, 64, 16, dtype, "cpu", seed=2)
    b.write_new_tokens()
    out = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
    assert not out.isnan().any()
    assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 20.0)])
def test_cpu_decode_kernel_matches_torch_path_and_reference(dtype, window, softcap):
    """The C++ decode kernel (built on first use) against the pure-torch path and the reference,
    on a mixed batch with NaN in every unwritten slot and non-contiguous query rows."""
    from pagedcore.kernels import cpu_ext

    if cpu_ext.load() is None:
        pytest.skip("no C++ toolchain: the torch path is what runs")
    ql = [1, 1, 5, 1, 1, 1]
    sl = [1, 17, 40, 100, 257, 33]
    b = make_paged_batch(ql, sl, 12, 3, 64, 16, dtype, "cpu", seed=7, num_padding_tokens=2)
    b.write_new_tokens()
    query = b.query.transpose(0, 1).contiguous().transpose(0, 1)  # [T, Hq, D] as transformers hands it over
    ext = cpu_paged_attention(query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap)
    torch_path = cpu_paged_attention(query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap, use_ext=False)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap)
    assert not ext.isnan().any()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(ext, ref) < tol and rel_err(ext, torch_path) < tol


def _ext_or_skip():
    from pagedcore.kernels import cpu_ext

    if cpu_ext.load() is None:
        pytest.skip("no C++ toolchain: the torch path is what runs")


@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (8, 4), (10, 2), (12, 2), (7, 1), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [16, 20, 40, 64, 96, 128])
def test_cpu_decode_kernel_head_shapes(heads, head_dim):
    """GQA groups that take every register tiling of the C++ kernel (sub-groups of 4 on vdpbf16ps, of 3, of 2
    and 1, whole groups of 1) and head dims of its paths: 64 and 128 compiled as constants, other multiples of 16
    at run time, the rest (20, 40) through the scalar path. Lengths cover partial 3- and 4-key tiles."""
    _ext_or_skip()
    hq, hkv = heads
    sl = [1, 2, 3, 5, 16, 33, 130]
    for dtype in (torch.float32, torch.bfloat16):
        b = make_paged_batch([1] * len(sl), sl, hq, hkv, head_dim, 16, dtype, "cpu", seed=head_dim + hq)
        b.write_new_tokens()
        b.query *= 3.0  # a sharp softmax
        out = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, head_dim**-0.5)
        ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, head_dim**-0.5)
        assert not out.isnan().any()
        assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("window,softcap", [(None, None), (300, None), (None, 20.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_decode_kernel_splits_long_sequences(dtype, window, softcap):
    """With several threads, a sequence much longer than the rest of the step is split into partitions
    (each with its own max and sum, combined after): same result as unsplit and as the reference."""
    _ext_or_skip()
    sl = [3000, 5, 700, 1]
    b = make_paged_batch([1] * len(sl), sl, 9, 3, 64, 16, dtype, "cpu", seed=11)
    b.write_new_tokens()
    b.query *= 4.0  # sharp softmax: partition maxima differ, so a wrong rescale shows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # splits even on a 2-core machine
        split = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap)
        torch.set_num_threads(1)  # one thread: never split
        whole = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap)
    finally:
        torch.set_num_threads(threads)
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125, window, softcap)
    assert not split.isnan().any()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(split, ref) < tol and rel_err(whole, ref) < tol and rel_err(split, whole) < tol


def _decode_rows_of(b, rows: list[int]):
    """The decode step of batch `b` restricted to sequences `rows` (same caches, block tables and queries)."""
    import dataclasses

    md = b.metadata
    sl = [md.seq_lens_cpu[i] for i in rows]
    sub = dataclasses.replace(
        md, num_tokens=len(rows), query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(sl, dtype=torch.int32), block_table=md.block_table[rows].contiguous(),
        slot_mapping=md.slot_mapping[rows], max_query_len=1, max_seq_len=max(sl),
        query_start_loc_cpu=list(range(len(rows) + 1)), seq_lens_cpu=sl)
    return b.query[rows].contiguous(), sub


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_rows_do_not_depend_on_the_batch(dtype):
    """A sequence's attention output is the same bits alone and beside any others: how a long sequence is split
    over threads depends on its own length only (a split by a share of the step's positions moved its logprobs
    by ulps as the batch thinned)."""
    _ext_or_skip()
    sl = [700, 300, 257, 1200, 40] + [300] * 11
    b = make_paged_batch([1] * len(sl), sl, 9, 3, 64, 16, dtype, "cpu", seed=5)
    b.write_new_tokens()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
        for rows in ([0], [3], [0, 3], [2, 4], [1, 0]):
            q, md = _decode_rows_of(b, rows)
            got = cpu_paged_attention(q, b.k_cache, b.v_cache, md, 0.125)
            assert torch.equal(got, full[rows]), rows
    finally:
        torch.set_num_threads(threads)
    assert not full.isnan().any()


def _at_threads(counts, run) -> dict:
    """run() at each of torch's thread counts `counts` (the count restored after): {count: result}."""
    threads, out = torch.get_num_threads(), {}
    try:
        for n in counts:
            torch.set_num_threads(n)
            out[n] = run()
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_threads_share_positions_not_sequences(dtype):
    """Threads take even shares of the step's positions (cuts between items), so short sequences first and long
    ones last still split the work; every item is run exactly once whatever the thread count, including more
    threads than items and one item longer than all the rest: the same bits at 2, 3 and 8 threads (the long
    sequence's partitions depend on its length alone), the reference's values at 1."""
    _ext_or_skip()
    sl = sorted([5, 40, 17, 60, 33, 150, 200, 256, 240, 90]) + [2000]
    b = make_paged_batch([1] * len(sl), sl, 9, 3, 64, 16, dtype, "cpu", seed=7)
    b.write_new_tokens()
    out = _at_threads((1, 2, 3, 8, 16), lambda: cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125))
    ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, 0.125)
    assert all(not o.isnan().any() for o in out.values())
    for n in (3, 8, 16):
        assert torch.equal(out[n], out[2]), n
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(out[1], ref) < tol and rel_err(out[2], ref) < tol


@pytest.mark.parametrize("head_dim", [64, 40])  # 40: the scalar path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_decode_kernel_fewer_sequences_than_threads_split_their_kv_heads(dtype, head_dim):
    """Fewer sequences than threads (a single stream): each sequence's KV heads go to the threads in groups, so
    none idles; every head's output is the same bits as the whole sequence in one item (1 thread), for any
    group count (3 KV heads over 2, 3 and 4 threads, 2 sequences over 3 and 8)."""
    _ext_or_skip()
    for sl in ([200], [1, 37], [250, 90]):
        b = make_paged_batch([1] * len(sl), sl, 9, 3, head_dim, 16, dtype, "cpu", seed=len(sl))
        b.write_new_tokens()
        out = _at_threads((1, 2, 3, 4, 8),
                          lambda: cpu_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, head_dim ** -0.5))
        assert not out[1].isnan().any()
        for n in (2, 3, 4, 8):
            assert torch.equal(out[n], out[1]), (sl, n)
        ref = ref_paged_attention(b.query, b.k_cache, b.v_cache, b.metadata, head_dim ** -0.5)
        assert rel_err(out[1], ref) < (2e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("window", [0, 24])
def test_decode_stack_prefetches_exactly_the_kv_rows_each_threads_items_read(window):
    """The decode stack asks for the next layer's K/V during the gate/up GEMM (LineStream): each thread's spans
    are the K and V rows its planned attention items read (inside the window), each line once, for any thread
    count; blocks adjacent in memory merge into one span."""
    from pagedcore.kernels import cpu_ext
    from pagedcore.kernels.ext_decode_plan import plan_ext_decode

    _ext_or_skip()
    ext = cpu_ext.load()
    sl = [5, 40, 17, 60, 33, 150, 200, 256, 240, 90, 2000]
    b = make_paged_batch([1] * len(sl), sl, 9, 3, 64, 16, torch.bfloat16, "cpu", seed=7)
    plan = plan_ext_decode(b.metadata)
    row_bytes, bs = 3 * 64 * 2, 16
    want = set()
    for i, length in enumerate(sl):
        for pos in range(max(0, length - window) if window else 0, length):
            blk = int(plan.block_table[i, pos // bs])
            for cache in (b.k_cache, b.v_cache):
                start = cache.data_ptr() + (blk * cache.stride(0) + (pos % bs) * 3 * 64) * 2
                want.update(range(start, start + row_bytes, 64))
    for threads in (1, 2, 3, 8):
        spans = ext.decode_kv_lines(b.query, plan.rows, b.k_cache, b.v_cache, plan.block_table, plan.seq_lens,
                                    window, threads).tolist()
        got = [a + 64 * j for _, a, n in spans for j in range(n)]
        assert len(got) == len(set(got)) and set(got) == want, threads
        assert {t for t, _, _ in spans} <= set(range(threads))
    # One sequence over consecutive blocks: its K rows are one span, its V rows another.
    bt = torch.arange(8, dtype=torch.int32).view(1, 8)
    spans = ext.decode_kv_lines(b.query[:1], torch.zeros(1, dtype=torch.long), b.k_cache, b.v_cache, bt,
                                torch.tensor([100], dtype=torch.int32), 0, 1).tolist()
    assert [n for _, _, n in spans] == [100 * row_bytes // 64] * 2


def test_cpu_decode_kernel_query_dtype_differs_from_cache():
    """fp32 queries over a bf16 cache (and bf16 over fp32): the q load and the output store convert."""
    _ext_or_skip()
    sl = [7, 40, 129]
    for q_dtype, kv_dtype in [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                              (torch.float16, torch.bfloat16)]:
        b = make_paged_batch([1] * len(sl), sl, 6, 2, 64, 16, kv_dtype, "cpu", seed=5)
        b.write_new_tokens()
        query = b.query.to(q_dtype)
        out = cpu_paged_attention(query, b.k_cache, b.v_cache, b.metadata, 0.125)
        ref = ref_paged_attention(query, b.k_cache, b.v_cache, b.metadata, 0.125)
        assert out.dtype == q_dtype and not out.isnan().any()
        assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_output_rounding(kv_dtype):
    """A bf16/fp16 query gives exactly the fp32 query's result rounded by torch (round to nearest even):
    the kernel's vectorised q load and output store convert like c10 does."""
    _ext_or_skip()
    b = make_paged_batch([1] * 6, [3, 17, 40, 100, 129, 7], 6, 2, 64, 16, kv_dtype, "cpu", seed=3)
    b.write_new_tokens()
    for q_dtype in (torch.bfloat16, torch.float16):
        low = b.query.to(q_dtype)
        out = cpu_paged_attention(low, b.k_cache, b.v_cache, b.metadata, 0.125)
        out32 = cpu_paged_attention(low.float(), b.k_cache, b.v_cache, b.metadata, 0.125)
        assert torch.equal(out, out32.to(q_dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_write_kv_cache_matches_index_copy(ext, dtype):
    """The C++ cache write puts each token's K/V exactly where index_copy_ puts it, and nowhere else."""
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, d, T = 7, 16, 3, 64, 21
    caches = [torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype) for _ in range(2)]
    key, value = (torch.randn(T, hkv, d, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    want = [c.clone() for c in caches]
    want[0].view(-1, hkv, d).index_copy_(0, slots, key)
    want[1].view(-1, hkv, d).index_copy_(0, slots, value)
    ext.write_kv_cache(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(RuntimeError, match="out of range"):
        ext.write_kv_cache(key, value, caches[0], caches[1], slots + num_blocks * block_size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_write_kv_cache_reads_strided_token_rows_in_place(ext, dtype):
    """K/V as the fused q/k/v matmul gives them (column slices of one [T, q + k + v] output, tokens at its row
    stride) land exactly as their contiguous copies do."""
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, hkv, d, T = 5, 8, 3, 64, 33
    qkv = torch.randn(T, (9 + 2 * hkv) * d, generator=g).to(dtype)
    key = qkv[:, 9 * d:(9 + hkv) * d].view(T, hkv, d)
    value = qkv[:, (9 + hkv) * d:].view(T, hkv, d)
    assert not key.is_contiguous() and key.stride(1) == d
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    got = [torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype) for _ in range(2)]
    want = [c.clone() for c in got]
    ext.write_kv_cache(key, value, got[0], got[1], slots)
    ext.write_kv_cache(key.contiguous(), value.contiguous(), want[0], want[1], slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0].abs().sum() > 0

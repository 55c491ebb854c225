// Paged decode attention for the CPU: one query token per sequence, read straight from the block
// table (no gathered copy, no padding), fp32 math and accumulation.
//
// Work item = one sequence (or, with several threads and a sequence much longer than the rest of the
// step, one partition of its positions). Two passes per item:
//   1. scores [Hq, count]: the scale is folded into q; for a few positions at a time, every KV head's
//      key row is widened to fp32 once and FMA'd into the accumulators of all `group = Hq / Hkv` query
//      heads that read it (3 keys x 3 heads or 4 keys x 2 heads per register tile), one horizontal
//      reduction then yields 3-4 scores. Whole cache rows (all KV heads) are consumed together, so
//      blocks are read sequentially; K rows are software-prefetched 16 positions ahead, and the V row of
//      the same position into L2 beside it: the pass is bound by loads in flight, not arithmetic, and two
//      streams took a batch-64 step's attention from ~15 to ~12 ms (an AVX-512 rewrite of the loops, half
//      the instructions, had changed nothing). With AVX512-BF16, a bf16 query and cache and head_dim 64 or 128,
//      the dot products run on vdpbf16ps instead (scores_dp: q as it is, 4 keys x up to 4 heads a tile, one
//      reduction tree a tile): 64 sequences x 140 positions, one layer, 2 threads (Zen 4), K/V in L3 ~240 -> ~185 us,
//      from memory ~5-10% less.
//   2. softmax per head (AVX2 Cephes-style exp, ~1 ulp), then the weighted sum of V rows: tiles of
//      positions whose rows stay in L1 while each (head sub-group, 16-column block) pass goes over them (on
//      AVX-512, 3-head groups of head_dim 64: whole rows in zmm, one pass, the same FMA chains). A bf16 cache
//      with AVX512-BF16 and head_dim 64 or 128 takes vdpbf16ps instead (pv_dp): the weights rounded to bf16, as
//      torch's CPU flash attention rounds P, two positions a dot product, and the output divided by the rounded
//      weights' sum. From L2 PV had run at the FMA peak; on Zen 4 a 64-row step's attention ~13.8 -> ~12.1 ms
//      (30 layers, 64 x ~135 positions); accuracy against fp64 1.39e-3 -> 1.46e-3 (the bf16 output's rounding
//      dominates); over 48 chat prompts the engine's bf16 greedy text follows transformers' bf16 for 14.2 tokens
//      on average before a near-tie parts them, 12.4 with fp32 weights (torch rounds P too).
// In the decode stack at 8+ rows, the rows a layer's items read were asked for during the previous layer's gate/up
// GEMM (kv_lines, LineStream): from L3 rather than memory, a 64-row step's attention ~11.8 -> ~8.1 ms on Zen 4 (VNNI
// tiles), ~19 -> ~13 ms on an AVX2 Zen 3 (fp32 panels).
// bf16 K/V are widened in registers with one 32-byte load per 16 elements: even elements = lane << 16,
// odd ones = lane & 0xffff0000 (a bf16 is the top half of an fp32); q and the V accumulators are kept
// in that (even, odd) order, so the loops never shuffle. fp16 goes through F16C.
// Split sequences (flash-decoding): each partition keeps its max and sum, a cheap combine rescales.
// Only positions < seq_len (inside the window) are ever read: unwritten cache slots may hold NaN.
// Quantized caches (kv_cache_dtype int8 / fp8_e4m3, kernels/kv_quant.py): int8 rows are widened to fp32
// in registers (sign-extend, convert), e4m3 rows through a 256-entry table; the fp16 scale of each
// (position, KV head) multiplies its score after the dot product, and its softmax weight before the
// weighted sum of V, so the inner loops never touch the scales.
//
// AVX2 + FMA path for head_dim % 16 == 0 (head_dim 64 and 128 compiled as constants); a portable
// scalar path with the same structure otherwise, or when built without AVX2.
// The kernels are in decode_attention_rows.h (element conversions, row offsets, the scalar kernels, the AVX2 row
// primitives and softmax), decode_attention_avx2.h (scores and PV on AVX2) and decode_attention_bf16.h (on
// vdpbf16ps); this file holds the work items, their two passes, the partitions' combine and the ops.
#include "ops.h"
#include "decode_stack_parts.h"
#include "decode_attention_rows.h"
#include "decode_attention_avx2.h"
#include "decode_attention_bf16.h"
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Positions per partition when a sequence is split across threads. Fixed, not a share of the step's positions:
// a sequence's partitions then depend on its own length alone, so its logprobs do not move by ulps with the
// batch it shares a step with (a share of the step split a long sequence only once the batch had thinned).
// 30 layers, 2 threads (an AVX-512 Xeon), against the share: 64 sequences x 100-250 positions 26.6 -> 25.2 ms, x 300-600 67.4 ->
// 66.8, 2 x 1500-3000 11.0 -> 10.8, 8 x 800-2000 27.1 -> 28.8 (more partitions, combined on one thread).
constexpr int64_t kPart = 256;
// An item's fixed work (its query, softmax set-up, output) in positions' worth, for the threads' shares.
constexpr int64_t kItemCost = 8;

// Scores [hkv * group, count] of one item's hkv KV heads (query head h reads KV head h / group; qrow, q, k_cache and
// v_cache at the item's first head): scale * q_h . k_t.
template <typename T, typename Q>
void item_scores(const DecodeAttention& a, int64_t hkv, const Q* qrow, const float* q, const T* k_cache,
                 const T* v_cache, const int64_t* off, int64_t count, float* sc) {
  const int64_t d = a.d, group = a.hq / a.hkv, row_elems = a.hkv * d;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>) {
    if (d == 64) return scores_dp<2>(qrow, a.q_head_stride, hkv, group, k_cache, v_cache, off, count, row_elems, a.scale, sc);
    if (d == 128) return scores_dp<4>(qrow, a.q_head_stride, hkv, group, k_cache, v_cache, off, count, row_elems, a.scale, sc);
  }
#endif
#ifdef PC_ATTN_AVX2
  if (d % 16 == 0) {  // q: scaled, in Rows<T> order (load_q)
    if (d == 64) return scores_avx2<T, 64>(q, hkv, group, k_cache, v_cache, off, count, d, row_elems, sc);
    if (d == 128) return scores_avx2<T, 128>(q, hkv, group, k_cache, v_cache, off, count, d, row_elems, sc);
    return scores_avx2<T, 0>(q, hkv, group, k_cache, v_cache, off, count, d, row_elems, sc);
  }
#endif
  for (int64_t kv = 0; kv < hkv; ++kv)
    scores_scalar(q + kv * group * d, group, k_cache + kv * d, off, count, d, sc + kv * group * count);
}

// One sequence's positions [p0, p1) (or the whole sequence) for every head, as the items of a step.
template <typename T, typename Q>
void run_items(const DecodeAttention& a, int64_t begin, int64_t end) {
  const int64_t hq = a.hq, hkv = a.hkv, d = a.d, group = hq / hkv, row_elems = hkv * d, pstride = d + 2;
  const Q* query = static_cast<const Q*>(a.query);
  const T *k_cache = static_cast<const T*>(a.k_cache), *v_cache = static_cast<const T*>(a.v_cache);
  Q* out = static_cast<Q*>(a.out);
#ifdef PC_ATTN_AVX2
  const bool vec = d % 16 == 0;
#else
  [[maybe_unused]] const bool vec = false;
#endif
  std::vector<float> q(hq * d), acc(hq * d), scores, ml(2 * hq);
  [[maybe_unused]] std::vector<c10::BFloat16> wb;  // pv_dp's bf16 weights
  std::vector<int64_t> off, soff, noff;
  for (int64_t it = begin; it < end; ++it) {
    const DecodeItem& item = a.items[it];
    const int64_t count = item.p1 - item.p0;
    // The item's KV heads [kv0, kv1) and their query heads [h0, h0 + nh): pointers below start at them.
    const int64_t nkv = item.kv1 - item.kv0, h0 = item.kv0 * group, nh = nkv * group;
    const Q* qrow = query + a.rows[item.seq] * a.q_row_stride + h0 * a.q_head_stride;
    const T *kc = k_cache + item.kv0 * d, *vc = v_cache + item.kv0 * d;
#ifdef PC_ATTN_AVX2
    if (vec)
      for (int64_t h = 0; h < nh; ++h) load_q<T>(&q[h * d], qrow + h * a.q_head_stride, d, a.scale);
    else
#endif
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t i = 0; i < d; ++i) q[h * d + i] = to_float(qrow[h * a.q_head_stride + i]) * a.scale;
    std::fill(acc.begin(), acc.end(), 0.f);
    if (count > 0) {
      if (int64_t(off.size()) < count) off.resize(count);
      if (int64_t(scores.size()) < hq * count) scores.resize(hq * count);
      const int32_t* table = a.block_table + item.seq * a.max_blocks;
      row_offsets(table, item.p0, item.p1, a.block_size, row_elems, a.block_stride, off.data());
      if (a.k_scales != nullptr) {
        if (int64_t(soff.size()) < count) soff.resize(count);
        row_offsets(table, item.p0, item.p1, a.block_size, hkv, a.scale_block_stride, soff.data());
      }
      float* sc = scores.data();
      // Scores [nh, count] (query head h reads KV head h / group), softmax per head, weighted V.
      item_scores<T, Q>(a, nkv, qrow, q.data(), kc, vc, off.data(), count, sc);
      if (a.k_scales != nullptr) apply_row_scales(sc, nkv, group, count, a.k_scales + item.kv0, soff.data());
      if (a.softcap > 0.f)
        for (int64_t j = 0; j < nh * count; ++j) sc[j] = a.softcap * std::tanh(sc[j] / a.softcap);
      for (int64_t h = 0; h < nh; ++h) {
#ifdef PC_ATTN_AVX2
        if (vec) softmax_avx2(sc + h * count, count, &ml[2 * h], &ml[2 * h + 1]);
        else
#endif
          softmax_scalar(sc + h * count, count, &ml[2 * h], &ml[2 * h + 1]);
      }
      // After the softmax (its sums stay those of the weights): V's scales go into the weights.
      if (a.v_scales != nullptr) apply_row_scales(sc, nkv, group, count, a.v_scales + item.kv0, soff.data());
      bool pv_ran = false;  // by the bf16 cache's vdpbf16ps PV (natural order), else below
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (d == 64 || d == 128) {
          int64_t ncount = 0;
          if (it + 1 < end) {  // the next item's K rows, asked for into L2 during this PV
            const DecodeItem& nx = a.items[it + 1];
            ncount = nx.p1 - nx.p0;
            if (int64_t(noff.size()) < ncount) noff.resize(ncount);
            if (ncount > 0)
              row_offsets(a.block_table + nx.seq * a.max_blocks, nx.p0, nx.p1, a.block_size, row_elems, a.block_stride,
                          noff.data());
          }
          const int64_t rb = row_elems * 2;
          if (d == 64) pv_dp<2>(sc, nkv, group, vc, off.data(), count, acc.data(), ml.data(), wb, k_cache, noff.data(), ncount, rb);
          else pv_dp<4>(sc, nkv, group, vc, off.data(), count, acc.data(), ml.data(), wb, k_cache, noff.data(), ncount, rb);
          pv_ran = true;
        }
      }
#endif
#ifdef PC_ATTN_AVX2
      if (!pv_ran && vec) {
        if (d == 64) pv_avx2<T, 64>(sc, nkv, group, vc, off.data(), count, d, row_elems, acc.data());
        else if (d == 128) pv_avx2<T, 128>(sc, nkv, group, vc, off.data(), count, d, row_elems, acc.data());
        else pv_avx2<T, 0>(sc, nkv, group, vc, off.data(), count, d, row_elems, acc.data());
        for (int64_t h = 0; h < nh; ++h) to_natural<T>(&acc[h * d], d);
      } else
#endif
        if (!pv_ran)
          for (int64_t kv = 0; kv < nkv; ++kv)
            pv_scalar(sc + kv * group * count, group, vc + kv * d, off.data(), count, d, &acc[kv * group * d]);
    } else {
      for (int64_t h = 0; h < nh; ++h) ml[2 * h] = -std::numeric_limits<float>::max(), ml[2 * h + 1] = 0.f;
    }
    if (item.slot >= 0) {
      float* dst = const_cast<float*>(a.partial.data()) + (item.slot * hq + h0) * pstride;
      for (int64_t h = 0; h < nh; ++h) {
        dst[h * pstride] = ml[2 * h];
        dst[h * pstride + 1] = ml[2 * h + 1];
        std::copy(acc.data() + h * d, acc.data() + (h + 1) * d, dst + h * pstride + 2);
      }
    } else {
      Q* orow = out + (item.seq * hq + h0) * d;
      for (int64_t h = 0; h < nh; ++h) {
        const float inv = ml[2 * h + 1] > 0.f ? 1.f / ml[2 * h + 1] : 0.f;
#ifdef PC_ATTN_AVX2
        if (vec) {
          store_out(orow + h * d, &acc[h * d], d, inv);
          continue;
        }
#endif
        for (int64_t i = 0; i < d; ++i) orow[h * d + i] = static_cast<Q>(acc[h * d + i] * inv);
      }
    }
  }
}

// Combine the partitions of each split sequence (consecutive items): rescale to the common max.
template <typename Q>
void combine_items(const DecodeAttention& a) {
  const int64_t hq = a.hq, d = a.d, pstride = d + 2, num_items = int64_t(a.items.size());
  const auto& items = a.items;
  const auto& partial = a.partial;
  Q* out = static_cast<Q*>(a.out);
  std::vector<float> o(d);
  for (int64_t it = 0; it < num_items;) {
    if (items[it].slot < 0) {
      ++it;
      continue;
    }
    int64_t last = it;
    while (last + 1 < num_items && items[last + 1].seq == items[it].seq) ++last;
    for (int64_t h = 0; h < hq; ++h) {
      float m = -std::numeric_limits<float>::max();
      for (int64_t j = it; j <= last; ++j) m = std::max(m, partial[(items[j].slot * hq + h) * pstride]);
      float l = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t j = it; j <= last; ++j) {
        const float* pj = partial.data() + (items[j].slot * hq + h) * pstride;
        if (pj[1] == 0.f) continue;  // empty partition
        const float f = std::exp(pj[0] - m);
        l += f * pj[1];
        for (int64_t i = 0; i < d; ++i) o[i] += f * pj[2 + i];
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      Q* orow = out + (items[it].seq * hq + h) * d;
      for (int64_t i = 0; i < d; ++i) orow[i] = static_cast<Q>(o[i] * inv);
    }
    it = last + 1;
  }
}

// Calls f(T{}, Q{}) with the cache's and the query's element types.
template <typename F>
void dispatch_types(const DecodeAttention& a, F&& f) {
  auto with_cache = [&](auto cache_elem) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.query_type, "paged_decode_q",
                                    [&] { f(cache_elem, scalar_t{}); });
  };
  if (a.cache_type == at::kChar) {
    with_cache(int8_t{});
  } else if (a.cache_type == at::kFloat8_e4m3fn) {
    with_cache(c10::Float8_e4m3fn{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.cache_type, "paged_decode_kv",
                                    [&] { with_cache(scalar_t{}); });
  }
}
}  // namespace

void DecodeAttention::plan(int64_t threads) {
  auto first_of = [&](int64_t s) {
    const int64_t len = seq_lens[s];
    return window > 0 ? std::max<int64_t>(0, len - window) : int64_t(0);
  };
  int64_t total = 0;
  for (int64_t s = 0; s < n; ++s) total += seq_lens[s] - first_of(s);
  // Work items: one per sequence, except that with several threads a sequence longer than kPart positions is
  // split into ceil(count / kPart) even partitions.
  const int64_t part_len = threads > 1 ? kPart : std::numeric_limits<int64_t>::max();
  items.clear();
  items.reserve(n);
  int64_t slots = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t first = first_of(s), len = seq_lens[s], count = len - first;
    const int64_t parts = count > part_len ? (count + part_len - 1) / part_len : 1;
    const int64_t step = (count + parts - 1) / parts;
    for (int64_t p = 0; p < parts; ++p)
      items.push_back({s, first + p * step, std::min(len, first + (p + 1) * step), parts > 1 ? slots++ : -1, 0, hkv});
  }
  has_split = slots > 0;
  // Fewer sequences than threads (a single stream): each sequence's KV heads in near-equal groups, one item each, so
  // no thread idles through the step's attention. A head's sums are the same in any group: results do not change.
  if (!items.empty() && int64_t(items.size()) < threads && !has_split && hkv > 1) {
    const int64_t groups = std::min(hkv, threads / int64_t(items.size()));
    std::vector<DecodeItem> by_heads;
    for (const DecodeItem& it : items)
      for (int64_t g = 0; g < groups; ++g)
        by_heads.push_back({it.seq, it.p0, it.p1, -1, g * hkv / groups, (g + 1) * hkv / groups});
    items = std::move(by_heads);
  }
  // Partial results of split items: [slot][head] x (max, sum, acc[d]).
  partial.assign(slots * hq * (d + 2), 0.f);
  // Cuts at even shares of the work, an item weighing its positions plus kItemCost for its fixed part, per KV head.
  cuts.assign(threads + 1, int64_t(items.size()));
  cuts[0] = 0;
  int64_t work = 0, done = 0;
  auto weight = [&](const DecodeItem& it) { return (it.p1 - it.p0 + kItemCost) * (it.kv1 - it.kv0); };
  for (const DecodeItem& it : items) work += weight(it);
  for (int64_t i = 0, t = 1; i < int64_t(items.size()) && t < threads; ++i) {
    const int64_t w = weight(items[i]);
    // cut before item i if that lands nearer thread t's share than cutting after it
    while (t < threads && 2 * (done + w) * threads - w * threads > 2 * work * t) cuts[t++] = i;
    done += w;
  }
  // Small batches run inline (grain: a chunk holds >= 2^18 query-head x position x head_dim FMAs, ~50 us here).
  const int64_t per_item = std::max<int64_t>(1, total / std::max<int64_t>(1, int64_t(items.size())));
  grain = grain_for(per_item * hq * d, 1 << 18);
}

std::pair<int64_t, int64_t> DecodeAttention::share_of(int64_t tid, int64_t nth) const {
  if (int64_t(cuts.size()) == nth + 1) return {cuts[tid], cuts[tid + 1]};
  const int64_t n = int64_t(items.size()), per = (n + nth - 1) / nth;  // not planned for nth: even counts
  return {std::min(n, tid * per), std::min(n, (tid + 1) * per)};
}

void DecodeAttention::run(int64_t begin, int64_t end) const {
  dispatch_types(*this, [&](auto t, auto q) { run_items<decltype(t), decltype(q)>(*this, begin, end); });
}

void DecodeAttention::kv_lines(int64_t begin, int64_t end, LineStream& out) const {
  const int64_t esize = int64_t(c10::elementSize(cache_type)), row_bytes = hkv * d * esize;
  for (const void* cache : {k_cache, v_cache}) {  // all K, then all V: adjacent blocks merge into one span
    for (int64_t it = begin; it < end; ++it) {
      const DecodeItem& item = items[it];
      if (it > begin && items[it - 1].seq == item.seq && items[it - 1].p0 == item.p0) continue;  // its other heads
      const int32_t* table = block_table + item.seq * max_blocks;
      for (int64_t p = item.p0; p < item.p1;) {
        const int64_t o = p % block_size, run = std::min(block_size - o, item.p1 - p);
        out.add(static_cast<const char*>(cache) + (int64_t(table[p / block_size]) * block_stride + o * hkv * d) * esize,
                run * row_bytes);
        p += run;
      }
    }
  }
}

void DecodeAttention::combine() const {
  if (!has_split) return;
  dispatch_types(*this, [&](auto, auto q) { combine_items<decltype(q)>(*this); });
}

// query [T, Hq, D] (last dim contiguous); rows [n] int64: query row of each sequence;
// caches [num_blocks, block_size, Hkv, D], rows dense within a block (blocks any stride apart); block_table
// [n, max_blocks] int32; seq_lens [n] int32. A quantized cache (int8 / float8_e4m3fn) comes with its fp16
// scales [num_blocks, block_size, Hkv]. Returns [n, Hq, D] in query's dtype.
namespace {
DecodeAttention describe(const torch::Tensor& query, const torch::Tensor& rows, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                         double scale, int64_t window, double softcap, const c10::optional<torch::Tensor>& k_scales,
                         const c10::optional<torch::Tensor>& v_scales, void* out) {
  const int64_t n = rows.size(0), hq = query.size(1), d = query.size(2);
  const int64_t hkv = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(query.stride(2) == 1, "query layout");
  for (const auto& c : {k_cache, v_cache})
    TORCH_CHECK(c.stride(3) == 1 && c.stride(2) == d && c.stride(1) == hkv * d, "cache rows dense within a block");
  TORCH_CHECK(k_cache.stride(0) == v_cache.stride(0), "K and V caches of one layout");
  TORCH_CHECK(block_table.is_contiguous() && block_table.scalar_type() == at::kInt, "block_table int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && rows.scalar_type() == at::kLong, "seq_lens int32, rows int64");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches of one dtype");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && k_cache.size(3) == d, "heads / head_dim");
  const bool quant = k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(quant == (k_scales.has_value() && v_scales.has_value()), "scales exactly with an int8 / fp8 cache");
  const c10::Half *ks = nullptr, *vs = nullptr;
  int64_t scale_block_stride = 0;
  if (quant) {
    for (const auto& c : {*k_scales, *v_scales})
      TORCH_CHECK(c.scalar_type() == at::kHalf && c.stride(2) == 1 && c.stride(1) == hkv, "scales fp16, dense rows");
    TORCH_CHECK(k_scales->stride(0) == v_scales->stride(0), "K and V scales of one layout");
    ks = k_scales->data_ptr<c10::Half>();
    vs = v_scales->data_ptr<c10::Half>();
    scale_block_stride = k_scales->stride(0);
  }
  return DecodeAttention{query.scalar_type(), k_cache.scalar_type(), query.data_ptr(), k_cache.data_ptr(),
                         v_cache.data_ptr(), block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                         rows.data_ptr<int64_t>(), out, n, hq, hkv, d, block_size, block_table.size(1),
                         query.stride(0), query.stride(1), float(scale), window, float(softcap), k_cache.stride(0), ks,
                         vs, scale_block_stride};
}
}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor rows, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t window,
                           double softcap, c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales) {
  auto out = torch::empty({rows.size(0), query.size(1), query.size(2)}, query.options());
  DecodeAttention a = describe(query, rows, k_cache, v_cache, block_table, seq_lens, scale, window, softcap, k_scales,
                               v_scales, out.data_ptr());
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  a.plan(threads);
  const int64_t items = int64_t(a.items.size());
  if (threads == 1 || items <= a.grain) {
    a.run(0, items);
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const auto [i0, i1] = a.share_of(t, threads);
        if (i0 < i1) a.run(i0, i1);
      }
    });
  }
  a.combine();
  return out;
}

// The K/V lines the decode stack asks for ahead of each of `threads` threads' items (kv_lines): rows
// [thread, address, lines] of its LineStream's spans, for the tests.
torch::Tensor decode_kv_lines(torch::Tensor query, torch::Tensor rows, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_table, torch::Tensor seq_lens, int64_t window, int64_t threads) {
  DecodeAttention a = describe(query, rows, k_cache, v_cache, block_table, seq_lens, 1.0, window, 0.0, c10::nullopt,
                               c10::nullopt, nullptr);
  a.plan(threads);
  std::vector<int64_t> out;
  for (int64_t t = 0; t < threads; ++t) {
    const auto [i0, i1] = a.share_of(t, threads);
    LineStream s;
    a.kv_lines(i0, i1, s);
    for (const auto& span : s.spans) out.insert(out.end(), {t, int64_t(reinterpret_cast<uintptr_t>(span.p)), span.lines});
  }
  return torch::tensor(out, torch::kLong).view({-1, 3});
}

// The decode attention kernels on AVX512-BF16 for a bf16 query and cache, head_dim 64 or 128
// (cpu_decode_attention.cpp): scores and PV on vdpbf16ps. Internal to the file that includes it (an anonymous
// namespace).
#pragma once

#include "decode_attention_rows.h"
#include <vector>

#if defined(__AVX512BF16__)
namespace {

// Scores of a bf16 query against a bf16 cache on vdpbf16ps: one instruction multiplies 32 elements of a key row by
// the query head's and sums them in pairs into 16 fp32 lanes (no widening, twice an fp32 FMA's products), q used as
// it is (bf16, exact) and the scale applied to the dot product. A tile holds G heads x 4 keys of zmm accumulators;
// a transpose-and-add tree then reduces the 16 (G < 4: padded) of them into one zmm, head h's 4 scores in its
// 128-bit lane h (~3 instructions a score, where one reduction each took ~8).
PC_INLINE __m512 sum_pairs(__m512 a, __m512 b) {  // per 128-bit lane: (a, b, a, b) partial sums
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
PC_INLINE __m512 sum_quads(__m512 ab, __m512 cd) {  // per 128-bit lane: (a, b, c, d)
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
PC_INLINE __m512 sum_lanes(__m512 a, __m512 b) {  // lanes (a0 + a1, a2 + a3, b0 + b1, b2 + b3)
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

// s[h * stride + t] = scale * q_h . k_t for G <= 4 heads (q_h at q + h * qs) and keys t < n of k[0..4), C * 32
// elements a row (k[t >= n] repeat a valid row: computed, not stored).
template <int G, int C>
PC_INLINE void scores_tile_dp(const c10::BFloat16* q, int64_t qs, const c10::BFloat16* const* k, float scale,
                              float* s, int64_t stride, int64_t n) {
  __m512 a[G][4];
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) a[h][t] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    __m512bh qv[G];
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) qv[h] = (__m512bh)_mm512_loadu_si512(q + h * qs + 32 * c);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(k[t] + 32 * c);
#pragma GCC unroll 4
      for (int h = 0; h < G; ++h) a[h][t] = _mm512_dpbf16_ps(a[h][t], kv, qv[h]);
    }
  }
  __m512 u[4];
#pragma GCC unroll 4
  for (int h = 0; h < 4; ++h)
    u[h] = h < G ? sum_quads(sum_pairs(a[h][0], a[h][1]), sum_pairs(a[h][2], a[h][3])) : _mm512_setzero_ps();
  alignas(64) float w[16];
  _mm512_store_ps(w, _mm512_mul_ps(sum_lanes(sum_lanes(u[0], u[1]), sum_lanes(u[2], u[3])), _mm512_set1_ps(scale)));
  const __mmask8 valid = __mmask8((1u << n) - 1);
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h) _mm_mask_storeu_ps(s + h * stride, valid, _mm_load_ps(w + 4 * h));
}

// scores_avx2 for a bf16 query and cache, head_dim C * 32: 4 keys a step, the same prefetches. Sub-groups of 4
// heads if g % 4 == 0, of 3 if g % 3 == 0, else of 2 (and 1).
template <int C>
void scores_dp(const c10::BFloat16* q, int64_t qs, int64_t hkv, int64_t g, const c10::BFloat16* k,
               const c10::BFloat16* vb, const int64_t* off, int64_t count, int64_t row_elems, float scale, float* s) {
  constexpr int64_t PF = 16, D = 32 * C;
  const int64_t sub = g % 4 == 0 ? 4 : g % 3 == 0 ? 3 : 2;
  for (int64_t t = 0; t < std::min(count, PF); ++t) prefetch_row(k + off[t], row_elems);
  for (int64_t t = 0; t < count; t += 4) {
    for (int64_t u = t + PF; u < t + PF + 4; ++u) {
      if (u < count) {
        prefetch_row(k + off[u], row_elems);
        prefetch_row_l2(vb + off[u], row_elems);
      } else if (u - count < std::min(count, PF)) {
        prefetch_row(vb + off[u - count], row_elems);
      }
    }
    const int64_t n = std::min<int64_t>(4, count - t);
    for (int64_t kv = 0; kv < hkv; ++kv) {
      const c10::BFloat16* kk = k + kv * D;
      const c10::BFloat16* rows[4];
      for (int64_t i = 0; i < 4; ++i) rows[i] = kk + off[t + std::min(i, n - 1)];
      for (int64_t h = kv * g; h < (kv + 1) * g;) {
        const int64_t m = std::min(sub, (kv + 1) * g - h);
        const c10::BFloat16* qh = q + h * qs;
        float* sh = s + h * count + t;
        switch (m) {
          case 1: scores_tile_dp<1, C>(qh, qs, rows, scale, sh, count, n); break;
          case 2: scores_tile_dp<2, C>(qh, qs, rows, scale, sh, count, n); break;
          case 3: scores_tile_dp<3, C>(qh, qs, rows, scale, sh, count, n); break;
          default: scores_tile_dp<4, C>(qh, qs, rows, scale, sh, count, n); break;
        }
        h += m;
      }
    }
  }
}

// Rows of the next item's K asked for into L2 while this item's PV runs from L2 (the scores pass asks for this
// item's V): memory then streams through both passes, where it idled through the PV (T0 into L1 ran slower: the
// item's own V rows were pushed out). Zen 4, 2 threads, 30 layers' caches cycled (from memory), 40 x 125-250
// positions: 395-410 -> 338-352 us a layer; L2/L3-resident 173-175 -> 191-197 (the added prefetches); the bench
// workload's decode steps through the stack: attention phases 0.76-0.86 -> 0.61-0.70 s of a ~9.8 s run.
struct RowPrefetch {
  const char* base = nullptr;
  const int64_t* off = nullptr;
  int64_t next = 0, end = 0, per = 0, bytes = 0;
  PC_INLINE void step() {
    for (int64_t i = 0; i < per && next < end; ++i, ++next) {
      const char* r = base + off[next] * 2;
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
    }
  }
};

// PV of a bf16 cache on vdpbf16ps: the softmax weights rounded to bf16 (as torch's CPU flash attention rounds P for
// its PV matmul), positions in pairs (t, t + 1): the two V rows interleaved by 16-bit lanes (vpunpckl/hwd), so each
// dword holds one column's pair, against each head's weight pair broadcast: half the multiply-adds of fp32 weights,
// which is what PV costs from L2 (it ran at the FMA peak). Per 32 columns the unpacks leave columns {0-3, 8-11,
// 16-19, 24-27} in one accumulator and the rest in the other, put back in natural order at the end. An odd last
// position pairs with a zero row: nothing past seq_len is read (unwritten slots may hold NaN).
// G heads of one KV head (weight pairs wp[h * wstride + pair]), head_dim 32 C, out [G, 32 C] natural order.
template <int G, int C>
PC_INLINE void pv_dp_heads(const uint32_t* wp, int64_t wstride, int64_t count, const c10::BFloat16* v,
                           const int64_t* off, float* out, RowPrefetch& side) {
  constexpr int64_t PF = 16;
  __m512 a[G][2 * C];
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * C; ++j) a[h][j] = _mm512_setzero_ps();
  auto step = [&](const c10::BFloat16* r0, const c10::BFloat16* r1, int64_t pair) {
    __m512 x[2 * C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i u0 = _mm512_loadu_si512(r0 + 32 * c);
      const __m512i u1 = r1 != nullptr ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
      x[2 * c] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(u0, u1));
      x[2 * c + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(u0, u1));
    }
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const __m512bh wt = (__m512bh)_mm512_set1_epi32(int(wp[h * wstride + pair]));
#pragma GCC unroll 8
      for (int j = 0; j < 2 * C; ++j) a[h][j] = _mm512_dpbf16_ps(a[h][j], wt, (__m512bh)x[j]);
    }
  };
  const int64_t pairs = count / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t t = 2 * p;
    if (t + PF + 1 < count) {
      prefetch_row(v + off[t + PF], 32 * C);
      prefetch_row(v + off[t + PF + 1], 32 * C);
    }
    side.step();
    step(v + off[t], v + off[t + 1], p);
  }
  if (count & 1) step(v + off[count - 1], nullptr, pairs);
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(out + h * 32 * C + 32 * c, _mm512_permutex2var_ps(a[h][2 * c], lo, a[h][2 * c + 1]));
      _mm512_storeu_ps(out + h * 32 * C + 32 * c + 16, _mm512_permutex2var_ps(a[h][2 * c], hi, a[h][2 * c + 1]));
    }
}

// acc [hkv * g, 32 C] (natural order) = sum_t w[h * count + t] * v_t for a bf16 cache, through pv_dp_heads: each
// KV head's column of V read once for up to 4 (head_dim 64) or 2 (128) of its query heads. wb: scratch.
template <int C>
void pv_dp(const float* w, int64_t hkv, int64_t g, const c10::BFloat16* v, const int64_t* off, int64_t count,
           float* acc, float* ml, std::vector<c10::BFloat16>& wb, const c10::BFloat16* nk = nullptr,
           const int64_t* noff = nullptr, int64_t ncount = 0, int64_t row_bytes = 0) {
  constexpr int64_t kMaxG = C == 2 ? 4 : 2;
  const int64_t hq = hkv * g, wstride = count / 2 + 1;  // weight pairs a head, an odd count's last padded with 0
  wb.resize(hq * 2 * wstride);
  for (int64_t h = 0; h < hq; ++h) {
    const float* src = w + h * count;
    c10::BFloat16* dst = wb.data() + h * 2 * wstride;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < count; t += 16) {
      const __mmask16 m = count - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (count - t)) - 1);
      const __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + t));
      _mm256_mask_storeu_epi16(dst + t, m, r);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
    }
    dst[count] = c10::BFloat16(0.f);
    // The sum the output is divided by: of the weights as rounded, so they still sum to 1 (the rounding's common part
    // cancels: the output stays a weighted mean of V rows).
    ml[2 * h + 1] = _mm512_reduce_add_ps(sum);
  }
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(wb.data());
  RowPrefetch side;
  const int64_t calls = hkv * ((g + kMaxG - 1) / kMaxG), steps = calls * ((count + 1) / 2);
  if (nk != nullptr && ncount > 0 && steps > 0)
    side = {reinterpret_cast<const char*>(nk), noff, 0, ncount, (ncount + steps - 1) / steps, row_bytes};
  for (int64_t kv = 0; kv < hkv; ++kv) {
    const c10::BFloat16* vk = v + kv * 32 * C;
    for (int64_t h = kv * g; h < (kv + 1) * g;) {
      const int64_t m = std::min<int64_t>(kMaxG, (kv + 1) * g - h);
      const uint32_t* wh = wp + h * wstride;
      float* out = acc + h * 32 * C;
      switch (m) {
        case 1: pv_dp_heads<1, C>(wh, wstride, count, vk, off, out, side); break;
        case 2: pv_dp_heads<2, C>(wh, wstride, count, vk, off, out, side); break;
        case 3: if constexpr (kMaxG >= 3) pv_dp_heads<3, C>(wh, wstride, count, vk, off, out, side); break;
        default: if constexpr (kMaxG >= 4) pv_dp_heads<4, C>(wh, wstride, count, vk, off, out, side); break;
      }
      h += m;
    }
  }
}

}  // namespace
#endif

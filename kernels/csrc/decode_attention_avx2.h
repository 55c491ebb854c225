// The decode attention kernels on AVX2 + FMA (cpu_decode_attention.cpp): the scores pass (scores_tile, scores_avx2)
// and the weighted sum of V rows (pv_tile, pv_sub, pv_avx2; on AVX-512 the whole-row tile of 3-head groups of head_dim
// 64). Internal to the file that includes it (an anonymous namespace).
#pragma once

#include "decode_attention_rows.h"
#include <type_traits>

#ifdef PC_ATTN_AVX2
namespace {


// Scores of NT keys (rows k[0..NT)) against G query heads q [G, d] -> s[h * stride + 0..NT), NT <= 4.
// G * NT accumulators + NT rows + q + the bf16 mask fit the 16 ymm registers for (G, NT) = (3, 3),
// (2, 4), (1, 4).
template <typename T, int G, int NT, int D>
PC_INLINE void scores_tile(const float* q, const T* const* k, int64_t d_, float* s, int64_t stride) {
  using R = Rows<T>;
  const int64_t d = D > 0 ? D : d_;  // D: head_dim known at compile time (0: not)
  __m256 a[NT][G];
  {
    __m256 x[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) x[t] = R::lo(k[t]);
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * d);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) a[t][h] = _mm256_mul_ps(x[t], qv);
    }
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < d; i += 16) {
    if (i > 0) {
      __m256 x[NT];
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) x[t] = R::lo(k[t] + i);
#pragma GCC unroll 4
      for (int h = 0; h < G; ++h) {
        const __m256 qv = _mm256_loadu_ps(q + h * d + i);
#pragma GCC unroll 4
        for (int t = 0; t < NT; ++t) a[t][h] = _mm256_fmadd_ps(x[t], qv, a[t][h]);
      }
    }
    __m256 x[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) x[t] = R::hi(k[t] + i);
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * d + i + 8);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) a[t][h] = _mm256_fmadd_ps(x[t], qv, a[t][h]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h) {
    if constexpr (NT == 4) {
      _mm_storeu_ps(s + h * stride, hsum4(a[0][h], a[1][h], a[2][h], a[3][h]));
    } else {
      alignas(16) float r[4];
      _mm_store_ps(r, hsum4(a[0][h], a[NT > 1 ? 1 : 0][h], a[NT > 2 ? 2 : 0][h], a[0][h]));
      for (int t = 0; t < NT; ++t) s[h * stride + t] = r[t];
    }
  }
}

// s[h * count + t] = q_h . k_t for all heads h = kv * g + j (q [hkv * g, d] in Rows<T> order; key row t
// of KV head kv at k + off[t] + kv * d). A group of 3 (or 6, 9, ..) heads takes 3 keys at a time in
// sub-groups of 3, any other group 4 keys at a time in sub-groups of 2 (and 1). All KV heads of a
// few positions are done together: whole cache rows (contiguous within a block) are consumed at
// once. Prefetches rows PF positions ahead (K, then the first V rows at vb for the pass after).
template <typename T, int D>
void scores_avx2(const float* q, int64_t hkv, int64_t g, const T* k, const T* vb, const int64_t* off, int64_t count,
                 int64_t d_, int64_t row_elems, float* s) {
  const int64_t d = D > 0 ? D : d_;
  constexpr int64_t PF = 16;
  const bool by3 = g % 3 == 0;
  const int64_t step = by3 ? 3 : 4;
  for (int64_t t = 0; t < std::min(count, PF); ++t) prefetch_row(k + off[t], row_elems);
  int64_t t = 0;
  for (; t + step <= count; t += step) {
    for (int64_t u = t + PF; u < t + PF + step; ++u) {
      if (u < count) {
        prefetch_row(k + off[u], row_elems);
        prefetch_row_l2(vb + off[u], row_elems);  // V into L2 alongside: two streams in flight
      } else if (u - count < std::min(count, PF)) {
        prefetch_row(vb + off[u - count], row_elems);  // off has count rows
      }
    }
    for (int64_t kv = 0; kv < hkv; ++kv) {
      const T* kk = k + kv * d;
      const T* rows[4] = {kk + off[t], kk + off[t + 1], kk + off[t + 2], kk + off[t + step - 1]};
      const int64_t h0 = kv * g;
      if (by3) {
        for (int64_t h = h0; h < h0 + g; h += 3) scores_tile<T, 3, 3, D>(q + h * d, rows, d, s + h * count + t, count);
      } else {
        int64_t h = h0;
        for (; h + 2 <= h0 + g; h += 2) scores_tile<T, 2, 4, D>(q + h * d, rows, d, s + h * count + t, count);
        if (h < h0 + g) scores_tile<T, 1, 4, D>(q + h * d, rows, d, s + h * count + t, count);
      }
    }
  }
  for (; t < count; ++t) {
    for (int64_t kv = 0; kv < hkv; ++kv) {
      const T* rows[1] = {k + kv * d + off[t]};
      const int64_t h0 = kv * g;
      int64_t h = h0;
      for (; h + 2 <= h0 + g; h += 2) scores_tile<T, 2, 1, D>(q + h * d, rows, d, s + h * count + t, count);
      if (h < h0 + g) scores_tile<T, 1, 1, D>(q + h * d, rows, d, s + h * count + t, count);
    }
  }
}



// acc[h][c .. c + 16 NB) += sum over tokens [t0, t1) of w[h * count + t] * v_t[c ..], for G heads.
// With PF, also prefetches pf_len elements at pfb + pf[t - t0] for each token (the next tile's rows,
// spread over this pass).
template <typename T, int G, int NB, bool PF, int D>
PC_INLINE void pv_tile(const float* w, int64_t count, const T* v, const int64_t* off, int64_t t0, int64_t t1,
                       int64_t c, float* acc, int64_t d_, const T* pfb, const int64_t* pf, int64_t npf,
                       int64_t pf_len) {
  using R = Rows<T>;
  const int64_t d = D > 0 ? D : d_;
  __m256 a[G][2 * NB];
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NB; ++j) a[h][j] = _mm256_loadu_ps(acc + h * d + c + 8 * j);
  for (int64_t t = t0; t < t1; ++t) {
    if (PF && t - t0 < npf) prefetch_row(pfb + pf[t - t0], pf_len);
    const T* vr = v + off[t] + c;
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      const __m256 lo = R::lo(vr + 16 * b), hi = R::hi(vr + 16 * b);
#pragma GCC unroll 4
      for (int h = 0; h < G; ++h) {
        const __m256 wt = _mm256_broadcast_ss(w + h * count + t);
        a[h][2 * b] = _mm256_fmadd_ps(wt, lo, a[h][2 * b]);
        a[h][2 * b + 1] = _mm256_fmadd_ps(wt, hi, a[h][2 * b + 1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NB; ++j) _mm256_storeu_ps(acc + h * d + c + 8 * j, a[h][j]);
}

template <typename T, int G, int D>
PC_INLINE void pv_sub(const float* w, int64_t count, const T* v, const int64_t* off, int64_t t0, int64_t t1,
                      float* acc, int64_t d_, const T* pfb, const int64_t* pf, int64_t npf, int64_t pf_len) {
  const int64_t d = D > 0 ? D : d_;
  constexpr int NB = G == 1 ? 4 : (G == 2 ? 2 : 1);  // 2 G NB accumulators: enough chains, <= 16 ymm in all
  int64_t c = 0;
  if (npf > 0) {  // the first pass over the tile prefetches the next one
    if (16 * NB <= d) {
      pv_tile<T, G, NB, true, D>(w, count, v, off, t0, t1, c, acc, d, pfb, pf, npf, pf_len);
      c += 16 * NB;
    } else {
      pv_tile<T, G, 1, true, D>(w, count, v, off, t0, t1, c, acc, d, pfb, pf, npf, pf_len);
      c += 16;
    }
  }
  for (; c + 16 * NB <= d; c += 16 * NB)
    pv_tile<T, G, NB, false, D>(w, count, v, off, t0, t1, c, acc, d, pfb, pf, 0, 0);
  for (; c < d; c += 16) pv_tile<T, G, 1, false, D>(w, count, v, off, t0, t1, c, acc, d, pfb, pf, 0, 0);
}

#if defined(__AVX512F__)
// 16 elements of a cache row as fp32, in natural order.
PC_INLINE __m512 zrow16(const float* p) { return _mm512_loadu_ps(p); }
PC_INLINE __m512 zrow16(const c10::BFloat16* p) {  // zero-extend, shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// pv_tile for an fp32 or bf16 cache, 3 heads of one KV head, head_dim 64, on AVX-512: each head's whole output row in
// 4 zmm, so one pass over the tile's positions loads each V row and broadcasts each weight once (the AVX2 tile takes
// 4 passes of 16 columns, re-broadcasting the weights in each). For bf16 the accumulators are permuted from / to
// Rows<bf16> order (evens, odds of each 16 columns) at the tile's ends. Each output element is the same FMA chain
// over the positions in order as there: bit for bit the AVX2 result. 64 sequences x 176 positions, 30 layers, 2
// threads, fp32: 9.5 -> 8.8 ms over cache-resident blocks, 22.4 -> 21.8 ms with the cache past the LLC.
template <typename T>
PC_INLINE void pv_tile_g3_d64(const float* w, int64_t count, const T* v, const int64_t* off, int64_t t0, int64_t t1,
                              float* acc, const T* pfb, const int64_t* pf, int64_t npf, int64_t pf_len) {
  const __m512i to_nat = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m512i to_rows = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  auto order = [](__m512i idx, __m512 x) { return Rows<T>::kPermuted ? _mm512_permutexvar_ps(idx, x) : x; };
  __m512 a[3][4];
#pragma GCC unroll 3
  for (int h = 0; h < 3; ++h)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) a[h][j] = order(to_nat, _mm512_loadu_ps(acc + h * 64 + 16 * j));
  for (int64_t t = t0; t < t1; ++t) {
    if (t - t0 < npf) prefetch_row(pfb + pf[t - t0], pf_len);
    const T* vr = v + off[t];
    __m512 x[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) x[j] = zrow16(vr + 16 * j);
#pragma GCC unroll 3
    for (int h = 0; h < 3; ++h) {
      const __m512 wt = _mm512_set1_ps(w[h * count + t]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) a[h][j] = _mm512_fmadd_ps(wt, x[j], a[h][j]);
    }
  }
#pragma GCC unroll 3
  for (int h = 0; h < 3; ++h)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + h * 64 + 16 * j, order(to_rows, a[h][j]));
}
#endif

// acc [hkv * g, d] (Rows<T> order) += sum_t w[h * count + t] * v_t (row t of KV head kv = h / g at
// v + off[t] + kv * d). Tiles of a few positions whose cache rows (all KV heads) stay in L1 while
// every (KV head, head sub-group, column block) pass goes over them; the first pass over a tile
// prefetches the next tile's rows. Sub-groups of 3 heads if g % 3 == 0, else of 2 (and 1).
template <typename T, int D>
void pv_avx2(const float* w, int64_t hkv, int64_t g, const T* v, const int64_t* off, int64_t count, int64_t d_,
             int64_t row_elems, float* acc) {
  const int64_t d = D > 0 ? D : d_;
  const int64_t tile = std::max<int64_t>(8, std::min<int64_t>(32, 12288 / (row_elems * int64_t(sizeof(T)))));
  const bool by3 = g % 3 == 0;
#if defined(__AVX512F__)
  if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) && D == 64) {
    if (by3) {
      for (int64_t t0 = 0; t0 < count; t0 += tile) {
        const int64_t t1 = std::min(count, t0 + tile);
        int64_t npf = std::min(count, t1 + tile) - t1;
        for (int64_t kv = 0; kv < hkv; ++kv)
          for (int64_t h = kv * g; h < (kv + 1) * g; h += 3, npf = 0)
            pv_tile_g3_d64(w + h * count, count, v + kv * 64, off, t0, t1, acc + h * 64, v, off + t1, npf, row_elems);
      }
      return;
    }
  }
#endif
  for (int64_t t0 = 0; t0 < count; t0 += tile) {
    const int64_t t1 = std::min(count, t0 + tile);
    int64_t npf = std::min(count, t1 + tile) - t1;
    for (int64_t kv = 0; kv < hkv; ++kv) {
      const T* vv = v + kv * d;
      for (int64_t h = kv * g; h < (kv + 1) * g;) {
        const int64_t sub = by3 ? 3 : std::min<int64_t>(2, (kv + 1) * g - h);
        const float* wh = w + h * count;
        float* ah = acc + h * d;
        switch (sub) {
          case 1: pv_sub<T, 1, D>(wh, count, vv, off, t0, t1, ah, d, v, off + t1, npf, row_elems); break;
          case 2: pv_sub<T, 2, D>(wh, count, vv, off, t0, t1, ah, d, v, off + t1, npf, row_elems); break;
          default: pv_sub<T, 3, D>(wh, count, vv, off, t0, t1, ah, d, v, off + t1, npf, row_elems); break;
        }
        npf = 0;
        h += sub;
      }
    }
  }
}

}  // namespace
#endif  // PC_ATTN_AVX2

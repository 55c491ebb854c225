// Linear layers over weights packed once at load: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Why our own GEMM: on CPUs without bf16 matmul units (AVX2 only) torch's bf16 matmul falls back to a
// scalar loop (~1 GFLOP/s) and oneDNN refuses to pre-pack bf16 weights; with units, F.linear still
// re-lays the weight out on every call. Here the weight is packed once into panels of 16 output
// columns, [ceil(N/16), K, 16], kept in its own dtype (bf16 halves the bytes a decode step reads),
// and widened to fp32 in registers; accumulation is fp32, the result rounded once to x's dtype.
// The micro-kernel keeps a 6 x 16 tile of C in 12 AVX2 registers (BLIS-style); at M = 1 it
// streams each panel once, so decode runs at memory speed. This file: fp32 and bf16 panels and the entry points
// (gemm_input_*, gemm_panels, silu_mul_panels); int4 and int8 panels: cpu_gemm_int4.cpp, cpu_gemm_int8.cpp; bf16 VNNI
// pairs: cpu_gemm_vnni.cpp; the torch ops: cpu_linear_ops.cpp; the tiles they share: gemm_tiles.h.
#include "gemm_tiles.h"
#include "layer_rows.h"

#include <ATen/Parallel.h>

namespace {
// Rows of the tile that starts `left` rows before the end of its block. x packed into row tiles fixes them at MR;
// read in place (`free`), the last MR + 1..MR + 5 rows split evenly instead (64 rows: 10 x 6 + 4 -> 9 x 6 + 5 + 5):
// a tile of few rows has too few FMA chains to hide their latency, and reads its panel from L2 faster than it can.
inline int64_t tile_rows(int64_t left, bool free) {
  return free && MR < left && left < 2 * MR ? (left + 1) / 2 : std::min(MR, left);
}

// Panels [p0, p1) of y = x @ W^T for every row of x (packed into fp32 row tiles).
constexpr int64_t WIDEN_ROWS = 2 * MR;  // from more rows, bf16 panels are widened to fp32 once per call
// Whether the AVX-512 tiles run w for M rows: fp32 at every row count (each output one FMA chain over k in order,
// whatever the batch, so a row's result does not depend on how many rows share its step: the thin kernels'
// interleaved sums did, and greedy runs parted under preemption); bf16 panels widened from as many rows as before.
inline bool zmm_tiles_run(const PackedWeight& w, int64_t M) {
#ifdef PC_AVX512
  return !w.vnni && (w.type == at::kFloat || (w.type == at::kBFloat16 && M > WIDEN_ROWS));
#else
  return false;
#endif
}
#ifdef PC_AVX512
using zmm::PZ;
using zmm::tile_zmm;
inline bool runs_exact_int4(const PackedWeight& w, int64_t M) { return w.exact_q != nullptr && M <= w.exact_rows; }
// Up to 4 panels of an exact weight for exact_tile: their int4 panels and scale/min, and how far ahead (uint16s) the
// same panel of the next group lies.
struct ExactPanels {
  const uint16_t* q[4];
  const c10::Half* sm[4];
  int64_t ahead;
};
inline const uint16_t* exact_q_of(const PackedWeight& w, int64_t p) { return w.exact_q + p * w.K * 4; }
inline const c10::Half* exact_sm_of(const PackedWeight& w, int64_t p) {
  return w.exact_sm + p * (w.K / w.exact_group) * 2 * NR;
}
inline ExactPanels exact_panels(const PackedWeight& w, std::initializer_list<int64_t> panels, int64_t ahead) {
  ExactPanels e{};
  int i = 0;
  for (int64_t p : panels) e.q[i] = exact_q_of(w, p), e.sm[i++] = exact_sm_of(w, p);
  e.ahead = ahead * w.K * 4;
  return e;
}

// An exact fp32 weight's panel p from its int4 form (cpu_exact_int4.cpp): fma(q, d, m) as the check built it. A quad's
// 16 uint16 (one a column) zero-extended to lanes; code t of each is its nibble t, and vpermps, which reads only an
// index's low 4 bits, turns it into the float q from a table: 3 instructions per 16 weights (shift, permute, fma).
void widen_exact_int4(const PackedWeight& w, int64_t p, float* buf) {
  const int64_t K = w.K, G = w.exact_group;
  const uint16_t* q = exact_q_of(w, p);
  const c10::Half* sm = exact_sm_of(w, p);
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t g = 0; g < K / G; ++g) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + g * 2 * NR)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + g * 2 * NR + NR)));
    for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
      _mm_prefetch(reinterpret_cast<const char*>(q + k * 4) + PF4, _MM_HINT_T0);
      const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k * 4)));
      _mm512_storeu_ps(buf + k * NR, _mm512_fmadd_ps(_mm512_permutexvar_ps(v, codes), d, m));
      _mm512_storeu_ps(buf + (k + 1) * NR, _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), codes), d, m));
      _mm512_storeu_ps(buf + (k + 2) * NR, _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), codes), d, m));
      _mm512_storeu_ps(buf + (k + 3) * NR, _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), codes), d, m));
    }
  }
}

// R rows x P panels of an exact weight, each weight widened in registers as widen_exact_int4 widens it and used
// at once: widening into a buffer and tiling it moved every fp32 weight through L2 twice (~7 ms a one-row step
// on 2 threads). The same FMA chain per output as micro_kernel_zmm (from +0, over k in order): bit for bit its
// result. The same panel of the next group is asked for into L2 as this one is read.
template <int R, int P>
__attribute__((noinline)) void exact_tile_rp(const float* a, int64_t ka, int64_t ra, const ExactPanels& e, int64_t K,
                                             int64_t G, float* c) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[R][P];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    __m512 d[P], m[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      d[p] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.sm[p] + g * 2 * NR)));
      m[p] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.sm[p] + g * 2 * NR + NR)));
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
      __m512i v[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        if ((k & 7) == 0) _mm_prefetch(reinterpret_cast<const char*>(e.q[p] + e.ahead + k * 4), _MM_HINT_T1);
        v[p] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.q[p] + k * 4)));
      }
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const float* ak = a + (k + t) * ka;
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          const __m512 wv = _mm512_fmadd_ps(_mm512_permutexvar_ps(v[p], codes), d[p], m[p]);
          v[p] = _mm512_srli_epi32(v[p], 4);  // the next input's nibble into the index bits
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(ak[r * ra]), wv, acc[r][p]);
        }
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(c + p * MR * NR + r * NR, acc[r][p]);
}

template <int R>
void exact_tile_r(int64_t np, const float* a, int64_t ka, int64_t ra, const ExactPanels& e, int64_t K, int64_t G,
                  float* c) {
  switch (np) {
    case 1: return exact_tile_rp<R, 1>(a, ka, ra, e, K, G, c);
    case 2: return exact_tile_rp<R, 2>(a, ka, ra, e, K, G, c);
    case 3: return exact_tile_rp<R, 3>(a, ka, ra, e, K, G, c);
    default: return exact_tile_rp<R, 4>(a, ka, ra, e, K, G, c);
  }
}

void exact_tile(int64_t rows, int64_t np, const float* a, int64_t ka, int64_t ra, const ExactPanels& e, int64_t K,
                int64_t G, float* c) {
  switch (rows) {
    case 1: return exact_tile_r<1>(np, a, ka, ra, e, K, G, c);
    case 2: return exact_tile_r<2>(np, a, ka, ra, e, K, G, c);
    case 3: return exact_tile_r<3>(np, a, ka, ra, e, K, G, c);
    case 4: return exact_tile_r<4>(np, a, ka, ra, e, K, G, c);
    case 5: return exact_tile_r<5>(np, a, ka, ra, e, K, G, c);
    default: return exact_tile_r<6>(np, a, ka, ra, e, K, G, c);
  }
}

// Up to this many rows exact weights are widened in registers per row tile (exact_tile); from more up to TALL_ROWS
// in registers per tall tile of 12-24 rows and one panel (exact_tall, cpu_exact_int4.cpp); from more still once per
// call into a buffer the tiles share.
constexpr int64_t FUSED_ROWS = 2 * MR;
constexpr int64_t TALL_ROWS = 36;
inline bool tall_runs(const PackedWeight& w, int64_t M) { return runs_exact_int4(w, M) && M > FUSED_ROWS && M <= TALL_ROWS; }
// f(first row, rows) for each tall tile of M rows: all M up to 24, else 12 and M - 12 (tiles start on pack_tiles'
// 6-row tiles).
template <typename F>
inline void for_each_tall_tile(int64_t M, F&& f) {
  const int64_t split = M > 24 ? 12 : M;
  f(int64_t(0), split);
  if (split < M) f(split, M - split);
}

// dense_panels for tall_runs: x packed (pack_tiles), one panel at a time, the next one asked for meanwhile.
template <typename X>
void exact_tall_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1) {
  const int64_t N = w.N, K = w.K;
  TORCH_CHECK(in.direct == nullptr && !in.int8, "tall tiles read x packed");
  float c[24 * NR];
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* next = exact_q_of(w, std::min(p + 1, p1 - 1));
    for_each_tall_tile(in.M, [&](int64_t i, int64_t rows) {
      exact_tall(rows, in.xp.data() + i * K, K, exact_q_of(w, p), exact_sm_of(w, p), next, w.exact_group, c);
      store_tile(c, rows, std::min(NR, N - p * NR), w.bias, p * NR, y + i * N + p * NR, N);
    });
  }
}
// Where panel p's bytes start (exact: its int4 panel, K * 8 bytes).
inline const char* panel_bytes(const PackedWeight& w, int64_t p, bool exact, int64_t elem) {
  return exact ? reinterpret_cast<const char*>(exact_q_of(w, p))
               : static_cast<const char*>(w.w) + p * w.K * NR * elem;
}

// dense_panels over groups of PZ panels in zmm tiles: fp32 panels as they are, bf16 ones widened (PZ at a time).
template <typename X, typename W>
void dense_panels_zmm(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1,
                      std::vector<float>& wbuf) {
  const int64_t M = in.M, N = w.N, K = w.K;
  // fp32 panels with an exact int4 form are widened from it at decode rows (cpu_exact_int4.cpp): same values
  const bool exact = std::is_same_v<W, float> && runs_exact_int4(w, M);
  if (std::is_same_v<W, float> && tall_runs(w, M)) return exact_tall_panels(w, in, y, p0, p1);
  // One tile of rows: each weight widened in registers and used at once (exact_tile); more: widened once into wbuf.
  const bool fused = exact && M <= FUSED_ROWS;
  const bool widen = !std::is_same_v<W, float> || (exact && !fused);
  const int64_t pb = exact ? K * 8 : K * NR * int64_t(sizeof(W));  // bytes a panel
  const W* packed = static_cast<const W*>(w.w);
  if (widen && int64_t(wbuf.size()) < PZ * K * NR) wbuf.resize(PZ * K * NR);
  const float* a = in.direct ? in.direct : in.xp.data();  // row i at a + i * K either way
  float c[PZ * MR * NR];
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC);
    for (int64_t p = p0; p < p1; p += PZ) {
      const int64_t np = std::min(PZ, p1 - p);
      const float* b = reinterpret_cast<const float*>(packed + p * K * NR);
      if (widen) {
        for (int64_t q = 0; q < np; ++q) {
          if constexpr (std::is_same_v<W, float>)
            widen_exact_int4(w, p + q, wbuf.data() + q * K * NR);
          else
            widen_panel(packed + (p + q) * K * NR, K, wbuf.data() + q * K * NR);
        }
        b = wbuf.data();
      }
      // The next group's panels (contiguous after this one's) are asked for while this one computes, spread over
      // its row tiles: from memory they would stall the first tile at a memory latency per page.
      const char* next = panel_bytes(w, p + np, exact, sizeof(W));
      const int64_t next_lines = std::min(PZ, p1 - p - np) * pb / 64;
      const int64_t tiles = (m1 - m0 + MR - 1) / MR;
      const zmm::PrefetchSpread pf(next_lines, tiles * K);
      for (int64_t i = m0, t = 0; i < m1; i += MR, ++t) {
        const int64_t rows = std::min(MR, m1 - i);
        const int64_t first = t * pf.per_tile(K);
        if (fused)
          exact_tile(rows, np, a + i * K, in.direct ? 1 : rows, in.direct ? K : 1,
                     exact_panels(w, {p, p + 1, p + 2, p + 3}, PZ), K, w.exact_group, c);
        else
          tile_zmm(rows, np, a + i * K, in.direct ? 1 : rows, in.direct ? K : 1, b, K * NR, 2 * K * NR, K, c,
                   next + first * 64, first < next_lines ? pf.n : 0, pf.every);
        for (int64_t q = 0; q < np; ++q) {
          const int64_t n0 = (p + q) * NR;
          store_tile(c + q * MR * NR, rows, std::min(NR, N - n0), w.bias, n0, y + i * N + n0, N);
        }
      }
    }
  }
}
#endif

// Whether fp32 x is read where it lies (row stride K), not packed into row tiles: by the zmm tiles (but the tall exact
// int4 ones) and by the AVX2 tiles of dense fp32 / bf16 panels (packing a 2048-row prompt's x was ~2% of its step on
// an AVX2 Zen 3, in a parallel region of its own).
inline bool reads_x_in_place(const PackedWeight& w, int64_t M) {
#ifdef PC_AVX512
  return zmm_tiles_run(w, M) && !tall_runs(w, M);
#else
  (void)M;
  return !w.vnni && (w.type == at::kFloat || w.type == at::kBFloat16);
#endif
}

#ifdef PC_AVX512
// silu_mul_panels_zmm for tall_runs: gate panel p's tile, then up's, then their product (exact_tall_panels).
template <typename X>
void exact_tall_silu(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1) {
  const int64_t I = w.N / 2, half = I / NR, K = w.K, G = w.exact_group;
  TORCH_CHECK(in.direct == nullptr && !in.int8, "tall tiles read x packed");
  float g[24 * NR], u[24 * NR];
  for (int64_t p = p0; p < p1; ++p) {
    for_each_tall_tile(in.M, [&](int64_t i, int64_t rows) {
      const float* a = in.xp.data() + i * K;
      exact_tall(rows, a, K, exact_q_of(w, p), exact_sm_of(w, p), exact_q_of(w, half + p), G, g);
      exact_tall(rows, a, K, exact_q_of(w, half + p), exact_sm_of(w, half + p), exact_q_of(w, std::min(p + 1, p1 - 1)),
                 G, u);
      zmm::store_silu_mul(g, u, rows, w.bias, p * NR, (half + p) * NR, y + i * I + p * NR, I);
    });
  }
}

// y[M, I] = silu(x Wg^T + bg) * (x Wu^T + bu) for w = [gate; up] (N = 2 I, I % 16 == 0), gate panels [p0, p1):
// gate panels p, p + 1 and up's p, p + 1 share one tile, so the [M, 2 I] product is neither written nor read back
// by a silu pass (which ran ~5% of a prompt's step, scalar exp).
template <typename X, typename W>
void silu_mul_panels_zmm(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1,
                         std::vector<float>& wbuf) {
  const int64_t M = in.M, I = w.N / 2, K = w.K, half = I / NR, ps = K * NR;
  const bool exact = std::is_same_v<W, float> && runs_exact_int4(w, M);  // as in dense_panels_zmm
  if (std::is_same_v<W, float> && tall_runs(w, M)) return exact_tall_silu(w, in, y, p0, p1);
  const bool fused = exact && M <= FUSED_ROWS;
  const bool widen = !std::is_same_v<W, float> || (exact && !fused);
  const int64_t pb = exact ? K * 8 : ps * int64_t(sizeof(W));
  const W* packed = static_cast<const W*>(w.w);
  if (widen && int64_t(wbuf.size()) < PZ * ps) wbuf.resize(PZ * ps);
  const float* a = in.direct ? in.direct : in.xp.data();
  float c[PZ * MR * NR];
  auto widen_one = [&](int64_t panel, float* dst) {
    if constexpr (std::is_same_v<W, float>)
      widen_exact_int4(w, panel, dst);
    else
      widen_panel(packed + panel * ps, K, dst);
  };
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC);
    for (int64_t p = p0; p < p1; p += 2) {
      const int64_t pairs = std::min<int64_t>(2, p1 - p);
      const float* b = reinterpret_cast<const float*>(packed + p * ps);
      int64_t hs = half * ps;
      if (widen) {
        for (int64_t q = 0; q < pairs; ++q) {
          widen_one(p + q, wbuf.data() + q * ps);
          widen_one(half + p + q, wbuf.data() + (pairs + q) * ps);
        }
        b = wbuf.data();
        hs = pairs * ps;
      }
      // The next pairs' gate panels, then their up panels, asked for over this one's row tiles (dense_panels_zmm).
      const int64_t next_pairs = std::min<int64_t>(2, p1 - p - pairs);
      const int64_t side = next_pairs * pb / 64, next_lines = 2 * side;
      const char* gate_next = panel_bytes(w, p + pairs, exact, sizeof(W));
      const char* up_next = panel_bytes(w, half + p + pairs, exact, sizeof(W));
      const int64_t tiles = (m1 - m0 + MR - 1) / MR;
      const zmm::PrefetchSpread spread(next_lines, tiles * K);
      for (int64_t i = m0, t = 0; i < m1; i += MR, ++t) {
        const int64_t rows = std::min(MR, m1 - i);
        const int64_t first = t * spread.per_tile(K);
        const char* pf = first < side ? gate_next + first * 64 : up_next + (first - side) * 64;
        // One pair: gate and up as panels 0 and 1 (panel 1 at b + ps there).
        if (fused)
          exact_tile(rows, 2 * pairs, a + i * K, in.direct ? 1 : rows, in.direct ? K : 1,
                     pairs == 2 ? exact_panels(w, {p, p + 1, half + p, half + p + 1}, 2)
                                : exact_panels(w, {p, half + p}, 2),
                     K, w.exact_group, c);
        else
          tile_zmm(rows, 2 * pairs, a + i * K, in.direct ? 1 : rows, in.direct ? K : 1, b, pairs == 2 ? ps : hs, hs,
                   K, c, pf, first < next_lines ? spread.n : 0, spread.every);
        for (int64_t q = 0; q < pairs; ++q)
          zmm::store_silu_mul(c + q * MR * NR, c + (pairs + q) * MR * NR, rows, w.bias, (p + q) * NR,
                              (half + p + q) * NR, y + i * I + (p + q) * NR, I);
      }
    }
  }
}
#endif

// side: lines to ask for over the tiles (the decode stack's next K/V rows; the zmm tiles take none).
template <typename X, typename W>
void dense_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1, std::vector<float>& wbuf,
                  LineStream* side) {
  const int64_t M = in.M, N = w.N, K = w.K;
  const W* packed = static_cast<const W*>(w.w);
  const bool widen = M > WIDEN_ROWS;
#ifdef PC_AVX512
  if (std::is_same_v<W, float> || widen) return dense_panels_zmm<X, W>(w, in, y, p0, p1, wbuf);
#endif
  if (widen && int64_t(wbuf.size()) < K * NR) wbuf.resize(K * NR);
  if (side != nullptr) side->pace((p1 - p0) * ((M + MR - 1) / MR));
  const int64_t panel_lines = K * NR * int64_t(sizeof(W)) / 64;
  float c[MR * NR];
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC), tiles = (m1 - m0 + MR - 1) / MR;
    // The next panel spread over this one's row tiles (from 3 rows: the thin kernels ask for theirs PD rows ahead).
    const int64_t per_tile = M > 2 ? (panel_lines + tiles - 1) / tiles : 0;
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = packed + p * K * NR;
      const float* wide = widen ? widen_panel(panel, K, wbuf.data()) : nullptr;
      const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
      const char* next = reinterpret_cast<const char*>(panel + K * NR);
      for (int64_t i = m0, t = 0, rows; i < m1; i += rows, ++t) {
        rows = tile_rows(m1 - i, in.direct != nullptr);
        const Lines ahead{next + t * per_tile * 64, p + 1 < p1 ? std::clamp<int64_t>(panel_lines - t * per_tile, 0, per_tile) : 0};
        const auto [pf, pf_n] = side != nullptr ? side->take() : std::pair<const char*, int64_t>{nullptr, 0};
        const float* a = (in.direct ? in.direct : in.xp.data()) + i * K;  // row i here either way
        const int64_t ka = in.direct ? 1 : rows, ra = in.direct ? K : 1;
        if (wide)
          tile(rows, a, ka, ra, wide, K, c, ahead, {pf, pf_n});
        else
          tile(rows, a, ka, ra, panel, K, c, ahead, {pf, pf_n});
        store_tile(c, rows, ncols, w.bias, n0, y + i * N + n0, N);
      }
    }
  }
}

#if defined(PC_AVX2) && !defined(PC_AVX512)
// Rows of silu(g + bg) * (u + bu) for [rows, 16] tiles g and u into out (row stride ldo): the tile's products rounded
// to X where the unfused path stores them (store_tile), then silu_and_mul_row (layer_rows.h) over the whole tile in
// one call, so every value is the unfused silu_and_mul's bit for bit (an exp of our own moved greedy runs under int8
// KV and recompute preemption off their near-ties: the two paths must not differ).
template <typename X>
void store_silu_mul_rows(const float* g, const float* u, int64_t rows, const float* bias, int64_t ng, int64_t nu,
                         X* out, int64_t ldo) {
  alignas(32) X gx[MR * NR], ux[MR * NR], o[MR * NR];
  const X* gp = reinterpret_cast<const X*>(g);
  const X* up = reinterpret_cast<const X*>(u);
  if (!std::is_same_v<X, float> || bias != nullptr) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < NR; ++j) {
        gx[r * NR + j] = static_cast<X>(bias ? g[r * NR + j] + bias[ng + j] : g[r * NR + j]);
        ux[r * NR + j] = static_cast<X>(bias ? u[r * NR + j] + bias[nu + j] : u[r * NR + j]);
      }
    gp = gx, up = ux;
  }
  silu_and_mul_row(gp, up, o, rows * NR);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * ldo, o + r * NR, NR * sizeof(X));
}

// y[M, I] = silu(x Wg^T + bg) * (x Wu^T + bu) for w = [gate; up] on AVX2, gate panels [p0, p1): per row tile gate
// panel p's tile, then up's, then their product (store_silu_mul_rows), so the [M, 2 I] product is neither written
// nor read back by a silu pass (~2% of a 2048-token prompt step on an AVX2 Zen 3, and a parallel region of its own).
template <typename X, typename W>
void silu_mul_panels_ymm(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1,
                         std::vector<float>& wbuf, LineStream* side) {
  const int64_t M = in.M, I = w.N / 2, K = w.K, half = I / NR, ps = K * NR;
  const W* packed = static_cast<const W*>(w.w);
  const bool widen = M > WIDEN_ROWS && !std::is_same_v<W, float>;
  if (widen && int64_t(wbuf.size()) < 2 * ps) wbuf.resize(2 * ps);
  if (side != nullptr) side->pace(2 * (p1 - p0) * ((M + MR - 1) / MR));
  const int64_t panel_lines = ps * int64_t(sizeof(W)) / 64;
  const float* x = in.direct ? in.direct : in.xp.data();
  float cg[MR * NR], cu[MR * NR];
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC), tiles = (m1 - m0 + MR - 1) / MR;
    const int64_t per_tile = M > 2 ? (panel_lines + tiles - 1) / tiles : 0;  // dense_panels' next-panel spread
    for (int64_t p = p0; p < p1; ++p) {
      const W* gate = packed + p * ps;
      const W* up = packed + (half + p) * ps;
      const float* gate_wide = widen ? widen_panel(gate, K, wbuf.data()) : nullptr;
      const float* up_wide = widen ? widen_panel(up, K, wbuf.data() + ps) : nullptr;
      const bool more = p + 1 < p1;
      for (int64_t i = m0, t = 0, rows; i < m1; i += rows, ++t) {
        rows = tile_rows(m1 - i, in.direct != nullptr);
        const int64_t n = more ? std::clamp<int64_t>(panel_lines - t * per_tile, 0, per_tile) : 0;
        const float* a = x + i * K;
        const int64_t ka = in.direct ? 1 : rows, ra = in.direct ? K : 1;
        const Lines gate_next{reinterpret_cast<const char*>(gate + ps) + t * per_tile * 64, n};
        const Lines up_next{reinterpret_cast<const char*>(up + ps) + t * per_tile * 64, n};
        auto take = [&] { return side != nullptr ? side->take() : std::pair<const char*, int64_t>{nullptr, 0}; };
        const auto [pg, ng] = take();
        if (widen)
          tile(rows, a, ka, ra, gate_wide, K, cg, gate_next, {pg, ng});
        else
          tile(rows, a, ka, ra, gate, K, cg, gate_next, {pg, ng});
        const auto [pu, nu] = take();
        if (widen)
          tile(rows, a, ka, ra, up_wide, K, cu, up_next, {pu, nu});
        else
          tile(rows, a, ka, ra, up, K, cu, up_next, {pu, nu});
        store_silu_mul_rows(cg, cu, rows, w.bias, p * NR, (half + p) * NR, y + i * I + p * NR, I);
      }
    }
  }
}
#endif

template <typename X>
void fill_input(const PackedWeight& w, const X* x, GemmInput& in, int64_t t0, int64_t t1) {
  const int64_t K = w.K;
  if (!in.int8) return pack_tiles(x, in.M, K, t0, t1, in.xp.data());
  const int64_t G = w.group_size, blocks = K / QB, groups = K / G;  // tiles are rows here
  quantize_rows(x + t0 * K, t1 - t0, K, G, in.xq.data() + t0 * K, in.d.data() + t0 * blocks,
                in.xs.data() + t0 * groups);
}

template <typename X>
void panels_of(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1, std::vector<float>& wbuf,
               LineStream* side) {
  if (w.type == at::kFloat) return dense_panels<X, float>(w, in, y, p0, p1, wbuf, side);
  TORCH_CHECK(w.type == at::kBFloat16, "packed weight type");
  dense_panels<X, c10::BFloat16>(w, in, y, p0, p1, wbuf, side);
}

}  // namespace

// Whether fp32 x is read in place by the panels for M rows (gemm_input_resize; a prompt's rows split: run_by_rows).
bool gemm_reads_x_in_place(const PackedWeight& w, int64_t M) { return reads_x_in_place(w, M); }


void gemm_input_resize(const PackedWeight& w, int64_t M, GemmInput& in, const float* fp32_x,
                       const c10::BFloat16* bf16_x) {
  // `in` may be a kept one, last used by a call that read its x in place
  in.direct = nullptr;
  in.xb_rows = nullptr;
  in.amx = false;
  if (w.vnni) return vnni_input_resize(w, M, in, bf16_x);
  const int64_t K = w.K;
  in.M = M;
  in.direct = fp32_x != nullptr && reads_x_in_place(w, M) ? fp32_x : nullptr;
  if (in.direct) {
    in.int8 = false;
    return;
  }
  in.int8 = (w.type == at::kByte || w.type == at::kChar) && M <= w.int8_rows && w.group_size % QB == 0;
  if (in.int8) {
    in.xq.resize(M * K);
    in.d.resize(M * (K / QB));
    in.xs.resize(M * (K / w.group_size));
  } else {
    in.xp.resize(M * K);
  }
}

int64_t gemm_input_tiles(const GemmInput& in) { return in.int8 ? in.M : (in.M + MR - 1) / MR; }

void gemm_input_fill(const PackedWeight& w, at::ScalarType x_type, const void* x, GemmInput& in, int64_t t0,
                     int64_t t1) {
  if (in.direct) return;
  if (w.vnni) return vnni_input_fill(w, x_type, x, in, t0 * MR, t1 * MR);
  if (x_type == at::kFloat) return fill_input(w, static_cast<const float*>(x), in, t0, t1);
  TORCH_CHECK(x_type == at::kBFloat16, "x: float32 or bfloat16");
  fill_input(w, static_cast<const c10::BFloat16*>(x), in, t0, t1);
}

void gemm_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0, int64_t p1,
                 std::vector<float>& wbuf, LineStream* side) {
  if (w.vnni) return vnni_panels(w, in, x_type, y, p0, p1, side);
  if (w.type == at::kByte) return int4_gemm_panels(w, in, x_type, y, p0, p1, wbuf);
  if (w.type == at::kChar) return int8_gemm_panels(w, in, x_type, y, p0, p1, wbuf);
  if (x_type == at::kFloat) return panels_of(w, in, static_cast<float*>(y), p0, p1, wbuf, side);
  TORCH_CHECK(x_type == at::kBFloat16, "x: float32 or bfloat16");
  panels_of(w, in, static_cast<c10::BFloat16*>(y), p0, p1, wbuf, side);
}

bool silu_mul_runs(const PackedWeight& w, int64_t M) {
#if defined(PC_AVX2) && !defined(PC_AVX512)
  const bool ymm = !w.vnni && (w.type == at::kFloat || w.type == at::kBFloat16);  // silu_mul_panels_ymm
#else
  const bool ymm = false;
#endif
  return (zmm_tiles_run(w, M) || ymm || (w.vnni && vnni_silu_mul_runs())) && w.N % (2 * NR) == 0;
}

int64_t silu_mul_chunks(const PackedWeight& w) { return (w.N / (2 * NR) + 1) / 2; }

void silu_mul_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t c0,
                     int64_t c1, std::vector<float>& wbuf, LineStream* side) {
#ifdef PC_AVX512
  const int64_t p0 = 2 * c0, p1 = std::min(w.N / (2 * NR), 2 * c1);
  if (p0 >= p1) return;
  if (w.vnni) return vnni_silu_mul_panels(w, in, x_type, y, p0, p1, side);
  TORCH_CHECK(x_type == at::kFloat || x_type == at::kBFloat16, "x: float32 or bfloat16");
  if (x_type == at::kFloat) {
    if (w.type == at::kFloat) return silu_mul_panels_zmm<float, float>(w, in, static_cast<float*>(y), p0, p1, wbuf);
    return silu_mul_panels_zmm<float, c10::BFloat16>(w, in, static_cast<float*>(y), p0, p1, wbuf);
  }
  auto* yb = static_cast<c10::BFloat16*>(y);
  if (w.type == at::kFloat) return silu_mul_panels_zmm<c10::BFloat16, float>(w, in, yb, p0, p1, wbuf);
  silu_mul_panels_zmm<c10::BFloat16, c10::BFloat16>(w, in, yb, p0, p1, wbuf);
#elif defined(PC_AVX2)
  const int64_t p0 = 2 * c0, p1 = std::min(w.N / (2 * NR), 2 * c1);
  if (p0 >= p1) return;
  TORCH_CHECK(x_type == at::kFloat || x_type == at::kBFloat16, "x: float32 or bfloat16");
  if (x_type == at::kFloat) {
    auto* yf = static_cast<float*>(y);
    if (w.type == at::kFloat) return silu_mul_panels_ymm<float, float>(w, in, yf, p0, p1, wbuf, side);
    return silu_mul_panels_ymm<float, c10::BFloat16>(w, in, yf, p0, p1, wbuf, side);
  }
  auto* yb = static_cast<c10::BFloat16*>(y);
  if (w.type == at::kFloat) return silu_mul_panels_ymm<c10::BFloat16, float>(w, in, yb, p0, p1, wbuf, side);
  silu_mul_panels_ymm<c10::BFloat16, c10::BFloat16>(w, in, yb, p0, p1, wbuf, side);
#else
  TORCH_CHECK(false, "silu_mul_panels: AVX-512 or AVX2 only (silu_mul_runs)");
#endif
}

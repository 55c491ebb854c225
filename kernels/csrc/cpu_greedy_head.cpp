// Greedy decoding's LM head without every logit: the argmax of x W^T exactly as the fp32 panels
// (packed_linear) would give it, from int8 weights and a few exact columns.
//
// Why: a greedy row needs only the argmax, yet the LM head is the largest linear of a small model (the bundled
// SmolLM2: 49152 x 576, 113 MB of fp32, ~11 ms of a 64-row decode step, ~4.5 ms of a one-row step). Here:
//   1. approx: x as int16 codes (t = max|x| / 16383), W as int8 codes per vocab row (s_j = max|w_j| / 127),
//      a_j ~ s_j t sum_k q_jk xq_k with AVX-512 VNNI (vpdpwssd: 32 int16 products per instruction, twice the
//      fp32 FMA rate, a quarter of the bytes);
//   2. a bound E_j on |logit_j - a_j| that holds for every input (no statistics): the weights' rounding
//      max_k |w_jk - s_j q_jk| times |x|_1, the activations' (t / 2 plus fp32 rounding) times sum_k |s_j q_jk|,
//      the fp32 panels' own rounding (gamma_K sum_k |w_jk| max|x|) and the fp32 ops of step 1 (1e-6 |a_j|), all
//      taken 1% larger;
//   3. L = max_j (a_j - E_j) is below the largest logit, so every j with a_j + E_j < L loses to it; the rest
//      (the candidates: ~20 a row on the bundled model's final hidden states, at most ~130 seen) get their logit
//      as the fp32 panels would, the same FMA chain over k the GEMM tile runs (bit for bit), read from the
//      weight's rows; the largest wins, the lowest index on ties (argmax_logsumexp's rule).
// A row whose x or candidate logits are not finite returns -1: the caller computes its logits the usual way.
// AVX2 CPUs without AVX-512 run the fp32 head's port (cpu_greedy_head_avx2.cpp), the same codes and bounds.
// bf16 heads in the VNNI pair layout, where the AVX512-BF16 tiles run them (no AMX: vnni_silu_mul_runs), take the
// same three steps at twice the rate: x as uint8 codes (t = max|x| / 127, stored + 128) against the int8 codes of
// W with vpdpbusd (64 products per instruction; the + 128 taken back through each column's sum of codes), except
// x's largest dims (greedy_head.py's OUTLIER_DIMS), whose part of a_j is summed in fp32 from their bf16 weights two dims
// a vdpbf16ps; the same
// bounds (with the coarser x codes' error and that sum's rounding); candidates widened to any logit that could round
// to the same bf16 as the largest (2 bf16 ulps below L); their logits from the dp tile's chain (vdpbf16ps over the
// pairs in order, from +0), rounded to bf16 as the GEMM stores them. Bundled model, bf16, 64 decode rows of the bench's
// random prompts (~190 candidates a row): ~7.5 ms where the logits took ~9.6 and their argmax ~1.6; one row 0.9 / 1.7.
// The candidates are those whose bound E (~2 logits wide there) cannot rule out: with 16 outlier dims ~410 a row at 64
// rows, with 32 ~140, their exact logits ~1.3 -> ~0.45 ms (Zen 4); two dims a vdpbf16ps keep 32 dims at 16's cost.
#include "greedy_head_codes.h"
#include "ops.h"
#include "zmm_tile.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#ifdef PC_GREEDY_HEAD
#include <immintrin.h>
#endif

using namespace greedy_codes;

namespace {
#ifdef PC_GREEDY_HEAD
constexpr int64_t GR = 6;  // rows per tile
constexpr int64_t GP = 4;  // panels per tile: GR x GP int32 accumulators

// acc[r][p] = sum over the steps of panel p's codes (at w + p * ps) times row r's word (xw[r * steps + i]): int16 x
// pairs against int8 codes widened to int16 (vpdpwssd, 32 bytes of codes a step), or (U8) uint8 x quads against
// int8 codes (vpdpbusd, 64 bytes a step; the bf16 head's).
// The next panel group's codes asked for while a tile runs: n lines every `every` steps from p (zmm::PrefetchSpread),
// as the GEMM tiles ask for their next panels. Bundled model's bf16 head (28 MB of codes), Zen 4, 2 threads, codes from
// memory, two builds alternating (/tmp/t/gh_ab.py): 1 row 1.44-1.47 -> 1.27-1.29 ms, 8 rows 1.99-2.19 -> 1.55-1.94,
// 64 rows 7.06-8.31 -> 6.88-7.82; tokens identical.
struct Ahead {
  const char* p = nullptr;
  int64_t n = 0, every = 1;
};

template <bool U8, int R, int P>
__attribute__((noinline)) void approx_tile(const int32_t* xw, int64_t steps, const int8_t* w, int64_t ps, __m512i* out,
                                           Ahead ahead) {
  __m512i acc[R][P];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_si512();
  for (int64_t i = 0, due = ahead.n > 0 ? ahead.every : steps + 1; i < steps; ++i) {
    if (--due == 0) {
      for (int64_t l = 0; l < ahead.n; ++l) _mm_prefetch(ahead.p + l * 64, _MM_HINT_T1);
      ahead.p += ahead.n * 64;
      due = ahead.every;
    }
    __m512i wv[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      if constexpr (U8)
        wv[p] = _mm512_loadu_si512(w + p * ps + i * 64);
      else
        wv[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * ps + i * 32)));
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(xw[r * steps + i]);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
#ifdef PC_GREEDY_HEAD_BF16
        if constexpr (U8) {
          acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], xv, wv[p]);
          continue;
        }
#endif
        acc[r][p] = _mm512_dpwssd_epi32(acc[r][p], xv, wv[p]);
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) out[r * GP + p] = acc[r][p];
}

template <bool U8, int R>
void approx_rows(int64_t np, const int32_t* xw, int64_t steps, const int8_t* w, int64_t ps, __m512i* out, Ahead a) {
  switch (np) {
    case 1: return approx_tile<U8, R, 1>(xw, steps, w, ps, out, a);
    case 2: return approx_tile<U8, R, 2>(xw, steps, w, ps, out, a);
    case 3: return approx_tile<U8, R, 3>(xw, steps, w, ps, out, a);
    default: return approx_tile<U8, R, 4>(xw, steps, w, ps, out, a);
  }
}

template <bool U8>
void approx(int64_t rows, int64_t np, const int32_t* xw, int64_t steps, const int8_t* w, int64_t ps, __m512i* out,
            Ahead a) {
  switch (rows) {
    case 1: return approx_rows<U8, 1>(np, xw, steps, w, ps, out, a);
    case 2: return approx_rows<U8, 2>(np, xw, steps, w, ps, out, a);
    case 3: return approx_rows<U8, 3>(np, xw, steps, w, ps, out, a);
    case 4: return approx_rows<U8, 4>(np, xw, steps, w, ps, out, a);
    case 5: return approx_rows<U8, 5>(np, xw, steps, w, ps, out, a);
    default: return approx_rows<U8, 6>(np, xw, steps, w, ps, out, a);
  }
}

// The exact logits of up to 16 columns cols[0, n) for one row: per lane the fp32 tile's chain
// z = fma(x_k, w_k, z) from z = +0 over k in order (zmm_tile.h), w_k gathered from the weight's rows [V, K]
// (the same values as its panels: a column's k steps then lie in K * 4 / 64 lines, not K of them).
__m512 exact16(const float* x, int64_t K, const float* rows, const int32_t* cols, int64_t n) {
  alignas(64) int32_t base[NR];
  for (int64_t i = 0; i < NR; ++i) base[i] = int32_t(cols[std::min<int64_t>(i, n - 1)] * K);
  __m512i idx = _mm512_load_si512(base);
  const __m512i one = _mm512_set1_epi32(1);
  __m512 z = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    z = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), _mm512_i32gather_ps(idx, rows, 4), z);
    idx = _mm512_add_epi32(idx, one);
  }
  return z;
}

#ifdef PC_GREEDY_HEAD_BF16
// The exact logits of up to 16 columns cols[0, n) for one bf16 row, as the dp tile (cpu_gemm_vnni.cpp) computes and
// stores them: per column z = vdpbf16ps(z, x's pair, the column's pair) over the pairs in order from +0, then rounded
// to bf16: vcvtneps2bf16 for columns of whole panels, as c10::BFloat16 does for the last, partial one. Each column's
// chain runs in lane 0 of its own xmm register (16 chains side by side, the pairs broadcast from the head's rows
// [V, K], where a column's pairs lie in K * 2 / 64 lines: in the VNNI panels, in K / 2 lines of 64 bytes, ~190
// candidates a row read ~200 MB at 64 rows); gathering 16 columns' pairs into one zmm instead cost ~37 cycles a pair.
void exact16_bf16(const c10::BFloat16* x, int64_t K, const c10::BFloat16* rows, int64_t V, const int32_t* cols,
                  int64_t n, float* out) {
  const int64_t K2 = K / 2, whole = V / NR * NR;
  const int32_t* r[NR];
  for (int64_t i = 0; i < NR; ++i) r[i] = reinterpret_cast<const int32_t*>(rows + cols[std::min<int64_t>(i, n - 1)] * K);
  __m128 z[NR];
#pragma GCC unroll 16
  for (int i = 0; i < NR; ++i) z[i] = _mm_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    int32_t xp;
    std::memcpy(&xp, x + 2 * kp, 4);
    const __m128bh xv = (__m128bh)_mm_set1_epi32(xp);
#pragma GCC unroll 16
    for (int i = 0; i < NR; ++i) z[i] = _mm_dpbf16_ps(z[i], xv, (__m128bh)_mm_set1_epi32(r[i][kp]));
  }
  alignas(64) float lane0[NR];
#pragma GCC unroll 16
  for (int i = 0; i < NR; ++i) lane0[i] = _mm_cvtss_f32(z[i]);
  const __m512 zz = _mm512_load_ps(lane0);
  alignas(64) float v[NR];
  alignas(32) uint16_t b[NR];
  _mm512_store_ps(v, zz);
  _mm256_store_si256(reinterpret_cast<__m256i*>(b), (__m256i)_mm512_cvtneps_pbh(zz));
  for (int64_t i = 0; i < n; ++i) {
    if (!finite_bits(v[i])) {
      out[i] = v[i];  // not finite: the caller gives up on the row
      continue;
    }
    const uint32_t u = uint32_t(cols[i] < whole ? b[i] : c10::BFloat16(v[i]).x) << 16;
    std::memcpy(&out[i], &u, 4);
  }
}
#endif

// 16 fp32 -> bf16 bits, nearest even (the hi buffer's rounding: its input is raised first to make it an upper bound).
inline __m256i bf16_bits(__m512 v) {
#ifdef PC_GREEDY_HEAD_BF16
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
#endif
}

using zmm::tile_start;

inline float bf16_to_float_bits(__m256i b) {
  return _mm512_cvtss_f32(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
}

// What a row tile's bounds read and write (pass 1 of argmax_rows).
struct BoundsTile {
  const RowCodes& rc;
  int64_t V;
  const float* st;
  const int32_t* colsum;
  const c10::BFloat16* wo;
  int64_t no2;
  const float* ob;
  float gamma;
  __m512* low;  // this thread's per-row max of a_j - E_j
  uint16_t* hb;  // [groups][B][GP * 16]: a group's rows side by side, written in one sequential run
  int64_t B;
  float* top;  // [groups][B]: the largest of a group's bf16 a_j + E_j per row (+inf where one is NaN)
};

// R rows x np panels of one tile (its int32 sums in acc[r * GP + q]): each token's a_j and E_j, the row's largest
// a_j - E_j, a_j + E_j rounded up to bf16 into hb, and the largest of those per row and group into top. The outlier
// dims' parts are an R x GP register tile of their own (per column the same vdpbf16ps chain over the pairs in order
// from +0, as a loop per panel over a run-time row count kept them, on the stack).
template <bool BF16, int R>
__attribute__((noinline)) void bounds_tile(const __m512i* acc, int64_t np, int64_t r0, int64_t p, const BoundsTile& b) {
  const RowCodes& rc = b.rc;
  __m512 part[R][GP];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < GP; ++q) part[r][q] = _mm512_setzero_ps();
#ifdef PC_GREEDY_HEAD_BF16
  for (int64_t i = 0; i < b.no2; ++i) {  // the outlier dims, two a step
    __m512bh wv[GP];
#pragma GCC unroll 4
    for (int q = 0; q < GP; ++q)
      if (q < np) wv[q] = (__m512bh)_mm512_loadu_si512(b.wo + ((p + q) * b.no2 + i) * 2 * NR);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(rc.xo[(r0 + r) * b.no2 + i]);
#pragma GCC unroll 4
      for (int q = 0; q < GP; ++q)
        if (q < np) part[r][q] = _mm512_dpbf16_ps(part[r][q], xv, wv[q]);
    }
  }
#endif
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t V = b.V;
  const float* st = b.st;
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const __m512 t = _mm512_set1_ps(rc.t[row]), x1 = _mm512_set1_ps(rc.x1[row]), ob = _mm512_set1_ps(b.ob[row]);
    const __m512 xerr = _mm512_set1_ps(rc.xerr[row]), gx = _mm512_set1_ps(b.gamma * rc.xinf[row]);
    __m512 low = b.low[row], top = ninf;
    __mmask16 nan = 0;
#pragma GCC unroll 4
    for (int q = 0; q < GP; ++q) {
      if (q >= np) break;
      const int64_t j = (p + q) * NR;
      const __mmask16 in = V - j >= NR ? __mmask16(0xFFFF) : __mmask16((1u << (V - j)) - 1);
      const __m512 s = _mm512_maskz_loadu_ps(in, st + SCALE * V + j);
      const __m512i shift = BF16 ? _mm512_slli_epi32(_mm512_maskz_loadu_epi32(in, b.colsum + j), 7) : _mm512_setzero_si512();
      const __m512i dot = _mm512_sub_epi32(acc[r * GP + q], shift);  // exact: |dot| < 2^24
      const __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), s), t, part[r][q]);
      __m512 e = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, st + WERR * V + j), x1);
      e = _mm512_fmadd_ps(s, ob, e);
      e = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, st + L1 * V + j), xerr, e);
      e = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, st + W1 * V + j), gx, e);
      e = _mm512_fmadd_ps(_mm512_abs_ps(a), _mm512_set1_ps(1e-6f), e);
      e = _mm512_fmadd_ps(e, _mm512_set1_ps(1.01f), _mm512_set1_ps(1e-6f));
      const __m512 hi = _mm512_add_ps(a, e);
      low = _mm512_max_ps(low, _mm512_mask_blend_ps(in, ninf, _mm512_sub_ps(a, e)));
      // Rounded up: + 2^-6 |hi| (over a bf16 ulp, however the rounding goes) before the nearest-even bf16.
      const __m512 up = _mm512_add_ps(hi, _mm512_fmadd_ps(_mm512_abs_ps(hi), _mm512_set1_ps(1.f / 64), _mm512_set1_ps(1e-30f)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.hb + ((p / GP) * b.B + row) * GP * NR + q * NR), bf16_bits(up));
      top = _mm512_mask_max_ps(top, in, top, up);
      nan |= _mm512_mask_cmp_ps_mask(in, up, up, _CMP_UNORD_Q);
    }
    b.low[row] = low;
    // Rounding is monotonic: the bf16 of the largest up is the largest of the bf16s stored above.
    const float t_top = _mm512_reduce_max_ps(top);
    b.top[(p / GP) * b.B + row] = nan ? std::numeric_limits<float>::infinity() : bf16_to_float_bits(bf16_bits(_mm512_set1_ps(t_top)));
  }
}

template <bool BF16>
void bounds(int64_t rows, const __m512i* acc, int64_t np, int64_t r0, int64_t p, const BoundsTile& b) {
  switch (rows) {
    case 1: return bounds_tile<BF16, 1>(acc, np, r0, p, b);
    case 2: return bounds_tile<BF16, 2>(acc, np, r0, p, b);
    case 3: return bounds_tile<BF16, 3>(acc, np, r0, p, b);
    case 4: return bounds_tile<BF16, 4>(acc, np, r0, p, b);
    case 5: return bounds_tile<BF16, 5>(acc, np, r0, p, b);
    default: return bounds_tile<BF16, 6>(acc, np, r0, p, b);
  }
}

// Both passes for rows of codes rc against the head's codes (pc, ps bytes a panel) and stats; colsum: the bf16
// head's column sums of codes (the uint8 codes' + 128 taken back). exact(r, cols, n, out): the exact logits of
// candidates cols[0, n) of row r, as the GEMM would store them.
template <bool BF16, typename Exact>
void argmax_rows(const RowCodes& rc, int64_t B, int64_t K, int64_t V, int64_t P, const int8_t* pc, int64_t ps,
                 const float* st, const int32_t* colsum, const c10::BFloat16* wo, Exact exact, int64_t* ptok,
                 int32_t* pcnt) {
  // The outlier dims' part of a_j in fp32 from their bf16 weights in pairs (wo: [P][no2][16 x 2], x's pairs rc.xo):
  // vdpbf16ps, its products exact, at most |O| roundings in all plus the one that adds it to a_j, each by at most u
  // times the sum of |w_jk x_k| over O <= 127 s_j |x_O|_1; taken twice (however the instruction rounds its pair) and
  // 1% over. (Denormals it flushes move a sum by < 2^-126 |x|: inside E's absolute 1e-6.)
  const int64_t no = int64_t(rc.dims.size()), no2 = (no + 1) / 2;
  std::vector<float> ob(B);
  for (int64_t r = 0; r < B; ++r) ob[r] = float(2.02 * (no + 1) * UNIT * 127.0 * rc.xo1[r]);
  // Pass 1, panels split over the threads (all rows per panel group): per row, the max of a_j - E_j (per thread), and
  // a_j + E_j of every token as a bf16 rounded up (hb [P / 4][B][64]: 6 MB at 64 rows, each group's rows in one
  // sequential run). Keeping only the tokens whose a_j + E_j reached the running max, as this once did, cost ~4 ms of
  // branches and list growth at 64 rows of the bench's flat distributions (random prompts: ~3000 of 49152 kept a row
  // on the way up).
  const float gamma = float(1.01 * (K + 2) * UNIT / (1 - (K + 2) * UNIT));
  const int nth = std::max<int>(1, std::min<int>(at::get_num_threads(), int((P + GP - 1) / GP)));
  const float ninf_s = -std::numeric_limits<float>::infinity();
  const int64_t VP = P * NR;
  std::vector<__m512> lower(nth * B, _mm512_set1_ps(ninf_s));
  // Kept across calls: a fresh 6 MB buffer is fresh pages each call (glibc maps it), ~2 ms of page faults here.
  const int64_t groups = (P + GP - 1) / GP;
  static thread_local std::vector<uint16_t> hib;
  if (hib.size() < size_t(groups * B * GP * NR)) hib.resize(groups * B * GP * NR);  // whole groups: the last may be short
  uint16_t* const hb = hib.data();  // (the workers' own thread_local would be empty)
  static thread_local std::vector<float> topb;
  if (topb.size() < size_t(groups * B)) topb.resize(groups * B);
  float* const tops = topb.data();
#pragma omp parallel num_threads(nth)
  {
    alignas(64) __m512i acc[GR * GP];
    BoundsTile bt{rc, V, st, colsum, wo, no2, ob.data(), gamma, nullptr, hb, B, tops};
    const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t g0 = groups * tid / n, g1 = groups * (tid + 1) / n;
    bt.low = lower.data() + tid * B;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * GP, np = std::min(GP, P - p);
      // The thread's next group, spread over this group's row tiles.
      const int64_t ahead = g + 1 < g1 ? std::min(GP, P - p - np) * ps / 64 : 0, tiles = (B + GR - 1) / GR;
      const zmm::PrefetchSpread spread(ahead, tiles * rc.per_row);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = tile_start(B, tiles, t), rows = tile_start(B, tiles, t + 1) - r0;
        const int32_t* xw = rc.words.data() + r0 * rc.per_row;
        const Ahead a{reinterpret_cast<const char*>(pc + (p + np) * ps) + t * spread.per_tile(rc.per_row) * 64, spread.n,
                      spread.every};
        approx<BF16>(rows, np, xw, rc.per_row, pc + p * ps, ps, acc, a);
        bounds<BF16>(rows, acc, np, r0, p, bt);
      }
    }
#pragma omp barrier
  // Pass 2, per row, in the same parallel region: the candidates (tokens whose a_j + E_j reaches the edge of the
  // largest lower bound) in index order, their exact logits, the argmax (the lowest index on ties). Only groups whose
  // top reaches the edge are read (all 6 MB of hb were, ~0.5 ms of a 64-row call; Zen 4, /tmp/t40/hg.cpp).
  {
    const int64_t b0 = B * tid / n, b1 = B * (tid + 1) / n;
    static thread_local std::vector<int32_t> cand;
    if (cand.size() < size_t(VP + NR)) cand.resize(VP + NR);  // + a whole vector's slack
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t r = b0; r < b1; ++r) {
      if (!rc.ok[r]) continue;
      __m512 lv = lower[r];
      for (int i = 1; i < nth; ++i) lv = _mm512_max_ps(lv, lower[i * B + r]);
      const float L0 = edge<BF16>(_mm512_reduce_max_ps(lv));
      const __m512 L = _mm512_set1_ps(L0);
      int64_t count = 0;
      for (int64_t j = 0; j < V; j += NR) {
        if (j % (GP * NR) == 0 && !(tops[(j / (GP * NR)) * B + r] >= L0)) {  // no candidate in this group
          j += (GP - 1) * NR;
          continue;
        }
        const __mmask16 in = V - j >= NR ? __mmask16(0xFFFF) : __mmask16((1u << (V - j)) - 1);
        const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hb + ((j / (GP * NR)) * B + r) * GP * NR + j % (GP * NR))));
        const __mmask16 m = _mm512_mask_cmp_ps_mask(in, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)), L, _CMP_GE_OQ);
        if (m) {  // rare: compress in a register (vpcompressd to memory is ~140 cycles on Zen 4)
          _mm512_storeu_si512(cand.data() + count, _mm512_maskz_compress_epi32(m, _mm512_add_epi32(lanes, _mm512_set1_epi32(int32_t(j)))));
          count += __builtin_popcount(m);
        }
      }
      pcnt[r] = int32_t(count);
      ptok[r] = first_largest(cand.data(), count, [&](const int32_t* cols, int64_t k, float* out) { exact(r, cols, k, out); });
    }
  }
  }
}
#endif
}  // namespace

bool greedy_head_supported() {
#if defined(PC_GREEDY_HEAD) || defined(PC_GREEDY_HEAD_AVX2)
  return true;
#else
  return false;
#endif
}

bool greedy_head_bf16_panels_supported() {
#ifdef PC_GREEDY_HEAD_AVX2
  return true;
#else
  return false;
#endif
}

bool greedy_head_bf16_supported() {
#ifdef PC_GREEDY_HEAD_BF16
  return !vnni_amx();  // AMX machines run the head on tiles whose sums this kernel does not reproduce
#else
  return false;
#endif
}

std::vector<torch::Tensor> greedy_head_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "greedy_head_pack: fp32 weight [V, K]");
  const auto w = weight.contiguous();
  const int64_t V = w.size(0), K = w.size(1), P = (V + NR - 1) / NR, K2 = (K + 1) / 2;
  TORCH_CHECK(K <= MAX_K, "greedy_head_pack: K > ", MAX_K, " could overflow the int32 sums");
  auto codes = torch::zeros({P, K2, 2 * NR}, w.options().dtype(at::kChar));
  auto stats = torch::empty({NSTATS, V}, w.options());
  const float* pw = w.data_ptr<float>();
  int8_t* pc = codes.data_ptr<int8_t>();
  float* ps = stats.data_ptr<float>();
  std::atomic<bool> all_finite{true};
  at::parallel_for(0, V, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const float* row = pw + j * K;
      int8_t* dst = pc + (j / NR) * K2 * 2 * NR + (j % NR) * 2;
      if (!pack_row([&](int64_t k) { return row[k]; }, [&](int64_t k, int8_t q) { dst[(k / 2) * 2 * NR + k % 2] = q; },
                    K, j, V, ps, nullptr))
        all_finite = false;
    }
  });
  TORCH_CHECK(all_finite, "greedy_head_pack: the weight is not finite");
  return {codes, stats};
}

std::vector<torch::Tensor> greedy_head_pack_bf16(torch::Tensor panels, int64_t V) {
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 && panels.size(2) == 2 * NR &&
                  panels.is_contiguous(),
              "greedy_head_pack_bf16: bf16 VNNI panels [P, K / 2, 32] (pack_linear_weight_vnni)");
  const int64_t P = panels.size(0), K2 = panels.size(1), K = 2 * K2, K4 = K / 4;
  TORCH_CHECK(V > 0 && V <= P * NR && K % 4 == 0, "greedy_head_pack_bf16: V within the panels, K a multiple of 4");
  TORCH_CHECK(K <= MAX_K, "greedy_head_pack_bf16: K > ", MAX_K, " could overflow the int32 sums");
  auto codes = torch::zeros({P, K4, 4 * NR}, panels.options().dtype(at::kChar));
  auto stats = torch::empty({NSTATS, V}, panels.options().dtype(at::kFloat));
  auto colsum = torch::empty({V}, panels.options().dtype(at::kInt));
  const auto* pw = panels.data_ptr<c10::BFloat16>();
  int8_t* pc = codes.data_ptr<int8_t>();
  float* ps = stats.data_ptr<float>();
  int32_t* cs = colsum.data_ptr<int32_t>();
  std::atomic<bool> all_finite{true};
  at::parallel_for(0, V, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const c10::BFloat16* src = pw + (j / NR) * K2 * 2 * NR + (j % NR) * 2;  // column j's pair kp at kp * 32
      int8_t* dst = pc + (j / NR) * K4 * 4 * NR + (j % NR) * 4;              // its quad kq at kq * 64
      if (!pack_row([&](int64_t k) { return float(src[(k / 2) * 2 * NR + k % 2]); },
                    [&](int64_t k, int8_t q) { dst[(k / 4) * 4 * NR + k % 4] = q; }, K, j, V, ps, cs))
        all_finite = false;
    }
  });
  TORCH_CHECK(all_finite, "greedy_head_pack_bf16: the weight is not finite");
  return {codes, stats, colsum};
}

namespace {
void check_stats(const torch::Tensor& stats, int64_t V) {
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == NSTATS && stats.size(1) == V && stats.scalar_type() == at::kFloat &&
                  stats.is_contiguous(),
              "stats: the pack's");
}
}  // namespace

std::tuple<torch::Tensor, torch::Tensor> greedy_head(torch::Tensor x, torch::Tensor codes, torch::Tensor stats,
                                                     torch::Tensor weight) {
  TORCH_CHECK(greedy_head_supported(), "greedy_head: needs AVX-512 BW and VNNI, or AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: fp32 [B, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(2) == 2 * NR,
              "codes: greedy_head_pack's");
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || bf16) && weight.is_contiguous(),
              "weight: fp32 (or bf16) [V, K] rows, the values of the panels the logits would come from");
  TORCH_CHECK(!bf16 || greedy_head_bf16_panels_supported(), "greedy_head: bf16 rows need the AVX2 kernel");
  const auto xc = x.contiguous();
  const int64_t B = xc.size(0), K = xc.size(1), V = stats.size(-1), P = codes.size(0), K2 = codes.size(1);
  check_stats(stats, V);
  TORCH_CHECK(K2 == (K + 1) / 2 && P == (V + NR - 1) / NR && weight.size(0) == V && weight.size(1) == K &&
                  V * K < (int64_t(1) << 31),
              "greedy_head: x, codes, stats and weight disagree on K or V");
  auto tokens = torch::full({B}, -1, xc.options().dtype(at::kLong));
  auto counts = torch::zeros({B}, xc.options().dtype(at::kInt));
#ifdef PC_GREEDY_HEAD
  const float* px = xc.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  const RowCodes rc = quantize_rows(px, B, K, false, nullptr, 0);
  argmax_rows<false>(rc, B, K, V, P, codes.data_ptr<int8_t>(), K2 * 2 * NR, stats.data_ptr<float>(), nullptr, nullptr,
                     [&](int64_t r, const int32_t* cols, int64_t n, float* out) {
                       _mm512_store_ps(out, exact16(px + r * K, K, pw, cols, n));
                     },
                     tokens.data_ptr<int64_t>(), counts.data_ptr<int32_t>());
#elif defined(PC_GREEDY_HEAD_AVX2)
  const float* px = xc.data_ptr<float>();
  const RowCodes rc = quantize_rows(px, B, K, false, nullptr, 0);
  if (bf16)
    argmax_rows_avx2(rc, px, B, K, V, P, codes.data_ptr<int8_t>(), stats.data_ptr<float>(),
                     weight.data_ptr<c10::BFloat16>(), tokens.data_ptr<int64_t>(), counts.data_ptr<int32_t>());
  else
    argmax_rows_avx2(rc, px, B, K, V, P, codes.data_ptr<int8_t>(), stats.data_ptr<float>(), weight.data_ptr<float>(),
                     tokens.data_ptr<int64_t>(), counts.data_ptr<int32_t>());
#endif
  return {tokens, counts};
}

torch::Tensor greedy_head_outliers(torch::Tensor panels, torch::Tensor dims) {
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                  panels.size(2) == 2 * NR,
              "panels: bf16 VNNI panels [P, K / 2, 32]");
  TORCH_CHECK(dims.dim() == 1 && dims.scalar_type() == at::kInt && dims.is_contiguous(), "dims: int32 [n]");
  const int64_t P = panels.size(0), K2 = panels.size(1), no = dims.numel();
  const int32_t* pd = dims.data_ptr<int32_t>();
  for (int64_t i = 0; i < no; ++i) TORCH_CHECK(0 <= pd[i] && pd[i] < 2 * K2, "dims: within K");
  const int64_t no2 = (no + 1) / 2;
  auto wo = torch::zeros({P, no2, 2 * NR}, panels.options());  // an odd list's last pair: its second weight 0
  const auto* pw = panels.data_ptr<c10::BFloat16>();
  auto* po = wo.data_ptr<c10::BFloat16>();
  at::parallel_for(0, P, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = 0; i < no; ++i) {  // dim k: the even / odd half of each column's pair k / 2
        const c10::BFloat16* pair = pw + (p * K2 + pd[i] / 2) * 2 * NR;
        for (int64_t c = 0; c < NR; ++c) po[((p * no2 + i / 2) * NR + c) * 2 + i % 2] = pair[2 * c + pd[i] % 2];
      }
  });
  return wo;
}

std::tuple<torch::Tensor, torch::Tensor> greedy_head_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor stats,
                                                          torch::Tensor colsum, torch::Tensor rows, torch::Tensor dims,
                                                          torch::Tensor wo) {
  TORCH_CHECK(greedy_head_bf16_supported(), "greedy_head_bf16: needs AVX-512 BW, VNNI and BF16, and no AMX");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bf16 [B, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(2) == 4 * NR,
              "codes: greedy_head_pack_bf16's");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kBFloat16 && rows.is_contiguous(),
              "rows: the head's bf16 weight [V, K], the values of the VNNI panels the logits would come from");
  const auto xc = x.contiguous();
  const int64_t B = xc.size(0), K = xc.size(1), V = stats.size(-1), P = codes.size(0), K4 = codes.size(1);
  check_stats(stats, V);
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == V, "colsum: the pack's");
  TORCH_CHECK(dims.dim() == 1 && dims.scalar_type() == at::kInt && dims.is_contiguous() &&
                  wo.scalar_type() == at::kBFloat16 && wo.is_contiguous() && wo.dim() == 3 && wo.size(0) == P &&
                  wo.size(1) == (dims.numel() + 1) / 2 && wo.size(2) == 2 * NR,
              "dims, wo: greedy_head_outliers' dims and weights");
  for (int64_t i = 0; i < dims.numel(); ++i)
    TORCH_CHECK(0 <= dims.data_ptr<int32_t>()[i] && dims.data_ptr<int32_t>()[i] < K, "dims: within K");
  TORCH_CHECK(K % 4 == 0 && K4 == K / 4 && P == (V + NR - 1) / NR && rows.size(0) == V && rows.size(1) == K &&
                  V * K < (int64_t(1) << 31),
              "greedy_head_bf16: x, codes, stats and panels disagree on K or V");
  auto tokens = torch::full({B}, -1, xc.options().dtype(at::kLong));
  auto counts = torch::zeros({B}, xc.options().dtype(at::kInt));
#ifdef PC_GREEDY_HEAD_BF16
  const auto* px = xc.data_ptr<c10::BFloat16>();
  const auto* pr = rows.data_ptr<c10::BFloat16>();
  const RowCodes rc = quantize_rows(px, B, K, true, dims.data_ptr<int32_t>(), dims.numel());
  argmax_rows<true>(rc, B, K, V, P, codes.data_ptr<int8_t>(), K4 * 4 * NR, stats.data_ptr<float>(),
                    colsum.data_ptr<int32_t>(), wo.data_ptr<c10::BFloat16>(),
                    [&](int64_t r, const int32_t* cols, int64_t n, float* out) {
                      exact16_bf16(px + r * K, K, pr, V, cols, n, out);
                    },
                    tokens.data_ptr<int64_t>(), counts.data_ptr<int32_t>());
#endif
  return {tokens, counts};
}

// The dim of x's largest |value| over all rows, as torch's abs().amax(0).argmax() gives it: the first such dim, a NaN
// counting as the largest (the first NaN's dim). Compared as bits: |x| as bf16 bits orders as its value, every NaN
// above +inf (and -ffast-math may fold isnan away).
static int64_t largest_dim(const c10::BFloat16* x, int64_t B, int64_t K) {
  std::vector<uint16_t> m(K, 0);
  for (int64_t r = 0; r < B; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t v = x[r * K + k].x & 0x7fff;
      if (m[k] <= 0x7f80) m[k] = std::max(m[k], v);  // a NaN (> 0x7f80) stays
    }
  auto nan = [](uint16_t v) { return v > 0x7f80; };
  int64_t best = 0;
  for (int64_t k = 1; k < K; ++k)
    if (nan(m[k]) ? !nan(m[best]) : (!nan(m[best]) && m[k] > m[best])) best = k;
  return best;
}

std::tuple<c10::optional<torch::Tensor>, int64_t, int64_t> greedy_head_bf16_step(torch::Tensor x, torch::Tensor codes,
                                                                                  torch::Tensor stats, torch::Tensor colsum,
                                                                                  torch::Tensor rows, torch::Tensor dims,
                                                                                  torch::Tensor wo, bool check_dims) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bf16 [B, K]");
  const auto xc = x.contiguous();
  const int64_t top = largest_dim(xc.data_ptr<c10::BFloat16>(), xc.size(0), xc.size(1));
  if (check_dims) {
    TORCH_CHECK(dims.dim() == 1 && dims.scalar_type() == at::kInt && dims.is_contiguous(), "dims: int32 [n]");
    const int32_t* pd = dims.data_ptr<int32_t>();
    if (std::find(pd, pd + dims.numel(), int32_t(top)) == pd + dims.numel()) return {c10::nullopt, -1, top};
  }
  auto [tokens, counts] = greedy_head_bf16(xc, codes, stats, colsum, rows, dims, wo);
  const int64_t* pt = tokens.data_ptr<int64_t>();
  const int32_t* pc = counts.data_ptr<int32_t>();
  int64_t exact = 0;
  bool ok = true;
  for (int64_t r = 0; r < tokens.numel(); ++r) exact += pc[r], ok = ok && pt[r] >= 0;
  return {ok ? c10::optional<torch::Tensor>(tokens) : c10::nullopt, exact, top};
}

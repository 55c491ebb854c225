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
#include "ops.h"

#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PC_GREEDY_HEAD 1
#endif

namespace {
constexpr int64_t NR = 16;     // columns per panel (the fp32 panels' and the codes')
constexpr int64_t MAX_K = 1032;  // 127 * 16383 * K stays inside int32
constexpr float XMAX = 16383.f;
constexpr double UNIT = 1.0 / (1 << 24);  // fp32 unit roundoff
enum Stat { SCALE, WERR, L1, W1, NSTATS };

// From the exponent bits: -ffast-math (cpu_ext.py's flags) lets the compiler fold std::isfinite to true.
inline bool finite_bits(double v) {
  uint64_t b;
  std::memcpy(&b, &v, 8);
  return ((b >> 52) & 0x7ff) != 0x7ff;
}
inline bool finite_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return ((b >> 23) & 0xff) != 0xff;
}

#ifdef PC_GREEDY_HEAD
constexpr int64_t GR = 6;  // rows per tile
constexpr int64_t GP = 4;  // panels per tile: GR x GP int32 accumulators

// acc[r][p] = sum over k pairs of codes of panel p (at w + p * ps) times row r's pair (xp[r * K2 + kp]).
template <int R, int P>
__attribute__((noinline)) void approx_tile(const int32_t* xp, int64_t K2, const int8_t* w, int64_t ps, __m512i* out) {
  __m512i acc[R][P];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_si512();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i wv[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
      wv[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * ps + kp * 32)));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(xp[r * K2 + kp]);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpwssd_epi32(acc[r][p], xv, wv[p]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) out[r * GP + p] = acc[r][p];
}

template <int R>
void approx_rows(int64_t np, const int32_t* xp, int64_t K2, const int8_t* w, int64_t ps, __m512i* out) {
  switch (np) {
    case 1: return approx_tile<R, 1>(xp, K2, w, ps, out);
    case 2: return approx_tile<R, 2>(xp, K2, w, ps, out);
    case 3: return approx_tile<R, 3>(xp, K2, w, ps, out);
    default: return approx_tile<R, 4>(xp, K2, w, ps, out);
  }
}

void approx(int64_t rows, int64_t np, const int32_t* xp, int64_t K2, const int8_t* w, int64_t ps, __m512i* out) {
  switch (rows) {
    case 1: return approx_rows<1>(np, xp, K2, w, ps, out);
    case 2: return approx_rows<2>(np, xp, K2, w, ps, out);
    case 3: return approx_rows<3>(np, xp, K2, w, ps, out);
    case 4: return approx_rows<4>(np, xp, K2, w, ps, out);
    case 5: return approx_rows<5>(np, xp, K2, w, ps, out);
    default: return approx_rows<6>(np, xp, K2, w, ps, out);
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
#endif
}  // namespace

bool greedy_head_supported() {
#ifdef PC_GREEDY_HEAD
  return true;
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
      double m = 0.0;
      bool ok = true;
      for (int64_t k = 0; k < K; ++k) m = std::max(m, std::fabs(double(row[k]))), ok = ok && finite_bits(row[k]);
      if (!ok) all_finite = false;
      const float s = m > 0.0 ? float(m / 127.0) : 1.f;
      double err = 0.0, l1 = 0.0, w1 = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const int q = int(std::max(-127.0, std::min(127.0, std::nearbyint(double(row[k]) / s))));
        pc[((j / NR) * K2 + k / 2) * 2 * NR + (j % NR) * 2 + k % 2] = int8_t(q);
        err = std::max(err, std::fabs(double(row[k]) - double(s) * q));
        l1 += std::fabs(double(s) * q);
        w1 += std::fabs(double(row[k]));
      }
      // Rounded up into fp32: the bounds only grow.
      ps[SCALE * V + j] = s;
      ps[WERR * V + j] = float(err * (1 + 1e-6));
      ps[L1 * V + j] = float(l1 * (1 + 1e-6));
      ps[W1 * V + j] = float(w1 * (1 + 1e-6));
    }
  });
  TORCH_CHECK(all_finite, "greedy_head_pack: the weight is not finite");
  return {codes, stats};
}

std::tuple<torch::Tensor, torch::Tensor> greedy_head(torch::Tensor x, torch::Tensor codes, torch::Tensor stats,
                                                     torch::Tensor weight) {
  TORCH_CHECK(greedy_head_supported(), "greedy_head: needs AVX-512 BW and VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: fp32 [B, K]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.size(2) == 2 * NR,
              "codes: greedy_head_pack's");
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == NSTATS && stats.scalar_type() == at::kFloat && stats.is_contiguous(),
              "stats: greedy_head_pack's");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight: fp32 [V, K] rows, the values of the panels the logits would come from");
  const auto xc = x.contiguous();
  const int64_t B = xc.size(0), K = xc.size(1), V = stats.size(1), P = codes.size(0), K2 = codes.size(1);
  TORCH_CHECK(K2 == (K + 1) / 2 && P == (V + NR - 1) / NR && weight.size(0) == V && weight.size(1) == K &&
                  V * K < (int64_t(1) << 31),
              "greedy_head: x, codes, stats and weight disagree on K or V");
  auto tokens = torch::full({B}, -1, xc.options().dtype(at::kLong));
  auto counts = torch::zeros({B}, xc.options().dtype(at::kInt));
#ifdef PC_GREEDY_HEAD
  const float* px = xc.data_ptr<float>();
  const float* st = stats.data_ptr<float>();
  const int8_t* pc = codes.data_ptr<int8_t>();
  const float* pw = weight.data_ptr<float>();
  int64_t* ptok = tokens.data_ptr<int64_t>();
  int32_t* pcnt = counts.data_ptr<int32_t>();
  // Rows as int16 pairs; their scale, |x|_1, max|x| and code error. A row that is not finite keeps -1.
  std::vector<int32_t> xp(B * K2, 0);
  std::vector<float> t(B), x1(B), xinf(B), xerr(B);
  std::vector<char> ok(B);
  for (int64_t r = 0; r < B; ++r) {
    const float* row = px + r * K;
    double a1 = 0.0, am = 0.0;
    for (int64_t k = 0; k < K; ++k) a1 += std::fabs(double(row[k])), am = std::max(am, std::fabs(double(row[k])));
    ok[r] = finite_bits(a1);
    const float tr = am > 0.0 ? float(am / XMAX) : 1.f;
    t[r] = tr, x1[r] = float(a1 * (1 + 1e-6)), xinf[r] = float(am);
    double e = 0.0;
    auto* pair = reinterpret_cast<int16_t*>(xp.data() + r * K2);
    for (int64_t k = 0; ok[r] && k < K; ++k) {
      const double q = std::max(-double(XMAX), std::min(double(XMAX), std::nearbyint(double(row[k]) / tr)));
      pair[k] = int16_t(q);
      e = std::max(e, std::fabs(double(row[k]) - double(tr) * q));
    }
    xerr[r] = float(e * (1 + 1e-6));
  }
  // Pass 1, panels split over the threads (all rows per panel group): per thread and row, the running max of
  // a_j - E_j, and (j, a_j + E_j) of the tokens whose a_j + E_j reached it when they were scored: the max only
  // grows, so the others can never be candidates (no [B, V] buffer written and read back).
  const int64_t ps = K2 * 2 * NR;
  const float gamma = float(1.01 * K * UNIT / (1 - K * UNIT));
  const int nth = std::max<int>(1, std::min<int>(at::get_num_threads(), int((P + GP - 1) / GP)));
  const float ninf_s = -std::numeric_limits<float>::infinity();
  std::vector<__m512> lower(nth * B, _mm512_set1_ps(ninf_s));
  std::vector<std::vector<int32_t>> kept_j(nth * B);
  std::vector<std::vector<float>> kept_hi(nth * B);
#pragma omp parallel num_threads(nth)
  {
    alignas(64) __m512i acc[GR * GP];
    const int64_t groups = (P + GP - 1) / GP, tid = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t g0 = groups * tid / n, g1 = groups * (tid + 1) / n;
    __m512* low = lower.data() + tid * B;
    std::vector<float> thr(B, ninf_s);  // each row's running max of a_j - E_j, refreshed once a panel group
    const __m512 ninf = _mm512_set1_ps(ninf_s);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * GP, np = std::min(GP, P - p);
      for (int64_t r0 = 0; r0 < B; r0 += GR) {
        const int64_t rows = std::min(GR, B - r0);
        approx(rows, np, xp.data() + r0 * K2, K2, pc + p * ps, ps, acc);
        for (int64_t q = 0; q < np; ++q) {
          const int64_t j = (p + q) * NR;
          const __mmask16 in = V - j >= NR ? __mmask16(0xFFFF) : __mmask16((1u << (V - j)) - 1);
          const __m512 s = _mm512_maskz_loadu_ps(in, st + SCALE * V + j);
          const __m512 werr = _mm512_maskz_loadu_ps(in, st + WERR * V + j);
          const __m512 l1 = _mm512_maskz_loadu_ps(in, st + L1 * V + j);
          const __m512 w1 = _mm512_maskz_loadu_ps(in, st + W1 * V + j);
          const __m512i cols = _mm512_add_epi32(lanes, _mm512_set1_epi32(int32_t(j)));
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = r0 + r;
            const __m512 a = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r * GP + q]), s), _mm512_set1_ps(t[row]));
            __m512 e = _mm512_mul_ps(werr, _mm512_set1_ps(x1[row]));
            e = _mm512_fmadd_ps(l1, _mm512_set1_ps(xerr[row]), e);
            e = _mm512_fmadd_ps(w1, _mm512_set1_ps(gamma * xinf[row]), e);
            e = _mm512_fmadd_ps(_mm512_abs_ps(a), _mm512_set1_ps(1e-6f), e);
            e = _mm512_fmadd_ps(e, _mm512_set1_ps(1.01f), _mm512_set1_ps(1e-6f));
            const __m512 hi = _mm512_add_ps(a, e);
            low[row] = _mm512_max_ps(low[row], _mm512_mask_blend_ps(in, ninf, _mm512_sub_ps(a, e)));
            const __mmask16 m = _mm512_mask_cmp_ps_mask(in, hi, _mm512_set1_ps(thr[row]), _CMP_GE_OQ);
            if (m) {
              auto& kj = kept_j[tid * B + row];
              auto& kh = kept_hi[tid * B + row];
              const size_t c = kj.size();
              kj.resize(c + __builtin_popcount(m));
              kh.resize(kj.size());
              _mm512_mask_compressstoreu_epi32(kj.data() + c, m, cols);
              _mm512_mask_compressstoreu_ps(kh.data() + c, m, hi);
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) thr[r0 + r] = _mm512_reduce_max_ps(low[r0 + r]);
      }
    }
  }
  // Pass 2, per row: the candidates (kept tokens with a_j + E_j >= the largest lower bound, in index order: the
  // threads' panel ranges ascend), their exact logits, the argmax.
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> cand;
    for (int64_t r = b0; r < b1; ++r) {
      if (!ok[r]) continue;
      __m512 lv = lower[r];
      for (int i = 1; i < nth; ++i) lv = _mm512_max_ps(lv, lower[i * B + r]);
      const float L = _mm512_reduce_max_ps(lv);
      cand.clear();
      for (int i = 0; i < nth; ++i) {
        const auto& kj = kept_j[i * B + r];
        const auto& kh = kept_hi[i * B + r];
        for (size_t c = 0; c < kj.size(); ++c)
          if (kh[c] >= L) cand.push_back(kj[c]);
      }
      const int64_t count = int64_t(cand.size());
      pcnt[r] = int32_t(count);
      float best = -std::numeric_limits<float>::infinity();
      int64_t arg = -1;
      bool all_finite = count > 0;
      for (int64_t i = 0; i < count; i += NR) {
        const int64_t n = std::min<int64_t>(NR, count - i);
        alignas(64) float v[NR];
        _mm512_store_ps(v, exact16(px + r * K, K, pw, cand.data() + i, n));
        for (int64_t c = 0; c < n; ++c) {
          all_finite = all_finite && finite_bits(v[c]);
          if (v[c] > best) best = v[c], arg = cand[i + c];  // increasing j: ties keep the first
        }
      }
      ptok[r] = all_finite ? arg : -1;
    }
  });
#endif
  return {tokens, counts};
}

// What the greedy head's kernels share (cpu_greedy_head.cpp: AVX-512; cpu_greedy_head_avx2.cpp: AVX2): the int8
// codes of the head and their stats, x's codes, and which kernel this CPU builds.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PC_GREEDY_HEAD 1
#if defined(__AVX512BF16__)
#define PC_GREEDY_HEAD_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define PC_GREEDY_HEAD_AVX2 1  // the fp32 head, and bf16 heads in plain panels (VNNI pairs need AVX512-BF16)
#endif

namespace greedy_codes {
constexpr int64_t NR = 16;     // columns per panel (the fp32 panels' and the codes')
constexpr int64_t MAX_K = 1032;  // 127 * 16383 * K stays inside int32
constexpr float XMAX = 16383.f;
constexpr float XMAX8 = 127.f;  // the bf16 head's uint8 x codes: -127..127, stored + 128
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

// Codes of one vocab row w(k), k < K, into its code slots, and its stats: scale, the codes' max error, sum |s q|,
// sum |w| (rounded up into fp32: the bounds only grow). False if the row is not finite.
template <typename Get, typename Put>
bool pack_row(Get w, Put put, int64_t K, int64_t j, int64_t V, float* ps, int32_t* colsum) {
  double m = 0.0;
  bool ok = true;
  for (int64_t k = 0; k < K; ++k) m = std::max(m, std::fabs(double(w(k)))), ok = ok && finite_bits(w(k));
  const float s = m > 0.0 ? float(m / 127.0) : 1.f;
  double err = 0.0, l1 = 0.0, w1 = 0.0;
  int32_t sum = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int q = int(std::max(-127.0, std::min(127.0, std::nearbyint(double(w(k)) / s))));
    put(k, int8_t(q));
    sum += q;
    err = std::max(err, std::fabs(double(w(k)) - double(s) * q));
    l1 += std::fabs(double(s) * q);
    w1 += std::fabs(double(w(k)));
  }
  ps[SCALE * V + j] = s;
  ps[WERR * V + j] = float(err * (1 + 1e-6));
  ps[L1 * V + j] = float(l1 * (1 + 1e-6));
  ps[W1 * V + j] = float(w1 * (1 + 1e-6));
  if (colsum != nullptr) colsum[j] = sum;
  return ok;
}

// x's codes (int16 pairs, or uint8 quads stored + 128) and what the bounds need of each row: the scale t, |x|_1,
// max|x| and the codes' max error. A row that is not finite is marked and keeps token -1. With `outliers`, the
// dims with the largest |x| over the rows (LLMs' massive activations: one dim of the bundled model's final hidden
// states is ~40 where the median is ~0.4) are left out of the codes (code 0) and kept as they are, in bf16 pairs (xo:
// dims 2i and 2i + 1 of the list in one word, an odd list's last paired with 0): coded, they set t for every dim, and
// uint8 codes then bounded half the vocabulary into the candidates.
struct RowCodes {
  std::vector<int32_t> words;  // per row: `per_row` 32-bit words
  int64_t per_row = 0;
  std::vector<float> t, x1, xinf, xerr;
  std::vector<char> ok;
  std::vector<int32_t> dims;  // the outlier dims
  std::vector<int32_t> xo;  // per row: x at those dims as bf16 pairs (ceil(n / 2) words)
  std::vector<float> xo1;   // per row: the sum of their |x|
};

template <typename X>
RowCodes quantize_rows(const X* px, int64_t B, int64_t K, bool u8, const int32_t* dims, int64_t ndims) {
  RowCodes rc;
  rc.per_row = u8 ? K / 4 : (K + 1) / 2;
  rc.words.assign(B * rc.per_row, 0);
  rc.t.resize(B), rc.x1.resize(B), rc.xinf.resize(B), rc.xerr.resize(B), rc.ok.resize(B);
  rc.dims.assign(dims, dims + ndims);
  std::vector<char> out(K, 0);
  for (int32_t k : rc.dims) out[k] = 1;
  const int64_t no = int64_t(rc.dims.size());
  const int64_t no2 = (no + 1) / 2;
  rc.xo.assign(B * no2, 0), rc.xo1.assign(B, 0.f);
  const double xmax = u8 ? XMAX8 : XMAX;
  for (int64_t r = 0; r < B; ++r) {
    const X* row = px + r * K;
    double a1 = 0.0, am = 0.0, o1 = 0.0, all = 0.0, mall = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = std::fabs(double(row[k]));
      all += v, mall = std::max(mall, v);
      if (out[k]) o1 += v;
      else a1 += v, am = std::max(am, v);
    }
    rc.ok[r] = finite_bits(all);
    for (int64_t i = 0; i < no; ++i) {  // bf16 x as it is (an fp32 x is only ever coded without outliers)
      const uint32_t bits = c10::BFloat16(float(row[rc.dims[i]])).x;
      rc.xo[r * no2 + i / 2] |= int32_t(bits << (16 * (i % 2)));
    }
    rc.xo1[r] = float(o1 * (1 + 1e-6));
    const float tr = am > 0.0 ? float(am / xmax) : 1.f;
    rc.t[r] = tr, rc.x1[r] = float(a1 * (1 + 1e-6)), rc.xinf[r] = float(mall);
    double e = 0.0;
    auto* w16 = reinterpret_cast<int16_t*>(rc.words.data() + r * rc.per_row);
    auto* w8 = reinterpret_cast<uint8_t*>(rc.words.data() + r * rc.per_row);
    for (int64_t k = 0; rc.ok[r] && k < K; ++k) {
      const double q = out[k] ? 0.0 : std::max(-xmax, std::min(xmax, std::nearbyint(double(row[k]) / tr)));
      if (u8)
        w8[k] = uint8_t(int(q) + 128);
      else
        w16[k] = int16_t(q);
      if (!out[k]) e = std::max(e, std::fabs(double(row[k]) - double(tr) * q));
    }
    rc.xerr[r] = float(e * (1 + 1e-6));
  }
  return rc;
}

// Where a candidate must reach to matter against the largest lower bound L: L itself for fp32 logits; for logits
// rounded to bf16, 2 bf16 ulps below it (any logit below that rounds below what the largest rounds to).
template <bool BF16>
inline float edge(float L) {
  if constexpr (BF16) return L - std::fabs(L) * (1.f / 64) - 1e-30f;
  return L;
}

// The first of the largest exact logits of the candidates cand[0, count) (in index order: ties keep the lowest,
// argmax_logsumexp's rule), exact(cols, n, out) giving up to NR of them at a time; -1 if there are none or one is
// not finite (the caller then computes the row's logits).
template <typename Exact>
int64_t first_largest(const int32_t* cand, int64_t count, Exact exact) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t arg = -1;
  bool all_finite = count > 0;
  for (int64_t i = 0; i < count; i += NR) {
    const int64_t n = std::min<int64_t>(NR, count - i);
    alignas(64) float v[NR];
    exact(cand + i, n, v);
    for (int64_t c = 0; c < n; ++c) {
      all_finite = all_finite && finite_bits(v[c]);
      if (v[c] > best) best = v[c], arg = cand[i + c];
    }
  }
  return all_finite ? arg : -1;
}

#ifdef PC_GREEDY_HEAD_AVX2
// The head's argmax per row of rc (ptok; -1 where not finite) and its count of exact logits (pcnt), from the
// codes [P, K / 2, 32] and stats of greedy_head_pack and the weight's rows [V, K] (x: fp32 [B, K]): fp32 rows for
// fp32 panels' logits; bf16 rows for bf16 panels', which the GEMM stores rounded to bf16 (the same fp32 chain over
// the widened values, then nearest even).
template <typename W>
void argmax_rows_avx2(const RowCodes& rc, const float* x, int64_t B, int64_t K, int64_t V, int64_t P,
                      const int8_t* codes, const float* stats, const W* weight, int64_t* ptok, int32_t* pcnt);
#endif
}  // namespace greedy_codes

// fp32 panels that are exactly 4-bit per group: each group of G inputs of a column is fma(q, d, m) with q in 0..15
// and d, m fp16 (GGUF's Q4_1 grid, which the bundled model's linears come from: its fp32 weights are that
// format's de-quantization). Such a weight is kept beside its panels as int4 panels (per quad of 4 inputs one uint16
// a column, a nibble an input; fp16 scale/min per group), from which the decode rows' GEMMs widen each panel group back to the very same fp32 values
// and run the same tiles: a decode step reads 5 bits a weight instead of 32, bit for bit the same results.
// A weight with any group off the grid (or not finite) has no such form: it stays fp32 panels only.
#include "ops.h"
#include "decode_stack_parts.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PC_EXACT_INT4 1
#endif

namespace {
constexpr int64_t NR = 16;

#ifdef PC_EXACT_INT4
inline __m512 as_half(__m512 v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }

// Group g of panel p (16 columns at once): its codes and fp16 scale/min, or false if some value is off the grid.
// The check rebuilds every value as the widening does (fma(q, d, m) in fp32) and compares bits.
bool group_codes(const float* panel, int64_t k0, int64_t G, uint8_t* codes, c10::Half* scale, c10::Half* min) {
  __m512 lo = _mm512_loadu_ps(panel + k0 * NR), hi = lo;
  for (int64_t k = k0 + 1; k < k0 + G; ++k) {
    const __m512 v = _mm512_loadu_ps(panel + k * NR);
    lo = _mm512_min_ps(lo, v), hi = _mm512_max_ps(hi, v);
  }
  const __m512 m = as_half(lo);
  const __m512 d = as_half(_mm512_div_ps(_mm512_sub_ps(hi, lo), _mm512_set1_ps(15.f)));
  const __mmask16 steps = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ);  // a flat group's codes are 0
  for (int64_t k = k0; k < k0 + G; ++k) {
    const __m512 v = _mm512_loadu_ps(panel + k * NR);
    __m512 q = _mm512_roundscale_ps(_mm512_maskz_div_ps(steps, _mm512_sub_ps(v, m), d),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), _mm512_set1_ps(15.f));
    const __m512 back = _mm512_fmadd_ps(q, d, m);
    if (_mm512_cmpneq_epi32_mask(_mm512_castps_si512(back), _mm512_castps_si512(v)))
      return false;  // off the grid, not finite, or a -0 the widening would give as +0
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + (k - k0) * NR), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(scale), _mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(min), _mm512_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return true;
}
#endif
}  // namespace

#ifdef PC_EXACT_INT4
namespace {
// R rows (packed in tiles of 6 as pack_tiles lays them: row r at a + (r / 6) * 6 K + k * width + r % 6, the last
// tile `width` = R - 6 (tiles - 1) rows wide) x one panel of an exact weight. Each widened weight vector costs 3
// vector ops beside the R FMAs it feeds, on the same two ports: 6 rows x 4 panels (exact_tile) spend a third of
// their slots widening, 24 rows x 1 panel an eighth; so past 12 rows one tall tile a panel beats both exact_tile
// (its rows tile by tile, each widening again) and the fp32 panels (read at 32 bits a weight, memory-bound there).
// The same FMA chain per output as micro_kernel_zmm (from +0, over k in order): bit for bit its result.
template <int R>
__attribute__((noinline)) void exact_tall_r(const float* a, int64_t K, const uint16_t* q, const c10::Half* sm,
                                            const uint16_t* next_q, int64_t G, float* c) {
  constexpr int tiles = (R + 5) / 6, last = R - 6 * (tiles - 1);
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[R];
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + g * 2 * NR)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + g * 2 * NR + NR)));
    for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
      if ((k & 7) == 0) _mm_prefetch(reinterpret_cast<const char*>(next_q + k * 4), _MM_HINT_T1);
      __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k * 4)));
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512 wv = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, codes), d, m);
        v = _mm512_srli_epi32(v, 4);  // the next input's nibble into the index bits
#pragma GCC unroll 24
        for (int r = 0; r < R; ++r) {
          const int tile = r / 6, width = tile == tiles - 1 ? last : 6;
          const float x = a[tile * 6 * K + (k + t) * width + r % 6];
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x), wv, acc[r]);
        }
      }
    }
  }
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * NR, acc[r]);
}
}  // namespace

void exact_tall(int64_t rows, const float* a, int64_t K, const uint16_t* q, const c10::Half* sm,
                const uint16_t* next_q, int64_t G, float* c) {
  switch (rows) {
#define PC_TALL(R) \
  case R: return exact_tall_r<R>(a, K, q, sm, next_q, G, c);
    PC_TALL(12) PC_TALL(13) PC_TALL(14) PC_TALL(15) PC_TALL(16) PC_TALL(17) PC_TALL(18) PC_TALL(19) PC_TALL(20)
    PC_TALL(21) PC_TALL(22) PC_TALL(23) PC_TALL(24)
#undef PC_TALL
    default: TORCH_CHECK(false, "exact_tall: 12 to 24 rows, got ", rows);
  }
}
#endif

std::tuple<torch::Tensor, torch::Tensor> exact_int4_panels(torch::Tensor packed, int64_t group_size) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "exact_int4_panels: fp32 panels [panels, K, 16]");
  const int64_t P = packed.size(0), K = packed.size(1), G = group_size;
  TORCH_CHECK(G > 0 && G % 4 == 0, "exact_int4_panels: a group size that is a multiple of 4");
  auto none = std::make_tuple(torch::Tensor(), torch::Tensor());
#ifdef PC_EXACT_INT4
  if (K % G != 0 || P == 0) return none;
  const int64_t groups = K / G;
  auto q = torch::empty({P, K / 4, NR}, packed.options().dtype(at::kShort));  // K % 4 == 0: whole quads
  auto sm = torch::empty({P, groups, 2, NR}, packed.options().dtype(at::kHalf));
  const float* pw = packed.data_ptr<float>();
  uint16_t* pq = reinterpret_cast<uint16_t*>(q.data_ptr<int16_t>());
  c10::Half* psm = sm.data_ptr<c10::Half>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> codes(G * NR);
    for (int64_t p = p0; p < p1 && exact.load(std::memory_order_relaxed); ++p) {
      const float* panel = pw + p * K * NR;
      for (int64_t g = 0; g < groups; ++g) {
        c10::Half* gsm = psm + (p * groups + g) * 2 * NR;
        if (!group_codes(panel, g * G, G, codes.data(), gsm, gsm + NR)) {
          exact = false;
          return;
        }
        // Quads of 4 inputs, one uint16 a column: nibble t = the code of input 4 quad + t (widen_exact_int4).
        uint16_t* out = pq + (p * K + g * G) / 4 * NR;
        for (int64_t k = 0; k < G; k += 4)
          for (int64_t c = 0; c < NR; ++c)
            out[k / 4 * NR + c] = uint16_t(codes[k * NR + c] | codes[(k + 1) * NR + c] << 4 |
                                           codes[(k + 2) * NR + c] << 8 | codes[(k + 3) * NR + c] << 12);
      }
    }
  });
  if (exact) return std::make_tuple(q, sm);
#endif
  return none;
}

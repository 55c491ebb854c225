// Causal prefill attention over the paged cache on AVX-512 and AVX2 CPUs: each prompt's query rows against its keys
// up to their own positions (a prefix-cached context included), K and V read through the block table.
//
// Why: torch's CPU flash kernel (SDPA) ran this project's fp32 prompts (32-256 tokens, 9 heads of 64) at 55-90
// GFLOP/s, with a gathered copy of K/V and a transposed copy of q around every call (~0.9 ms a prompt and layer).
// Here both products run the GEMM's zmm tiles (zmm_tile.h; on AVX2 a 6 x 16 tile of ymm registers a panel): per
// (sequence, KV head) K's rows are packed once into 16-key panels and V's into 16-column panels, then per query head
// and 6-row tile S = q K^T over the keys the tile sees, a row-wise softmax into P (packed by key, the masked keys
// zero) and O = P V. fp32 math; q and out in fp32 or bf16, the cache in their dtype or quantized (int8 / fp8 e4m3 with
// an fp16 scale per token and head, de-quantized as kv_quant.dequantize does while K and V are packed). Each query
// row's result depends only on its row and its keys, not on which rows share the call: a prompt computed after a
// prefix-cache hit or in chunks gets the values it gets in one piece (with int8 KV, SDPA's causal path against a
// masked one differed in last bits that moved quantized K/V a step, and greedy runs parted).
// bf16 queries over a bf16 cache where AVX512-BF16 runs (and head_dim % 32 == 0) take run_item_dp instead: both products on vdpbf16ps (K and V
// packed as bf16 pairs, P rounded to bf16 as torch's flash kernel and the decode kernel round it, divided by its
// rounded sum). 14 prompts of 32-256 tokens, one layer, Zen 4: 3.98 -> 2.46 ms; against fp64 1.58e-3 -> 1.88e-3.
// There K is packed 16 keys at a time by 16 x 16 dword transposes and V a key pair at a time by 16-bit unpacks (were
// scalar stores), and each P row comes from one pass after its max (exp, bf16, sum; the fp32 weights never stored):
// 14 prompts of 32-256 tokens, 30 layers, 5 steps: 273-307 -> 250-266 ms, outputs bit-identical. The softmax (a
// third of this path) takes exp by vscalefps and sums P by a vdpbf16ps against ones, 32 keys a step: one layer of
// the bench workload's first prompt step (14 prompts, 2043 tokens), 1.53 -> 1.45 ms; 1.6e-5 of the outputs move an ulp.
// On AVX2 (Zen 3, fp32, 2 threads) torch's flash kernel and the MKL sgemm inside it took ~8% of a 2048-token prompt
// step over the gathered K/V; this kernel is the AVX-512 one with the tile, the softmax and the store in AVX2.
#include "ops.h"
#include "ymm_exp.h"
#include "zmm_tile.h"

#include <omp.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(PC_AVX512) || (defined(__AVX2__) && defined(__FMA__))
#define PC_PREFILL 1
#endif

namespace {
#ifdef PC_PREFILL
#ifdef PC_AVX512
using zmm::MR;
using zmm::NR;
using zmm::PZ;
#else
constexpr int64_t MR = 6, NR = 16, PZ = 4;  // zmm_tile.h's shapes: K and V are packed alike on both ISAs

#define PY_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
// C[R, 16] = A @ panel[K, 16] in 12 ymm accumulators (named, not an array: GCC spills arrays), row r of A's step k at
// a[k * ka + r * ra].
template <int R>
__attribute__((noinline)) void micro_kernel_ymm(const float* a, int64_t ka, int64_t ra, const float* b, int64_t K,
                                                float* c) {
#define PY_DECL(r) __m256 lo##r = _mm256_setzero_ps(), hi##r = _mm256_setzero_ps();
  PY_ROWS(PY_DECL)
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8);
    const float* ak = a + k * ka;
#define PY_FMA(r)                                          \
    if constexpr (R > r) {                                 \
      const __m256 av = _mm256_broadcast_ss(ak + r * ra);  \
      lo##r = _mm256_fmadd_ps(av, b0, lo##r);              \
      hi##r = _mm256_fmadd_ps(av, b1, hi##r);              \
    }
    PY_ROWS(PY_FMA)
  }
#define PY_STORE(r)                               \
  if constexpr (R > r) {                          \
    _mm256_storeu_ps(c + r * NR, lo##r);          \
    _mm256_storeu_ps(c + r * NR + 8, hi##r);      \
  }
  PY_ROWS(PY_STORE)
}
#endif

// C tiles [MR, NR] at c + t * MR * NR for np <= PZ panels (panel t at b + t * ps), A's rows as micro_kernel_ymm's.
inline void tile_f32(int64_t R, int64_t np, const float* a, int64_t ka, int64_t ra, const float* b, int64_t ps,
                     int64_t K, float* c) {
#ifdef PC_AVX512
  zmm::tile_zmm(R, np, a, ka, ra, b, ps, 2 * ps, K, c, nullptr, 0);
#else
  for (int64_t t = 0; t < np; ++t) {
    const float* bt = b + t * ps;
    float* ct = c + t * MR * NR;
    switch (R) {
      case 1: micro_kernel_ymm<1>(a, ka, ra, bt, K, ct); break;
      case 2: micro_kernel_ymm<2>(a, ka, ra, bt, K, ct); break;
      case 3: micro_kernel_ymm<3>(a, ka, ra, bt, K, ct); break;
      case 4: micro_kernel_ymm<4>(a, ka, ra, bt, K, ct); break;
      case 5: micro_kernel_ymm<5>(a, ka, ra, bt, K, ct); break;
      default: micro_kernel_ymm<6>(a, ka, ra, bt, K, ct);
    }
  }
#endif
}

struct Prefill {
  const void *q, *k, *v;
  void* out;
  const int32_t* block_table;
  int64_t hq, hkv, d, block_size, max_blocks, q_stride, out_stride;  // row strides
  int64_t block_stride;                     // cache elements per block (a quantized cache's blocks hold their scales too)
  const c10::Half *k_scales, *v_scales;     // quantized caches: [num_blocks, block_size, Hkv] per block_scale_stride
  int64_t scale_block_stride;
  float scale;
};


template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

// A cache value as fp32: as it is, or de-quantized (q * scale in fp32, rounded to the query's dtype T).
template <typename T, typename C>
inline float kv_value(C x, float s) {
  if constexpr (std::is_same_v<T, C>)
    return f32(x);
  else
    return f32(static_cast<T>(static_cast<float>(x) * s));
}

// s[0, n) <- exp(s * scale - max) in place; returns 1 / their sum (applied to the row's output: R x D products
// instead of a third pass over n).
#ifdef PC_AVX512
// max over j < n of s[j] * scale, broadcast (both softmax rows below).
inline __m512 scaled_max(const float* s, int64_t n, __m512 vs) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    vm = _mm512_mask_max_ps(vm, k, vm, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), vs));
  }
  return _mm512_set1_ps(_mm512_reduce_max_ps(vm));
}

inline float softmax_row(float* s, int64_t n, float scale) {
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512 m = scaled_max(s, n, vs);
  __m512 vl = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 e = zmm::exp_ps(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), vs), m));
    _mm512_mask_storeu_ps(s + j, k, e);
    vl = _mm512_mask_add_ps(vl, k, vl, e);
  }
  return 1.f / _mm512_reduce_add_ps(vl);
}
#else
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// The mask of lanes [0, n), n < 8.
inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float softmax_row(float* s, int64_t n, float scale) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::max());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_mul_ps(_mm256_loadu_ps(s + j), vs));
  if (j < n) {  // the tail's other lanes stand at -max, below any score
    const __m256i k = lanes_below(n - j);
    const __m256 t = _mm256_mul_ps(_mm256_maskload_ps(s + j, k), vs);
    const __m256 low = _mm256_set1_ps(-std::numeric_limits<float>::max());
    vm = _mm256_max_ps(vm, _mm256_blendv_ps(low, t, _mm256_castsi256_ps(k)));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const __m256 m = _mm256_set1_ps(std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4))));
  __m256 vl = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = ymm::exp_nonpos(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(s + j), vs), m));
    _mm256_storeu_ps(s + j, e);
    vl = _mm256_add_ps(vl, e);
  }
  if (j < n) {
    const __m256i k = lanes_below(n - j);
    const __m256 e = _mm256_and_ps(ymm::exp_nonpos(_mm256_sub_ps(_mm256_mul_ps(_mm256_maskload_ps(s + j, k), vs), m)),
                                   _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(s + j, k, e);
    vl = _mm256_add_ps(vl, e);
  }
  return 1.f / hsum(vl);
}
#endif

// o[0, 16) = c[0, 16) * inv, rounded to T.
template <typename T>
inline void store_scaled(const float* c, float inv, T* o) {
  alignas(64) float cr[NR];
  float* dst = std::is_same_v<T, float> ? reinterpret_cast<float*>(o) : cr;
#ifdef PC_AVX512
  _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_loadu_ps(c), _mm512_set1_ps(inv)));
#else
  const __m256 iv = _mm256_set1_ps(inv);
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_loadu_ps(c), iv));
  _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_loadu_ps(c + 8), iv));
#endif
  if constexpr (!std::is_same_v<T, float>)
    for (int64_t e = 0; e < NR; ++e) o[e] = static_cast<T>(cr[e]);
}

// The rows of the key kAhead places on are asked for as each key is packed: read on demand, the packing waited on
// them (it was ~10% of a prompt step's attention; 14 prompts of 32-256 tokens, 30 layers: 84 -> 79 ms).
constexpr int64_t kAhead = 8;
template <typename C>
inline void prefetch_key(const Prefill& a, const int32_t* bt, int64_t g, int64_t n, const C* kc, const C* vc) {
  const int64_t at = bt[n / a.block_size] * a.block_stride + (n % a.block_size * a.hkv + g) * a.d;
  for (int64_t b = 0; b < a.d * int64_t(sizeof(C)); b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(kc + at) + b, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(vc + at) + b, _MM_HINT_T0);
  }
}

// Scratch of one thread, reused across items (sized for the longest sequence).
struct Scratch {
  std::vector<float> kp, vp, qp, s;
  std::vector<uint32_t> kb, vb;  // run_item_dp: K and V as bf16 pairs
  std::vector<c10::BFloat16> pb;  // run_item_dp: P rows in bf16
  std::vector<c10::BFloat16> qb;  // amx_item_rows: a tile's 16 query rows
  std::vector<float> ob;  // amx_item_rows: a tile's outputs before the softmax's divisor
  float c[PZ * MR * NR];
};

#if defined(__AVX512BF16__)
// bf16 queries over a bf16 cache on vdpbf16ps (run_item_dp). Both products as dot products of bf16 pairs with fp32
// sums: S = q K^T over pairs of head dims (q's pairs as they lie, K packed [16-key panels][D / 2][16 keys]), and
// O = P V over pairs of keys (P rounded to bf16, as torch's CPU flash attention rounds it, and as the decode kernel
// does; V packed [16-column panels][keys / 2][16 columns]). A tile: R <= 6 rows x NP <= 4 panels of 16.
#define PC_DP_INLINE inline __attribute__((always_inline))
template <int R, int NP>
PC_DP_INLINE void dp_tile(const uint32_t* a, int64_t a_stride, const uint32_t* b, int64_t b_stride, int64_t pairs,
                          float* c, int64_t c_stride) {
  __m512 acc[R][NP];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh bv[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) bv[p] = (__m512bh)_mm512_loadu_si512(b + p * b_stride + i * 16);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int(a[r * a_stride + i]));
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], av, bv[p]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(c + r * c_stride + p * 16, acc[r][p]);
}

template <int NP>
void dp_tile_rows(int64_t R, const uint32_t* a, int64_t as, const uint32_t* b, int64_t bs, int64_t pairs, float* c,
                  int64_t cs) {
  switch (R) {
    case 1: return dp_tile<1, NP>(a, as, b, bs, pairs, c, cs);
    case 2: return dp_tile<2, NP>(a, as, b, bs, pairs, c, cs);
    case 3: return dp_tile<3, NP>(a, as, b, bs, pairs, c, cs);
    case 4: return dp_tile<4, NP>(a, as, b, bs, pairs, c, cs);
    case 5: return dp_tile<5, NP>(a, as, b, bs, pairs, c, cs);
    default: return dp_tile<6, NP>(a, as, b, bs, pairs, c, cs);
  }
}

// c[r][p * 16 + 0..16) = sum over pairs i of a[r * as + i] . b[p * bs + i * 16 + 0..16) (bf16 pairs), R rows x NP panels.
void dp_tiles(int64_t R, int64_t NP, const uint32_t* a, int64_t as, const uint32_t* b, int64_t bs, int64_t pairs,
              float* c, int64_t cs) {
  switch (NP) {
    case 1: return dp_tile_rows<1>(R, a, as, b, bs, pairs, c, cs);
    case 2: return dp_tile_rows<2>(R, a, as, b, bs, pairs, c, cs);
    case 3: return dp_tile_rows<3>(R, a, as, b, bs, pairs, c, cs);
    default: return dp_tile_rows<4>(R, a, as, b, bs, pairs, c, cs);
  }
}

// exp(x) for the softmax's x <= 0: e^x = 2^n e^f, n = round(x / ln 2), f = x - n ln 2 in [-ln 2 / 2, ln 2 / 2] (ln 2
// in two parts, as exp_ps), e^f by its degree-6 Taylor polynomial (error < 2e-7 relative), 2^n by vscalefps:
// 12 instructions against exp_ps's 17 (the softmax was ~30% of this kernel).
PC_DP_INLINE __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 y = _mm512_set1_ps(1.f / 720);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f / 120));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f / 24));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f / 6));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// p[0, n) <- exp(s * scale - max) over the vis keys row r sees, rounded to bf16, 0 for keys [vis, n rounded up to 32);
// returns the sum of the rounded weights (P is divided by it). One pass after the max, 32 keys a step: the weights
// rounded two vectors at once and summed by a vdpbf16ps against ones (exact products, fp32 sums); key j always in lane
// (j % 32) / 2 whatever n is, so a row's bits do not depend on the tile it shares.
PC_DP_INLINE float softmax_row_bf16(const float* s, int64_t vis, int64_t n, float scale, c10::BFloat16* p) {
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512 m = scaled_max(s, vis, vs);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
  auto weights = [&](int64_t j) __attribute__((always_inline)) {
    const int64_t left = vis - j;
    const __mmask16 k = left >= 16 ? __mmask16(0xFFFF) : left > 0 ? __mmask16((1u << left) - 1) : __mmask16(0);
    return _mm512_maskz_mov_ps(k, exp_nonpos(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + j), vs, m)));
  };
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 32) {
    const __m512bh b = _mm512_cvtne2ps_pbh(weights(j + 16), weights(j));
    _mm512_storeu_si512(p + j, (__m512i)b);
    sum = _mm512_dpbf16_ps(sum, b, ones);
  }
  return _mm512_reduce_add_ps(sum);
}

// r[i] <- dword i of r[0..16) (a 16 x 16 transpose): 32- and 64-bit unpacks within 128-bit lanes, then lanes.
PC_DP_INLINE void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4 i + c], lane L: column 4 L + c of rows 4 i .. 4 i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// AMX tiles (Intel) for both products of run_item_dp: 16 query rows a tile against the same packed K and V (their
// bf16 pairs are the tiles' B layout), the softmax between them as on vdpbf16ps. A row's result still depends only on
// its row and its keys (the k-steps fall at fixed multiples of 32 head dims or 32 keys; keys a row does not see weigh
// 0), so chunked and prefix-cached prompts get the same values. Prompt steps of 14 prompts of 32-256 tokens (the
// bundled model, 2 threads, AMX Xeon, best of 6): 330-352 -> 293-297 ms; offline bench workload, six alternated
// rounds: 905 -> 924 tok/s (mean).
constexpr int64_t kAmxRows = 16;
std::atomic<bool> amx_allowed{true};  // set_prefill_amx: tests run the vdpbf16ps products on AMX CPUs too
bool amx_attention() { return vnni_amx() && amx_allowed.load(std::memory_order_relaxed); }

#if defined(__x86_64__)
struct AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One 16 x 16 fp32 tile C (row stride c_stride bytes) = sum over ks steps of A [16 rows x 32 bf16] (step k at
// a + 64 k bytes, row stride a_stride bytes) times B's 16 x 16 pairs (step k at b + 1024 k bytes, rows 64 bytes apart).
__attribute__((target("amx-tile,amx-bf16"), noinline)) void amx_tile(const void* a, int64_t a_stride, const void* b,
                                                                     int64_t ks, float* c, int64_t c_stride) {
  _tile_zero(0);
  for (int64_t k = 0; k < ks; ++k) {
    _tile_loadd(4, static_cast<const char*>(a) + 64 * k, a_stride);
    _tile_loadd(6, static_cast<const char*>(b) + 1024 * k, 64);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, c, c_stride);
}

__attribute__((target("amx-tile"))) void amx_config() {
  AmxTileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
}

// run_item_dp's products on AMX for KV head g's query heads, rows [0, ql) of the item (K and V packed in w).
void amx_item_rows(const Prefill& a, int64_t g, int64_t q0, int64_t ql, int64_t off, int64_t lp, int64_t pl,
                   int64_t vs, Scratch& w) {
  using T = c10::BFloat16;
  const int64_t D = a.d, D2 = D / 2, dp = D / NR, group = a.hq / a.hkv;
  const T* q = static_cast<const T*>(a.q);
  T* out = static_cast<T*>(a.out);
  w.qb.resize(kAmxRows * D);
  w.ob.resize(kAmxRows * D);
  amx_config();
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t r0 = 0; r0 < ql; r0 += kAmxRows) {
      const int64_t R = std::min(kAmxRows, ql - r0), kmax = off + r0 + R, kpanels = (kmax + NR - 1) / NR;
      // The tile's query rows, 16 of them (rows past R zero: their results are never stored).
      for (int64_t r = 0; r < kAmxRows; ++r) {
        T* dst = w.qb.data() + r * D;
        if (r < R) std::copy_n(q + (q0 + r0 + r) * a.q_stride + h * D, D, dst);
        else std::fill_n(dst, D, T(0.f));
      }
      for (int64_t p = 0; p < kpanels; ++p)  // S[r][keys of panel p] = q_r . k_key
        amx_tile(w.qb.data(), D * 2, w.kb.data() + p * D2 * NR, D / 32, w.s.data() + p * NR, lp * 4);
      const int64_t kpairs = (kmax + 1) / 2;
      float inv[kAmxRows];
      for (int64_t r = 0; r < R; ++r) {  // softmax over the keys row r sees; P in bf16, divided by its rounded sum
        inv[r] = 1.f / softmax_row_bf16(w.s.data() + r * lp, off + r0 + r + 1, 2 * kpairs, a.scale, w.pb.data() + r * pl);
      }
      const int64_t ks = (kpairs + 15) / 16;  // 32 keys a step (P's row holds them: zero past what the row sees)
      for (int64_t p = 0; p < dp; ++p)  // O[r][columns of panel p] = sum over key pairs of P[r][pair] . v_pair
        amx_tile(w.pb.data(), pl * 2, w.vb.data() + p * vs * NR, ks, w.ob.data() + p * NR, D * 4);
      for (int64_t r = 0; r < R; ++r) {
        T* o = out + (q0 + r0 + r) * a.out_stride + h * D;
        const __m512 sc = _mm512_set1_ps(inv[r]);
        for (int64_t c = 0; c < D; c += 16)  // rounded to nearest even, as c10::BFloat16
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w.ob.data() + r * D + c), sc)));
      }
    }
  }
}
#endif

void run_item_dp(const Prefill& a, int64_t seq, int64_t g, int64_t q0, int64_t q1, int64_t len, Scratch& w) {
  using T = c10::BFloat16;
  const int64_t D = a.d, D2 = D / 2, ql = q1 - q0, off = len - ql, lp = (len + NR - 1) / NR * NR, dp = D / NR;
  const int64_t pl = (len + 31) / 32 * 32;  // P's row stride: softmax_row_bf16 writes 32 keys a step
  const int64_t vs = pl / 2;  // key pairs a V panel holds: whole 16-pair AMX steps, zero past len
  const bool amx = amx_attention();
  const int64_t rows = amx ? kAmxRows : MR;
  const T* kc = static_cast<const T*>(a.k);
  const T* vc = static_cast<const T*>(a.v);
  const int32_t* bt = a.block_table + seq * a.max_blocks;
  w.kb.assign(lp * D2, 0u);
  w.vb.assign(D * vs, 0u);
  w.s.resize(rows * lp);
  w.pb.assign(rows * pl, T(0.f));
  uint16_t* vh = reinterpret_cast<uint16_t*>(w.vb.data());
  const __m512i first_half = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second_half = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t j0 = 0; j0 < len; j0 += NR) {  // 16 keys a panel
    const int64_t n = std::min<int64_t>(NR, len - j0);
    const uint32_t* kr[NR];
    const uint16_t* vr[NR];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t j = j0 + t;
      if (j + kAhead < len) prefetch_key(a, bt, g, j + kAhead, kc, vc);
      const int64_t at = bt[j / a.block_size] * a.block_stride + (j % a.block_size * a.hkv + g) * D;
      kr[t] = reinterpret_cast<const uint32_t*>(kc + at);
      vr[t] = reinterpret_cast<const uint16_t*>(vc + at);
    }
    uint32_t* kd = w.kb.data() + (j0 / NR) * D2 * NR;
    if (n == NR) {  // K's pairs [D2][16 keys]: 16 x 16 dword transposes
      for (int64_t h = 0; h < D2; h += 16) {
        __m512i r[16];
        for (int64_t t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(kr[t] + h);
        transpose16(r);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(kd + (h + i) * NR, r[i]);
      }
    } else {
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < D2; ++i) kd[i * NR + t] = kr[t][i];
    }
    // V's key pairs [16 columns x 2 keys] a panel: two rows interleaved by 16-bit lanes (an odd last key with zeros),
    // then each 128-bit lane pair put back in column order.
    for (int64_t t = 0; t < n; t += 2) {
      const int64_t jp = (j0 + t) / 2;
      for (int64_t c = 0; c < D / 32; ++c) {
        const __m512i u0 = _mm512_loadu_si512(vr[t] + 32 * c);
        const __m512i u1 = t + 1 < n ? _mm512_loadu_si512(vr[t + 1] + 32 * c) : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi16(u0, u1), hi = _mm512_unpackhi_epi16(u0, u1);
        _mm512_storeu_si512(vh + (2 * c * vs + jp) * 2 * NR, _mm512_permutex2var_epi64(lo, first_half, hi));
        _mm512_storeu_si512(vh + ((2 * c + 1) * vs + jp) * 2 * NR, _mm512_permutex2var_epi64(lo, second_half, hi));
      }
    }
  }
  const T* q = static_cast<const T*>(a.q);
  T* out = static_cast<T*>(a.out);
  const int64_t group = a.hq / a.hkv, qs = a.q_stride / 2;
#if defined(__x86_64__)
  if (amx) return amx_item_rows(a, g, q0, ql, off, lp, pl, vs, w);
#endif
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t r0 = 0; r0 < ql; r0 += MR) {
      const int64_t R = std::min(MR, ql - r0), kmax = off + r0 + R, kpanels = (kmax + NR - 1) / NR;
      const uint32_t* qa = reinterpret_cast<const uint32_t*>(q + (q0 + r0) * a.q_stride + h * D);
      for (int64_t p = 0; p < kpanels; p += PZ)  // S[r][keys] = q_r . k_key
        dp_tiles(R, std::min(PZ, kpanels - p), qa, qs, w.kb.data() + p * D2 * NR, D2 * NR, D2, w.s.data() + p * NR, lp);
      const int64_t kpairs = (kmax + 1) / 2;
      float inv[MR];
      for (int64_t r = 0; r < R; ++r) {  // softmax over the keys row r sees; P in bf16, divided by its rounded sum
        float* sr = w.s.data() + r * lp;
        T* pr = w.pb.data() + r * pl;
        inv[r] = 1.f / softmax_row_bf16(sr, off + r0 + r + 1, 2 * kpairs, a.scale, pr);
      }
      const uint32_t* pa = reinterpret_cast<const uint32_t*>(w.pb.data());
      for (int64_t p = 0; p < dp; p += PZ) {  // O[r][columns] = sum over key pairs of P[r][pair] . v_pair
        const int64_t np = std::min(PZ, dp - p);
        dp_tiles(R, np, pa, pl / 2, w.vb.data() + p * vs * NR, vs * NR, kpairs, w.c, PZ * NR);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t t = 0; t < np; ++t) {  // rounded to nearest even, as c10::BFloat16
            T* o = out + (q0 + r0 + r) * a.out_stride + h * D + (p + t) * NR;
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(w.c + r * PZ * NR + t * NR), _mm512_set1_ps(inv[r]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(v));
          }
      }
    }
  }
}
#endif

template <typename T, typename C>
void run_item(const Prefill& a, int64_t seq, int64_t g, int64_t q0, int64_t q1, int64_t len, Scratch& w) {
  const int64_t D = a.d, ql = q1 - q0, off = len - ql, lp = (len + NR - 1) / NR * NR, dp = D / NR;
  const C* kc = static_cast<const C*>(a.k);
  const C* vc = static_cast<const C*>(a.v);
  constexpr bool quantized = !std::is_same_v<T, C>;
  const int32_t* bt = a.block_table + seq * a.max_blocks;
  w.kp.assign(lp * D, 0.f);
  w.vp.assign(D * lp, 0.f);
  w.qp.resize(D * MR);
  w.s.resize(MR * lp);
  // K: panel j / 16 holds [D][16 keys]; V: panel d / 16 holds [lp keys][16 columns].
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) prefetch_key(a, bt, g, j + kAhead, kc, vc);
    const int64_t block = bt[j / a.block_size], pos = j % a.block_size;
    const C* kr = kc + block * a.block_stride + (pos * a.hkv + g) * D;
    const C* vr = vc + block * a.block_stride + (pos * a.hkv + g) * D;
    float ks = 1.f, vs = 1.f;
    if constexpr (quantized) {
      const int64_t si = block * a.scale_block_stride + pos * a.hkv + g;
      ks = static_cast<float>(a.k_scales[si]);
      vs = static_cast<float>(a.v_scales[si]);
    }
    float* kd = w.kp.data() + (j / NR) * D * NR + j % NR;
    for (int64_t e = 0; e < D; ++e) kd[e * NR] = kv_value<T>(kr[e], ks);
    for (int64_t p = 0; p < dp; ++p) {
      float* vd = w.vp.data() + p * lp * NR + j * NR;
      for (int64_t e = 0; e < NR; ++e) vd[e] = kv_value<T>(vr[p * NR + e], vs);
    }
  }
  const T* q = static_cast<const T*>(a.q);
  T* out = static_cast<T*>(a.out);
  const int64_t group = a.hq / a.hkv;
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t r0 = 0; r0 < ql; r0 += MR) {
      const int64_t R = std::min(MR, ql - r0), kmax = off + r0 + R, kpanels = (kmax + NR - 1) / NR;
      // fp32 q is read in place (row stride q_stride); bf16 widened into [D][R].
      const float* qa = w.qp.data();
      int64_t ka = R, ra = 1;
      if constexpr (std::is_same_v<T, float>) {
        qa = q + (q0 + r0) * a.q_stride + h * D;
        ka = 1;
        ra = a.q_stride;
      } else {
        for (int64_t e = 0; e < D; ++e)
          for (int64_t r = 0; r < R; ++r) w.qp[e * R + r] = f32(q[(q0 + r0 + r) * a.q_stride + h * D + e]);
      }
      for (int64_t p = 0; p < kpanels; p += PZ) {  // S[r][keys] = q_r . k_key
        const int64_t np = std::min(PZ, kpanels - p);
        tile_f32(R, np, qa, ka, ra, w.kp.data() + p * D * NR, D * NR, D, w.c);
        for (int64_t t = 0; t < np; ++t)
          for (int64_t r = 0; r < R; ++r)
            std::copy_n(w.c + t * MR * NR + r * NR, NR, w.s.data() + r * lp + (p + t) * NR);
      }
      float inv[MR];
      for (int64_t r = 0; r < R; ++r) {  // softmax over the keys row r sees (its position and before)
        float* sr = w.s.data() + r * lp;
        const int64_t vis = off + r0 + r + 1;
        inv[r] = softmax_row(sr, vis, a.scale);
        std::fill(sr + vis, sr + kmax, 0.f);  // the keys after it: P = 0
      }
      for (int64_t p = 0; p < dp; p += PZ) {  // O[r][columns] = sum over keys of P[r][key] v_key, P read by rows
        const int64_t np = std::min(PZ, dp - p);
        tile_f32(R, np, w.s.data(), 1, lp, w.vp.data() + p * lp * NR, lp * NR, kmax, w.c);
        for (int64_t t = 0; t < np; ++t)
          for (int64_t r = 0; r < R; ++r)
            store_scaled(w.c + t * MR * NR + r * NR, inv[r], out + (q0 + r0 + r) * a.out_stride + h * D + (p + t) * NR);
      }
    }
  }
}
#endif
}  // namespace

bool set_prefill_amx(bool on) {
#if defined(PC_PREFILL) && defined(__AVX512BF16__)
  return amx_allowed.exchange(on);
#else
  return false;
#endif
}

bool paged_prefill_supported(int64_t head_dim) {
#ifdef PC_PREFILL
  return head_dim % 16 == 0;
#else
  (void)head_dim;
  return false;
#endif
}

void paged_prefill(torch::Tensor query, torch::Tensor out, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor block_table, std::vector<int64_t> seqs, std::vector<int64_t> q_starts,
                   std::vector<int64_t> q_ends, std::vector<int64_t> seq_lens, double scale,
                   c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales) {
  TORCH_CHECK(paged_prefill_supported(query.size(-1)),
              "paged_prefill: needs AVX-512 or AVX2 + FMA and head_dim % 16 == 0");
#ifdef PC_PREFILL
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && query.stride(2) == 1 && out.stride(2) == 1 &&
                  query.stride(1) == query.size(2) && out.stride(1) == out.size(2),
              "query/out: [T, Hq, D], each row's heads contiguous");
  // Blocks may be strided (a quantized cache's data view), each block's [block_size, Hkv, D] contiguous.
  auto blocks_ok = [](const torch::Tensor& c) {
    return c.dim() == 4 && c.stride(3) == 1 && c.stride(2) == c.size(3) && c.stride(1) == c.size(2) * c.size(3);
  };
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() && blocks_ok(k_cache),
              "k/v cache: [num_blocks, block_size, Hkv, D], each block contiguous");
  const auto dtype = query.scalar_type(), cache_type = k_cache.scalar_type();
  const bool quantized = k_scales.has_value();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && out.scalar_type() == dtype &&
                  v_cache.scalar_type() == cache_type,
              "paged_prefill: query and out in one dtype, float32 or bfloat16; k and v caches in one");
  TORCH_CHECK(quantized == v_scales.has_value() &&
                  (quantized ? (cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn) : cache_type == dtype),
              "paged_prefill: the caches in the query's dtype, or int8 / fp8 e4m3 with k_scales and v_scales");
  if (quantized)
    TORCH_CHECK(k_scales->scalar_type() == at::kHalf && k_scales->dim() == 3 && k_scales->sizes() == v_scales->sizes() &&
                    k_scales->strides() == v_scales->strides() && k_scales->size(0) == k_cache.size(0) &&
                    k_scales->size(1) == k_cache.size(1) && k_scales->size(2) == k_cache.size(2) &&
                    k_scales->stride(2) == 1 && k_scales->stride(1) == k_cache.size(2),
                "k/v scales: fp16 [num_blocks, block_size, Hkv], each block contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.is_contiguous(),
              "block_table: int32 [B, max_blocks]");
  const size_t n = seqs.size();
  TORCH_CHECK(q_starts.size() == n && q_ends.size() == n && seq_lens.size() == n, "one start, end, length a sequence");
  Prefill a{query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_table.data_ptr<int32_t>(),
            query.size(1), k_cache.size(2), query.size(2), k_cache.size(1), block_table.size(1), query.stride(0), out.stride(0),
            k_cache.stride(0), quantized ? k_scales->data_ptr<c10::Half>() : nullptr,
            quantized ? v_scales->data_ptr<c10::Half>() : nullptr, quantized ? k_scales->stride(0) : 0,
            static_cast<float>(scale)};
  TORCH_CHECK(k_cache.size(3) == a.d && a.hq % a.hkv == 0, "head_dim and head counts of query and cache");
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= q_starts[i] && q_starts[i] < q_ends[i] && q_ends[i] <= query.size(0) &&
                    q_ends[i] - q_starts[i] <= seq_lens[i] && seqs[i] >= 0 && seqs[i] < block_table.size(0) &&
                    (seq_lens[i] + a.block_size - 1) / a.block_size <= a.max_blocks,
                "paged_prefill: a sequence's rows, length or blocks out of range");
  // Work items (sequence, KV head), the costliest first, handed out as threads free up: prompt lengths differ.
  std::vector<std::pair<int64_t, int64_t>> items;
  for (size_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < a.hkv; ++g) items.emplace_back(int64_t(i), g);
  std::stable_sort(items.begin(), items.end(), [&](const auto& x, const auto& y) {
    auto cost = [&](size_t i) { return (q_ends[i] - q_starts[i]) * seq_lens[i]; };
    return cost(x.first) > cost(y.first);
  });
  const int nth = std::max<int>(1, std::min<int>(at::get_num_threads(), int(items.size())));
#pragma omp parallel num_threads(nth)
  {
    static thread_local Scratch w;  // kept: freeing it each call left glibc mapping later large tensors afresh
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < int64_t(items.size()); ++t) {
      const auto [i, g] = items[t];
      const int64_t s = seqs[i], q0 = q_starts[i], q1 = q_ends[i], len = seq_lens[i];
      if (dtype == at::kFloat) {
        if (cache_type == at::kChar)
          run_item<float, int8_t>(a, s, g, q0, q1, len, w);
        else if (cache_type == at::kFloat8_e4m3fn)
          run_item<float, c10::Float8_e4m3fn>(a, s, g, q0, q1, len, w);
        else
          run_item<float, float>(a, s, g, q0, q1, len, w);
      } else {
        if (cache_type == at::kChar)
          run_item<c10::BFloat16, int8_t>(a, s, g, q0, q1, len, w);
        else if (cache_type == at::kFloat8_e4m3fn)
          run_item<c10::BFloat16, c10::Float8_e4m3fn>(a, s, g, q0, q1, len, w);
        else
#if defined(__AVX512BF16__)
          if (a.d % 32 == 0)  // run_item_dp packs K and V 32 head dims at a time
            run_item_dp(a, s, g, q0, q1, len, w);
          else
#endif
            run_item<c10::BFloat16, c10::BFloat16>(a, s, g, q0, q1, len, w);
      }
    }
  }
#endif
}

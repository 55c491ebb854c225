// bf16 linears over weights in the VNNI pair layout, for CPUs with AMX tiles.
//
// Why: the 16-column panels of cpu_gemm.cpp widen bf16 to fp32 and multiply with FMA (~0.2 TFLOP/s on 2
// cores); AMX multiplies bf16 tiles at 5-15x that. oneDNN's pre-packed matmul got there past a few rows but
// needs its own copy of every weight beside the panels, and runs outside the decode stack's parallel region
// (a fork per call). This layout serves every row count from one copy, inside the stack:
//   panel p (16 output columns) = K / 32 tiles of [16 input pairs][16 columns][2 inputs] bf16 (1 KiB),
// an AMX B tile as is. bf16 x's whole 16-row tiles are read where they lie, the rest (or fp32 x) copied into whole
// tiles (GemmInput::xb, padding rows zero). Even one row
// runs the tiles: they streamed the weights faster than the panels (measured 8.9 vs 10.2 ms for a decode
// step's 212 MB, 1-2 rows; vdpbf16ps over the same layout 12.5). Up to 16 rows, four panels per pass read x's
// tile once per input step; more rows run two panels x two row tiles.
// CPUs without AMX but with AVX512-BF16 (AMD Zen 4) run vdpbf16ps tiles of 6 rows x 4 panels over the same layout:
// one pair row is one zmm (twice the multiply-adds of an fp32 FMA, no widening; 0.38-0.42 TFLOP/s at 512 rows on 2
// cores against the widened panels' 0.18-0.20); up to 4 rows as four streams of panels (kSeqRows). Other CPUs run a
// scalar loop over it (the engine picks the layout only where AMX or AVX512-BF16 runs; the loop keeps every path
// testable).
// Products of bf16 are exact in fp32 and accumulated in fp32; the result rounds once to x's dtype: results equal the
// panels' up to the order of the fp32 sums.
#include "ops.h"
#include "decode_stack_parts.h"
#include "zmm_tile.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t NR = 16;       // output columns per panel
constexpr int64_t KT = 32;       // inputs per tile (16 pairs)
constexpr int64_t TILE = 16 * 32;  // bf16 per weight tile
constexpr int64_t PF = 8;        // weight tiles prefetched ahead (8 KiB)

#if defined(__x86_64__)
inline void cpuid(int leaf, int sub, unsigned r[4]) {
  __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}
bool detect_amx() {
  unsigned r[4];
  cpuid(0, 0, r);
  if (r[0] < 7) return false;
  cpuid(7, 0, r);
  const bool tile = r[3] & (1u << 24), bf16 = r[3] & (1u << 22);
  // Linux hands out the 8 KiB tile state only on request (once per process, for every thread).
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return tile && bf16 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#else
bool detect_amx() { return false; }
#endif

// A computed block (fp32, row stride ldc) into y rows [0, rows), columns [n0, n0 + cols), plus bias, rounded once.
template <typename X>
inline void store_block(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias, int64_t n0, X* y,
                        int64_t N) {
#if defined(__AVX512BF16__)
  if (cols == NR) {  // a whole panel: a vector a row (element by element, the stores cost ~40% of a K = 576 tile)
    const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * ldc), b);
      if constexpr (std::is_same_v<X, float>)
        _mm512_storeu_ps(y + r * N + n0, v);
      else  // round to nearest even, as c10::BFloat16 does
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + n0), (__m256i)_mm512_cvtneps_pbh(v));
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    X* out = y + r * N + n0;
    const float* cr = c + r * ldc;
    for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<X>(bias ? cr[j] + bias[n0 + j] : cr[j]);
  }
}

// ---- scalar: any CPU ---------------------------------------------------------------------------------
template <typename X>
void scalar_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1) {
  const int64_t K = w.K, N = w.N;
  const auto* W = static_cast<const c10::BFloat16*>(w.w);
  float c[NR];
  for (int64_t p = p0; p < p1; ++p) {
    const c10::BFloat16* panel = W + p * K * NR;
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    for (int64_t m = 0; m < in.M; ++m) {
      const c10::BFloat16* a = in.xb.data() + m * K;  // (no AMX: xb holds every row)
      std::fill(c, c + NR, 0.f);
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < NR; ++j) c[j] += float(a[k]) * float(panel[(k / 2) * 2 * NR + 2 * j + k % 2]);
      store_block(c, NR, 1, cols, w.bias, n0, y + m * N, N);
    }
  }
}

#if defined(__x86_64__)
// ---- AMX tiles -------------------------------------------------------------------------------------- ------------------------------------------------------------------
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: C tiles 16 x 16 fp32, A tiles 16 rows x 32 bf16, B tiles 16 pairs x 16 x 2.
__attribute__((target("amx-tile"))) void config_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
}

// C tiles 0-3; A tiles 4-5; B tiles 6-7. Tile numbers are immediates, hence one function per shape.
// P = 4 or 2 panels x one row tile (<= 16 rows): x's tile loaded once per k, the weight streamed once. Two serve a
// thread's panels past its fours (k/v's 6 a thread: 4 + 2; as two one-panel passes without prefetches, 3-4% slower).
template <int P>
__attribute__((target("amx-tile,amx-bf16"), noinline)) void amx_px1(const c10::BFloat16* a, const c10::BFloat16* w,
                                                                    int64_t K, float* c) {
  static_assert(P == 2 || P == 4, "two or four panels");
  const int64_t ks = K / KT, ps = ks * TILE;  // tiles per panel, bf16 per panel
  _tile_zero(0); _tile_zero(1);
  if constexpr (P == 4) { _tile_zero(2); _tile_zero(3); }
  for (int64_t k = 0; k < ks; ++k) {
    for (int q = 0; q < P; ++q)  // a line or two per panel starts the hardware's stream
      for (int l = 0; l < 1024; l += 512)
        _mm_prefetch(reinterpret_cast<const char*>(w + q * ps + (k + PF / 2) * TILE) + l, _MM_HINT_T0);
    _tile_loadd(4, a + k * KT, K * 2);
    _tile_loadd(6, w + k * TILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w + ps + k * TILE, 64);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (P == 4) {
      _tile_loadd(6, w + 2 * ps + k * TILE, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, w + 3 * ps + k * TILE, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  _tile_stored(0, c, 4 * 64);
  _tile_stored(1, c + 16, 4 * 64);
  if constexpr (P == 4) {
    _tile_stored(2, c + 32, 4 * 64);
    _tile_stored(3, c + 48, 4 * 64);
  }
}

// Two panels x two row tiles (32 rows): each loaded tile feeds two products.
// a0, a1: the two row tiles (row stride K; in place or copied, GemmInput::tile).
__attribute__((target("amx-tile,amx-bf16"), noinline)) void amx_2x2(const c10::BFloat16* a0, const c10::BFloat16* a1,
                                                                    const c10::BFloat16* w, int64_t K, float* c,
                                                                    bool prefetch) {
  const int64_t ks = K / KT, ps = ks * TILE;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < ks; ++k) {
    if (prefetch)
      for (int q = 0; q < 2; ++q)
        for (int l = 0; l < 1024; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w + q * ps + (k + PF / 2) * TILE) + l, _MM_HINT_T0);
    _tile_loadd(6, w + k * TILE, 64);
    _tile_loadd(7, w + ps + k * TILE, 64);
    _tile_loadd(4, a0 + k * KT, K * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + k * KT, K * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 2 * 64);
  _tile_stored(1, c + 16, 2 * 64);
  _tile_stored(2, c + 16 * 32, 2 * 64);
  _tile_stored(3, c + 16 * 32 + 16, 2 * 64);
}

// One panel x one row tile: what is left over.
__attribute__((target("amx-tile,amx-bf16"), noinline)) void amx_1x1(const c10::BFloat16* a, const c10::BFloat16* w,
                                                                    int64_t K, float* c, bool prefetch = false) {
  const int64_t ks = K / KT;
  _tile_zero(0);
  for (int64_t k = 0; k < ks; ++k) {
    if (prefetch)
      for (int l = 0; l < 1024; l += 512)
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + PF / 2) * TILE) + l, _MM_HINT_T0);
    _tile_loadd(6, w + k * TILE, 64);
    _tile_loadd(4, a + k * KT, K * 2);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, c, 64);
}

// Weight bytes a block of panel pairs spans: each block's pairs run over all row tiles before the next block, so a
// block read from memory once stays in L2 for the other row tiles, and each 32-row tile pair of x is read from L2 once
// per block instead of once per pair (a probe of this loop, x in place, 2 threads, 512 rows: gate/up 0.97-1.00 ->
// 0.88-0.93 ms, down 0.49-0.54 -> 0.41 ms).
constexpr int64_t BLOCK_BYTES = 512 << 10;

template <typename X>
void amx_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1) {
  const int64_t K = w.K, N = w.N, M = in.M, ps = K * NR;
  const auto* W = static_cast<const c10::BFloat16*>(w.w);
  alignas(64) float c[32 * 64];
  config_tiles();
  auto store = [&](const float* blk, int64_t ldc, int64_t m0, int64_t rows, int64_t p) {
    rows = std::min(rows, M - m0);
    if (rows > 0) store_block(blk, ldc, rows, std::min(NR, N - p * NR), w.bias, p * NR, y + m0 * N, N);
  };
  int64_t p = p0;
  if (M <= 16) {
    for (; p + 4 <= p1; p += 4) {
      amx_px1<4>(in.tile(0, K), W + p * ps, K, c);
      for (int q = 0; q < 4; ++q) store(c + q * 16, 64, 0, 16, p + q);
    }
    if (p + 2 <= p1) {
      amx_px1<2>(in.tile(0, K), W + p * ps, K, c);
      for (int q = 0; q < 2; ++q) store(c + q * 16, 64, 0, 16, p + q);
      p += 2;
    }
    if (p < p1) {
      amx_1x1(in.tile(0, K), W + p * ps, K, c, true);
      store(c, 16, 0, 16, p);
      ++p;
    }
  } else {
    const int64_t pairs_end = p0 + (p1 - p0) / 2 * 2, block = 2 * std::max<int64_t>(1, BLOCK_BYTES / (2 * ps * 2));
    for (int64_t b = p0; b < pairs_end; b += block) {
      const int64_t e = std::min(pairs_end, b + block);
      for (int64_t m0 = 0; m0 < M; m0 += 32)
        for (p = b; p < e; p += 2) {
          if (m0 + 16 >= M) {  // one row tile left
            for (int q = 0; q < 2; ++q) {
              amx_1x1(in.tile(m0, K), W + (p + q) * ps, K, c);
              store(c, 16, m0, 16, p + q);
            }
            continue;
          }
          amx_2x2(in.tile(m0, K), in.tile(m0 + 16, K), W + p * ps, K, c, m0 == 0);
          for (int q = 0; q < 2; ++q) store(c + q * 16, 32, m0, 32, p + q);
        }
    }
    p = pairs_end;
  }
  for (; p < p1; ++p)
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      amx_1x1(in.tile(m0, K), W + p * ps, K, c);
      store(c, 16, m0, 16, p);
    }
}

#if defined(__AVX512BF16__)
// Greedy rows' LM head on AMX tiles: each 16-row x 64-column block of logits as amx_panels computes it (the same
// tiles, so the same fp32 sums: AMX's are the same whatever the tile shape or row count), rounded to bf16 as its
// stores round them, folded into each row's running argmax (the first of equals, as argmax_logsumexp picks) and
// never stored. A row meeting a logit that is not finite is marked bad (-1): the caller computes its logits.
struct RowBest {  // lane j: the largest logit seen in columns = j (mod 16), and its column (the first of equals)
  alignas(64) float v[16];
  int32_t i[16];
  bool bad = false;
  RowBest() { std::fill(v, v + 16, -std::numeric_limits<float>::infinity()), std::fill(i, i + 16, -1); }
};

__attribute__((target("amx-tile,amx-bf16"))) void amx_argmax(const c10::BFloat16* A, int64_t M, int64_t K,
                                                             const c10::BFloat16* W, int64_t vocab, int64_t p0,
                                                             int64_t p1, RowBest* best) {
  const int64_t ps = K * NR;
  alignas(64) float c[16 * 64];
  config_tiles();
  const __m512i exponent = _mm512_set1_epi32(0x7F800000), lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                                                   5, 4, 3, 2, 1, 0);
  auto fold = [&](const float* blk, int64_t ldc, int64_t m0, int64_t p, int64_t np) {
    const int64_t rows = std::min<int64_t>(16, M - m0);
    for (int64_t q = 0; q < np; ++q) {
      const int64_t n0 = (p + q) * NR, cols = std::min(NR, vocab - n0);
      if (cols <= 0) return;
      const __mmask16 live = cols == NR ? 0xFFFF : (__mmask16)((1u << cols) - 1);
      const __m512i col = _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(n0)));
      for (int64_t r = 0; r < rows; ++r) {
        // rounded to bf16 as the logits path stores it (nearest even), widened back: exact
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(blk + r * ldc + q * NR));
        const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
        RowBest& b = best[m0 + r];
        // inf or NaN: the exponent all ones
        b.bad |= _mm512_mask_cmpeq_epi32_mask(live, _mm512_and_si512(bits, exponent), exponent) != 0;
        const __m512 v = _mm512_castsi512_ps(bits), old = _mm512_load_ps(b.v);
        const __mmask16 up = _mm512_mask_cmp_ps_mask(live, v, old, _CMP_GT_OQ);  // strictly: the first of equals stays
        _mm512_store_ps(b.v, _mm512_mask_mov_ps(old, up, v));
        _mm512_storeu_si512(b.i, _mm512_mask_mov_epi32(_mm512_loadu_si512(b.i), up, col));
      }
    }
  };
  // Row tiles inner: a group's panels (4 x K x 32 bytes) stay in L1/L2 for every row tile.
  int64_t p = p0;
  for (; p + 4 <= p1; p += 4)
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      amx_px1<4>(A + m0 * K, W + p * ps, K, c);
      fold(c, 64, m0, p, 4);
    }
  for (; p < p1; ++p)
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      amx_1x1(A + m0 * K, W + p * ps, K, c);
      fold(c, 16, m0, p, 1);
    }
}
#endif
#endif

#if defined(__AVX512BF16__)
// ---- AVX512-BF16 without AMX (AMD Zen 4): vdpbf16ps -------------------------------------------------
// One instruction multiplies one input pair into 16 columns: 32 bf16 products, summed in pairs into fp32 (twice an
// fp32 FMA's multiply-adds, and no widening). R rows x P panels of zmm accumulators (6 x 4 = 24 of 32 registers);
// per pair P weight loads and R broadcasts of x's pair (row r at a + r * lda) feed R * P products. Panel q's pair kp
// lies at b + (q % 2) * ps + (q / 2) * hs + kp * 32 (adjacent panels: hs = 2 ps; a fused gate/up weight's gate panels
// p, p + 1 beside up's: hs = the up half's offset, as zmm_tile.h's tiles). pf_n cache lines from pf are asked for
// every pf_every pairs (the next panel group); pf2_n lines from pf2, one every pf2_every pairs (a LineStream's run: the
// decode stack's next layer's K/V); both as they fall due between blocks of KB pairs.
constexpr int64_t DR = 6;   // rows per tile
constexpr int64_t DP = 4;   // panels per tile
constexpr int64_t KB = 8;    // pair steps between prefetches
constexpr int64_t DMC = 96;  // rows of x per cache block (96 bf16 rows of K <= 2048 stay in L2)
// Up to this many rows a thread's panels run as four streams, each a run of adjacent panels read start to end with
// one chain per row and panel (the same sums, in the same order, as the 6-row tiles: a row's bits do not depend on
// the rows beside it). One stream (a panel at a time) is one vdpbf16ps chain per row: its latency caps a row at
// ~38 GB/s a thread from cache (2 threads, weights in L2: q 8.5 -> 4.0 us, down 23 -> 10 us with four streams), near
// what memory gives a thread in fast spells. From memory, weights in huge pages (as the engine holds them), 1 row:
// the same or a few % faster (q 48.6 -> 51.4, k/v 37.7 -> 40.6 GB/s where a read probe gave 52); decode steps of the
// bundled model, one process alternating: GEMM phase at 1 row 14 of 16 faster (8.54 -> 8.21 ms) and 9 of 16, at 4
// rows 13 of 16, at 2 rows 8 of 16. Side by side with the next group prefetched instead (an earlier layout) was
// slower: 1.03-1.14x torch's sum over as many bytes against 0.74-0.92x a panel at a time; 6 rows x 1 panel 5.13 ->
// 6.54 ms against 5 rows (six broadcasts of x a step for one panel's load, where 4 panels share them).
constexpr int64_t kSeqRows = 4;
#define DP_PANELS(X, r) X(r, 0) X(r, 1) X(r, 2) X(r, 3)
#define DP_ROWS_PANELS(X) DP_PANELS(X, 0) DP_PANELS(X, 1) DP_PANELS(X, 2) DP_PANELS(X, 3) DP_PANELS(X, 4) DP_PANELS(X, 5)
inline __m512bh load_pairs(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
using zmm::tile_start;

template <int R, int P>
__attribute__((noinline)) void dp_kernel(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ps,
                                         int64_t hs, int64_t pairs, float* c, const char* pf, int64_t pf_n,
                                         int64_t pf_every, const char* pf2, int64_t pf2_n, int64_t pf2_every) {
  const int32_t* ap = reinterpret_cast<const int32_t*>(a);  // x's pairs as 32-bit words
  const int64_t la = lda / 2;
#define DP_DECL(r, p) __m512 z##r##p = _mm512_setzero_ps();
  DP_ROWS_PANELS(DP_DECL)
#define DP_DOT(r, p) \
    if constexpr (R > r && P > p) z##r##p = _mm512_dpbf16_ps(z##r##p, (__m512bh)_mm512_set1_epi32(ap[r * la + k]), b##p);
  auto dots = [&](int64_t k) __attribute__((always_inline)) {
    const c10::BFloat16* bk = b + k * 2 * NR;
    const __m512bh b0 = load_pairs(bk);
    const __m512bh b1 = P > 1 ? load_pairs(bk + ps) : b0;
    const __m512bh b2 = P > 2 ? load_pairs(bk + hs) : b0;
    const __m512bh b3 = P > 3 ? load_pairs(bk + hs + ps) : b0;
    DP_ROWS_PANELS(DP_DOT)
  };
  // The prefetches fall due between blocks of KB steps, so the steps themselves run without a branch; but lines
  // due every step (a few rows: the tiles read weights at the bandwidth) go out every step, not in bursts.
  const bool every_step = pf_n > 0 && pf_every == 1;
  int64_t due = pf_n > 0 && !every_step ? pf_every : pairs + KB, due2 = pf2_n > 0 ? pf2_every : pairs + KB;
  int64_t k = 0;
  for (; k + KB <= pairs; k += KB) {
#pragma GCC unroll 8
    for (int64_t j = 0; j < KB; ++j) {
      dots(k + j);
      if (every_step) {
        for (int64_t l = 0; l < pf_n; ++l) _mm_prefetch(pf + l * 64, _MM_HINT_T1);
        pf += pf_n * 64;
      }
    }
    for (due -= KB; due <= 0; due += pf_every) {
      for (int64_t l = 0; l < pf_n; ++l) _mm_prefetch(pf + l * 64, _MM_HINT_T1);
      pf += pf_n * 64;
    }
    for (due2 -= KB; due2 <= 0 && pf2_n > 0; due2 += pf2_every, --pf2_n, pf2 += 64) _mm_prefetch(pf2, _MM_HINT_T1);
  }
  for (; k < pairs; ++k) dots(k);
#define DP_STORE(r, p) \
  if constexpr (R > r && P > p) _mm512_storeu_ps(c + p * DR * NR + r * NR, z##r##p);
  DP_ROWS_PANELS(DP_STORE)
}

template <int R>
void dp_rows(int64_t np, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ps, int64_t hs,
             int64_t pairs, float* c, const char* pf, int64_t pf_n, int64_t pf_every, const char* pf2, int64_t pf2_n,
             int64_t pf2_every) {
  switch (np) {
    case 1: return dp_kernel<R, 1>(a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
    case 2: return dp_kernel<R, 2>(a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
    case 3: return dp_kernel<R, 3>(a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
    default: return dp_kernel<R, 4>(a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
  }
}

inline void dp_tile(int64_t rows, int64_t np, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ps,
                    int64_t hs, int64_t pairs, float* c, const char* pf, int64_t pf_n, int64_t pf_every,
                    const char* pf2 = nullptr, int64_t pf2_n = 0, int64_t pf2_every = 1) {
  switch (rows) {
    case 1: return dp_rows<1>(np, a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
    case 2: return dp_rows<2>(np, a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
    case 3: return dp_rows<3>(np, a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
    case 4: return dp_rows<4>(np, a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
    case 5: return dp_rows<5>(np, a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
    default: return dp_rows<6>(np, a, lda, b, ps, hs, pairs, c, pf, pf_n, pf_every, pf2, pf2_n, pf2_every);
  }
}

// np panels (at b + (q % 2) * ps + (q / 2) * hs) for rows [0, M <= DR) into c, each start to end, with this tile's
// share of the stream's lines.
inline void dp_stream_tile(int64_t M, int64_t np, const c10::BFloat16* A, int64_t K, const c10::BFloat16* b,
                           int64_t ps, int64_t hs, float* c, LineStream* stream) {
  const auto [pf2, pf2_n] = stream != nullptr ? stream->take() : std::pair<const char*, int64_t>{nullptr, 0};
  const int64_t pairs = K / 2, every = std::max<int64_t>(1, pairs / std::max<int64_t>(1, pf2_n));
  dp_tile(M, np, A, K, b, ps, hs, pairs, c, nullptr, 0, 1, pf2, pf2_n, every);
}

// Panels [p0, p1) for every row: groups of DP panels, each over the row tiles of a cache block of x; the next
// group's lines are asked for spread over this group's tiles (from memory they would stall its first tile).
template <typename X>
void dp_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1, LineStream* stream) {
  const int64_t K = w.K, N = w.N, M = in.M, ps = K * NR, pairs = K / 2;
  const auto* W = static_cast<const c10::BFloat16*>(w.w);
  const c10::BFloat16* A = in.xb_rows != nullptr ? in.xb_rows : in.xb.data();
  alignas(64) float c[DP * DR * NR];
  if (M <= kSeqRows) {
    // One row tile over four streams G panels apart, each read start to end (no prefetches).
    const int64_t L = p1 - p0, G = (L + DP - 1) / DP;
    if (stream != nullptr) stream->pace(G);
    for (int64_t j = 0; j < G; ++j) {
      const int64_t p = p0 + j, np = (L - j + G - 1) / G;  // the streams with a panel left
      dp_stream_tile(M, np, A, K, W + p * ps, G * ps, 2 * G * ps, c, stream);
      for (int64_t q = 0; q < np; ++q)
        store_block(c + q * DR * NR, NR, M, std::min(NR, N - (p + q * G) * NR), w.bias, (p + q * G) * NR, y, N);
    }
    return;
  }
  if (stream != nullptr) stream->pace((p1 - p0 + DP - 1) / DP * ((M + DR - 1) / DR));
  for (int64_t m0 = 0; m0 < M; m0 += DMC) {
    const int64_t m1 = std::min(M, m0 + DMC);
    for (int64_t p = p0; p < p1; p += DP) {
      const int64_t np = std::min(DP, p1 - p);
      const char* next = reinterpret_cast<const char*>(W + (p + np) * ps);
      const int64_t tiles = (m1 - m0 + DR - 1) / DR;
      const zmm::PrefetchSpread pf(std::min(DP, p1 - p - np) * ps * 2 / 64, tiles * pairs);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t i = m0 + tile_start(m1 - m0, tiles, t), rows = m0 + tile_start(m1 - m0, tiles, t + 1) - i;
        const auto [pf2, pf2_n] = stream != nullptr ? stream->take() : std::pair<const char*, int64_t>{nullptr, 0};
        dp_tile(rows, np, A + i * K, K, W + p * ps, ps, 2 * ps, pairs, c, next + t * pf.per_tile(pairs) * 64, pf.n,
                pf.every, pf2, pf2_n, std::max<int64_t>(1, pairs / std::max<int64_t>(1, pf2_n)));
        for (int64_t q = 0; q < np; ++q)
          store_block(c + q * DR * NR, NR, rows, std::min(NR, N - (p + q) * NR), w.bias, (p + q) * NR, y + i * N, N);
      }
    }
  }
}

// y[M, I] = silu(x Wg^T + bg) * (x Wu^T + bu) for w = [gate; up] (N = 2 I), gate panels [p0, p1): gate panels p, p + 1
// and up's p, p + 1 share a tile, so the [M, 2 I] product is never written and read back (a silu pass over it read
// the half the other thread wrote: ~1.3 ms of a 64-row decode step).
template <typename X>
void dp_silu_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1, LineStream* stream) {
  const int64_t K = w.K, M = in.M, I = w.N / 2, half = I / NR, ps = K * NR, hs = half * ps, pairs = K / 2;
  const auto* W = static_cast<const c10::BFloat16*>(w.w);
  const c10::BFloat16* A = in.xb_rows != nullptr ? in.xb_rows : in.xb.data();
  alignas(64) float c[DP * DR * NR];
  if (M <= kSeqRows) {
    // One row tile over two gate streams G panels apart and their up panels (as dp_panels: four streams).
    const int64_t L = p1 - p0, G = (L + 1) / 2;
    if (stream != nullptr) stream->pace(G);
    for (int64_t j = 0; j < G; ++j) {
      const int64_t p = p0 + j, np = (L - j + G - 1) / G;
      // gate p (and p + G), then their up panels: the tiles' panel q at b + (q % 2) * ps + (q / 2) * hs
      dp_stream_tile(M, 2 * np, A, K, W + p * ps, np == 2 ? G * ps : hs, hs, c, stream);
      for (int64_t q = 0; q < np; ++q)
        zmm::store_silu_mul(c + q * DR * NR, c + (np + q) * DR * NR, M, w.bias, (p + q * G) * NR,
                            (half + p + q * G) * NR, y + (p + q * G) * NR, I);
    }
    return;
  }
  if (stream != nullptr) stream->pace((p1 - p0 + 1) / 2 * ((M + DR - 1) / DR));
  for (int64_t m0 = 0; m0 < M; m0 += DMC) {
    const int64_t m1 = std::min(M, m0 + DMC);
    for (int64_t p = p0; p < p1; p += 2) {
      const int64_t np = std::min<int64_t>(2, p1 - p);
      // The next gate panels, then their up panels, asked for over this group's row tiles.
      const int64_t side = std::min<int64_t>(2, p1 - p - np) * ps * 2 / 64;
      const char* gate_next = reinterpret_cast<const char*>(W + (p + np) * ps);
      const char* up_next = reinterpret_cast<const char*>(W + (half + p + np) * ps);
      const int64_t tiles = (m1 - m0 + DR - 1) / DR;
      const zmm::PrefetchSpread pf(2 * side, tiles * pairs);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t i = m0 + tile_start(m1 - m0, tiles, t), rows = m0 + tile_start(m1 - m0, tiles, t + 1) - i;
        const int64_t first = t * pf.per_tile(pairs);
        const char* next = first < side ? gate_next + first * 64 : up_next + (first - side) * 64;
        const auto [pf2, pf2_n] = stream != nullptr ? stream->take() : std::pair<const char*, int64_t>{nullptr, 0};
        // One gate panel: gate and up as panels 0 and 1 (panel 1 at b + ps there).
        dp_tile(rows, 2 * np, A + i * K, K, W + p * ps, np == 2 ? ps : hs, hs, pairs, c, next,
                first < 2 * side ? pf.n : 0, pf.every, pf2, pf2_n, std::max<int64_t>(1, pairs / std::max<int64_t>(1, pf2_n)));
        for (int64_t q = 0; q < np; ++q)
          zmm::store_silu_mul(c + q * DR * NR, c + (np + q) * DR * NR, rows, w.bias, (p + q) * NR, (half + p + q) * NR,
                              y + i * I + (p + q) * NR, I);
      }
    }
  }
}
#endif

template <typename X>
void panels_of(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1, LineStream* side) {
#if defined(__x86_64__)
  if (in.amx) return amx_panels(w, in, y, p0, p1);
#endif
#if defined(__AVX512BF16__)
  return dp_panels(w, in, y, p0, p1, side);
#endif
  scalar_panels(w, in, y, p0, p1);
}

template <typename X>
void fill_rows(const X* x, int64_t K, c10::BFloat16* xb, int64_t r0, int64_t r1) {
  if constexpr (std::is_same_v<X, c10::BFloat16>) {
    // Streamed past the caches: every thread's tiles read all of xb, so each line a plain store writes is first
    // taken back from the other core's cache (~25 ns a line: a 64-row decode step's four fills per layer cost
    // 2.6 ms through memcpy, 0.2 ms streamed; the tiles then read xb from memory, ahead of their need).
    char* d = reinterpret_cast<char*>(xb + r0 * K);
    const char* s = reinterpret_cast<const char*>(x + r0 * K);
    int64_t n = (r1 - r0) * K * sizeof(X);
    const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
    std::memcpy(d, s, head);
    d += head; s += head; n -= head;
#if defined(__AVX512F__)
    for (; n >= 64; n -= 64, d += 64, s += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
#elif defined(__AVX__)  // the scalar path's CPUs: the same streaming, half a line a store
    for (; n >= 32; n -= 32, d += 32, s += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
#endif
    std::memcpy(d, s, n);
#if defined(__x86_64__)
    _mm_sfence();
#endif
  } else {
    for (int64_t i = r0 * K; i < r1 * K; ++i) xb[i] = c10::BFloat16(x[i]);  // round to nearest even
  }
}
}  // namespace

bool vnni_amx() {
  static const bool yes = detect_amx();
  return yes;
}

bool vnni_dpbf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void vnni_input_resize(const PackedWeight& w, int64_t M, GemmInput& in, const c10::BFloat16* bf16_x) {
  in.M = M;
  in.int8 = false;
  in.amx = vnni_amx();
  in.xb_rows = nullptr;
  if (!in.amx) {  // every row is filled before it is read
    in.xb.resize(M * w.K);
    return;
  }
  // AMX reads whole 16-row tiles: x's where it lies (no copy: a 512-row q_proj spent 40% of its time copying x),
  // else (or for the last, partial tile) copies in xb, rows past M zero (their results are never stored).
  in.xb_rows = bf16_x;
  const int64_t copied = M - in.rows_in_place(), rows = (copied + 15) / 16 * 16;
  in.xb.resize(rows * w.K);
  std::fill(in.xb.begin() + copied * w.K, in.xb.end(), c10::BFloat16(0.f));
}

void vnni_input_fill(const PackedWeight& w, at::ScalarType x_type, const void* x, GemmInput& in, int64_t r0,
                     int64_t r1) {
  const int64_t skip = in.amx ? in.rows_in_place() : 0;  // rows the tiles read in place
  r0 = std::max(r0, skip);
  r1 = std::min(r1, in.M);
  if (r0 >= r1) return;
  if (x_type == at::kFloat)
    return fill_rows(static_cast<const float*>(x) + skip * w.K, w.K, in.xb.data(), r0 - skip, r1 - skip);
  TORCH_CHECK(x_type == at::kBFloat16, "x: float32 or bfloat16");
  fill_rows(static_cast<const c10::BFloat16*>(x) + skip * w.K, w.K, in.xb.data(), r0 - skip, r1 - skip);
}

bool vnni_silu_mul_runs() { return vnni_dpbf16() && !vnni_amx(); }

bool vnni_reads_rows_in_place(const PackedWeight& w, at::ScalarType x_type) {
  return w.vnni && x_type == at::kBFloat16 && vnni_silu_mul_runs();  // the AVX512-BF16 tiles read rows of any count
}

void vnni_silu_mul_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0,
                          int64_t p1, LineStream* side) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(!in.amx, "vnni_silu_mul_panels: the AVX512-BF16 tiles (vnni_silu_mul_runs)");
  if (x_type == at::kFloat) return dp_silu_panels(w, in, static_cast<float*>(y), p0, p1, side);
  TORCH_CHECK(x_type == at::kBFloat16, "x: float32 or bfloat16");
  return dp_silu_panels(w, in, static_cast<c10::BFloat16*>(y), p0, p1, side);
#else
  TORCH_CHECK(false, "vnni_silu_mul_panels: needs AVX512-BF16 (vnni_silu_mul_runs)");
#endif
}

void vnni_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0, int64_t p1,
                 LineStream* side) {
  if (x_type == at::kFloat) return panels_of(w, in, static_cast<float*>(y), p0, p1, side);
  TORCH_CHECK(x_type == at::kBFloat16, "x: float32 or bfloat16");
  panels_of(w, in, static_cast<c10::BFloat16*>(y), p0, p1, side);
}

torch::Tensor greedy_head_amx(torch::Tensor x, torch::Tensor packed, int64_t vocab) {
  TORCH_CHECK(greedy_head_amx_supported(), "greedy_head_amx: needs AMX tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 2 * NR && 2 * packed.size(1) == x.size(1),
              "packed: the head's VNNI pairs [P, K / 2, 32] (pack_linear_weight_vnni)");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(vocab > 0 && vocab <= P * NR, "vocab: at most the packed columns");
  auto tokens = torch::empty({M}, torch::kLong);
#if defined(__x86_64__) && defined(__AVX512BF16__)
  // x in whole 16-row tiles (rows past M zero), as amx_panels reads it
  std::vector<c10::BFloat16> xb((M + 15) / 16 * 16 * K, c10::BFloat16(0.f));
  const auto xc = x.contiguous();
  std::memcpy(xb.data(), xc.data_ptr<at::BFloat16>(), M * K * sizeof(c10::BFloat16));
  const auto* W = static_cast<const c10::BFloat16*>(packed.data_ptr());
  const int nth = at::get_num_threads();
  std::vector<std::vector<RowBest>> best(nth, std::vector<RowBest>(M));
  const int64_t chunk = (P + nth - 1) / nth;
  at::parallel_for(0, nth, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      amx_argmax(xb.data(), M, K, W, vocab, std::min(P, t * chunk), std::min(P, (t + 1) * chunk), best[t].data());
  });
  auto* out = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    bool bad = false;
    float v = -std::numeric_limits<float>::infinity();
    int64_t i = -1;
    for (int t = 0; t < nth; ++t) {
      const RowBest& o = best[t][r];
      bad |= o.bad;
      for (int j = 0; j < 16; ++j)
        if (o.i[j] >= 0 && (i < 0 || o.v[j] > v || (o.v[j] == v && o.i[j] < i))) v = o.v[j], i = o.i[j];
    }
    out[r] = bad ? -1 : i;
  }
#endif
  return tokens;
}

bool greedy_head_amx_supported() {
#if defined(__x86_64__) && defined(__AVX512BF16__)
  return vnni_amx();
#else
  return false;
#endif
}

// out[p][kp][2c + t] = w[16p + c][2kp + t]; padding columns zero.
torch::Tensor pack_linear_weight_vnni(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "VNNI weights: bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + NR - 1) / NR;
  TORCH_CHECK(K % KT == 0, "VNNI weights: in_features a multiple of 32");
  auto padded = torch::zeros({panels * NR, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, NR, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({panels, K / 2, 2 * NR});
}

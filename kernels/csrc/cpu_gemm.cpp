// Linear layers over weights packed once at load: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Why our own GEMM: on CPUs without bf16 matmul units (AVX2 only) torch's bf16 matmul falls back to a
// scalar loop (~1 GFLOP/s) and oneDNN refuses to pre-pack bf16 weights; with units, F.linear still
// re-lays the weight out on every call. Here the weight is packed once into panels of 16 output
// columns, [ceil(N/16), K, 16], kept in its own dtype (bf16 halves the bytes a decode step reads),
// and widened to fp32 in registers; accumulation is fp32, the result rounded once to x's dtype.
// The micro-kernel keeps a 6 x 16 tile of C in 12 AVX2 registers (BLIS-style); at M = 1 it
// streams each panel once, so decode runs at memory speed.
#include "ops.h"
#include "decode_stack_parts.h"
#include "layer_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <initializer_list>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PC_AVX2 1
#include "zmm_tile.h"  // PC_AVX512 where the CPU has it
#endif

namespace {

constexpr int64_t NR = 16;  // output columns per packed panel
constexpr int64_t MR = 6;   // rows of x per micro-kernel tile
constexpr int64_t MC = 96;  // rows of x per cache block (MC x K fp32 stays in L2)
constexpr int64_t PD = 256;  // rows of a panel prefetched ahead at M <= 2 (one decode step at 1 thread: 32 rows 41%, 256 rows 83% of read bw)
// Column held by each of a bf16 panel's 16 slots (its own inverse: it swaps columns 4-7 and 8-11).
constexpr int64_t BF16_ORDER[NR] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
template <typename W>
constexpr int64_t slot(int64_t col) { return std::is_same_v<W, c10::BFloat16> ? BF16_ORDER[col] : col; }

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename W>
inline float wval(const W* p) { return static_cast<float>(*p); }
template <>
inline float wval<c10::BFloat16>(const c10::BFloat16* p) { return bf16_to_float(p->x); }

// n cache lines from p, to ask for ahead of use.
struct Lines {
  const char* p = nullptr;
  int64_t n = 0;
  void all(int hint) {  // every one left, now
#ifdef PC_AVX2
    for (; n > 0; --n, p += 64) hint == _MM_HINT_T0 ? _mm_prefetch(p, _MM_HINT_T0) : _mm_prefetch(p, _MM_HINT_T1);
#else
    (void)hint, n = 0;
#endif
  }
};

#ifdef PC_AVX2
// 16 packed weights -> two 8-lane fp32 vectors.
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
// bf16 panels are stored in BF16_ORDER, so that interleaving with zeros (one op per half) yields
// columns 0-7 and 8-15 in order: a bf16 is the top half of its fp32.
inline void load16(const c10::BFloat16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

// C[R, 16] = A @ panel[K, 16], row r of A's step k at a[k * ka + r * ra] (packed [K][R]: ka = R, ra = 1; fp32 rows
// read in place: ka = 1, ra = the row stride); R <= MR, results to c (row stride 16).
// Accumulators are named variables, not an array: with an array GCC spills them every iteration.
// Lines asked for on the way, spread over the k steps: `next` (this thread's next panel, into L1: from memory, the
// first row tile of each panel waited on it) and `side` (the decode stack's next K/V rows, a LineStream's share, into
// L2).
#define PC_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int R, typename W>
__attribute__((noinline)) void micro_kernel(const float* a, int64_t ka, int64_t ra, const W* panel, int64_t K, float* c,
                                            Lines next, Lines side) {
#define PC_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
  PC_ROWS(PC_DECL)
  const int64_t most = std::max(next.n, side.n), every = most > 0 ? std::max<int64_t>(1, K / most) : K + 1;
  for (int64_t k = 0, due = every; k < K; ++k) {
    if (--due == 0) {
      if (next.n > 0) _mm_prefetch(next.p, _MM_HINT_T0), next.p += 64, --next.n;
      if (side.n > 0) _mm_prefetch(side.p, _MM_HINT_T1), side.p += 64, --side.n;
      due = every;
    }
    __m256 b0, b1;
    load16(panel + k * NR, b0, b1);
    const float* ak = a + k * ka;
#define PC_FMA(r)                                         \
    if constexpr (R > r) {                                \
      const __m256 av = _mm256_broadcast_ss(ak + r * ra); \
      c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);         \
      c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);         \
    }
    PC_ROWS(PC_FMA)
  }
#define PC_STORE(r)                                       \
  if constexpr (R > r) {                                  \
    _mm256_storeu_ps(c + r * NR, c##r##0);                \
    _mm256_storeu_ps(c + r * NR + 8, c##r##1);            \
  }
  PC_ROWS(PC_STORE)
  next.all(_MM_HINT_T0), side.all(_MM_HINT_T1);
}

// One or two rows (decode): the weights streamed from memory with every line asked for PD rows ahead. S > 1
// interleaves S accumulator sets over k (summed at the end) to hide the FMA latency, but then a row's sums differ
// from micro_kernel's (batch invariance): tile() runs S = 1, as fast here, the weight read being the bound (AMD
// Zen 3: 26-32 GB/s at one row either way).
template <int R, int S, typename W>
__attribute__((noinline)) void micro_kernel_thin(const float* a, int64_t ka, int64_t ra, const W* panel, int64_t K,
                                                 float* c) {
  __m256 acc[S][R][2];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) acc[s][r][0] = acc[s][r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + S <= K; k += S) {
    // Decode streams every weight from memory once: ask for every cache line of it PD rows ahead
    // (8 KiB for bf16). One line 1 KiB ahead kept too few misses in flight: 10 GB/s of ~16.
    for (int64_t l = 0; l < S * NR * int64_t(sizeof(W)); l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PD) * NR) + l, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      __m256 b0, b1;
      load16(panel + (k + s) * NR, b0, b1);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + (k + s) * ka + r * ra);
        acc[s][r][0] = _mm256_fmadd_ps(av, b0, acc[s][r][0]);
        acc[s][r][1] = _mm256_fmadd_ps(av, b1, acc[s][r][1]);
      }
    }
  }
  for (; k < K; ++k) {
    __m256 b0, b1;
    load16(panel + k * NR, b0, b1);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + k * ka + r * ra);
      acc[0][r][0] = _mm256_fmadd_ps(av, b0, acc[0][r][0]);
      acc[0][r][1] = _mm256_fmadd_ps(av, b1, acc[0][r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 lo = acc[0][r][0], hi = acc[0][r][1];
    for (int s = 1; s < S; ++s) {
      lo = _mm256_add_ps(lo, acc[s][r][0]);
      hi = _mm256_add_ps(hi, acc[s][r][1]);
    }
    _mm256_storeu_ps(c + r * NR, lo);
    _mm256_storeu_ps(c + r * NR + 8, hi);
  }
}
#define PC_THIN 1
#else
template <int R, typename W>
void micro_kernel(const float* a, int64_t ka, int64_t ra, const W* panel, int64_t K, float* c, Lines, Lines) {
  float acc[R][NR] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* b = panel + k * NR;
    for (int r = 0; r < R; ++r) {
      const float av = a[k * ka + r * ra];
      for (int j = 0; j < NR; ++j) acc[r][j] += av * wval(b + slot<W>(j));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) c[r * NR + j] = acc[r][j];
}
#endif

// A's rows as micro_kernel's (ka, ra); next / side: lines asked for on the way (micro_kernel's; before the thin
// kernels, which stream their weights).
template <typename W>
inline void tile(int64_t rows, const float* a, int64_t ka, int64_t ra, const W* panel, int64_t K, float* c,
                 Lines next = {}, Lines side = {}) {
  switch (rows) {
#ifdef PC_THIN
    // One accumulator set (S = 1): each output the same FMA chain over k as in micro_kernel, so a row's result
    // does not depend on how many rows share its step (interleaved sets, 4 at one row, broke batch invariance).
    case 1:
    case 2:
      next.all(_MM_HINT_T0), side.all(_MM_HINT_T1);
      if (rows == 1)
        micro_kernel_thin<1, 1>(a, ka, ra, panel, K, c);
      else
        micro_kernel_thin<2, 1>(a, ka, ra, panel, K, c);
      break;
#else
    case 1: micro_kernel<1>(a, ka, ra, panel, K, c, next, side); break;
    case 2: micro_kernel<2>(a, ka, ra, panel, K, c, next, side); break;
#endif
    case 3: micro_kernel<3>(a, ka, ra, panel, K, c, next, side); break;
    case 4: micro_kernel<4>(a, ka, ra, panel, K, c, next, side); break;
    case 5: micro_kernel<5>(a, ka, ra, panel, K, c, next, side); break;
    default: micro_kernel<6>(a, ka, ra, panel, K, c, next, side); break;
  }
}

// Row tile t of x (rows [t*MR, t*MR + R)) as fp32 packed [K, R] at xp + t*MR*K: the micro-kernel
// then reads A sequentially.
template <typename X>
void pack_tiles(const X* x, int64_t M, int64_t K, int64_t t0, int64_t t1, float* xp) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t * MR, R = std::min(MR, M - i0);
    float* out = xp + i0 * K;
    const X* rows = x + i0 * K;
    // Writes in order (R streams read): the other way round each store landed R floats from the last one.
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < R; ++r) out[k * R + r] = static_cast<float>(rows[r * K + k]);
  }
}

// A panel widened to fp32 once, so that for many rows the micro-kernel does not convert it again
// per tile (bf16 -> fp32 costs about a third of the FMA time).
template <typename W>
const float* widen_panel(const W* panel, int64_t K, float* buf) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < NR; ++j) buf[k * NR + j] = static_cast<float>(panel[k * NR + slot<W>(j)]);
  return buf;
}
template <>
const float* widen_panel<float>(const float* panel, int64_t, float*) { return panel; }

// A computed tile (fp32, row stride 16) to y (row stride N), plus bias, rounded once to X.
template <typename X>
inline void store_tile(const float* c, int64_t rows, int64_t ncols, const float* bias, int64_t n0, X* y, int64_t N) {
#ifdef PC_AVX512
  if constexpr (std::is_same_v<X, float>) {
    if (ncols == NR) {  // a whole panel: one vector a row
      const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * N, _mm512_add_ps(_mm512_loadu_ps(c + r * NR), b));
      return;
    }
  }
#elif defined(PC_AVX2)
  if constexpr (std::is_same_v<X, float>) {
    // A whole panel: two vectors a row (the loop below became a memmove call a row, ~1% of a prompt step).
    if (ncols == NR) {
      if (bias == nullptr) {
        for (int64_t r = 0; r < rows; ++r) {
          _mm256_storeu_ps(y + r * N, _mm256_loadu_ps(c + r * NR));
          _mm256_storeu_ps(y + r * N + 8, _mm256_loadu_ps(c + r * NR + 8));
        }
        return;
      }
      const __m256 b0 = _mm256_loadu_ps(bias + n0), b1 = _mm256_loadu_ps(bias + n0 + 8);
      for (int64_t r = 0; r < rows; ++r) {
        _mm256_storeu_ps(y + r * N, _mm256_add_ps(_mm256_loadu_ps(c + r * NR), b0));
        _mm256_storeu_ps(y + r * N + 8, _mm256_add_ps(_mm256_loadu_ps(c + r * NR + 8), b1));
      }
      return;
    }
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    X* out = y + r * N;
    const float* cr = c + r * NR;
    if (bias)
      for (int64_t j = 0; j < ncols; ++j) out[j] = static_cast<X>(cr[j] + bias[n0 + j]);
    else
      for (int64_t j = 0; j < ncols; ++j) out[j] = static_cast<X>(cr[j]);
  }
}

// Rows of the tile that starts `left` rows before the end of its block. x packed into row tiles fixes them at MR;
// read in place (`free`), the last MR + 1..MR + 5 rows split evenly instead (64 rows: 10 x 6 + 4 -> 9 x 6 + 5 + 5):
// a tile of few rows has too few FMA chains to hide their latency, and reads its panel from L2 faster than it can.
inline int64_t tile_rows(int64_t left, bool free) {
  return free && MR < left && left < 2 * MR ? (left + 1) / 2 : std::min(MR, left);
}

// Panels [p0, p1) of y = x @ W^T for every row of x (packed into fp32 row tiles).
constexpr int64_t WIDEN_ROWS = 2 * MR;  // from more rows, bf16 panels are widened to fp32 once per call
constexpr int64_t ROW_SPLIT_ROWS = 2 * MC;  // from this many rows (read in place), threads split rows, not panels
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
void widen_exact_int4(const PackedWeight& w, int64_t p, float* buf);
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
void exact_tile(int64_t rows, int64_t np, const float* a, int64_t ka, int64_t ra, const ExactPanels& e, int64_t K,
                int64_t G, float* c);
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

// ---- int4 weights (w = q * scale + min per group of G inputs, as GGUF's Q4_1) ------------------
// Panel p holds K (rounded up to 4, zero codes past K) inputs in quads of 4: 32 bytes per quad, byte
// c * 4 + t = column c (low nibble) | column c + 8 (high nibble) at input 4 * quad + t. So each 32-bit
// lane holds 4 consecutive inputs of one column: the operand of an integer dot product (maddubs +
// madd) against 4 int8 activations, with no horizontal sums. Beside it, per group g, 16 scales then
// 16 mins: fp16 where the format's own are (GGUF's d and m; pagedcore's int4 rounds its scale and min
// so), else fp32. Decode reads 4 bits per weight plus 1 (fp16) or 2 (fp32) of scale and min (groups of 32).
//
// Two ways to run it. Decode (M <= int8_rows, groups a multiple of 32): x is quantized once per call
// to int8 per block of 32 inputs (symmetric, round to nearest, d = max|x| / 127, as llama.cpp's Q8
// blocks), products summed in integers per block, then y += s * d * dot(q, xq) per block and
// y += m * sum(d * sum(xq)) per group in fp32: ~0.15 instructions per weight, so it runs at memory
// speed. Otherwise x stays fp32 and the panel is dequantized to fp32 (in registers at M = 1, into a
// buffer for more rows, then the fp32 micro-kernel): exact, ALU-bound at M = 1 (~0.7 per weight).
constexpr int64_t QB = 32;  // inputs per int8 activation block
constexpr int64_t PF4 = 1024;  // bytes of a panel prefetched ahead by the decode kernels
// Up to this many fp32 rows, quantized weights are dequantized in registers for every row; more rows widen
// each panel into a [K, 16] fp32 buffer once. Widening at 2 rows measured 4x slower with 2 threads than
// with 1 here (the 36 KB buffers per thread), registers: M = 2 ~1.5 ms -> ~0.25 ms (1536 x 576, int4).
#ifdef PC_AVX2
constexpr int64_t REGISTER_ROWS = 3;
#else
constexpr int64_t REGISTER_ROWS = 0;
#endif

inline int64_t round4(int64_t K) { return (K + 3) / 4 * 4; }

// The scale/min panels' kinds: fp32 or fp16 (scale, min) pairs, or HalfZero: fp16 (scale, zero point z)
// with min = -z * scale formed in fp32 (exact: an 11-bit mantissa times a small integer), so that GPTQ's
// (q - z) * s keeps 16 bits a pair although -z * s is rarely an fp16.
struct HalfZero {};
template <typename S> struct ScaleMinStorage { using T = S; };
template <> struct ScaleMinStorage<HalfZero> { using T = c10::Half; };
template <typename S> using sm_t = typename ScaleMinStorage<S>::T;

#ifdef PC_AVX2
// 8 scales or mins as fp32.
inline __m256 load_sm(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_sm(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 8 mins for the 8 scales s.
template <typename S>
inline __m256 load_min(const sm_t<S>* p, __m256 s) {
  if constexpr (std::is_same_v<S, HalfZero>)
    return _mm256_fnmadd_ps(load_sm(p), s, _mm256_setzero_ps());
  else
    return load_sm(p);
}

// Each k of the panel dequantized (columns 0-7, 8-15) and handed to f(k, t = k % 4, w0, w1).
template <typename S, typename F>
inline void for_each_dequantized(const uint8_t* q, const sm_t<S>* sm, int64_t K, int64_t G, F&& f) {
  const __m256i nib = _mm256_set1_epi32(0x0F);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, m0 = s0, m1 = s0;
  int64_t next = 0;  // first input of the next group
  for (int64_t k0 = 0; k0 < K; k0 += 4) {
    _mm_prefetch(reinterpret_cast<const char*>(q + k0 * 8 + PF4), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k0 * 8));
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const int64_t k = k0 + t;
      if (k == K) return;
      if (k == next) {  // groups of any even size: one may start inside a quad
        const sm_t<S>* gsm = sm + (k / G) * 2 * NR;
        s0 = load_sm(gsm), s1 = load_sm(gsm + 8);
        m0 = load_min<S>(gsm + NR, s0), m1 = load_min<S>(gsm + NR + 8, s1);
        next += G;
      }
      const __m256i b = _mm256_srli_epi32(v, 8 * t);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, nib));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 4), nib));
      f(k, t, _mm256_fmadd_ps(lo, s0, m0), _mm256_fmadd_ps(hi, s1, m1));
    }
  }
}

// R <= 3 rows (a packed [K, R]), fp32 activations: each weight dequantized in registers and used for every
// row. One row keeps two interleaved accumulator sets (FMA latency); more rows are independent chains.
template <int R>
struct RegisterTile {
  static constexpr int I = R == 1 ? 2 : 1;
  __m256 acc[I][R][2];
  RegisterTile() {
    for (int i = 0; i < I; ++i)
      for (int r = 0; r < R; ++r) acc[i][r][0] = acc[i][r][1] = _mm256_setzero_ps();
  }
  inline void add(const float* a, int64_t k, int t, __m256 w0, __m256 w1) {
    const int i = I == 2 ? (t & 1) : 0;
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + k * R + r);
      acc[i][r][0] = _mm256_fmadd_ps(av, w0, acc[i][r][0]);
      acc[i][r][1] = _mm256_fmadd_ps(av, w1, acc[i][r][1]);
    }
  }
  void store(float* c) const {
    for (int r = 0; r < R; ++r) {
      __m256 c0 = acc[0][r][0], c1 = acc[0][r][1];
      if (I == 2) c0 = _mm256_add_ps(c0, acc[I - 1][r][0]), c1 = _mm256_add_ps(c1, acc[I - 1][r][1]);
      _mm256_storeu_ps(c + r * NR, c0);
      _mm256_storeu_ps(c + r * NR + 8, c1);
    }
  }
};

template <typename S, int R>
__attribute__((noinline)) void micro_kernel_int4(const float* a, const uint8_t* q, const sm_t<S>* sm, int64_t K,
                                                 int64_t G, float* c) {
  RegisterTile<R> tile;
  for_each_dequantized<S>(q, sm, K, G, [&](int64_t k, int t, __m256 w0, __m256 w1) { tile.add(a, k, t, w0, w1); });
  tile.store(c);
}

// The panel as fp32 [K, 16], for many rows (then the fp32 micro-kernel runs at the FMA rate).
template <typename S>
void widen_int4(const uint8_t* q, const sm_t<S>* sm, int64_t K, int64_t G, float* buf) {
  for_each_dequantized<S>(q, sm, K, G, [&](int64_t k, int, __m256 w0, __m256 w1) {
    _mm256_storeu_ps(buf + k * NR, w0);
    _mm256_storeu_ps(buf + k * NR + 8, w1);
  });
}

#ifdef PC_AVX512
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
#endif

// R rows of int8 activations (xq rows at stride K, block scales d at stride K / 32, group sums xs at
// stride K / G) against one panel; G a multiple of 32. Per quad and row: one maddubs per 8 columns
// (u4 x s8, pairs summed to int16: |.| <= 2 * 15 * 127), added in int16 over the block's 8 quads
// (<= 30480, no overflow), widened once per block by madd with ones.
template <int R, typename S>
__attribute__((noinline)) void micro_kernel_int4_int8(const int8_t* xq, const float* d, const float* xs, int64_t K,
                                                      int64_t G, const uint8_t* q, const sm_t<S>* sm, float* c) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t blocks = K / QB, groups = K / G, per_group = G / QB;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const sm_t<S>* gsm = sm + g * 2 * NR;
    const __m256 s0 = load_sm(gsm), s1 = load_sm(gsm + 8);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* qb = q + b * QB * 8;  // 256 bytes: 8 quads
      for (int l = 0; l < 256; l += 64) _mm_prefetch(reinterpret_cast<const char*>(qb + PF4 + l), _MM_HINT_T0);
      __m256i sum[R][2];
      for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + j * 32));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, xq + r * K + b * QB + j * 4, 4);
          const __m256i xv = _mm256_set1_epi32(x4);
          sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_maddubs_epi16(lo, xv));
          sum[r][1] = _mm256_add_epi16(sum[r][1], _mm256_maddubs_epi16(hi, xv));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 dv = _mm256_broadcast_ss(d + r * blocks + b);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][0], ones)), _mm256_mul_ps(s0, dv), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][1], ones)), _mm256_mul_ps(s1, dv), acc[r][1]);
      }
    }
    const __m256 m0 = load_min<S>(gsm + NR, s0), m1 = load_min<S>(gsm + NR + 8, s1);
    for (int r = 0; r < R; ++r) {
      const __m256 xsv = _mm256_broadcast_ss(xs + r * groups + g);
      acc[r][0] = _mm256_fmadd_ps(xsv, m0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xsv, m1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * NR, acc[r][0]);
    _mm256_storeu_ps(c + r * NR + 8, acc[r][1]);
  }
}
#else
template <typename S>
inline float min_of(const sm_t<S>* gsm, int64_t j) {  // column j's min in a group's panel
  if constexpr (std::is_same_v<S, HalfZero>)
    return -(float(gsm[NR + j]) * float(gsm[j]));
  else
    return float(gsm[NR + j]);
}

inline int code(const uint8_t* q, int64_t k, int64_t j) {  // column j's code at input k
  const uint8_t b = q[(k / 4) * 32 + (j % 8) * 4 + k % 4];
  return j < 8 ? (b & 0x0F) : (b >> 4);
}

template <typename S>
void widen_int4(const uint8_t* q, const sm_t<S>* sm, int64_t K, int64_t G, float* buf) {
  for (int64_t k = 0; k < K; ++k) {
    const sm_t<S>* gsm = sm + (k / G) * 2 * NR;
    for (int64_t j = 0; j < NR; ++j) buf[k * NR + j] = float(code(q, k, j)) * float(gsm[j]) + min_of<S>(gsm, j);
  }
}

template <int R, typename S>
void micro_kernel_int4_int8(const int8_t* xq, const float* d, const float* xs, int64_t K, int64_t G,
                            const uint8_t* q, const sm_t<S>* sm, float* c) {
  const int64_t blocks = K / QB, groups = K / G, per_group = G / QB;
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < NR; ++j) {
      float acc = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const sm_t<S>* gsm = sm + g * 2 * NR;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
          int32_t dot = 0;
          for (int64_t k = b * QB; k < (b + 1) * QB; ++k) dot += code(q, k, j) * xq[r * K + k];
          acc += float(dot) * (float(gsm[j]) * d[r * blocks + b]);
        }
        acc += xs[r * groups + g] * min_of<S>(gsm, j);
      }
      c[r * NR + j] = acc;
    }
}
#endif

// Rows of x as int8 per block of 32 inputs (xq = round-half-even(x * (127 * (1 / max|x|))), d = max|x| / 127),
// and per row and group xs = sum over its blocks of d * sum(xq): the min term's activation sum. A block
// holding inf or NaN gets d = NaN, so it reaches the output as NaN rather than as a wrong number.
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* d, float* xs) {
  const int64_t blocks = K / QB, groups = K / G, per_group = G / QB;
  for (int64_t i = 0; i < M * groups; ++i) xs[i] = 0.f;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t b = 0; b < blocks; ++b) {
      float v[QB];
      uint32_t amax_bits = 0;  // max of |x| on the bits: ordered like the floats, and NaN sorts above inf
      for (int64_t j = 0; j < QB; ++j) {
        v[j] = static_cast<float>(x[i * K + b * QB + j]);
        uint32_t u;
        std::memcpy(&u, &v[j], 4);
        amax_bits = std::max(amax_bits, u & 0x7FFFFFFFu);
      }
      int8_t* out = xq + i * K + b * QB;
      float db = 0.f;
      int32_t total = 0;
      if (amax_bits >= 0x7F800000u) {
        const uint32_t nan_bits = 0x7FC00000u;
        std::memcpy(&db, &nan_bits, 4);
        std::memset(out, 0, QB);
      } else if (amax_bits == 0) {
        std::memset(out, 0, QB);
      } else {
        float amax;
        std::memcpy(&amax, &amax_bits, 4);
        const float id = 127.f * (1.f / amax);  // as written: -ffast-math may turn 127 / amax into this anyway
        db = amax / 127.f;
        for (int64_t j = 0; j < QB; ++j) {
          const int32_t qv = static_cast<int32_t>(std::nearbyint(v[j] * id));
          out[j] = static_cast<int8_t>(qv);
          total += qv;
        }
      }
      d[i * blocks + b] = db;
      xs[i * groups + b / per_group] += db * static_cast<float>(total);
    }
}

// Panels [p0, p1) of an int4 weight against int8-quantized rows, two rows at a time.
template <typename X, typename S>
void int4_int8_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1) {
  const int64_t M = in.M, N = w.N, K = w.K, G = w.group_size, groups = K / G, Kp = round4(K);
  const uint8_t* q = static_cast<const uint8_t*>(w.w);
  float c[2 * NR];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* qp = q + p * Kp * 8;
    const sm_t<S>* smp = static_cast<const sm_t<S>*>(w.scale_min) + p * groups * 2 * NR;
    const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
    for (int64_t i = 0; i < M; i += 2) {
      const int64_t rows = std::min<int64_t>(2, M - i);
      const int8_t* xi = in.xq.data() + i * K;
      const float *di = in.d.data() + i * (K / QB), *si = in.xs.data() + i * groups;
      if (rows == 2)
        micro_kernel_int4_int8<2, S>(xi, di, si, K, G, qp, smp, c);
      else
        micro_kernel_int4_int8<1, S>(xi, di, si, K, G, qp, smp, c);
      store_tile(c, rows, ncols, w.bias, n0, y + i * N + n0, N);
    }
  }
}

// Panels [p0, p1) of an int4 weight against fp32 rows: dequantized in registers (one row) or widened.
template <typename X, typename S>
void int4_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1, std::vector<float>& wbuf) {
  const int64_t M = in.M, N = w.N, K = w.K, G = w.group_size, groups = K / G, Kp = round4(K);
  const uint8_t* q = static_cast<const uint8_t*>(w.w);
  const bool widen = M > REGISTER_ROWS;
  if (widen && int64_t(wbuf.size()) < K * NR) wbuf.resize(K * NR);
  float c[MR * NR];
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC);
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* qp = q + p * Kp * 8;
      const sm_t<S>* smp = static_cast<const sm_t<S>*>(w.scale_min) + p * groups * 2 * NR;
      if (widen) widen_int4<S>(qp, smp, K, G, wbuf.data());
      const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
      for (int64_t i = m0; i < m1; i += MR) {
        const int64_t rows = std::min(MR, m1 - i);
        const float* a = in.xp.data() + i * K;
        if (widen)
          tile(rows, a, rows, 1, wbuf.data(), K, c);
#ifdef PC_AVX2
        else if (rows == 1)
          micro_kernel_int4<S, 1>(a, qp, smp, K, G, c);
        else if (rows == 2)
          micro_kernel_int4<S, 2>(a, qp, smp, K, G, c);
        else
          micro_kernel_int4<S, 3>(a, qp, smp, K, G, c);
#endif
        store_tile(c, rows, ncols, w.bias, n0, y + i * N + n0, N);
      }
    }
  }
}

// ---- int8 weights (w = q * scale per group of G inputs: GGUF's Q8_0, compressed-tensors' W8A16) -------
// Panel p holds K (rounded up to 4, zero past K) inputs in quads: 64 bytes per quad, byte c * 4 + t =
// column c at input 4 * quad + t (columns 0-7 in its first 32 bytes, 8-15 in the next 32): each 32-bit
// lane holds 4 inputs of one column, as in the int4 panels. Beside it, per group, 16 scales (fp16 where
// every one is one, as Q8_0's d, else fp32); per channel is one group of K. Decode rows (M <= int8_rows)
// take int8 activations per 32 inputs as the int4 kernel does (llama.cpp's Q8_0 x Q8_0); other rows
// widen the panel to fp32 once and run the fp32 micro-kernel.
#ifdef PC_AVX2
// Each k of the panel dequantized (columns 0-7, 8-15) and handed to f(k, t = k % 4, w0, w1).
template <typename S, typename F>
inline void for_each_dequantized_int8(const int8_t* q, const sm_t<S>* sc, int64_t K, int64_t G, F&& f) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t next = 0;
  for (int64_t k0 = 0; k0 < K; k0 += 4) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k0 * 16));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k0 * 16 + 32));
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const int64_t k = k0 + t;
      if (k == K) return;
      if (k == next) {
        const sm_t<S>* g = sc + (k / G) * NR;
        s0 = load_sm(g), s1 = load_sm(g + 8);
        next += G;
      }
      // byte t of every lane, sign-extended: to the top byte, then an arithmetic shift down
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v0, 24 - 8 * t), 24));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v1, 24 - 8 * t), 24));
      f(k, t, _mm256_mul_ps(w0, s0), _mm256_mul_ps(w1, s1));
    }
  }
}

template <typename S>
void widen_int8(const int8_t* q, const sm_t<S>* sc, int64_t K, int64_t G, float* buf) {
  for_each_dequantized_int8<S>(q, sc, K, G, [&](int64_t k, int, __m256 w0, __m256 w1) {
    _mm256_storeu_ps(buf + k * NR, w0);
    _mm256_storeu_ps(buf + k * NR + 8, w1);
  });
}

template <typename S, int R>
__attribute__((noinline)) void micro_kernel_int8(const float* a, const int8_t* q, const sm_t<S>* sc, int64_t K,
                                                 int64_t G, float* c) {
  RegisterTile<R> tile;
  for_each_dequantized_int8<S>(q, sc, K, G, [&](int64_t k, int t, __m256 w0, __m256 w1) { tile.add(a, k, t, w0, w1); });
  tile.store(c);
}

// R rows of int8 activations against one int8 panel. Per quad and row: |w| (unsigned) times x with w's
// sign (maddubs: pairs summed to int16, |.| <= 2 * 128 * 127), widened by madd with ones and summed in
// int32 over the block; then y += s * d * sum per block in fp32.
template <int R, typename S>
__attribute__((noinline)) void micro_kernel_int8_int8(const int8_t* xq, const float* d, int64_t K, int64_t G,
                                                      const int8_t* q, const sm_t<S>* sc, float* c) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t blocks = K / QB, per_group = G / QB;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const sm_t<S>* g = sc + (b / per_group) * NR;
    const __m256 s0 = load_sm(g), s1 = load_sm(g + 8);
    const int8_t* qb = q + b * QB * 16;  // 512 bytes: 8 quads
    for (int l = 0; l < 512; l += 64) _mm_prefetch(reinterpret_cast<const char*>(qb + PF4 + l), _MM_HINT_T0);
    __m256i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + j * 64));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + j * 64 + 32));
      const __m256i a0 = _mm256_abs_epi8(v0), a1 = _mm256_abs_epi8(v1);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * K + b * QB + j * 4, 4);
        const __m256i xv = _mm256_set1_epi32(x4);
        const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, v0));
        const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, v1));
        sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(p0, ones));
        sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(p1, ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dv = _mm256_broadcast_ss(d + r * blocks + b);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][0]), _mm256_mul_ps(s0, dv), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][1]), _mm256_mul_ps(s1, dv), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * NR, acc[r][0]);
    _mm256_storeu_ps(c + r * NR + 8, acc[r][1]);
  }
}
#else
inline int code8(const int8_t* q, int64_t k, int64_t j) { return q[(k / 4) * 64 + j * 4 + k % 4]; }

template <typename S>
void widen_int8(const int8_t* q, const sm_t<S>* sc, int64_t K, int64_t G, float* buf) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < NR; ++j) buf[k * NR + j] = float(code8(q, k, j)) * float(sc[(k / G) * NR + j]);
}

template <int R, typename S>
void micro_kernel_int8_int8(const int8_t* xq, const float* d, int64_t K, int64_t G, const int8_t* q,
                            const sm_t<S>* sc, float* c) {
  const int64_t blocks = K / QB, per_group = G / QB;
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < NR; ++j) {
      float acc = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * QB; k < (b + 1) * QB; ++k) dot += code8(q, k, j) * xq[r * K + k];
        acc += float(dot) * (float(sc[(b / per_group) * NR + j]) * d[r * blocks + b]);
      }
      c[r * NR + j] = acc;
    }
}
#endif

// Panels [p0, p1) of an int8 weight against int8-quantized rows, two rows at a time.
template <typename X, typename S>
void int8_int8_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1) {
  const int64_t M = in.M, N = w.N, K = w.K, G = w.group_size, groups = K / G, Kp = round4(K);
  const int8_t* q = static_cast<const int8_t*>(w.w);
  float c[2 * NR];
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* qp = q + p * Kp * NR;
    const sm_t<S>* scp = static_cast<const sm_t<S>*>(w.scale_min) + p * groups * NR;
    const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
    for (int64_t i = 0; i < M; i += 2) {
      const int64_t rows = std::min<int64_t>(2, M - i);
      const int8_t* xi = in.xq.data() + i * K;
      const float* di = in.d.data() + i * (K / QB);
      if (rows == 2)
        micro_kernel_int8_int8<2, S>(xi, di, K, G, qp, scp, c);
      else
        micro_kernel_int8_int8<1, S>(xi, di, K, G, qp, scp, c);
      store_tile(c, rows, ncols, w.bias, n0, y + i * N + n0, N);
    }
  }
}

// Panels [p0, p1) of an int8 weight against fp32 rows: dequantized in registers (a few rows) or each
// panel widened once, then the fp32 tiles.
template <typename X, typename S>
void int8_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1, std::vector<float>& wbuf) {
  const int64_t M = in.M, N = w.N, K = w.K, G = w.group_size, groups = K / G, Kp = round4(K);
  const int8_t* q = static_cast<const int8_t*>(w.w);
  const bool widen = M > REGISTER_ROWS;
  if (widen && int64_t(wbuf.size()) < K * NR) wbuf.resize(K * NR);
  float c[MR * NR];
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC);
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* qp = q + p * Kp * NR;
      const sm_t<S>* scp = static_cast<const sm_t<S>*>(w.scale_min) + p * groups * NR;
      if (widen) widen_int8<S>(qp, scp, K, G, wbuf.data());
      const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
      for (int64_t i = m0; i < m1; i += MR) {
        const int64_t rows = std::min(MR, m1 - i);
        const float* a = in.xp.data() + i * K;
        if (widen)
          tile(rows, a, rows, 1, wbuf.data(), K, c);
#ifdef PC_AVX2
        else if (rows == 1)
          micro_kernel_int8<S, 1>(a, qp, scp, K, G, c);
        else if (rows == 2)
          micro_kernel_int8<S, 2>(a, qp, scp, K, G, c);
        else
          micro_kernel_int8<S, 3>(a, qp, scp, K, G, c);
#endif
        store_tile(c, rows, ncols, w.bias, n0, y + i * N + n0, N);
      }
    }
  }
}

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
  switch (w.type) {
    case at::kFloat: return dense_panels<X, float>(w, in, y, p0, p1, wbuf, side);
    case at::kBFloat16: return dense_panels<X, c10::BFloat16>(w, in, y, p0, p1, wbuf, side);
    case at::kChar:
      if (w.half_scales) {
        if (in.int8) return int8_int8_panels<X, c10::Half>(w, in, y, p0, p1);
        return int8_panels<X, c10::Half>(w, in, y, p0, p1, wbuf);
      }
      if (in.int8) return int8_int8_panels<X, float>(w, in, y, p0, p1);
      return int8_panels<X, float>(w, in, y, p0, p1, wbuf);
    case at::kByte:
      if (w.zero_point) {
        if (in.int8) return int4_int8_panels<X, HalfZero>(w, in, y, p0, p1);
        return int4_panels<X, HalfZero>(w, in, y, p0, p1, wbuf);
      }
      if (w.half_scales) {
        if (in.int8) return int4_int8_panels<X, c10::Half>(w, in, y, p0, p1);
        return int4_panels<X, c10::Half>(w, in, y, p0, p1, wbuf);
      }
      if (in.int8) return int4_int8_panels<X, float>(w, in, y, p0, p1);
      return int4_panels<X, float>(w, in, y, p0, p1, wbuf);
    default: TORCH_CHECK(false, "packed weight type");
  }
}

// A prompt's rows split between threads, each over every panel (from ROW_SPLIT_ROWS rows, x read in place): no
// thread ends on a short panel group (k/v's 12 panels were 4 + 2 a thread), a q/k/v/o weight (<= 1.3 MB) stays in
// each core's L2 across row blocks, and each thread's output rows stay in its core's cache for the row-wise ops
// after (split by panels, half of every row came from the other core). run(part, y_rows) runs one thread's rows.
template <typename Run>
bool run_by_rows(const PackedWeight& w, const torch::Tensor& x2, const Run& run) {
  const int64_t M = x2.size(0);
  const bool fp32 = x2.scalar_type() == at::kFloat && reads_x_in_place(w, M);
  if (M < ROW_SPLIT_ROWS || !(fp32 || vnni_reads_rows_in_place(w, x2.scalar_type()))) return false;
  at::parallel_for(0, (M + MR - 1) / MR, MC / MR, [&](int64_t t0, int64_t t1) {
    GemmInput part;
    part.M = std::min(M, t1 * MR) - t0 * MR;
    if (fp32)
      part.direct = x2.data_ptr<float>() + t0 * MR * w.K;
    else
      part.xb_rows = static_cast<const c10::BFloat16*>(x2.data_ptr()) + t0 * MR * w.K;
    run(part, t0 * MR);
  });
  return true;
}

// One linear as a torch op: a prompt's rows split (run_by_rows), or x prepared over the row tiles, then the panels
// split between threads (each weight panel read by one thread only). Grain: about 64k multiply-adds per chunk, so a
// tiny matmul runs inline.
void run_linear(const PackedWeight& w, const torch::Tensor& x2, torch::Tensor& y) {
  const int64_t row_bytes = w.N * y.element_size();
  if (run_by_rows(w, x2, [&](const GemmInput& part, int64_t r0) {
        std::vector<float> wbuf;
        gemm_panels(w, part, x2.scalar_type(), static_cast<char*>(y.data_ptr()) + r0 * row_bytes, 0, w.panels(), wbuf);
      }))
    return;
  // Kept per calling thread: a fresh one zero-filled M x K floats (12 MB for a 2048-row down_proj) on every call,
  // ~7% of a prefill step, before the fill overwrote them.
  // A reference: the parallel_for lambdas below must reach this thread's buffer, not their own thread's.
  static thread_local GemmInput kept;
  GemmInput& in = kept;
  gemm_input_resize(w, x2.size(0), in, x2.scalar_type() == at::kFloat ? x2.data_ptr<float>() : nullptr);
  const int64_t M = in.M;
  at::parallel_for(0, gemm_input_tiles(in), grain_for((in.int8 ? 1 : MR) * w.K), [&](int64_t b, int64_t e) {
    gemm_input_fill(w, x2.scalar_type(), x2.data_ptr(), in, b, e);
  });
  at::parallel_for(0, w.panels(), grain_for(M * w.K * NR, 65536), [&](int64_t p0, int64_t p1) {
    std::vector<float> wbuf;
    gemm_panels(w, in, x2.scalar_type(), y.data_ptr(), p0, p1, wbuf);
  });
}

// x [..., K] times the packed weight w (its bias from `bias`) -> [..., N] in x's dtype: the torch ops' body.
torch::Tensor run_packed(const torch::Tensor& x, PackedWeight w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  auto x2 = x.reshape({-1, w.K}).contiguous();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = w.N;
  auto y = torch::empty({x2.size(0), w.N}, x.options());
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == w.N, "bias: [out_features]");
    w.bias = b.data_ptr<float>();
  }
  if (x2.size(0) > 0) run_linear(w, x2, y);
  return y.view(out_sizes);
}

// silu(x W_gate^T) * (x W_up^T) over the fused [gate; up] packed weight: in the tiles where the AVX-512 ones run
// fp32 or widened bf16 panels (AVX2: the ymm tiles of fp32 / bf16 panels), else the product then silu_and_mul.
torch::Tensor run_packed_silu_mul(const torch::Tensor& x, PackedWeight w, const c10::optional<torch::Tensor>& bias) {
  const int64_t I = w.N / 2;
  auto x2 = x.reshape({-1, w.K}).contiguous();
  const int64_t M = x2.size(0);
  if (!silu_mul_runs(w, M)) {
    auto y = run_packed(x2, w, bias);
    return silu_and_mul(y.narrow(1, 0, I), y.narrow(1, I, I)).view([&] {
      auto sizes = x.sizes().vec();
      sizes.back() = I;
      return sizes;
    }());
  }
#ifdef PC_AVX2  // silu_mul_runs: the zmm, ymm or VNNI tiles
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == w.N, "bias: [2 * intermediate]");
    w.bias = b.data_ptr<float>();
  }
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = I;
  auto y = torch::empty({M, I}, x.options());
  if (M == 0) return y.view(out_sizes);
  const int64_t row_bytes = I * y.element_size();
  if (run_by_rows(w, x2, [&](const GemmInput& part, int64_t r0) {
        std::vector<float> wbuf;
        silu_mul_panels(w, part, x2.scalar_type(), static_cast<char*>(y.data_ptr()) + r0 * row_bytes, 0,
                        silu_mul_chunks(w), wbuf);
      }))
    return y.view(out_sizes);
  static thread_local GemmInput kept;  // as run_linear's
  GemmInput& in = kept;
  gemm_input_resize(w, M, in, x2.scalar_type() == at::kFloat ? x2.data_ptr<float>() : nullptr);
  at::parallel_for(0, gemm_input_tiles(in), grain_for(MR * w.K), [&](int64_t t0, int64_t t1) {
    gemm_input_fill(w, x2.scalar_type(), x2.data_ptr(), in, t0, t1);
  });
  at::parallel_for(0, silu_mul_chunks(w), grain_for(4 * M * w.K * NR, 65536), [&](int64_t c0, int64_t c1) {
    std::vector<float> wbuf;
    silu_mul_panels(w, in, x2.scalar_type(), y.data_ptr(), c0, c1, wbuf);
  });
  return y.view(out_sizes);
#else
  return torch::Tensor();
#endif
}
}  // namespace

void gemm_input_resize(const PackedWeight& w, int64_t M, GemmInput& in, const float* fp32_x) {
  in.direct = nullptr;  // `in` may be a kept one, last used by a call that read its x in place
  if (w.vnni) return vnni_input_resize(w, M, in);
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

namespace {
// out[p][k][j] = w[p * 16 + slot^-1(j)][k]: 16 source rows read in step, one panel (<= K * 64 bytes) written
// at a time; padding columns zero. Panels split between threads (an engine start packs ~100-500 MB).
template <typename T>
void pack_panels(const T* w, T* out, int64_t N, int64_t K) {
  const int64_t panels = (N + NR - 1) / NR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      T* dst = out + p * K * NR;
      for (int64_t c = 0; c < NR; ++c) {
        T* d = dst + slot<T>(c);
        const int64_t n = p * NR + c;
        if (n >= N) {
          for (int64_t k = 0; k < K; ++k) d[k * NR] = T(0);
          continue;
        }
        const T* src = w + n * K;
        for (int64_t k = 0; k < K; ++k) d[k * NR] = src[k];
      }
    }
  });
}
}  // namespace

torch::Tensor pack_linear_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "weight: [N, K]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "packed linear weights: float32 or bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + NR - 1) / NR;
  auto w = weight.contiguous();
  // [panels, K, 16]: a panel's 16 weights of one k are contiguous (bf16 in BF16_ORDER).
  auto packed = torch::empty({panels, K, NR}, weight.options());
  if (weight.scalar_type() == at::kFloat)
    pack_panels(w.data_ptr<float>(), packed.data_ptr<float>(), N, K);
  else
    pack_panels(w.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), N, K);
  return packed;
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, c10::optional<torch::Tensor> bias) {
  const bool vnni = packed_is_vnni(packed);
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == NR || vnni) && packed.is_contiguous(),
              "packed: [panels, K, 16] panels or bf16 [panels, K / 2, 32] VNNI pairs");
  const int64_t K = vnni ? 2 * packed.size(1) : packed.size(1), N = out_features;
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's in_features");
  TORCH_CHECK(packed.size(0) * NR >= N, "out_features larger than the packed weight");
  PackedWeight w{packed.scalar_type(), packed.data_ptr(), nullptr, nullptr, N, K, 0, 0};
  w.vnni = vnni;
  return run_packed(x, w, bias);
}

torch::Tensor packed_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                     c10::optional<torch::Tensor> bias) {
  const bool vnni = packed_is_vnni(packed);
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == NR || vnni) && packed.is_contiguous(),
              "packed: [panels, K, 16] panels or bf16 [panels, K / 2, 32] VNNI pairs");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  const int64_t K = vnni ? 2 * packed.size(1) : packed.size(1), N = out_features;
  TORCH_CHECK(N % (2 * NR) == 0 && packed.size(0) * NR == N,
              "out_features: the fused [gate; up] width, each half a multiple of 16, all of the packed weight");
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's in_features");
  PackedWeight w{packed.scalar_type(), packed.data_ptr(), nullptr, nullptr, N, K, 0, 0};
  w.vnni = vnni;
  return run_packed_silu_mul(x, w, bias);
}

// q: uint8 [N, K] values 0..15; scale, min: fp32 [N, K / G]. Returns (q panels uint8 [panels, K
// rounded up to 4, 8] in quads (see the int4 section), scale/min [panels, K / G, 2, 16] in scale's dtype,
// fp32 or fp16); padding
// columns and inputs are zero.
std::tuple<torch::Tensor, torch::Tensor> pack_int4_weight(torch::Tensor q, torch::Tensor scale, torch::Tensor min,
                                                         int64_t group_size) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "q: uint8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), G = group_size, panels = (N + NR - 1) / NR, Kp = round4(K);
  TORCH_CHECK(G > 0 && G % 2 == 0 && K % G == 0, "K must be a multiple of an even group size");
  TORCH_CHECK(scale.sizes() == min.sizes() && scale.size(0) == N && scale.size(1) == K / G, "scale/min: [N, K / G]");
  auto qp = torch::zeros({panels * NR, Kp}, q.options());
  qp.narrow(0, 0, N).narrow(1, 0, K).copy_(q.bitwise_and(0x0F));
  qp = qp.view({panels, NR, Kp / 4, 4}).permute({0, 2, 1, 3});  // [panels, quads, 16 columns, 4 inputs]
  auto packed = qp.narrow(2, 0, 8).bitwise_or(qp.narrow(2, 8, 8).bitwise_left_shift(4)).contiguous().view({panels, Kp, 8});
  TORCH_CHECK(scale.scalar_type() == min.scalar_type() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scale/min: both fp32 or both fp16 (the panels keep their dtype)");
  auto sm = torch::zeros({panels * NR, K / G, 2}, scale.options());
  sm.narrow(0, 0, N).select(2, 0).copy_(scale);
  sm.narrow(0, 0, N).select(2, 1).copy_(min);
  sm = sm.view({panels, NR, K / G, 2}).permute({0, 2, 3, 1}).contiguous();  // [panels, K/G, 2, 16]
  return {packed, sm};
}

torch::Tensor packed_linear_int4(torch::Tensor x, torch::Tensor q, torch::Tensor sm, int64_t out_features,
                                 int64_t group_size, c10::optional<torch::Tensor> bias, int64_t int8_rows,
                                 bool zero_point) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 8 && q.is_contiguous() && q.scalar_type() == at::kByte, "q: [panels, K, 8]");
  TORCH_CHECK(sm.dim() == 4 && sm.size(0) == q.size(0) && sm.size(2) == 2 && sm.size(3) == NR && sm.is_contiguous() &&
                  (sm.scalar_type() == at::kFloat || sm.scalar_type() == at::kHalf),
              "scale/min: [panels, K / G, 2, 16] fp32 or fp16");
  const int64_t G = group_size, K = sm.size(1) * G, N = out_features;
  TORCH_CHECK(!zero_point || sm.scalar_type() == at::kHalf, "zero points: fp16 scale/zero panels");
  TORCH_CHECK(G > 0 && q.size(1) == round4(K), "group_size does not match the packed weight");
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's in_features");
  TORCH_CHECK(q.size(0) * NR >= N, "out_features larger than the packed weight");
  return run_packed(x, {at::kByte, q.data_ptr(), sm.data_ptr(), nullptr, N, K, G, int8_rows,
                       sm.scalar_type() == at::kHalf, zero_point}, bias);
}

// q: int8 [N, K]; scale: fp32 or fp16 [N, K / G] (one group of K: per channel). Returns (q panels int8
// [panels, K rounded up to 4, 16] in quads (see the int8 section), scale panels [panels, K / G, 16] in
// scale's dtype); padding columns and inputs are zero.
std::tuple<torch::Tensor, torch::Tensor> pack_int8_weight(torch::Tensor q, torch::Tensor scale, int64_t group_size) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "q: int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), G = group_size, panels = (N + NR - 1) / NR, Kp = round4(K);
  TORCH_CHECK(G > 0 && K % G == 0, "K must be a multiple of the group size");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / G, "scale: [N, K / G]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf, "scale: fp32 or fp16");
  auto qp = torch::zeros({panels * NR, Kp}, q.options());
  qp.narrow(0, 0, N).narrow(1, 0, K).copy_(q);
  auto packed = qp.view({panels, NR, Kp / 4, 4}).permute({0, 2, 1, 3}).contiguous().view({panels, Kp, NR});
  auto sc = torch::zeros({panels * NR, K / G}, scale.options());
  sc.narrow(0, 0, N).copy_(scale);
  return {packed, sc.view({panels, NR, K / G}).permute({0, 2, 1}).contiguous()};
}

torch::Tensor packed_linear_int8(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t out_features,
                                 int64_t group_size, c10::optional<torch::Tensor> bias, int64_t int8_rows) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == NR && q.is_contiguous() && q.scalar_type() == at::kChar,
              "q: int8 [panels, K, 16]");
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == q.size(0) && scale.size(2) == NR && scale.is_contiguous() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "scale: [panels, K / G, 16] fp32 or fp16");
  const int64_t G = group_size, K = scale.size(1) * G, N = out_features;
  TORCH_CHECK(G > 0 && q.size(1) == round4(K), "group_size does not match the packed weight");
  TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's in_features");
  TORCH_CHECK(q.size(0) * NR >= N, "out_features larger than the packed weight");
  return run_packed(x, {at::kChar, q.data_ptr(), scale.data_ptr(), nullptr, N, K, G, int8_rows,
                       scale.scalar_type() == at::kHalf, false}, bias);
}

// Probe (not part of the engine): whether AMX tiles overlap streaming a weight from memory with their products, at
// decode-sized M (the decode stack's 17-128 rows). One fused gate/up-sized weight (N = 3072, K = 576, bf16 VNNI
// panels), rotated over 1 GiB of copies so every call reads it from memory, panels split between OpenMP threads.
//   g++ -O2 -march=native -fopenmp benchmarks/amx_stream_overlap.cpp -o /tmp/amx_overlap
//   for v in 4 5 0 1 3; do OMP_NUM_THREADS=2 HUGE=1 /tmp/amx_overlap 64 3072 576 $v; done
//   OMP_NUM_THREADS=2 HUGE=1 /tmp/amx_overlap 64 3072 576 2 DIST STEP HINT   (DIST pairs ahead; HINT 0-3 T0/T1/T2/NTA,
//   4 a plain vector load, 5 a byte load)
// V: 0 the engine's loop (blocks of 512 KiB, 32-row pairs inside, 16 lines a panel asked for 4 tiles ahead on the
// first pass); 1 panel pairs outermost; 2 the same, the pair DIST ahead asked for spread over this pair's calls; 3 four
// panels x one row tile (amx_4x1) over each row tile; 4 the weight's read alone (amx_4x1 at 16 rows); 5 the products
// alone (the same 8 panels every call, from cache); 7 the products from cache while the rotated weight is asked for
// (HINT) at the rate of V2; 14 / 15 each pair asked for (14) or not (15), STEP us of spinning, then its products.
// Session 49 (AMX Xeon, 2 vCPUs, 2 MiB THP on, 2 threads, us per call): read alone 132-139, products alone 84-92,
// the engine's loop 234-257 = the two added, not overlapped; pairs outermost 225-240; next pairs asked for 1-8 pairs
// ahead with any hint 225-240; plain loads instead 229-238; 4x1 row tiles 211-216. One thread the same (read 248-261,
// products 148-152, the engine's loop 386-446). 14 vs 15 (one thread, 5 us spins): a pair asked for and given 5 us
// to arrive then multiplies no faster than one read on demand. oneDNN's pre-packed matmul at 64 rows: the same
// 240 us (bench linears). So at 64 rows the tiles wait out each of their weight's reads: the decode step's GEMMs cost
// reads + products on this machine, whatever asks for the lines ahead.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <sys/mman.h>
typedef uint16_t bf;
struct TileCfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void cfg() { TileCfg c{}; c.palette = 1; for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; } _tile_loadconfig(&c); }
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
constexpr int64_t NR = 16, KT = 32, TILE = 512;
int DIST = 4, STEP = 64, HINT = 0, RATE = 16;
static inline void pf(const char* p) {
  switch (HINT) { case 0: _mm_prefetch(p, _MM_HINT_T0); break; case 1: _mm_prefetch(p, _MM_HINT_T1); break;
  case 2: _mm_prefetch(p, _MM_HINT_T2); break; case 4: asm volatile("vmovdqa64 (%0), %%zmm31" :: "r"(p) : "xmm31", "memory"); break;
  case 5: asm volatile("movb (%0), %%al" :: "r"(p) : "al", "memory"); break; default: _mm_prefetch(p, _MM_HINT_NTA); }
}
// side: n lines from sp spread over the ks steps
__attribute__((noinline)) void amx_2x2(const bf* a0, const bf* a1, const bf* w, int64_t K, float* c, bool prefetch, const char* sp, int64_t sn) {
  const int64_t ks = K / KT, ps = ks * TILE;
  int64_t done = 0;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < ks; ++k) {
    for (const int64_t e = (k + 1) * sn / ks; done < e; ++done) pf(sp + done * 64);
    if (prefetch)
      for (int q = 0; q < 2; ++q)
        for (int l = 0; l < 1024; l += STEP)
          pf(reinterpret_cast<const char*>(w + q * ps + (k + DIST) * TILE) + l);
    _tile_loadd(6, w + k * TILE, 64);
    _tile_loadd(7, w + ps + k * TILE, 64);
    _tile_loadd(4, a0 + k * KT, K * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + k * KT, K * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 2 * 64); _tile_stored(1, c + 16, 2 * 64); _tile_stored(2, c + 16 * 32, 2 * 64); _tile_stored(3, c + 16 * 32 + 16, 2 * 64);
}
__attribute__((noinline)) void amx_4x1(const bf* a, const bf* w, int64_t K, float* c, bool prefetch) {
  const int64_t ks = K / KT, ps = ks * TILE;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < ks; ++k) {
    if (prefetch) for (int q = 0; q < 4; ++q) for (int l = 0; l < 1024; l += 512) _mm_prefetch(reinterpret_cast<const char*>(w + q * ps + (k + 4) * TILE) + l, _MM_HINT_T0);
    _tile_loadd(4, a + k * KT, K * 2);
    _tile_loadd(6, w + k * TILE, 64); _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w + ps + k * TILE, 64); _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, w + 2 * ps + k * TILE, 64); _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, w + 3 * ps + k * TILE, 64); _tile_dpbf16ps(3, 4, 7);
  }
  _tile_stored(0, c, 4 * 64); _tile_stored(1, c + 16, 4 * 64); _tile_stored(2, c + 32, 4 * 64); _tile_stored(3, c + 48, 4 * 64);
}
static inline void store_block(const float* c, int64_t ldc, int64_t rows, int64_t n0, bf* y, int64_t N) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_loadu_ps(c + r * ldc);
    _mm256_storeu_si256((__m256i*)(y + r * N + n0), (__m256i)_mm512_cvtneps_pbh(v));
  }
}
int64_t M, N, K;
bf *X, *Y;
std::vector<bf*> Ws;
int V = 0;
void run(const bf* W) {
  const int64_t ps = K * NR, P = N / NR;
#pragma omp parallel
  {
    int t = omp_get_thread_num(), n = omp_get_num_threads();
    cfg();
    alignas(64) float c[32 * 64];
    int64_t p0 = P * t / n / 4 * 4, p1 = t == n - 1 ? P : P * (t + 1) / n / 4 * 4;
    if (V == 0) {  // engine: blocks of 512 KiB, m0 pairs inside, prefetch at m0 == 0
      const int64_t block = 2 * std::max<int64_t>(1, (512 << 10) / (2 * ps * 2));
      for (int64_t b = p0; b < p1; b += block) {
        const int64_t e = std::min(p1, b + block);
        for (int64_t m0 = 0; m0 < M; m0 += 32)
          for (int64_t p = b; p < e; p += 2) {
            amx_2x2(X + m0 * K, X + (m0 + 16) * K, W + p * ps, K, c, m0 == 0, nullptr, 0);
            for (int q = 0; q < 2; ++q) store_block(c + q * 16, 32, 32, (p + q) * NR, Y + m0 * N, N);
          }
      }
    } else if (V == 1) {  // pair outer, prefetch own at m0 == 0
      for (int64_t p = p0; p < p1; p += 2)
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
          amx_2x2(X + m0 * K, X + (m0 + 16) * K, W + p * ps, K, c, m0 == 0, nullptr, 0);
          for (int q = 0; q < 2; ++q) store_block(c + q * 16, 32, 32, (p + q) * NR, Y + m0 * N, N);
        }
    } else if (V == 2) {  // pair outer, next pairs (RATE pairs ahead: AHEAD=DIST pairs) prefetched spread over this pair's calls
      const int64_t lines = 2 * ps * 2 / 64, calls = (M + 31) / 32, per = (lines + calls - 1) / calls;
      // warm: first DIST pairs
      for (int64_t p = p0; p < std::min(p1, p0 + 2 * DIST); ++p) for (int64_t l = 0; l < ps * 2 / 64; ++l) pf((const char*)(W + p * ps) + l * 64);
      for (int64_t p = p0; p < p1; p += 2) {
        const int64_t np = p + 2 * DIST;
        const char* nx = (const char*)(W + np * ps);
        int64_t t2 = 0;
        for (int64_t m0 = 0; m0 < M; m0 += 32, ++t2) {
          const int64_t n0 = std::min(lines, t2 * per), n1 = std::min(lines, (t2 + 1) * per);
          amx_2x2(X + m0 * K, X + (m0 + 16) * K, W + p * ps, K, c, false, np < p1 ? nx + n0 * 64 : nullptr, np < p1 ? n1 - n0 : 0);
          for (int q = 0; q < 2; ++q) store_block(c + q * 16, 32, 32, (p + q) * NR, Y + m0 * N, N);
        }
      }
    } else if (V == 3) {  // 4x1 groups outer, row tiles inner
      for (int64_t p = p0; p < p1; p += 4)
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
          amx_4x1(X + m0 * K, W + p * ps, K, c, m0 == 0);
          for (int q = 0; q < 4; ++q) store_block(c + q * 16, 64, 16, (p + q) * NR, Y + m0 * N, N);
        }
    } else if (V == 4) {  // memory only: 4x1 at M=16 rows (read floor)
      for (int64_t p = p0; p < p1; p += 4) {
        amx_4x1(X, W + p * ps, K, c, true);
        for (int q = 0; q < 4; ++q) store_block(c + q * 16, 64, 16, (p + q) * NR, Y, N);
      }
    } else if (V == 7) {  // the products from cache, the rotated weight's pairs asked for at V2's rate
      const int64_t lines = 2 * ps * 2 / 64, calls = (M + 31) / 32, per = (lines + calls - 1) / calls;
      for (int64_t p = p0; p < p1; p += 2) {
        const char* nx = (const char*)(W + p * ps);
        int64_t t2 = 0;
        for (int64_t m0 = 0; m0 < M; m0 += 32, ++t2) {
          const int64_t n0 = std::min(lines, t2 * per), n1 = std::min(lines, (t2 + 1) * per);
          amx_2x2(X + m0 * K, X + (m0 + 16) * K, Ws[0] + (p % 8) * ps, K, c, false, nx + n0 * 64, n1 - n0);
          for (int q = 0; q < 2; ++q) store_block(c + q * 16, 32, 32, (p + q) * NR, Y + m0 * N, N);
        }
      }
    } else if (V == 14 || V == 15) {  // per pair: prefetch all its lines (V14) or not (V15), wait SPIN us, compute it
      for (int64_t p = p0; p < p1; p += 2) {
        if (V == 14) for (int64_t l = 0; l < 2 * ps * 2 / 64; ++l) pf((const char*)(W + p * ps) + l * 64);
        const double t0 = now(); while (now() - t0 < STEP * 1e-6) {}
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
          amx_2x2(X + m0 * K, X + (m0 + 16) * K, W + p * ps, K, c, false, nullptr, 0);
          for (int q = 0; q < 2; ++q) store_block(c + q * 16, 32, 32, (p + q) * NR, Y + m0 * N, N);
        }
      }
    } else if (V == 5) {  // compute only: same weights every call (cache), engine loop
      for (int64_t p = p0; p < p1; p += 2)
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
          amx_2x2(X + m0 * K, X + (m0 + 16) * K, Ws[0] + (p % 8) * ps, K, c, false, nullptr, 0);
          for (int q = 0; q < 2; ++q) store_block(c + q * 16, 32, 32, (p + q) * NR, Y + m0 * N, N);
        }
    }
  }
}
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  M = atoi(argv[1]); N = atoi(argv[2]); K = atoi(argv[3]); V = atoi(argv[4]);
  if (argc > 5) DIST = atoi(argv[5]);
  if (argc > 6) STEP = atoi(argv[6]);
  if (argc > 7) HINT = atoi(argv[7]);
  const int64_t wbytes = N * K * 2, copies = std::max<int64_t>(2, (1024ll << 20) / wbytes);
  for (int64_t i = 0; i < copies; ++i) { const size_t al = (wbytes + (2<<20) - 1) / (2<<20) * (2<<20); bf* w = (bf*)aligned_alloc(2<<20, al); if (getenv("HUGE")) madvise(w, al, MADV_HUGEPAGE); for (int64_t j = 0; j < N * K; ++j) w[j] = 0x3c00 + (j * 7 + i) % 64; Ws.push_back(w); }
  X = (bf*)aligned_alloc(64, M * K * 2); for (int64_t j = 0; j < M * K; ++j) X[j] = 0x3c00 + j % 17;
  Y = (bf*)aligned_alloc(64, M * N * 2);
  for (int i = 0; i < copies; ++i) run(Ws[i]);
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    double t0 = now();
    for (int i = 0; i < copies; ++i) run(Ws[i]);
    best = std::min(best, (now() - t0) / copies);
  }
  printf("M=%ld N=%ld K=%ld V=%d DIST=%d STEP=%d HINT=%d: %.1f us  %.1f GB/s  %.2f TFLOP/s\n", M, N, K, V, DIST, STEP, HINT, best * 1e6, wbytes / best / 1e9, 2.0 * M * N * K / best / 1e12);
}

// Probe (not part of the engine): how fast AMX bf16 tiles stream SmolLM2's 30 layers of fused weights (q/k/v,
// o, gate/up, down; 212 MB of bf16 in VNNI k-pair panels) at M rows, 2 OpenMP threads. The measurement
// behind issue 13's next step (an AMX kernel of our own inside the decode stack). Build and run on an AMX CPU:
//   g++ -O2 -march=native -mamx-tile -mamx-bf16 -fopenmp benchmarks/amx_probe.cpp -o /tmp/amx_probe
//   for m in 4 16 32 64; do /tmp/amx_probe $m; done
// Session 12 (Xeon, quiet, read bandwidth 24-28 GB/s in the same minute): M=4 8.05 ms (26.4 GB/s), M=16 7.6-7.7
// (27.8), M=32 9.0 (23.5), M=64 14.2 (15.0, the second 32-row pass re-reads the panels: block it); oneDNN's
// pre-packed matmul over the same shapes: M=4 12.1 ms, M=64 16.1.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct TileCfg {
  uint8_t palette, start;
  uint8_t res[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static void config_tiles() {
  TileCfg c{};
  c.palette = 1;
  for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; }
  _tile_loadconfig(&c);
}

// W panels: [N/16][K/32][16 (k pairs)][16 cols][2] bf16 = per (panel, kstep) one 1 KB tile.
// A: [M][K] bf16 row-major. C: [M][N] fp32.
static void gemm(const uint16_t* A, const uint16_t* W, float* C, int M, int N, int K, int p0, int p1) {
  const int ks = K / 32;
  for (int p = p0; p < p1; p += 2) {  // two panels at a time
    for (int m0 = 0; m0 < M; m0 += 32) {  // 32 rows: 2 row tiles x 2 panels = 4 C tiles
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      const uint16_t* w0 = W + (size_t)p * ks * 512;
      const uint16_t* w1 = W + (size_t)(p + 1) * ks * 512;
      for (int k = 0; k < ks; ++k) {
        if (m0 == 0) {
          for (int c = 0; c < 1024; c += 64) {
            _mm_prefetch((const char*)(w0 + (k + 4) * 512) + c, _MM_HINT_T0);
            _mm_prefetch((const char*)(w1 + (k + 4) * 512) + c, _MM_HINT_T0);
          }
        }
        _tile_loadd(4, w0 + k * 512, 64);
        _tile_loadd(5, w1 + k * 512, 64);
        _tile_loadd(6, A + (size_t)m0 * K + k * 32, K * 2);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
        _tile_loadd(7, A + (size_t)(m0 + 16) * K + k * 32, K * 2);
        _tile_dpbf16ps(2, 7, 4);
        _tile_dpbf16ps(3, 7, 5);
      }
      _tile_stored(0, C + (size_t)m0 * N + p * 16, N * 4);
      _tile_stored(1, C + (size_t)m0 * N + (p + 1) * 16, N * 4);
      _tile_stored(2, C + (size_t)(m0 + 16) * N + p * 16, N * 4);
      _tile_stored(3, C + (size_t)(m0 + 16) * N + (p + 1) * 16, N * 4);
    }
  }
}

// One panel, 4 row tiles (M = 64): each weight tile loaded once, A tiles from L1/L2.
static void gemm64(const uint16_t* A, const uint16_t* W, float* C, int M, int N, int K, int p0, int p1) {
  const int ks = K / 32;
  for (int p = p0; p < p1; ++p) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint16_t* w0 = W + (size_t)p * ks * 512;
    for (int k = 0; k < ks; ++k) {
      _mm_prefetch((const char*)(w0 + (k + 4) * 512), _MM_HINT_T0);
      _mm_prefetch((const char*)(w0 + (k + 4) * 512 + 256), _MM_HINT_T0);
      _tile_loadd(4, w0 + k * 512, 64);
      _tile_loadd(5, A + k * 32, K * 2);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(6, A + (size_t)16 * K + k * 32, K * 2);
      _tile_dpbf16ps(1, 6, 4);
      _tile_loadd(5, A + (size_t)32 * K + k * 32, K * 2);
      _tile_dpbf16ps(2, 5, 4);
      _tile_loadd(6, A + (size_t)48 * K + k * 32, K * 2);
      _tile_dpbf16ps(3, 6, 4);
    }
    _tile_stored(0, C + p * 16, N * 4);
    _tile_stored(1, C + (size_t)16 * N + p * 16, N * 4);
    _tile_stored(2, C + (size_t)32 * N + p * 16, N * 4);
    _tile_stored(3, C + (size_t)48 * N + p * 16, N * 4);
  }
}

// M <= 16: one A tile per k step, four panels' C tiles; the weight streams once, 4 KB per k step.
static void gemm16(const uint16_t* A, const uint16_t* W, float* C, int M, int N, int K, int p0, int p1) {
  const int ks = K / 32;
  for (int p = p0; p < p1; p += 4) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint16_t* w = W + (size_t)p * ks * 512;
    const size_t ps = (size_t)ks * 512;  // next panel
    for (int k = 0; k < ks; ++k) {
      _mm_prefetch((const char*)(w + (k + 4) * 512), _MM_HINT_T0);
      _mm_prefetch((const char*)(w + ps + (k + 4) * 512), _MM_HINT_T0);
      _mm_prefetch((const char*)(w + 2 * ps + (k + 4) * 512), _MM_HINT_T0);
      _mm_prefetch((const char*)(w + 3 * ps + (k + 4) * 512), _MM_HINT_T0);
      _tile_loadd(4, A + k * 32, K * 2);
      _tile_loadd(5, w + k * 512, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, w + ps + k * 512, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, w + 2 * ps + k * 512, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, w + 3 * ps + k * 512, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, C + p * 16, N * 4);
    _tile_stored(1, C + (p + 1) * 16, N * 4);
    _tile_stored(2, C + (p + 2) * 16, N * 4);
    _tile_stored(3, C + (p + 3) * 16, N * 4);
  }
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) { perror("arch_prctl"); return 1; }
  const int M = argc > 1 ? atoi(argv[1]) : 64;
  const int L = 30;
  const int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  std::vector<std::vector<uint16_t>> W(L * 4);
  size_t bytes = 0;
  for (int l = 0; l < L; ++l)
    for (int s = 0; s < 4; ++s) {
      auto& w = W[l * 4 + s];
      w.resize((size_t)shapes[s][0] * shapes[s][1]);
      for (size_t i = 0; i < w.size(); ++i) w[i] = 0x3c00 + (i % 7);
      bytes += w.size() * 2;
    }
  std::vector<uint16_t> A((size_t)(M < 64 ? 64 : M) * 1536, 0x3f80);
  std::vector<float> C((size_t)(M < 64 ? 64 : M) * 3072);
  double best = 1e9;
  for (int rep = 0; rep < 8; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < L; ++l)
      for (int s = 0; s < 4; ++s) {
        const int N = shapes[s][0], K = shapes[s][1];
#pragma omp parallel num_threads(2)
        {
          config_tiles();
          const int tid = omp_get_thread_num(), panels = N / 16, per = (panels / 2 + 1) / 2 * 2;
          const int p0 = tid * per, p1 = tid ? panels : per;
          if (M <= 16) { const int q = panels / 4, pq = (q + 1) / 2 * 4; gemm16(A.data(), W[l * 4 + s].data(), C.data(), M, N, K, tid * pq, tid ? panels : pq); }
          else if (M == 64 && getenv("ONE")) gemm64(A.data(), W[l * 4 + s].data(), C.data(), M, N, K, p0, p1);
          else gemm(A.data(), W[l * 4 + s].data(), C.data(), M, N, K, p0, p1);
          _tile_release();
        }
      }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt < best) best = dt;
  }
  printf("M=%d: %.2f ms for %.0f MB = %.1f GB/s, %.2f TFLOP/s\n", M, best * 1e3, bytes / 1e6, bytes / best / 1e9,
         2.0 * M * bytes / 2 / best / 1e12);
}

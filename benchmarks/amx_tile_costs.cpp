// Probe (not part of the engine): what one AMX bf16 tile operation costs on this CPU, one thread. Why: on the
// session-47 Xeon (KVM, 2 vCPUs, 2 MiB L2 each) the decode stack's AMX tiles ran a 64-row step's GEMMs at ~1.0
// TFLOP/s against torch's 1.88 measured peak, and took the weights' read time plus their products' time (no overlap).
// Build and run on an AMX CPU:
//   g++ -O2 -march=native -mamx-tile -mamx-bf16 benchmarks/amx_tile_costs.cpp -o /tmp/amx_tile_costs && /tmp/amx_tile_costs
// Session 47 (the other vCPU busy): TDPBF16PS alone 5.1-5.4 ns (3.0-3.2 TFLOP/s a core); 2 x 2 tiles with their four
// 1 KiB loads from L1 68-71 ns a k step (0.93-0.98 TFLOP/s); 4 panels x 1 row tile (five loads) 81-85 ns; four tile
// loads alone 18.7 ns each; the 4 x 1 step with its weight tiles over 1 MiB 90 ns, 2 MiB 107-113 ns, 128 MiB 340 ns
// (12 GB/s a thread). So the tiles are bound by their loads, not the products: a kernel here gains by loading fewer
// tiles per product, not by prefetching (asking for the next panel pair or the next layer's K/V during the tiles
// slowed the 64-row GEMMs by ~20%).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
struct TileCfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void cfg() { TileCfg c{}; c.palette = 1; for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; } _tile_loadconfig(&c); }
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  cfg();
  std::vector<uint16_t> buf(64 << 20);  // 128 MB
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = 0x3f80;
  const int N = 2000000;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, buf.data(), 64); _tile_loadd(5, buf.data(), 64); _tile_loadd(6, buf.data(), 64); _tile_loadd(7, buf.data(), 64);
  double t = now();
  for (int i = 0; i < N; ++i) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
  double dt = now() - t;
  printf("dp only: %.2f ns/op  %.0f GFLOP/s\n", dt / (4.0 * N) * 1e9, 4.0 * N * 16384 / dt / 1e9);
  // loads from L1: 2 B + 2 A per 4 dp
  t = now();
  for (int i = 0; i < N; ++i) {
    _tile_loadd(6, buf.data(), 64); _tile_loadd(7, buf.data() + 512, 64);
    _tile_loadd(4, buf.data() + 1024, 64); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, buf.data() + 1536, 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  dt = now() - t;
  printf("2x2 L1: %.2f ns/kstep  %.0f GFLOP/s\n", dt / N * 1e9, 4.0 * N * 16384 / dt / 1e9);
  // 4x1: 1 A + 4 B from L1
  t = now();
  for (int i = 0; i < N; ++i) {
    _tile_loadd(4, buf.data(), 64);
    _tile_loadd(6, buf.data() + 512, 64); _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, buf.data() + 1024, 64); _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, buf.data() + 1536, 64); _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, buf.data() + 2048, 64); _tile_dpbf16ps(3, 4, 7);
  }
  dt = now() - t;
  printf("4x1 L1: %.2f ns/kstep  %.0f GFLOP/s\n", dt / N * 1e9, 4.0 * N * 16384 / dt / 1e9);
  // 4x1 with B streamed over 1 MB (L2)
  for (size_t span : {(size_t)1 << 19, (size_t)1 << 20, (size_t)64 << 20}) {
    const size_t tiles = span / 512;  // 512 bf16 per tile
    int M2 = N / 4;
    t = now();
    size_t j = 0;
    for (int i = 0; i < M2; ++i) {
      _tile_loadd(4, buf.data(), 64);
      _tile_loadd(6, buf.data() + 512 * ((j) % tiles), 64); _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, buf.data() + 512 * ((j + 1) % tiles), 64); _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, buf.data() + 512 * ((j + 2) % tiles), 64); _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, buf.data() + 512 * ((j + 3) % tiles), 64); _tile_dpbf16ps(3, 4, 7);
      j += 4;
    }
    dt = now() - t;
    printf("4x1 B over %zu KB: %.2f ns/kstep  %.1f GB/s of B\n", span * 2 / 1024, dt / M2 * 1e9, 4096.0 * M2 / dt / 1e9);
  }

  // double-buffered 1x2: C 0,1; A 2|3; B 4,5|6,7 (no tile reloaded while the step before still reads it)
  t = now();
  for (int i = 0; i < N / 2; ++i) {
    _tile_loadd(2, buf.data(), 64); _tile_loadd(4, buf.data() + 512, 64); _tile_loadd(5, buf.data() + 1024, 64);
    _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(1, 2, 5);
    _tile_loadd(3, buf.data() + 1536, 64); _tile_loadd(6, buf.data() + 2048, 64); _tile_loadd(7, buf.data() + 2560, 64);
    _tile_dpbf16ps(0, 3, 6); _tile_dpbf16ps(1, 3, 7);
  }
  dt = now() - t;
  printf("1x2 db L1: %.2f ns/dp  %.0f GFLOP/s\n", dt / (2.0 * N) * 1e9, 2.0 * N * 16384 / dt / 1e9);
  // 2x2, loads ordered after the dps that last read them, A first
  t = now();
  for (int i = 0; i < N; ++i) {
    _tile_loadd(4, buf.data() + 1024, 64); _tile_loadd(6, buf.data(), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, buf.data() + 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, buf.data() + 1536, 64);
    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  dt = now() - t;
  printf("2x2 L1 reordered: %.2f ns/kstep  %.0f GFLOP/s\n", dt / N * 1e9, 4.0 * N * 16384 / dt / 1e9);
  // loads only
  t = now();
  for (int i = 0; i < N; ++i) { _tile_loadd(4, buf.data(), 64); _tile_loadd(5, buf.data() + 512, 64); _tile_loadd(6, buf.data() + 1024, 64); _tile_loadd(7, buf.data() + 1536, 64); }
  dt = now() - t;
  printf("loads only L1: %.2f ns/load\n", dt / (4.0 * N) * 1e9);
  float c[256]; _tile_stored(0, c, 64); printf("%f\n", c[0]);
}

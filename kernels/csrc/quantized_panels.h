// The panel loops every quantized weight kind shares (cpu_gemm_int4.cpp, cpu_gemm_int8.cpp): a Kind supplies the
// codes' layout and its kernels, these walk the panels and rows and store the tiles. Internal to the file that
// includes it (an anonymous namespace).
//
// A Kind has: Code (the panel's element type), kPanelStride (Codes a panel holds per input), kScaleStride (scale
// entries a panel holds per group), widen<S>(q, sm, K, G, buf) (a panel as fp32 [K, 16]), int8_rows<R, S>(in, i, K,
// G, q, sm, c) (rows i.. of int8 activations against a panel), and on AVX2 registers<S, R>(a, q, sm, K, G, c) (R
// fp32 rows against a panel dequantized in registers).
#pragma once

#include "gemm_tiles.h"

namespace {

// Panels [p0, p1) of a quantized weight against int8-quantized rows (decode), two rows at a time.
template <typename Kind, typename X, typename S>
void quantized_int8_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1) {
  const int64_t M = in.M, N = w.N, K = w.K, G = w.group_size, groups = K / G, Kp = round4(K);
  const auto* q = static_cast<const typename Kind::Code*>(w.w);
  float c[2 * NR];
  for (int64_t p = p0; p < p1; ++p) {
    const auto* qp = q + p * Kp * Kind::kPanelStride;
    const sm_t<S>* smp = static_cast<const sm_t<S>*>(w.scale_min) + p * groups * Kind::kScaleStride;
    const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
    for (int64_t i = 0; i < M; i += 2) {
      const int64_t rows = std::min<int64_t>(2, M - i);
      if (rows == 2)
        Kind::template int8_rows<2, S>(in, i, K, G, qp, smp, c);
      else
        Kind::template int8_rows<1, S>(in, i, K, G, qp, smp, c);
      store_tile(c, rows, ncols, w.bias, n0, y + i * N + n0, N);
    }
  }
}

// Panels [p0, p1) of a quantized weight against fp32 rows: dequantized in registers (a few rows) or each panel
// widened once, then the fp32 tiles.
template <typename Kind, typename X, typename S>
void quantized_panels(const PackedWeight& w, const GemmInput& in, X* y, int64_t p0, int64_t p1,
                      std::vector<float>& wbuf) {
  const int64_t M = in.M, N = w.N, K = w.K, G = w.group_size, groups = K / G, Kp = round4(K);
  const auto* q = static_cast<const typename Kind::Code*>(w.w);
  const bool widen = M > REGISTER_ROWS;
  if (widen && int64_t(wbuf.size()) < K * NR) wbuf.resize(K * NR);
  float c[MR * NR];
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC);
    for (int64_t p = p0; p < p1; ++p) {
      const auto* qp = q + p * Kp * Kind::kPanelStride;
      const sm_t<S>* smp = static_cast<const sm_t<S>*>(w.scale_min) + p * groups * Kind::kScaleStride;
      if (widen) Kind::template widen<S>(qp, smp, K, G, wbuf.data());
      const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
      for (int64_t i = m0; i < m1; i += MR) {
        const int64_t rows = std::min(MR, m1 - i);
        const float* a = in.xp.data() + i * K;
        if (widen)
          tile(rows, a, rows, 1, wbuf.data(), K, c);
#ifdef PC_AVX2
        else if (rows == 1)
          Kind::template registers<S, 1>(a, qp, smp, K, G, c);
        else if (rows == 2)
          Kind::template registers<S, 2>(a, qp, smp, K, G, c);
        else
          Kind::template registers<S, 3>(a, qp, smp, K, G, c);
#endif
        store_tile(c, rows, ncols, w.bias, n0, y + i * N + n0, N);
      }
    }
  }
}

}  // namespace

// The packed linears as torch ops: x reshaped to rows, a prompt's rows split between threads or x prepared once
// and the panels split, over the GEMM entry points (gemm_input_*, gemm_panels, silu_mul_panels); weights packed.
#include "gemm_tiles.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <exception>

namespace {
constexpr int64_t ROW_SPLIT_ROWS = 2 * MC;  // from this many rows (read in place), threads split rows, not panels

// A prompt's rows split between threads, each over every panel (from ROW_SPLIT_ROWS rows, x read in place): no
// thread ends on a short panel group (k/v's 12 panels were 4 + 2 a thread), a q/k/v/o weight (<= 1.3 MB) stays in
// each core's L2 across row blocks, and each thread's output rows stay in its core's cache for the row-wise ops
// after (split by panels, half of every row came from the other core). run(part, y_rows) runs a chunk of rows.
// The rows are claimed in chunks that shrink as they run out (OpenMP's guided schedule: a share of what is left, down
// to MIN_CHUNK_TILES row tiles): a core the host slows takes fewer rows instead of holding the other at the join.
// This machine's two vCPUs share their cores with other guests: halves fixed up front waited ~3% of a prompt step's
// GEMM time (perf); 2044-row gate/up and o_proj, alternated, medians 17.7-18.6 -> 17.1-17.3 ms and 3.5 -> 3.3 ms.
// Each row's result is the same chain over k in any chunk.
constexpr int64_t MIN_CHUNK_TILES = 2;

template <typename Run>
bool run_by_rows(const PackedWeight& w, const torch::Tensor& x2, const Run& run) {
  const int64_t M = x2.size(0);
  const bool fp32 = x2.scalar_type() == at::kFloat && gemm_reads_x_in_place(w, M);
  if (M < ROW_SPLIT_ROWS || !(fp32 || vnni_reads_rows_in_place(w, x2.scalar_type()))) return false;
  const int64_t tiles = (M + MR - 1) / MR;
  auto rows = [&](int64_t t0, int64_t t1) {
    GemmInput part;
    part.M = std::min(M, t1 * MR) - t0 * MR;
    if (fp32)
      part.direct = x2.data_ptr<float>() + t0 * MR * w.K;
    else
      part.xb_rows = static_cast<const c10::BFloat16*>(x2.data_ptr()) + t0 * MR * w.K;
    run(part, t0 * MR);
  };
  const int nth = at::get_num_threads();
  if (nth <= 1 || at::in_parallel_region()) {
    rows(0, tiles);
    return true;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;  // the first a chunk raised, rethrown here (an exception may not leave the region)
#pragma omp parallel num_threads(nth)
  {
    const int64_t n = omp_get_num_threads();
    for (;;) {
      int64_t t0 = next.load(std::memory_order_relaxed), t1 = 0;
      do {
        if (t0 >= tiles) break;
        t1 = std::min(tiles, t0 + std::max(MIN_CHUNK_TILES, (tiles - t0) / (2 * n)));
      } while (!next.compare_exchange_weak(t0, t1, std::memory_order_relaxed));
      if (t0 >= tiles) break;
      try {
        rows(t0, t1);
      } catch (...) {
#pragma omp critical(pagedcore_run_by_rows)
        if (!error) error = std::current_exception();
        next.store(tiles);  // the others stop at their next claim
      }
    }
  }
  if (error) std::rethrow_exception(error);
  return true;
}

// x2's rows as w's input: fp32 read in place where the panels can, bf16's whole 16-row tiles in place where AMX runs,
// the rest copied (split between threads).
void prepare_input(const PackedWeight& w, const torch::Tensor& x2, GemmInput& in) {
  const bool fp32 = x2.scalar_type() == at::kFloat;
  gemm_input_resize(w, x2.size(0), in, fp32 ? x2.data_ptr<float>() : nullptr,
                    fp32 ? nullptr : static_cast<const c10::BFloat16*>(x2.data_ptr()));
  if (in.direct != nullptr || in.rows_in_place() == in.M) return;
  at::parallel_for(0, gemm_input_tiles(in), grain_for((in.int8 ? 1 : MR) * w.K), [&](int64_t b, int64_t e) {
    gemm_input_fill(w, x2.scalar_type(), x2.data_ptr(), in, b, e);
  });
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
  prepare_input(w, x2, in);
  const int64_t M = in.M;
  at::parallel_for(0, w.panels(), grain_for(M * w.K * NR, 65536), [&](int64_t p0, int64_t p1) {
    std::vector<float> wbuf;
    gemm_panels(w, in, x2.scalar_type(), y.data_ptr(), p0, p1, wbuf);
  });
}

}  // namespace


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

namespace {

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
  prepare_input(w, x2, in);
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

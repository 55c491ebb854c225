// Sampler reductions over [B, V] rows for the CPU, parallel over rows.
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

// One read of each row for greedy decoding: the argmax (first index of the maximum, as torch.argmax)
// and logsumexp (for the sampled token's logprob). A NaN in a row makes its logsumexp NaN, so the
// caller can see it (the argmax alone would skip it).
template <typename T>
static void argmax_logsumexp_row(const T* row, int64_t V, int64_t* arg, float* lse) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < V; ++i) m = std::max(m, static_cast<float>(row[i]));
  int64_t first = 0;
  for (int64_t i = 0; i < V; ++i)
    if (static_cast<float>(row[i]) == m) { first = i; break; }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < V; ++i) total += std::exp(static_cast<float>(row[i]) - m);
  *arg = first;
  *lse = m + std::log(total);
}

std::tuple<torch::Tensor, torch::Tensor> argmax_logsumexp(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2, "logits: [B, V]");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), V = x.size(1);
  auto idx = torch::empty({rows}, x.options().dtype(at::kLong));
  auto lse = torch::empty({rows}, x.options().dtype(at::kFloat));
  int64_t* pi = idx.data_ptr<int64_t>();
  float* pl = lse.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_logsumexp", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(V, 1 << 17), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) argmax_logsumexp_row(px + b * V, V, pi + b, pl + b);
    });
  });
  return {idx, lse};
}

// Inverse-CDF sampling, one uniform u per row: the first token whose running sum of probabilities
// exceeds u * (the row's sum). Sums run in fp64, so every token keeps its own share of [0, 1) to
// ~1e-16, however small its probability; a token of probability 0 is never returned. One uniform
// per row instead of V exponentials (the exponential race) is ~40x less work here.
torch::Tensor sample_inverse_cdf(torch::Tensor probs, torch::Tensor u) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat, "probs: [B, V] float32");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == probs.size(0) && u.scalar_type() == at::kDouble, "u: [B] float64");
  auto p = probs.contiguous();
  auto uc = u.contiguous();
  const int64_t rows = p.size(0), V = p.size(1);
  constexpr int64_t CHUNK = 256;
  auto out = torch::empty({rows}, p.options().dtype(at::kLong));
  const float* pp = p.data_ptr<float>();
  const double* pu = uc.data_ptr<double>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_for(V, 1 << 17), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = pp + b * V;
      double total = 0.0;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < V; ++i) total += double(row[i]);
      const double target = pu[b] * total;
      // Skip whole chunks while their sum keeps the running total at or below the target.
      double acc = 0.0;
      int64_t i = 0;
      for (; i + CHUNK <= V; i += CHUNK) {
        double c = 0.0;
#pragma omp simd reduction(+ : c)
        for (int64_t j = i; j < i + CHUNK; ++j) c += double(row[j]);
        if (acc + c > target) break;
        acc += c;
      }
      int64_t pick = -1, last_positive = -1;
      for (; i < V; ++i) {
        if (row[i] > 0.f) last_positive = i;
        acc += double(row[i]);
        if (acc > target && row[i] > 0.f) { pick = i; break; }
      }
      if (pick < 0) {  // rounding left the running sum a hair under the target: the last positive token
        if (last_positive < 0)
          for (int64_t j = V - 1; j >= 0; --j)
            if (row[j] > 0.f) { last_positive = j; break; }
        pick = last_positive < 0 ? 0 : last_positive;
      }
      po[b] = pick;
    }
  });
  return out;
}

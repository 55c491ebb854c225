// Decoder-layer elementwise ops for the CPU, each one pass instead of several aten ops.
// Every op rounds where transformers' own sequence of ops rounds (to the tensor dtype after each
// op), so bf16 results are bit-identical to transformers' except where an fp32 library function
// (exp in silu) differs by an ulp before rounding.
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "layer_rows.h"

// No fused multiply-add where transformers rounds between the multiply and the add (fp32 path).
#pragma GCC optimize("fp-contract=off")

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(), "weight: x's dtype, contiguous");
  auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t h = xc.size(-1), rows = xc.numel() / h;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    const scalar_t *px = xc.data_ptr<scalar_t>(), *pw = weight.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(h), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) rms_norm_row(px + i * h, pw, po + i * h, h, float(eps));
    });
  });
  return out;
}

// The residual add and the next RMSNorm, as a decoder layer does them: s = x + residual (rounded),
// then rms_norm(s). Returns (s, normed).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(), "x, residual: same shape");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(), "weight: x's dtype, contiguous");
  auto xc = x.contiguous(), rc = residual.contiguous();
  auto sum = torch::empty_like(xc), normed = torch::empty_like(xc);
  const int64_t h = xc.size(-1), rows = xc.numel() / h;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *px = xc.data_ptr<scalar_t>(), *pr = rc.data_ptr<scalar_t>(), *pw = weight.data_ptr<scalar_t>();
    scalar_t *ps = sum.data_ptr<scalar_t>(), *pn = normed.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(h), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) add_rms_norm_row(px + i * h, pr + i * h, pw, ps + i * h, pn + i * h, h, float(eps));
    });
  });
  return {sum, normed};
}

// transformers' RoPE: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), each product and
// the sum rounded to x's dtype. x [T, H, D] with unit stride in D; cos, sin [T, D] contiguous.
template <typename T>
static void rope_rows(T* x, int64_t tokens, int64_t heads, int64_t d, int64_t s_tok, int64_t s_head, const T* cos,
                      const T* sin) {
  at::parallel_for(0, tokens, grain_for(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rope_token(x + t * s_tok, heads, d, s_head, cos + t * d, sin + t * d);
  });
}

void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "q, k: [T, H, D], unit stride in D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == q.size(0) * q.size(2), "cos, sin: [T, D]");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type(), "one dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding_", [&] {
    const scalar_t *c = cos.data_ptr<scalar_t>(), *s = sin.data_ptr<scalar_t>();
    rope_rows(q.data_ptr<scalar_t>(), q.size(0), q.size(1), q.size(2), q.stride(0), q.stride(1), c, s);
    rope_rows(k.data_ptr<scalar_t>(), k.size(0), k.size(1), k.size(2), k.stride(0), k.stride(1), c, s);
  });
}

// act_fn(gate) * up with act_fn = SiLU: silu rounded to the dtype (as torch's silu returns it), then
// the product rounded. gate and up may be strided views (the two halves of one fused gate_up
// matmul): rows of `width` elements, unit stride inside a row.
template <typename T>
static void silu_and_mul_rows(const T* g, const T* u, T* out, int64_t rows, int64_t width, int64_t g_stride,
                              int64_t u_stride) {
  at::parallel_for(0, rows, grain_for(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      silu_and_mul_row(g + row * g_stride, u + row * u_stride, out + row * width, width);
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), "gate, up: same shape and dtype");
  const int64_t width = gate.size(-1);
  auto g = gate.stride(-1) == 1 ? gate.reshape({-1, width}) : gate.contiguous().view({-1, width});
  auto u = up.stride(-1) == 1 ? up.reshape({-1, width}) : up.contiguous().view({-1, width});
  auto out = torch::empty(gate.sizes(), gate.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows(g.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), g.size(0), width,
                      g.stride(0), u.stride(0));
  });
  return out;
}

// k_cache/v_cache [num_blocks, block_size, Hkv, D] (contiguous) at flat slot slot_mapping[t] <- key/value[t]
// (vLLM's reshape_and_cache). index_copy_ costs ~25 us a call in setup for a decode's few hundred
// bytes; this is a memcpy per token. Slots < 0 (padding tokens) are skipped.
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
              "key/value in the caches' dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, "slot_mapping int64 [T]");
  const int64_t T = slot_mapping.size(0);
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(key.size(0) == T && value.size(0) == T && key.numel() == T * row && value.numel() == T * row,
              "key/value [T, Hkv, D] matching the caches");
  // Each token's [Hkv, D] row dense, tokens at any stride: the fused q/k/v matmul's column slices are read in
  // place (a contiguous() copied both, ~2% of a prompt step's non-GEMM time).
  const auto dense_rows = [](const torch::Tensor& x) {
    return x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  auto k = dense_rows(key), v = dense_rows(value);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t bytes = row * k.element_size();
  const int64_t k_step = (k.dim() == 3 ? k.stride(0) : row) * k.element_size();
  const int64_t v_step = (v.dim() == 3 ? v.stride(0) : row) * v.element_size();
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " out of range (", num_slots, " slots)");
  // Split between threads for a prompt's thousands of rows (first touches of cache pages fault: ~3% of a
  // prompt step on one thread); a decode's few rows run inline.
  at::parallel_for(0, T, grain_for(2 * bytes, 1 << 18), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      std::memcpy(kd + s * bytes, ks + t * k_step, bytes);
      std::memcpy(vd + s * bytes, vs + t * v_step, bytes);
    }
  });
}

// Quantizing cache write (kv_cache_dtype int8 / fp8_e4m3; kernels/kv_quant.py is the reference): each
// (token, KV head) row gets scale = fp16(max|x| / qmax) and q = floor(x / scale + 0.5) clamped to +-127
// (int8) or e4m3(x / scale) (fp8). data [num_blocks, block_size, Hkv, D] (rows dense within a block, any
// block stride), scales [num_blocks, block_size, Hkv] fp16.
template <typename Q>
static void quantize_rows(const float* x, int64_t t, int64_t hkv, int64_t d, Q* data, c10::Half* scales,
                          int64_t block, int64_t o, const torch::Tensor& data_t, const torch::Tensor& scales_t,
                          float qmax) {
  for (int64_t h = 0; h < hkv; ++h) {
    const float* row = x + (t * hkv + h) * d;
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(row[i]));
    const c10::Half sh(std::min(amax / qmax, 65504.f));
    const float s = static_cast<float>(sh);
    Q* dst = data + block * data_t.stride(0) + o * data_t.stride(1) + h * data_t.stride(2);
    scales[block * scales_t.stride(0) + o * scales_t.stride(1) + h] = sh;
    for (int64_t i = 0; i < d; ++i) {
      const float y = s > 0.f ? row[i] / s : 0.f;
      if constexpr (std::is_same_v<Q, int8_t>) {
        dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::floor(y + 0.5f))));
      } else {
        dst[i] = Q(std::min(448.f, std::max(-448.f, y)));
      }
    }
  }
}

void write_kv_cache_quant(torch::Tensor key, torch::Tensor value, torch::Tensor k_data, torch::Tensor v_data,
                          torch::Tensor k_scales, torch::Tensor v_scales, torch::Tensor slot_mapping) {
  TORCH_CHECK(k_data.scalar_type() == v_data.scalar_type() &&
                  (k_data.scalar_type() == at::kChar || k_data.scalar_type() == at::kFloat8_e4m3fn),
              "int8 or float8_e4m3fn data");
  TORCH_CHECK(k_scales.scalar_type() == at::kHalf && v_scales.scalar_type() == at::kHalf, "fp16 scales");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, "slot_mapping int64 [T]");
  const int64_t T = slot_mapping.size(0), bs = k_data.size(1), hkv = k_data.size(2), d = k_data.size(3);
  for (const auto& c : {k_data, v_data})
    TORCH_CHECK(c.stride(3) == 1 && c.stride(2) == d && c.stride(1) == hkv * d, "data rows dense within a block");
  for (const auto& c : {k_scales, v_scales}) TORCH_CHECK(c.stride(2) == 1 && c.stride(1) == hkv, "scales dense");
  TORCH_CHECK(key.size(0) >= T && value.size(0) >= T && key.size(1) == hkv && key.size(2) == d, "key/value [T, Hkv, D]");
  auto k = key.narrow(0, 0, T).to(at::kFloat).contiguous(), v = value.narrow(0, 0, T).to(at::kFloat).contiguous();
  const int64_t num_slots = k_data.size(0) * bs;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const bool int8 = k_data.scalar_type() == at::kChar;
  const float qmax = int8 ? 127.f : 448.f;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    TORCH_CHECK(s < num_slots, "slot ", s, " out of range (", num_slots, " slots)");
    const int64_t block = s / bs, o = s % bs;
    if (int8) {
      quantize_rows(k.data_ptr<float>(), t, hkv, d, k_data.data_ptr<int8_t>(), k_scales.data_ptr<c10::Half>(), block,
                    o, k_data, k_scales, qmax);
      quantize_rows(v.data_ptr<float>(), t, hkv, d, v_data.data_ptr<int8_t>(), v_scales.data_ptr<c10::Half>(), block,
                    o, v_data, v_scales, qmax);
    } else {
      using F8 = c10::Float8_e4m3fn;
      quantize_rows(k.data_ptr<float>(), t, hkv, d, k_data.data_ptr<F8>(), k_scales.data_ptr<c10::Half>(), block, o,
                    k_data, k_scales, qmax);
      quantize_rows(v.data_ptr<float>(), t, hkv, d, v_data.data_ptr<F8>(), v_scales.data_ptr<c10::Half>(), block, o,
                    v_data, v_scales, qmax);
    }
  }
}

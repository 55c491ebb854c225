// The decoder stack of a Llama-family model for a step of decode rows, as one call: every layer's
// RMSNorms, q/k/v, RoPE, KV-cache write, paged attention, o, gate/up, SiLU x up and down, run by the
// same threads in one parallel region, with a barrier between dependent phases.
//
// Why: at a few rows a step is bound by reading the weights, yet the layer-by-layer path (lean_layers.py)
// spent a third of a bf16 step outside its matmuls: ~10 Python-dispatched ops per layer, each paying
// the op's dispatch, its output's allocation and a thread fork/join, and each matmul starting a cold
// prefetch stream. Here the threads stay up for the whole stack and a phase costs a barrier (~1 us).
// The phases are the functions the torch ops run (decode_stack_parts.h, layer_rows.h), so results
// equal the layer-by-layer path's bit for bit (same kernels, same split of work per thread count).
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

#include "decode_stack_parts.h"
#include "layer_rows.h"

// As in cpu_layer_ops.cpp: no fused multiply-add where transformers rounds between the multiply and the
// add. The row ops of layer_rows.h are inlined here, and carry the caller's contraction setting with them.
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t TILE = 6;  // rows per GEMM input tile (gemm_tiles.h's MR): one thread prepares a tile
// From this many rows the gate/up and down phases ask for the next layer's K/V (LineStream). Zen 4, 2 threads, bundled model,
// one process alternating with and without: 64 rows x 32-224 positions, step 55.7 -> 53.4 ms (attention 11.8 -> 8.1,
// GEMMs +0.4); 32 x 64-448: 41.2 -> 39.1; 8 rows: 12.5 -> 12.2; 1 row x 512: 9.7 / 9.9 (noise; GEMMs +0.4).
constexpr int64_t kKvPrefetchRows = 8;
constexpr int64_t kExactGroup = 32;  // inputs per scale/min of an exact int4 form (Q4_1's blocks)
constexpr int64_t kExactRows = 32;  // up to this many rows exact int4 forms are widened (set_exact_int4_rows): in
                                    // 6-row tiles to 12 rows, tall tiles to 36; at 33-36 rows the workload's steps ran
                                    // no faster than the fp32 panels (2 threads)

struct StackLinear {
  PackedWeight w;
  std::vector<torch::Tensor> keep;  // the tensors w points into
};

// A linear in oneDNN's pre-packed layout (pagedcore/onednn_linear.py: bf16 on AMX CPUs), run through torch's
// mkldnn::_linear_pointwise op, which parallelises by itself: outside the stack's parallel regions.
struct OnednnLinear {
  torch::Tensor w;
  c10::optional<torch::Tensor> bias;
};

struct StackLayer {
  torch::Tensor in_norm, post_norm, k_cache, v_cache;
  float in_eps, post_eps, scale;
  int64_t window;
  StackLinear qkv, o, gate_up, down;
  std::vector<OnednnLinear> onednn;  // qkv, o, gate_up, down; empty: panels only
};

// y = x W^T + b through oneDNN: a new contiguous [T, N] tensor (the next phases read it in place).
torch::Tensor onednn_linear(const OnednnLinear& l, const torch::Tensor& x) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, l.w, l.bias.has_value() ? c10::IValue(*l.bias) : c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  auto y = stack[0].toTensor();
  TORCH_CHECK(y.is_contiguous() && y.size(0) == x.size(0), "oneDNN linear: unexpected output layout");
  return y;
}

// [begin, end) of `count` items for thread `tid` of `nth`, contiguous, in units of `unit`.
inline std::pair<int64_t, int64_t> share(int64_t count, int64_t tid, int64_t nth, int64_t unit = 1) {
  const int64_t units = (count + unit - 1) / unit, per = (units + nth - 1) / nth;
  const int64_t b = std::min(count, tid * per * unit), e = std::min(count, (tid + 1) * per * unit);
  return {b, e};
}

StackLinear make_linear(torch::Tensor packed, c10::optional<torch::Tensor> scale_min, c10::optional<torch::Tensor> bias,
                        int64_t out_features, int64_t group_size, int64_t int8_rows, bool zero_point) {
  StackLinear l;
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3, "packed weight: contiguous panels");
  l.keep.push_back(packed);
  const void* sm = nullptr;
  bool half_scales = false;
  const bool vnni = packed_is_vnni(packed);
  int64_t K = vnni ? 2 * packed.size(1) : packed.size(1);
  if (packed.scalar_type() == at::kByte || packed.scalar_type() == at::kChar) {  // int4 / int8 codes
    TORCH_CHECK(scale_min.has_value() && scale_min->is_contiguous() &&
                    (scale_min->scalar_type() == at::kFloat || scale_min->scalar_type() == at::kHalf),
                "int4 / int8 weight: fp32 or fp16 scale(/min) panels");
    l.keep.push_back(*scale_min);
    sm = scale_min->data_ptr();
    half_scales = scale_min->scalar_type() == at::kHalf;
    TORCH_CHECK(!zero_point || (half_scales && packed.scalar_type() == at::kByte), "zero points: fp16 int4 panels");
    K = scale_min->size(1) * group_size;
  } else {
    TORCH_CHECK(packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16, "packed weight dtype");
  }
  const float* pb = nullptr;
  if (bias.has_value() && bias->defined()) {
    auto b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == out_features, "bias: [out_features]");
    l.keep.push_back(b);
    pb = b.data_ptr<float>();
  }
  TORCH_CHECK(packed.size(0) * 16 >= out_features, "out_features larger than the packed weight");
  l.w = {packed.scalar_type(), packed.data_ptr(), sm, pb, out_features, K, group_size, int8_rows, half_scales,
         zero_point, vnni};
  if (packed.scalar_type() == at::kFloat) {  // fp32 panels on a 4-bit grid (GGUF Q4_1's): decode widens its int4 form
    auto [q, qsm] = exact_int4_panels(packed, kExactGroup);
    if (q.defined()) {
      l.keep.push_back(q), l.keep.push_back(qsm);
      l.w.exact_q = reinterpret_cast<const uint16_t*>(q.data_ptr<int16_t>()), l.w.exact_sm = qsm.data_ptr<c10::Half>(), l.w.exact_group = kExactGroup;
    }
  }
  return l;
}

// Thread rows [r0, r1) of x into w's input tiles (whole GEMM input tiles, so the thread also prepares them).
inline void fill_rows(const PackedWeight& w, GemmInput& g, at::ScalarType xt, const void* x, int64_t r0, int64_t r1) {
  if (r0 < r1) gemm_input_fill(w, xt, x, g, g.int8 ? r0 : r0 / TILE, g.int8 ? r1 : (r1 + TILE - 1) / TILE);
}

// Seconds per call of y = x W^T run as the stack runs its linears (bench linears' "stack" rows): `calls` calls in one
// parallel region, cycling through `weights` (one shape, packed panels or VNNI pairs), each call's input tiles filled
// by the threads' rows, then its panels shared out, a barrier after each: no op dispatch, allocation or fork/join.
double time_stack_linears(torch::Tensor x, std::vector<torch::Tensor> weights, int64_t out_features, int64_t calls) {
  TORCH_CHECK(!weights.empty() && calls > 0, "time_stack_linears: weights and calls");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: contiguous [M, K], float32 or bfloat16");
  std::vector<PackedWeight> ls;  // as make_linear builds them, without its scan of fp32 panels for a 4-bit grid
  for (const auto& p : weights) {
    TORCH_CHECK(p.is_contiguous() && p.dim() == 3 && p.size(0) * 16 >= out_features &&
                    (p.scalar_type() == at::kFloat || p.scalar_type() == at::kBFloat16),
                "weights: fp32 or bf16 panels or VNNI pairs");
    const bool vnni = packed_is_vnni(p);
    ls.push_back({p.scalar_type(), p.data_ptr(), nullptr, nullptr, out_features, vnni ? 2 * p.size(1) : p.size(1), 0, 0,
                  false, false, vnni});
  }
  const int64_t T = x.size(0), nl = int64_t(ls.size());
  TORCH_CHECK(x.size(1) == ls[0].K && std::all_of(ls.begin(), ls.end(), [&](const PackedWeight& w) { return w.K == ls[0].K; }),
              "x: [M, K] against the weights' K");
  const auto xt = x.scalar_type();
  auto y = torch::empty({T, out_features}, x.options());
  const void* xp = x.data_ptr();
  void* yp = y.data_ptr();
  GemmInput in;
  gemm_input_resize(ls[0], T, in, xt == at::kFloat ? x.data_ptr<float>() : nullptr,
                    xt == at::kBFloat16 ? static_cast<const c10::BFloat16*>(x.data_ptr()) : nullptr);
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), omp_get_max_threads()));
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(nth)
  {
    const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
    std::vector<float> wbuf;
    const auto [r0, r1] = share(T, tid, n, TILE);
    for (int64_t c = 0; c < calls; ++c) {
      const PackedWeight& w = ls[c % nl];
      fill_rows(w, in, xt, xp, r0, r1);
#pragma omp barrier
      const auto [p0, p1] = share(w.panels(), tid, n);
      if (p0 < p1) gemm_panels(w, in, xt, yp, p0, p1, wbuf);
#pragma omp barrier
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(calls);
}

class DecodeStack {
 public:
  DecodeStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate)
      : H_(hidden), hq_(heads), hkv_(kv_heads), d_(head_dim), I_(intermediate) {}

  // One layer; each linear as (packed, scale_min or None, bias or None, out_features, group_size, int8_rows).
  void add_layer(torch::Tensor in_norm, double in_eps, torch::Tensor post_norm, double post_eps, double scale,
                 int64_t window, torch::Tensor k_cache, torch::Tensor v_cache, py::tuple qkv, py::tuple o,
                 py::tuple gate_up, py::tuple down) {
    TORCH_CHECK(in_norm.is_contiguous() && post_norm.is_contiguous() && in_norm.numel() == H_, "norm weights");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                    k_cache.size(2) == hkv_ && k_cache.size(3) == d_ && k_cache.sizes() == v_cache.sizes(),
                "KV caches [num_blocks, block_size, Hkv, D], contiguous");
    StackLayer l{in_norm, post_norm, k_cache, v_cache, float(in_eps), float(post_eps), float(scale), window,
                 linear(qkv), linear(o), linear(gate_up), linear(down)};
    const int64_t q = hq_ * d_, kv = hkv_ * d_;
    TORCH_CHECK(l.qkv.w.N == q + 2 * kv && l.qkv.w.K == H_ && l.o.w.N == H_ && l.o.w.K == q &&
                    l.gate_up.w.N == 2 * I_ && l.gate_up.w.K == H_ && l.down.w.N == H_ && l.down.w.K == I_,
                "linear shapes do not match the stack");
    if (!layers_.empty()) {  // one GemmInput per projection serves every layer
      const StackLayer& f = layers_.front();
      auto same = [](const PackedWeight& a, const PackedWeight& b) {
        return a.type == b.type && a.vnni == b.vnni && a.group_size == b.group_size && a.int8_rows == b.int8_rows;
      };
      TORCH_CHECK(same(f.qkv.w, l.qkv.w) && same(f.o.w, l.o.w) && same(f.gate_up.w, l.gate_up.w) &&
                      same(f.down.w, l.down.w) && f.k_cache.sizes() == l.k_cache.sizes() &&
                      f.k_cache.scalar_type() == l.k_cache.scalar_type(),
                  "every layer's projections must share their weight format and KV cache layout");
    }
    layers_.push_back(std::move(l));
  }

  // A layer's four linears in oneDNN's layout, as ((weight, bias or None) x 4: qkv, o, gate_up, down), for steps
  // of onednn_rows rows and more (forward's argument); in the order the layers were added.
  void add_onednn(int64_t layer, py::tuple linears) {
    TORCH_CHECK(layer >= 0 && layer < int64_t(layers_.size()) && linears.size() == 4, "add_onednn(layer, 4 linears)");
    std::vector<OnednnLinear> all;
    for (const auto& item : linears) {
      auto pair = item.cast<py::tuple>();
      TORCH_CHECK(pair.size() == 2, "(weight, bias or None)");
      OnednnLinear l{pair[0].cast<torch::Tensor>(), {}};
      TORCH_CHECK(l.w.is_mkldnn(), "a weight in oneDNN's layout (torch.ops.mkldnn._reorder_linear_weight)");
      if (!pair[1].is_none()) l.bias = pair[1].cast<torch::Tensor>();
      all.push_back(std::move(l));
    }
    layers_[layer].onednn = std::move(all);
  }

  // hidden [T, H] (the embeddings); cos, sin [T, D]; slot_mapping int64 [T]; block_table int32 [T, max_blocks],
  // seq_lens int32 [T]: every row is one decode query (row t of sequence t). int8_rows: for int4 linears
  // added with int8_rows -1, up to how many rows their activations are quantized to int8 this step.
  // Returns the residual stream after the last layer (before the final norm).
  // With onednn_rows > 0, a step of that many rows or more runs every layer's linears through oneDNN (they must
  // all have been added) and the rest in parallel regions between them.
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor rows, torch::Tensor block_table, torch::Tensor seq_lens, int64_t int8_rows,
                        int64_t onednn_rows) {
    TORCH_CHECK(!layers_.empty(), "no layers");
    const auto dtype = hidden.scalar_type();
    const int64_t T = hidden.size(0);
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == H_, "hidden: [T, hidden]");
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "hidden: float32 or bfloat16");
    TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.numel() == T * d_ && sin.numel() == T * d_,
                "cos, sin: [T, head_dim] in hidden's dtype");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T, "slot_mapping int64 [T]");
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.numel() == T, "rows int64 [T]");
    TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.size(0) == T,
                "block_table int32 [T, max_blocks]");
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == T, "seq_lens int32 [T]");
    const auto& first = layers_.front();
    TORCH_CHECK(first.k_cache.scalar_type() == dtype && first.in_norm.scalar_type() == dtype,
                "KV cache and norm weights in hidden's dtype");
    const int64_t num_slots = first.k_cache.size(0) * first.k_cache.size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t* row_ids = rows.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range (", num_slots, ")");
      TORCH_CHECK(row_ids[t] == t, "every row must be its own sequence's one query");
    }
    auto opts = hidden.options();
    const int64_t W = (hq_ + 2 * hkv_) * d_;
    Buffers b{hidden.clone(), torch::empty({T, H_}, opts), torch::empty({T, W}, opts),
              torch::empty({T, hq_ * d_}, opts), torch::empty({T, H_}, opts), torch::empty({T, 2 * I_}, opts),
              torch::empty({T, I_}, opts), torch::empty({T, H_}, opts)};
    const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), omp_get_max_threads()));
    auto attention = plan_attention(b, block_table, seq_lens, rows, nth);
    std::vector<Weights> weights;
    weights.reserve(layers_.size());
    auto resolve = [&](PackedWeight w) {
      if (w.int8_rows < 0) w.int8_rows = int8_rows;
      w.exact_rows = exact_rows_;
      return w;
    };
    for (const auto& l : layers_)
      weights.push_back({resolve(l.qkv.w), resolve(l.o.w), resolve(l.gate_up.w), resolve(l.down.w)});
    GemmInput in_qkv, in_o, in_gu, in_down;
    // Inputs are read in place from the step's buffers where the tiles can (gemm_input_resize): fp32 by the panels,
    // bf16's whole 16-row tiles by AMX (64-row step 41.8 / 40.1 / 40.4 -> 40.1 / 39.5 / 38.7 ms, alternated
    // processes; the copies cost ~0.7 ms at 64 rows even streamed).
    auto fp32 = [&](const torch::Tensor& t) { return dtype == at::kFloat ? t.data_ptr<float>() : nullptr; };
    auto bf16 = [&](const torch::Tensor& t) {
      return dtype == at::kBFloat16 ? static_cast<const c10::BFloat16*>(t.data_ptr()) : nullptr;
    };
    gemm_input_resize(weights[0].qkv, T, in_qkv, fp32(b.normed), bf16(b.normed));
    gemm_input_resize(weights[0].o, T, in_o, fp32(b.attn), bf16(b.attn));
    gemm_input_resize(weights[0].gate_up, T, in_gu, fp32(b.normed), bf16(b.normed));
    gemm_input_resize(weights[0].down, T, in_down, fp32(b.act), bf16(b.act));
    Inputs in{in_qkv, in_o, in_gu, in_down};
    if (onednn_rows > 0 && T >= onednn_rows) {
      for (const auto& l : layers_) TORCH_CHECK(l.onednn.size() == 4, "a layer without oneDNN weights");
      TORCH_CHECK(dtype == at::kBFloat16, "oneDNN linears: bfloat16");
      run_onednn<c10::BFloat16>(b, attention, cos, sin, slots, T, nth);
      return b.residual;
    }
    if (dtype == at::kFloat)
      run<float>(b, in, weights, attention, cos, sin, slots, T, nth);
    else
      run<c10::BFloat16>(b, in, weights, attention, cos, sin, slots, T, nth);
    return b.residual;
  }

  // The model's token embedding [V, H], RoPE tables cos, sin [N, head_dim] (row p: position p) and final norm, for
  // forward_ids; all in the layers' dtype.
  void set_io(torch::Tensor embedding, torch::Tensor cos_table, torch::Tensor sin_table, torch::Tensor norm_weight,
              double norm_eps) {
    TORCH_CHECK(!layers_.empty(), "set_io after the layers");
    const auto dtype = layers_.front().in_norm.scalar_type();
    TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == H_ && embedding.is_contiguous() &&
                    embedding.scalar_type() == dtype, "embedding: contiguous [V, hidden] in the layers' dtype");
    TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == d_ && cos_table.is_contiguous() &&
                    cos_table.scalar_type() == dtype && sin_table.sizes() == cos_table.sizes() &&
                    sin_table.is_contiguous() && sin_table.scalar_type() == dtype,
                "cos, sin tables: contiguous [positions, head_dim] in the layers' dtype");
    TORCH_CHECK(norm_weight.numel() == H_ && norm_weight.is_contiguous() && norm_weight.scalar_type() == dtype,
                "final norm weight: [hidden] in the layers' dtype");
    io_ = {embedding, cos_table, sin_table, norm_weight, float(norm_eps)};
    has_io_ = true;
  }

  // forward from token ids and positions: the embedding rows and the RoPE tables' rows looked up here, and the final
  // norm applied to the result (rms_norm_row, as the fused norm op computes it). One call a step, where the lookups
  // and the norm were four torch ops, each run with cold caches after the weights streamed (~50-100 us each).
  torch::Tensor forward_ids(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slot_mapping,
                            torch::Tensor rows, torch::Tensor block_table, torch::Tensor seq_lens, int64_t int8_rows,
                            int64_t onednn_rows) {
    TORCH_CHECK(has_io_, "forward_ids: set_io first");
    const int64_t T = input_ids.numel();
    TORCH_CHECK(input_ids.scalar_type() == at::kLong && input_ids.is_contiguous() && positions.scalar_type() == at::kLong &&
                    positions.is_contiguous() && positions.numel() == T, "input_ids, positions: int64 [T]");
    const int64_t V = io_.embedding.size(0), N = io_.cos.size(0);
    const int64_t *ids = input_ids.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ids[t] >= 0 && ids[t] < V, "token id ", ids[t], " out of range (vocabulary of ", V, ")");
      TORCH_CHECK(pos[t] >= 0 && pos[t] < N, "position ", pos[t], " past the RoPE table (", N, ")");
    }
    auto opts = io_.embedding.options();
    auto hidden = torch::empty({T, H_}, opts), cos = torch::empty({T, d_}, opts), sin = torch::empty({T, d_}, opts);
    const int64_t es = io_.embedding.element_size();
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(static_cast<char*>(hidden.data_ptr()) + t * H_ * es,
                  static_cast<const char*>(io_.embedding.data_ptr()) + ids[t] * H_ * es, H_ * es);
      std::memcpy(static_cast<char*>(cos.data_ptr()) + t * d_ * es,
                  static_cast<const char*>(io_.cos.data_ptr()) + pos[t] * d_ * es, d_ * es);
      std::memcpy(static_cast<char*>(sin.data_ptr()) + t * d_ * es,
                  static_cast<const char*>(io_.sin.data_ptr()) + pos[t] * d_ * es, d_ * es);
    }
    auto res = forward(hidden, cos, sin, slot_mapping, rows, block_table, seq_lens, int8_rows, onednn_rows);
    auto out = torch::empty_like(res);
    auto norm = [&](auto* x, auto* o, const auto* w) {
      for (int64_t t = 0; t < T; ++t) rms_norm_row(x + t * H_, w, o + t * H_, H_, io_.eps);
    };
    if (res.scalar_type() == at::kFloat)
      norm(res.data_ptr<float>(), out.data_ptr<float>(), io_.norm.data_ptr<float>());
    else
      norm(res.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), io_.norm.data_ptr<c10::BFloat16>());
    return out;
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // Linears kept with an exact int4 form too (cpu_exact_int4.cpp), and up to how many rows it runs (0: never).
  int64_t exact_int4_linears() const {
    int64_t n = 0;
    for (const auto& l : layers_)
      for (const StackLinear* s : {&l.qkv, &l.o, &l.gate_up, &l.down}) n += s->w.exact_q != nullptr;
    return n;
  }
  void set_exact_int4_rows(int64_t rows) { exact_rows_ = rows; }

  // Wall time of the panel steps' phases, for `bench step` (the stack is one call, so no outside timer can split
  // it): thread 0 stamps each phase's end after its barrier, so waits count in the phase that caused them.
  // (gemm, attention = RoPE + cache write + paged attention, other = norms and input tiles), seconds and steps since
  // the last take; steps that ran oneDNN's linears are not split.
  void set_profiling(bool on) { profiling_ = on; }
  std::tuple<double, double, double, int64_t> take_profile() {
    auto out = std::make_tuple(profile_[0], profile_[1], profile_[2], profile_steps_);
    profile_ = {0.0, 0.0, 0.0};
    profile_steps_ = 0;
    return out;
  }

 private:
  struct Buffers {
    torch::Tensor residual, normed, qkv, attn, o, gate_up, act, down;
  };
  struct Inputs {
    GemmInput &qkv, &o, &gate_up, &down;
  };
  struct Weights {  // a layer's linears with this step's int8_rows
    PackedWeight qkv, o, gate_up, down;
  };

  static StackLinear linear(const py::tuple& spec) {
    TORCH_CHECK(spec.size() == 7,
                "linear: (packed, scale_min, bias, out_features, group_size, int8_rows, zero_point)");
    auto opt = [](const py::handle& h) {
      return h.is_none() ? c10::optional<torch::Tensor>() : c10::optional<torch::Tensor>(h.cast<torch::Tensor>());
    };
    return make_linear(spec[0].cast<torch::Tensor>(), opt(spec[1]), opt(spec[2]), spec[3].cast<int64_t>(),
                       spec[4].cast<int64_t>(), spec[5].cast<int64_t>(), spec[6].cast<bool>());
  }

  // One attention plan per layer (layers differ in cache and window); the split of work depends only on
  // the lengths, the window and the thread count, as in the torch op.
  std::vector<DecodeAttention> plan_attention(Buffers& b, const torch::Tensor& block_table,
                                              const torch::Tensor& seq_lens, const torch::Tensor& rows, int64_t nth) {
    std::vector<DecodeAttention> plans;
    plans.reserve(layers_.size());
    const int64_t T = b.qkv.size(0), W = b.qkv.size(1);
    for (const auto& l : layers_) {
      DecodeAttention a{b.qkv.scalar_type(), l.k_cache.scalar_type(), b.qkv.data_ptr(), l.k_cache.data_ptr(),
                        l.v_cache.data_ptr(), block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                        rows.data_ptr<int64_t>(), b.attn.data_ptr(), T, hq_, hkv_, d_, l.k_cache.size(1),
                        block_table.size(1), W, d_, l.scale, l.window, 0.f, l.k_cache.stride(0), nullptr, nullptr, 0};
      const DecodeAttention* same = nullptr;
      for (const auto& p : plans)
        if (p.window == l.window) same = &p;
      if (same != nullptr) {
        a.items = same->items;
        a.partial.assign(same->partial.size(), 0.f);
        a.has_split = same->has_split;
        a.cuts = same->cuts;
      } else {
        a.plan(nth);
      }
      plans.push_back(std::move(a));
    }
    return plans;
  }

  // Rows [r0, r1) of q/k/v [T, (Hq + 2 Hkv) D]: RoPE on q and k, then k and v into the layer's cache.
  template <typename X>
  void rope_and_cache(const StackLayer& l, X* qkv, const X* cos, const X* sin, const int64_t* slots, int64_t r0,
                      int64_t r1) const {
    const int64_t d = d_, q_width = hq_ * d_, kv_width = hkv_ * d_, W = q_width + 2 * kv_width;
    const int64_t row_bytes = kv_width * int64_t(sizeof(X));
    for (int64_t t = r0; t < r1; ++t) {
      X* row = qkv + t * W;
      rope_token(row, hq_, d, d, cos + t * d, sin + t * d);
      rope_token(row + q_width, hkv_, d, d, cos + t * d, sin + t * d);
      std::memcpy(static_cast<char*>(l.k_cache.data_ptr()) + slots[t] * row_bytes, row + q_width, row_bytes);
      std::memcpy(static_cast<char*>(l.v_cache.data_ptr()) + slots[t] * row_bytes, row + q_width + kv_width,
                  row_bytes);
    }
  }

  template <typename X>
  void run(Buffers& b, Inputs& in, const std::vector<Weights>& weights, std::vector<DecodeAttention>& attention, const torch::Tensor& cos_t,
           const torch::Tensor& sin_t, const int64_t* slots, int64_t T, int64_t nth) {
    X *res = b.residual.data_ptr<X>(), *h = b.normed.data_ptr<X>(), *qkv = b.qkv.data_ptr<X>();
    X *attn = b.attn.data_ptr<X>(), *o = b.o.data_ptr<X>(), *gu = b.gate_up.data_ptr<X>();
    X *act = b.act.data_ptr<X>(), *down = b.down.data_ptr<X>();
    const X *cos = cos_t.data_ptr<X>(), *sin = sin_t.data_ptr<X>();
    const auto xt = b.residual.scalar_type();
    const int64_t H = H_, I = I_;
    enum Part { GEMM, ATTENTION, OTHER };
    using clock = std::chrono::steady_clock;
    const bool profiling = profiling_;
    profile_steps_ += profiling;
#pragma omp parallel num_threads(nth)
    {
      const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
      std::vector<float> wbuf;
      LineStream stream;
      auto last = clock::now();
      auto mark = [&](Part part) {  // the phase since the last mark ended (after its barrier)
        if (!profiling || tid != 0) return;
        const auto now = clock::now();
        profile_[part] += std::chrono::duration<double>(now - last).count();
        last = now;
      };
      // Rows of this thread in whole GEMM input tiles, so it also prepares those tiles (no barrier between).
      const auto [r0, r1] = share(T, tid, n, TILE);
      auto fill = [&](const PackedWeight& w, GemmInput& g, const X* x) { fill_rows(w, g, xt, x, r0, r1); };
      auto matmul = [&](const PackedWeight& w, const GemmInput& g, X* y, LineStream* side = nullptr) {
        const auto [p0, p1] = share(w.panels(), tid, n);
        if (p0 < p1) gemm_panels(w, g, xt, y, p0, p1, wbuf, side);
#pragma omp barrier
        mark(GEMM);
      };
      for (size_t li = 0; li < layers_.size(); ++li) {
        const StackLayer& l = layers_[li];
        const Weights& w = weights[li];
        const X *in_w = l.in_norm.data_ptr<X>(), *post_w = l.post_norm.data_ptr<X>();
        // The previous layer's residual add (down), then this layer's input norm; the q/k/v input.
        for (int64_t t = r0; t < r1; ++t) {
          if (li == 0)
            rms_norm_row(res + t * H, in_w, h + t * H, H, l.in_eps);
          else
            add_rms_norm_row(res + t * H, down + t * H, in_w, res + t * H, h + t * H, H, l.in_eps);
        }
        fill(w.qkv, in.qkv, h);
#pragma omp barrier
        mark(OTHER);
        matmul(w.qkv, in.qkv, qkv);
        rope_and_cache(l, qkv, cos, sin, slots, r0, r1);
#pragma omp barrier
        DecodeAttention& a = attention[li];
        const auto [i0, i1] = a.share_of(tid, n);
        if (i0 < i1) a.run(i0, i1);
#pragma omp barrier
        if (a.has_split) {
          if (tid == 0) a.combine();
#pragma omp barrier
        }
        mark(ATTENTION);
        fill(w.o, in.o, attn);
#pragma omp barrier
        mark(OTHER);
        matmul(w.o, in.o, o);
        for (int64_t t = r0; t < r1; ++t) add_rms_norm_row(res + t * H, o + t * H, post_w, res + t * H, h + t * H, H, l.post_eps);
        fill(w.gate_up, in.gate_up, h);
#pragma omp barrier
        mark(OTHER);
        // The next layer's K/V rows of this thread's attention items, asked for from inside the gate/up and down
        // tiles: the attention then reads them from L3 (at a few rows the tiles read weights at the bandwidth).
        stream.clear();
        if (li + 1 < layers_.size() && T >= kKvPrefetchRows) {
          const auto [i0, i1] = attention[li + 1].share_of(tid, n);
          attention[li + 1].kv_lines(i0, i1, stream);
        }
        LineStream* kv = stream.lines > 0 ? &stream : nullptr;
        if (silu_mul_runs(w.gate_up, T)) {  // the product never written
          const auto [c0, c1] = share(silu_mul_chunks(w.gate_up), tid, n);
          silu_mul_panels(w.gate_up, in.gate_up, xt, act, c0, c1, wbuf, kv);
#pragma omp barrier
          mark(GEMM);
        } else {
          matmul(w.gate_up, in.gate_up, gu, kv);
          for (int64_t t = r0; t < r1; ++t) silu_and_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);
        }
        fill(w.down, in.down, act);
#pragma omp barrier
        mark(OTHER);
        matmul(w.down, in.down, down, stream.lines > stream.given ? kv : nullptr);  // what gate/up left
      }
      // The last layer's residual add.
      for (int64_t t = r0; t < r1; ++t)
        for (int64_t j = 0; j < H; ++j)
          res[t * H + j] = static_cast<X>(static_cast<float>(res[t * H + j]) + static_cast<float>(down[t * H + j]));
    }
  }

  // The same phases as `run`, each matmul through oneDNN between parallel regions (oneDNN runs its own); the
  // phases read oneDNN's outputs in place.
  template <typename X>
  void run_onednn(Buffers& b, std::vector<DecodeAttention>& attention, const torch::Tensor& cos_t,
                  const torch::Tensor& sin_t, const int64_t* slots, int64_t T, int64_t nth) {
    X *res = b.residual.data_ptr<X>(), *h = b.normed.data_ptr<X>();
    const X *cos = cos_t.data_ptr<X>(), *sin = sin_t.data_ptr<X>();
    const int64_t H = H_, I = I_;
    torch::Tensor down_t;  // the previous layer's down projection, added to the residual by the next
    for (size_t li = 0; li < layers_.size(); ++li) {
      const StackLayer& l = layers_[li];
      const X *in_w = l.in_norm.data_ptr<X>(), *post_w = l.post_norm.data_ptr<X>();
      const X* down = li == 0 ? nullptr : down_t.data_ptr<X>();
#pragma omp parallel num_threads(nth)
      {
        const auto [r0, r1] = share(T, omp_get_thread_num(), omp_get_num_threads());
        for (int64_t t = r0; t < r1; ++t) {
          if (li == 0)
            rms_norm_row(res + t * H, in_w, h + t * H, H, l.in_eps);
          else
            add_rms_norm_row(res + t * H, down + t * H, in_w, res + t * H, h + t * H, H, l.in_eps);
        }
      }
      torch::Tensor qkv_t = onednn_linear(l.onednn[0], b.normed);
      X* qkv = qkv_t.data_ptr<X>();
      DecodeAttention& a = attention[li];
      a.query = qkv;  // [T, W] rows, as planned over b.qkv
#pragma omp parallel num_threads(nth)
      {
        const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
        const auto [r0, r1] = share(T, tid, n);
        rope_and_cache(l, qkv, cos, sin, slots, r0, r1);
#pragma omp barrier
        const auto [i0, i1] = a.share_of(tid, n);
        if (i0 < i1) a.run(i0, i1);
#pragma omp barrier
        if (a.has_split && tid == 0) a.combine();
      }
      torch::Tensor o_t = onednn_linear(l.onednn[1], b.attn);
      const X* o = o_t.data_ptr<X>();
#pragma omp parallel num_threads(nth)
      {
        const auto [r0, r1] = share(T, omp_get_thread_num(), omp_get_num_threads());
        for (int64_t t = r0; t < r1; ++t) add_rms_norm_row(res + t * H, o + t * H, post_w, res + t * H, h + t * H, H, l.post_eps);
      }
      torch::Tensor gu_t = onednn_linear(l.onednn[2], b.normed);
      X *gu = gu_t.data_ptr<X>(), *act = b.act.data_ptr<X>();
#pragma omp parallel num_threads(nth)
      {
        const auto [r0, r1] = share(T, omp_get_thread_num(), omp_get_num_threads());
        for (int64_t t = r0; t < r1; ++t) silu_and_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);
      }
      down_t = onednn_linear(l.onednn[3], b.act);
    }
    const X* down = down_t.data_ptr<X>();
    for (int64_t t = 0; t < T; ++t)  // the last layer's residual add
      for (int64_t j = 0; j < H; ++j)
        res[t * H + j] = static_cast<X>(static_cast<float>(res[t * H + j]) + static_cast<float>(down[t * H + j]));
  }

  struct Io {
    torch::Tensor embedding, cos, sin, norm;
    float eps = 0.f;
  };
  int64_t H_, hq_, hkv_, d_, I_;
  std::vector<StackLayer> layers_;
  Io io_;
  bool has_io_ = false;
  bool profiling_ = false;
  int64_t exact_rows_ = kExactRows;
  std::array<double, 3> profile_{0.0, 0.0, 0.0};
  int64_t profile_steps_ = 0;
};

}  // namespace

void bind_decode_stack(py::module& m) {
  m.def("time_stack_linears", &time_stack_linears, py::call_guard<py::gil_scoped_release>(),
        "seconds per call of x @ W^T over packed weights, run as the decode stack runs its linears (bench linears)");
  py::class_<DecodeStack>(m, "DecodeStack",
                          "A Llama-family decoder stack over packed weights, run for decode rows in one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t>(), py::arg("hidden"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"))
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_onednn", &DecodeStack::add_onednn)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("set_io", &DecodeStack::set_io)
      .def("forward_ids", &DecodeStack::forward_ids, py::call_guard<py::gil_scoped_release>())
      .def("set_profiling", &DecodeStack::set_profiling)
      .def("take_profile", &DecodeStack::take_profile)
      .def("set_exact_int4_rows", &DecodeStack::set_exact_int4_rows)
      .def_property_readonly("exact_int4_linears", &DecodeStack::exact_int4_linears)
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}

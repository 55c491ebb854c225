// The C++ CPU ops of pagedcore, one extension module (bindings.cpp); built by kernels/cpu_ext.py.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <tuple>
#include <vector>

// at::parallel_for grain: enough items that a chunk holds ~min_work elements. Small batches then
// run inline: waking the other threads costs more than the work, and far more when a core is busy.
inline int64_t grain_for(int64_t work_per_item, int64_t min_work = 32768) {
  return std::max<int64_t>(1, min_work / std::max<int64_t>(1, work_per_item));
}

// cpu_decode_attention.cpp
// k_cache/v_cache: [num_blocks, block_size, Hkv, D] in the model dtype, or int8 / float8_e4m3fn values of a
// quantized cache with their fp16 scales [num_blocks, block_size, Hkv] (k_scales, v_scales).
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor rows, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t window,
                           double softcap, c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales);
torch::Tensor decode_kv_lines(torch::Tensor query, torch::Tensor rows, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_table, torch::Tensor seq_lens, int64_t window, int64_t threads);

// cpu_prefill_attention.cpp: causal attention of prompt rows over the paged cache (AVX-512 CPUs, head_dim % 16 == 0)
bool paged_prefill_supported(int64_t head_dim);
// Whether bf16 prompts may take AMX tiles where they run (default on); returns the previous setting. For tests.
bool set_prefill_amx(bool on);
void paged_prefill(torch::Tensor query, torch::Tensor out, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor block_table, std::vector<int64_t> seqs, std::vector<int64_t> q_starts,
                   std::vector<int64_t> q_ends, std::vector<int64_t> seq_lens, double scale,
                   c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales);

// cpu_layer_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps);
void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping);
void write_kv_cache_quant(torch::Tensor key, torch::Tensor value, torch::Tensor k_data, torch::Tensor v_data,
                          torch::Tensor k_scales, torch::Tensor v_scales, torch::Tensor slot_mapping);

// cpu_sampling.cpp
std::tuple<torch::Tensor, torch::Tensor> argmax_logsumexp(torch::Tensor logits);
torch::Tensor sample_inverse_cdf(torch::Tensor probs, torch::Tensor u);

// cpu_linear_ops.cpp
torch::Tensor pack_linear_weight(torch::Tensor weight);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features, c10::optional<torch::Tensor> bias);
// silu(x Wg^T + bg) * (x Wu^T + bu) over the fused [gate; up] packed weight (out_features = 2 I): [..., I].
torch::Tensor packed_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                     c10::optional<torch::Tensor> bias);
// cpu_gemm_vnni.cpp
torch::Tensor pack_linear_weight_vnni(torch::Tensor weight);
bool vnni_amx();
bool vnni_dpbf16();
// greedy rows' argmax over an LM head in VNNI pairs on AMX tiles: the bf16 logits the head gives, never stored (-1: a
// logit not finite)
bool greedy_head_amx_supported();
torch::Tensor greedy_head_amx(torch::Tensor x, torch::Tensor packed, int64_t vocab);
// cpu_gemm_int4.cpp
std::tuple<torch::Tensor, torch::Tensor> pack_int4_weight(torch::Tensor q, torch::Tensor scale, torch::Tensor min,
                                                         int64_t group_size);
torch::Tensor packed_linear_int4(torch::Tensor x, torch::Tensor q, torch::Tensor sm, int64_t out_features,
                                 int64_t group_size, c10::optional<torch::Tensor> bias, int64_t int8_rows,
                                 bool zero_point);
// cpu_gemm_int8.cpp
std::tuple<torch::Tensor, torch::Tensor> pack_int8_weight(torch::Tensor q, torch::Tensor scale, int64_t group_size);
torch::Tensor packed_linear_int8(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t out_features,
                                 int64_t group_size, c10::optional<torch::Tensor> bias, int64_t int8_rows);

// cpu_decode_stack.cpp: the DecodeStack class (a decoder stack for decode rows, one call per step).
void bind_decode_stack(py::module& m);

// huge_pages.cpp: a uint8 [nbytes] buffer in 2 MiB transparent huge pages where the OS gives them.
torch::Tensor huge_page_buffer(int64_t nbytes);
// dicts[i].get(keys[i]) is values[i] for all i (objects_in_place.cpp)
bool objects_in_place(py::list dicts, py::list keys, py::list values);

// cpu_exact_int4.cpp: fp32 panels [P, K, 16] that are exactly 4-bit per group of group_size inputs (fp16 scale and
// min) as int4 panels [P, K / 4, 16] (int16: a column's 4 codes of a quad, one a nibble) and scale/min [P, K / group_size, 2, 16] fp16; undefined tensors if any value is not
std::tuple<torch::Tensor, torch::Tensor> exact_int4_panels(torch::Tensor packed, int64_t group_size);
// Rows x one panel of such a weight, x packed by pack_tiles (cpu_exact_int4.cpp; cpu_gemm.cpp's tall tiles).
void exact_tall(int64_t rows, const float* a, int64_t K, const uint16_t* q, const c10::Half* sm, const uint16_t* next_q,
                int64_t G, float* c);

// cpu_greedy_head.cpp: the argmax of x W^T as the fp32 panels give it, from int8 codes of W and a few exact columns
bool greedy_head_supported();
std::vector<torch::Tensor> greedy_head_pack(torch::Tensor weight);
std::tuple<torch::Tensor, torch::Tensor> greedy_head(torch::Tensor x, torch::Tensor codes, torch::Tensor stats,
                                                     torch::Tensor weight);
// greedy_head's weight rows may be bf16 (a bf16 head in plain panels, whose logits are stored rounded to bf16)
bool greedy_head_bf16_panels_supported();
// The same for a bf16 head in VNNI pairs, as the AVX512-BF16 tiles give its logits (rounded to bf16)
bool greedy_head_bf16_supported();
std::vector<torch::Tensor> greedy_head_pack_bf16(torch::Tensor panels, int64_t vocab);
torch::Tensor greedy_head_outliers(torch::Tensor panels, torch::Tensor dims);
std::tuple<torch::Tensor, torch::Tensor> greedy_head_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor stats,
                                                          torch::Tensor colsum, torch::Tensor rows, torch::Tensor dims,
                                                          torch::Tensor wo);
// greedy_head_bf16 for a step: (the tokens, or None where one is -1; the exact logits computed in all; the dim of x's
// largest |value|), and with check_dims nothing computed (None, -1, that dim) where that dim is not among dims.
std::tuple<c10::optional<torch::Tensor>, int64_t, int64_t> greedy_head_bf16_step(torch::Tensor x, torch::Tensor codes,
                                                                                  torch::Tensor stats, torch::Tensor colsum,
                                                                                  torch::Tensor rows, torch::Tensor dims,
                                                                                  torch::Tensor wo, bool check_dims);

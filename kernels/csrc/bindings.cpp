#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention, one query token per sequence",
        py::arg("query"), py::arg("rows"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("window"), py::arg("softcap"), py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none());
  m.def("decode_kv_lines", &decode_kv_lines,
        "[thread, address, lines] of the K/V spans the decode stack prefetches for each thread's planned items",
        py::arg("query"), py::arg("rows"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("window"), py::arg("threads"));
  m.def("paged_prefill_supported", &paged_prefill_supported, "whether paged_prefill runs here for this head_dim");
  m.def("set_prefill_amx", &set_prefill_amx, "allow AMX tiles in bf16 prefill attention (default); returns the old");
  m.def("paged_prefill", &paged_prefill,
        "causal attention of prompt rows (query rows [start, end) of each listed sequence, the last rows of its "
        "seq_len positions) over the paged cache, into out",
        py::arg("query"), py::arg("out"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("seqs"), py::arg("q_starts"), py::arg("q_ends"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none());
  // Without the GIL: huge_pages.prefault runs it in a thread while the main thread loads the model.
  m.def("huge_page_buffer", &huge_page_buffer, "uint8 [nbytes] in 2 MiB transparent huge pages where the OS gives them",
        py::arg("nbytes"), py::call_guard<py::gil_scoped_release>());
  m.def("objects_in_place", &objects_in_place,
        "whether dicts[i].get(keys[i]) is values[i] for every i (False where a dicts[i] is not a plain dict)",
        py::arg("dicts"), py::arg("keys"), py::arg("values"));
  m.def("rms_norm", &rms_norm, "transformers' Llama RMSNorm");
  m.def("add_rms_norm", &add_rms_norm, "(x + residual, rms_norm(x + residual))");
  m.def("rotary_embedding_", &rotary_embedding_, "rotate q and k in place (transformers' rotate_half RoPE)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("write_kv_cache", &write_kv_cache, "key/value [T, Hkv, D] into the paged caches at slot_mapping");
  m.def("write_kv_cache_quant", &write_kv_cache_quant,
        "key/value [T, Hkv, D] quantized (int8 / fp8 e4m3, one fp16 scale per token and head) into the caches");
  m.def("argmax_logsumexp", &argmax_logsumexp, "per row: (argmax, logsumexp)");
  m.def("exact_int4_panels", &exact_int4_panels,
        "fp32 panels [P, K, 16] exactly 4-bit per group -> (int4 panels int16 [P, K / 4, 16], fp16 scale/min [P, K / G, 2, 16]), "
        "or undefined tensors");
  m.def("greedy_head_supported", &greedy_head_supported, "whether greedy_head runs here (AVX-512 BW and VNNI, or AVX2 and FMA)");
  m.def("greedy_head_pack", &greedy_head_pack, "fp32 W [V, K] -> (int8 codes [ceil(V/16), ceil(K/2), 32], stats [4, V])");
  m.def("greedy_head", &greedy_head,
        "per row of x: (argmax of x W^T as pack_linear_weight's fp32 panels of W [V, K] give it, or -1 where x or "
        "a candidate logit is not finite; how many logits were computed exactly, from W's rows); bf16 rows W: as "
        "its bf16 panels give it, the logits rounded to bf16 (greedy_head_bf16_panels_supported)",
        py::arg("x"), py::arg("codes"), py::arg("stats"), py::arg("weight"));
  m.def("greedy_head_bf16_panels_supported", &greedy_head_bf16_panels_supported,
        "whether greedy_head takes bf16 rows (a bf16 head in plain panels: AVX2 without AVX-512)");
  m.def("greedy_head_bf16_supported", &greedy_head_bf16_supported,
        "whether greedy_head_bf16 runs here (AVX-512 BW, VNNI and BF16, no AMX)");
  m.def("greedy_head_pack_bf16", &greedy_head_pack_bf16,
        "bf16 VNNI panels [P, K / 2, 32], vocab V -> (int8 codes [P, K / 4, 64], stats [4, V], int32 column sums [V])");
  m.def("greedy_head_bf16", &greedy_head_bf16,
        "per bf16 row of x: (argmax of the bf16 logits the VNNI panels of W give, W's rows [V, K] the exact logits' "
        "source, or -1 where x or a candidate logit is not finite; how many logits were computed exactly)",
        py::arg("x"), py::arg("codes"), py::arg("stats"), py::arg("colsum"), py::arg("rows"), py::arg("dims"),
        py::arg("wo"));
  m.def("greedy_head_bf16_step", &greedy_head_bf16_step,
        "greedy_head_bf16 as a decode step runs it: (tokens, or None where a row gave -1; the exact logits in all; the "
        "dim of x's largest |value|); with check_dims, (None, -1, that dim) without computing where it is not in dims",
        py::arg("x"), py::arg("codes"), py::arg("stats"), py::arg("colsum"), py::arg("rows"), py::arg("dims"),
        py::arg("wo"), py::arg("check_dims") = true, py::call_guard<py::gil_scoped_release>());
  m.def("greedy_head_outliers", &greedy_head_outliers,
        "the weights of dims (int32 [n]) of bf16 VNNI panels [P, K / 2, 32], in pairs of dims [P, ceil(n / 2), 32] "
        "(an odd n's last paired with 0): greedy_head_bf16's outlier dims, kept out of x's codes");
  m.def("pack_linear_weight", &pack_linear_weight, "W [N, K] -> panels [ceil(N/16), K, 16], same dtype");
  m.def("packed_linear_silu_mul", &packed_linear_silu_mul,
        "silu(x @ W_gate^T) * (x @ W_up^T) over a fused [gate; up] packed weight, never writing the product",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("packed_linear", &packed_linear, "x @ W^T (+ bias) over a packed weight; fp32 accumulation",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("pack_linear_weight_vnni", &pack_linear_weight_vnni,
        "bf16 W [N, K] (K a multiple of 32) -> VNNI pairs [ceil(N/16), K/2, 32] for packed_linear (AMX tiles)");
  m.def("vnni_amx", &vnni_amx, "whether AMX tiles run here (the CPU has them and the OS granted their state)");
  m.def("greedy_head_amx_supported", &greedy_head_amx_supported, "whether greedy_head_amx runs here (AMX tiles)");
  m.def("greedy_head_amx", &greedy_head_amx, py::arg("x"), py::arg("packed"), py::arg("vocab"),
        "the argmax of each bf16 row's logits over an LM head in VNNI pairs, on AMX tiles (the logits the head gives, "
        "rounded to bf16, never stored; the first of equals; -1 where a logit is not finite)");
  m.def("vnni_dpbf16", &vnni_dpbf16, "whether AVX512-BF16 vdpbf16ps tiles run the VNNI pairs here (no AMX)");
  m.def("pack_int4_weight", &pack_int4_weight,
        "q uint8 [N, K], scale/min (or scale/zero point) [N, K/G] -> int4 panels, scale/min panels");
  m.def("packed_linear_int4", &packed_linear_int4,
        "x @ W^T (+ bias), W = q * scale + min per group (zero_point: W = (q - z) * scale, fp16 panels); fp32 "
        "accumulation; inputs of M <= int8_rows rows quantized to int8 per 32 (integer dot products), others fp32",
        py::arg("x"), py::arg("q"), py::arg("sm"), py::arg("out_features"), py::arg("group_size"),
        py::arg("bias") = py::none(), py::arg("int8_rows") = 0, py::arg("zero_point") = false);
  m.def("pack_int8_weight", &pack_int8_weight, "q int8 [N, K], scale [N, K/G] -> int8 panels, scale panels");
  m.def("packed_linear_int8", &packed_linear_int8,
        "x @ W^T (+ bias), W = q * scale per group (one group of K: per channel); fp32 accumulation; inputs of "
        "M <= int8_rows rows quantized to int8 per 32 (integer dot products), others kept fp32",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("out_features"), py::arg("group_size"),
        py::arg("bias") = py::none(), py::arg("int8_rows") = 0);
  bind_decode_stack(m);
  m.def("sample_inverse_cdf", &sample_inverse_cdf, "per row: first token whose running fp64 sum exceeds u * total");
}

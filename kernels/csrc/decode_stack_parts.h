// The pieces of the CPU ops that the decoder stack (cpu_decode_stack.cpp) runs inside one parallel
// region: each splits its work by an explicit range, so the caller decides which thread does what
// (the torch ops wrap the same functions in at::parallel_for).
#pragma once
#include <torch/extension.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// Cache lines a GEMM's tiles ask for at a steady rate between their dot products: the decode stack's next layer's
// K/V while this layer's compute-bound gate/up runs (asked for in a burst, they stalled the tiles as long as the
// attention would have waited): a tile takes a contiguous run of them and asks for a few between its blocks of k-steps.
struct LineStream {
  struct Span {
    const char* p;
    int64_t lines;
  };
  std::vector<Span> spans;
  size_t span = 0;
  int64_t taken = 0, given = 0, lines = 0, quota = 0;
  void add(const char* p, int64_t bytes) {
    const int64_t n = (bytes + 63) / 64;
    if (!spans.empty() && spans.back().p + spans.back().lines * 64 == p)
      spans.back().lines += n;  // adjacent blocks: one span
    else
      spans.push_back({p, n});
    lines += n;
  }
  void clear() { spans.clear(), span = 0, taken = 0, given = 0, lines = 0; }
  // Lines a tile asks for: those not yet taken over `tiles` tiles (a later GEMM takes what an earlier one could not).
  void pace(int64_t tiles) { quota = (lines - given + tiles - 1) / std::max<int64_t>(1, tiles); }
  // The next tile's lines: up to `quota` of them, contiguous (the rest of a span, or part of it).
  std::pair<const char*, int64_t> take() {
    if (span == spans.size()) return {nullptr, 0};
    const Span& s = spans[span];
    const int64_t n = std::min(quota, s.lines - taken);
    const char* p = s.p + taken * 64;
    given += n;
    if ((taken += n) == s.lines) ++span, taken = 0;
    return {p, n};
  }
};

// ---- paged decode attention (cpu_decode_attention.cpp) ----------------------------------------
struct DecodeItem {
  int64_t seq, p0, p1;  // positions [p0, p1) of sequence seq
  int64_t slot;         // partial-result slot when the sequence is split, else -1
  int64_t kv0, kv1;     // its KV heads [kv0, kv1) and their query heads (all, unless fewer sequences than threads)
};

struct DecodeAttention {
  at::ScalarType query_type, cache_type;
  const void *query, *k_cache, *v_cache;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int64_t* rows;
  void* out;  // [n, hq, d] in the query's dtype
  int64_t n, hq, hkv, d, block_size, max_blocks, q_row_stride, q_head_stride;
  float scale;
  int64_t window;
  float softcap;
  int64_t block_stride;
  const c10::Half *k_scales, *v_scales;
  int64_t scale_block_stride;
  // The plan: work items (sequences or their partitions), partial results of split ones.
  std::vector<DecodeItem> items;
  std::vector<float> partial;
  bool has_split = false;
  int64_t grain = 1;
  // Thread t of the planned count runs items [cuts[t], cuts[t + 1]): even shares of positions, not of items
  // (a step's sequences differ in length; the bench's prompts 32-256 tokens).
  std::vector<int64_t> cuts;

  void plan(int64_t threads);
  std::pair<int64_t, int64_t> share_of(int64_t tid, int64_t nth) const;  // thread tid's items of nth threads
  void run(int64_t begin, int64_t end) const;  // items [begin, end)
  void combine() const;                        // split sequences' partitions -> out (one thread)
  void kv_lines(int64_t begin, int64_t end, LineStream& out) const;  // the K/V rows items [begin, end) read
};

// ---- linears over packed weights (cpu_gemm.cpp; int4, int8: cpu_gemm_int4.cpp, cpu_gemm_int8.cpp) ---
struct PackedWeight {
  at::ScalarType type;  // kFloat / kBFloat16 panels; kByte: int4 panels with scale/min panels; kChar: int8 panels
                        // with scale panels
  const void* w;
  const void* scale_min;  // int4 only: fp32, or fp16 where the format's scales are (GGUF's d and m)
  const float* bias;      // fp32 [N] or nullptr
  int64_t N, K, group_size, int8_rows;
  bool half_scales = false;  // scale_min holds fp16
  bool zero_point = false;   // fp16 (scale, zero point z) pairs: min = -z * scale
  bool vnni = false;         // kBFloat16 in the VNNI pair layout (cpu_gemm_vnni.cpp), not panels
  // kFloat panels that are exactly 4-bit per group (cpu_exact_int4.cpp): their int4 panels and fp16 scale/min,
  // which the AVX-512 tiles widen back to the same fp32 values up to exact_rows rows (nullptr: none)
  const uint16_t* exact_q = nullptr;
  const c10::Half* exact_sm = nullptr;
  int64_t exact_group = 0, exact_rows = 0;
  int64_t panels() const { return (N + 15) / 16; }
};

// A bf16 weight in the VNNI pair layout [panels, K / 2, 32] (panels are [panels, K, 16]).
inline bool packed_is_vnni(const torch::Tensor& p) {
  return p.dim() == 3 && p.scalar_type() == at::kBFloat16 && p.size(2) == 32;
}

// x prepared once per call for every panel: fp32 row tiles, or int8 blocks for the int4 decode kernel.
struct GemmInput {
  int64_t M = 0;
  bool int8 = false;
  std::vector<float> xp, d, xs;
  std::vector<int8_t> xq;
  std::vector<c10::BFloat16> xb;  // VNNI weights: x in bf16 rows (whole 16-row tiles where AMX runs)
  // VNNI weights, bf16 x read where it lies (row stride K): without AMX every row; with AMX its whole 16-row tiles,
  // xb then holding the rest (the last, partial tile).
  const c10::BFloat16* xb_rows = nullptr;
  bool amx = false;
  int64_t rows_in_place() const { return xb_rows != nullptr ? (amx ? M / 16 * 16 : M) : 0; }
  // AMX: the 16-row tile of x starting at row m0 (a multiple of 16), row stride K.
  const c10::BFloat16* tile(int64_t m0, int64_t K) const {
    const int64_t in_place = rows_in_place();
    return m0 < in_place ? xb_rows + m0 * K : xb.data() + (m0 - in_place) * K;
  }
  // fp32 x read where it lies (row stride K) by the AVX-512 tiles, instead of a packed copy in xp: the copy of a
  // 2048-row prompt's x cost ~10% of its matmul (down_proj), for no faster tile.
  const float* direct = nullptr;
};

// Size `in` for M rows of x against w; then fill it by tiles [t0, t1) of gemm_input_tiles(...). fp32_x: x itself
// where it is fp32 [M, K] contiguous and stays put until the panels have run (then it may be read in place).
// bf16_x: x itself where it is bf16 [M, K] contiguous and stays put until the panels have run (the AMX tiles read
// its whole 16-row tiles in place).
void gemm_input_resize(const PackedWeight& w, int64_t M, GemmInput& in, const float* fp32_x = nullptr,
                       const c10::BFloat16* bf16_x = nullptr);
int64_t gemm_input_tiles(const GemmInput& in);
void gemm_input_fill(const PackedWeight& w, at::ScalarType x_type, const void* x, GemmInput& in, int64_t t0,
                     int64_t t1);
// The same for weights in the VNNI pair layout (cpu_gemm_vnni.cpp), which the functions above call: fill takes
// rows [r0, r1) here.
void vnni_input_resize(const PackedWeight& w, int64_t M, GemmInput& in, const c10::BFloat16* bf16_x = nullptr);
void vnni_input_fill(const PackedWeight& w, at::ScalarType x_type, const void* x, GemmInput& in, int64_t r0,
                     int64_t r1);
void vnni_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0, int64_t p1,
                 LineStream* side = nullptr);
bool vnni_amx();  // whether AMX tiles run here (cpuid, and the OS granted the tile state)
bool vnni_dpbf16();  // whether the AVX512-BF16 tiles were built (-march=native on a CPU with them)
// Whether the VNNI tiles read an x of this dtype in place (GemmInput::xb_rows): bf16 rows, AVX512-BF16 tiles.
bool vnni_reads_rows_in_place(const PackedWeight& w, at::ScalarType x_type);
// silu_mul_panels over VNNI pairs (gate panels [p0, p1)): where the AVX512-BF16 tiles run and AMX does not.
bool vnni_silu_mul_runs();
void vnni_silu_mul_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0,
                          int64_t p1, LineStream* side = nullptr);
// The same over int4 and int8 weights (cpu_gemm_int4.cpp, cpu_gemm_int8.cpp), which gemm_panels calls.
void int4_gemm_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0,
                      int64_t p1, std::vector<float>& wbuf);
void int8_gemm_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0,
                      int64_t p1, std::vector<float>& wbuf);
// Whether fp32 x is read where it lies (row stride K) by w's panels for M rows, not packed into row tiles.
bool gemm_reads_x_in_place(const PackedWeight& w, int64_t M);
// x [..., K] times the packed weight w (its bias from `bias`) -> [..., N] in x's dtype: the packed torch ops' body
// (cpu_linear_ops.cpp).
torch::Tensor run_packed(const torch::Tensor& x, PackedWeight w, const c10::optional<torch::Tensor>& bias);
// y[:, panels p0..p1) for all M rows; y [M, N] in x_type. wbuf: the thread's scratch.
void gemm_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t p0, int64_t p1,
                 std::vector<float>& wbuf, LineStream* side = nullptr);
// silu(x Wg^T) * (x Wu^T) into y [M, N / 2] over a fused [gate; up] weight (N = 2 I): whether it runs for M rows
// (else: gemm_panels, then silu_and_mul_row), its work in chunks (two gate panels each, with their up panels), and
// chunks [c0, c1) of it.
bool silu_mul_runs(const PackedWeight& w, int64_t M);
int64_t silu_mul_chunks(const PackedWeight& w);
void silu_mul_panels(const PackedWeight& w, const GemmInput& in, at::ScalarType x_type, void* y, int64_t c0,
                     int64_t c1, std::vector<float>& wbuf, LineStream* side = nullptr);

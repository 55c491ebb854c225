// One buffer in 2 MiB transparent huge pages (Linux; elsewhere plain memory): the packed weights are moved into it
// once the model is set up (pagedcore/huge_pages.py). A decode step streams nearly every weight from memory, and
// with 4 KiB pages each 4 KiB of the stream is a TLB miss and a page walk (fp32 GEMM at 1-64 rows, 2 threads:
// 3-9% faster from huge pages, /tmp bench of the tiles). With THP in "madvise" mode (this machine) nothing else
// gets them.
#include "ops.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <ATen/Parallel.h>

#include <cstdlib>

torch::Tensor huge_page_buffer(int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "huge_page_buffer: nbytes must be positive");
  auto opts = torch::TensorOptions().dtype(torch::kUInt8);
#if defined(__linux__)
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t len = (size_t(nbytes) + kHuge - 1) / kHuge * kHuge;
  // Reserve a huge page more than needed, then trim to a 2 MiB-aligned start (mmap aligns to 4 KiB only).
  void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw != MAP_FAILED) {
    char* base = static_cast<char*>(raw);
    char* start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge);
    if (start > base) munmap(base, start - base);
    const size_t tail = (base + len + kHuge) - (start + len);
    if (tail > 0) munmap(start + len, tail);
    madvise(start, len, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
    // First touch from every thread: a fresh huge page costs the kernel ~2-3 ms here (0.8 s for the bundled
    // model's 513 MiB on one thread, 0.43 on two, against 0.11 for 4 KiB pages).
    at::parallel_for(0, int64_t(len / kHuge), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) start[i * kHuge] = 0;
    });
    return torch::from_blob(start, {nbytes}, [len](void* p) { munmap(p, len); }, opts);
  }
#endif
  return torch::empty({nbytes}, opts);
}

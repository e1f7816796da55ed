// Allocation helpers for CPU kernels.
#pragma once

#include <ATen/ATen.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstdint>

namespace torchkit::cpu {

// A large output that is about to be written in full. Freshly mapped memory costs a page
// fault per 4 KiB page on first touch, and those cost as much as many kernels' arithmetic
// (measured here: 23 ms to first-write 64 MiB, as long as a 4096² × 128 float32 GEMM takes;
// 220 of 320 ms of a 4096 × 32000 gradient), and they serialise the threads. So the buffer
// asks for transparent huge pages (512 times fewer faults where THP is granted on request,
// the common `madvise` setting) and has the kernel populate them in one call (Linux ≥ 5.14):
// 64 MiB then costs 6 ms. Both are advice: where refused, nothing changes.
inline at::Tensor empty_for_writing(at::IntArrayRef sizes, const at::TensorOptions& options,
                                    at::MemoryFormat memory_format = at::MemoryFormat::Contiguous) {
  at::Tensor t = at::empty(sizes, options, memory_format);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, missing from older headers
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + t.nbytes()) & ~(kHuge - 1);
  if (last > first) {
    void* region = reinterpret_cast<void*>(first);
    if (madvise(region, last - first, MADV_HUGEPAGE) == 0) {
      madvise(region, last - first, kPopulateWrite);
    }
  }
#endif
  return t;
}

}  // namespace torchkit::cpu

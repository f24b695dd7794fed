// Asynchronous global -> shared copies (sm_80+) of the scan kernels.
#pragma once
#include <cuda_runtime.h>

namespace packloader_ops {

// 4 bytes, of which src_bytes (0 or 4) are read and the rest zero-filled
__device__ __forceinline__ void cp_async4(void *dst, const void *src, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
}
// 16 bytes (src and dst 16-byte aligned), of which src_bytes (0 or 16) are read and the rest zero-filled; .cg: cached
// in L2 only (each byte is staged once)
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

}  // namespace packloader_ops

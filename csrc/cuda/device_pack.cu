// CUDA half of csrc/device_pack.h: many device segments packed into one device buffer in a
// single kernel launch (instead of one cudaMemcpy per small tensor).
#include "../device_pack.h"

#include <cuda_runtime_api.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace distributed_ext {
namespace {

// One row of the piece table: (src_ptr, dst_ptr, nbytes), all device addresses.
__global__ void pack_pieces_kernel(const int64_t* table, int64_t npieces) {
  for (int64_t p = blockIdx.x; p < npieces; p += gridDim.x) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(table[3 * p]);
    uint8_t* dst = reinterpret_cast<uint8_t*>(table[3 * p + 1]);
    const int64_t n = table[3 * p + 2];
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
    int64_t done = 0;
    if (aligned) {
      const int64_t nvec = n / 16;
      const uint4* s = reinterpret_cast<const uint4*>(src);
      uint4* d = reinterpret_cast<uint4*>(dst);
      for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) d[i] = s[i];
      done = nvec * 16;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace

void device_pack_pieces(int64_t table_ptr, int64_t npieces, int64_t stream) {
  TORCH_CHECK_VALUE(npieces >= 0, "device_pack_pieces: negative piece count ", npieces);
  if (npieces == 0) return;
  TORCH_CHECK_VALUE(table_ptr != 0, "device_pack_pieces: null table");
  const int threads = 256;
  const int64_t blocks = npieces < 65535 ? npieces : 65535;
  pack_pieces_kernel<<<static_cast<unsigned int>(blocks), threads, 0,
                       reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const int64_t*>(table_ptr), npieces);
  cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "device_pack_pieces: launch failed: ", cudaGetErrorString(err));
}

}  // namespace distributed_ext

// CUDA half of csrc/device_copy.h: compiled only into the CUDA build.
#include "../device_copy.h"

#include <cuda_runtime_api.h>
#include <c10/util/Exception.h>

namespace distributed_ext {

bool built_with_cuda() { return true; }

void copy_async(int64_t dst_ptr, int64_t src_ptr, int64_t nbytes, int64_t stream) {
  TORCH_CHECK_VALUE(nbytes >= 0, "copy_async: negative length ", nbytes);
  if (nbytes == 0) return;
  TORCH_CHECK_VALUE(dst_ptr != 0 && src_ptr != 0, "copy_async: null pointer");
  cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(dst_ptr),
                                    reinterpret_cast<const void*>(src_ptr),
                                    static_cast<size_t>(nbytes), cudaMemcpyDefault,
                                    reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "copy_async: cudaMemcpyAsync of ", nbytes,
              " bytes failed: ", cudaGetErrorString(err));
}

}  // namespace distributed_ext

// CPU half of csrc/device_copy.h: the same ops as csrc/cuda/device_copy.cu, compiled only
// into the CPU build, where they raise with the reason.
#include "device_copy.h"

#include <c10/util/Exception.h>

namespace distributed_ext {

bool built_with_cuda() { return false; }

void copy_async(int64_t, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false,
              "copy_async: distributed_ext was built without CUDA (CppExtension); reinstall "
              "with a CUDA torch and toolkit present, or DISTRIBUTED_EXT_CUDA=1 to insist");
}

}  // namespace distributed_ext

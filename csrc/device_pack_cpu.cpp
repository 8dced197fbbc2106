// CPU half of csrc/device_pack.h (the CUDA half is csrc/cuda/device_pack.cu).
#include "device_pack.h"

#include <c10/util/Exception.h>

namespace distributed_ext {

void device_pack_pieces(int64_t, int64_t, int64_t) {
  TORCH_CHECK(false,
              "device_pack_pieces: distributed_ext was built without CUDA (CppExtension)");
}

}  // namespace distributed_ext

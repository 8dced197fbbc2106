#pragma once
#include <cstdint>

namespace distributed_ext {

// Whether this build was compiled with CUDA (csrc/cuda/*.cu). The CPU build has the same op
// names; there they raise, so a caller learns at the call which build it holds.
bool built_with_cuda();

// Enqueues a copy of nbytes from src_ptr to dst_ptr on the CUDA stream `stream` (a
// cudaStream_t as an integer, e.g. torch.cuda.Stream.cuda_stream) and returns at once.
// Either side may be device or pinned host memory (direction resolved by unified addressing).
// Lifetime rule: both buffers are borrowed until the stream reaches this copy; the caller
// records an event on `stream` and keeps both alive (and the source unmodified) until it has
// completed.
void copy_async(int64_t dst_ptr, int64_t src_ptr, int64_t nbytes, int64_t stream);

}  // namespace distributed_ext

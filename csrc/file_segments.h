#pragma once
#include <ATen/ATen.h>

namespace distributed_ext {

// Writes each row (src_ptr, file_offset, nbytes) of `table` ([n, 3] int64) to the file
// descriptor `fd` with pwrite, retrying short writes and EINTR, with the GIL released.
// Returns 0, or the errno of the first write that failed (nothing after it is written).
//
// Lifetime rule: the source pointers are borrowed; the caller keeps their owners alive and
// unmodified, and `fd` open, until the call returns (it is synchronous).
int64_t pwrite_segments(int64_t fd, const at::Tensor& table);

}  // namespace distributed_ext

#pragma once
#include <ATen/ATen.h>

namespace distributed_ext {

// Copies segment i of `table` ([n, 3] int64 rows of (src_ptr, dst_offset, nbytes)) from the
// borrowed pointer src_ptr into dst[dst_offset : dst_offset + nbytes]. GIL released.
void pack_segments(const at::Tensor& dst, const at::Tensor& table);

// The inverse: rows of (dst_ptr, src_offset, nbytes); copies src[src_offset : +nbytes] to dst_ptr.
void unpack_segments(const at::Tensor& src, const at::Tensor& table);

// One raw copy of nbytes from src_ptr to dst_ptr (non-overlapping), split over threads.
void copy_bytes(int64_t dst_ptr, int64_t src_ptr, int64_t nbytes);

}  // namespace distributed_ext

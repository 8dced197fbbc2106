#pragma once
#include <ATen/ATen.h>

#include <string>

namespace distributed_ext {

// pwrite of all `nbytes` of `src` at `offset` of `fd`, retrying short writes and EINTR;
// 0, or the errno of the write that failed (EIO for one that wrote nothing). No GIL needed.
int pwrite_fully(int fd, const char* src, int64_t nbytes, int64_t offset);

// Reads `dst`'s bytes (a contiguous CPU tensor) from `offset` of `fd` with pread, retrying
// short reads and EINTR, with the GIL released. Returns the bytes read: fewer than asked only
// where the file ends first (the caller names that a truncated file); -errno on a failed read.
int64_t pread_into(int64_t fd, const at::Tensor& dst, int64_t offset);

// Writes each row (src_ptr, file_offset, nbytes) of `table` ([n, 3] int64) to the file
// descriptor `fd` with pwrite, retrying short writes and EINTR, with the GIL released.
// Returns 0, or the errno of the first write that failed (nothing after it is written).
//
// Lifetime rule: the source pointers are borrowed; the caller keeps their owners alive and
// unmodified, and `fd` open, until the call returns (it is synchronous).
int64_t pwrite_segments(int64_t fd, const at::Tensor& table);

// Copies each row (src_ptr, file_offset, nbytes) of `table` into the file `fd` (open for
// reading and writing) through one shared mapping of the span the rows touch, unmapped
// before returning, with the GIL released. On a RAM filesystem this is the file's storage
// itself: processes writing disjoint bytes of one file do not take turns on its lock, as
// pwrite makes them, and a row costs a memcpy, not a syscall. Rows must lie inside
// [0, file_size) (ValueError otherwise); returns 0, or the errno of a failed fstat, mmap
// or munmap (EINVAL where the file is shorter than the rows reach). Same lifetime rule.
int64_t map_write_segments(int64_t fd, const at::Tensor& table, int64_t file_size);

// Swaps two paths atomically (Linux renameat2 with RENAME_EXCHANGE): each then names what
// the other named, and no instant sees either missing. Returns 0, or the errno: ENOSYS or
// EINVAL where the kernel or the filesystem cannot (the caller falls back), another errno
// for a real failure. Both paths must exist on the same filesystem.
int64_t exchange_paths(const std::string& a, const std::string& b);

}  // namespace distributed_ext

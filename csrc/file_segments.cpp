// Many small writes of one file in one native call: the exporter's scatter of packed pieces.
//
// A checkpoint of 100k small tensors lands as 100k runs at scattered file offsets; one
// Python-level pwrite per run costs more than the bytes. Python decides where each run goes
// (the table); this file only writes, without the GIL, so the receive loop keeps going.
#include "file_segments.h"

#include <torch/extension.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

namespace distributed_ext {

namespace {

// A (src_ptr, file_offset, nbytes) table and a descriptor, checked before any byte moves.
void check_file_table(int64_t fd, const at::Tensor& table, const char* op) {
  TORCH_CHECK_VALUE(table.device().is_cpu() && table.scalar_type() == at::kLong &&
                        table.dim() == 2 && table.size(1) == 3 && table.is_contiguous(),
                    op, ": the table must be a contiguous CPU int64 tensor of shape [n, 3], "
                    "got ", table.scalar_type(), " ", table.sizes());
  TORCH_CHECK_VALUE(fd >= 0, op, ": fd must be an open descriptor, got ", fd);
}

}  // namespace

int pwrite_fully(int fd, const char* src, int64_t nbytes, int64_t offset) {
  int64_t done = 0;
  while (done < nbytes) {
    const ssize_t w = ::pwrite(fd, src + done, static_cast<size_t>(nbytes - done),
                               static_cast<off_t>(offset + done));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (w == 0) return EIO;
    done += w;
  }
  return 0;
}

int64_t pread_into(int64_t fd, const at::Tensor& dst, int64_t offset) {
  TORCH_CHECK_VALUE(fd >= 0, "pread_into: fd must be an open file descriptor, got ", fd);
  TORCH_CHECK_VALUE(offset >= 0, "pread_into: offset must be >= 0, got ", offset);
  TORCH_CHECK_VALUE(dst.device().is_cpu() && dst.is_contiguous(),
                    "pread_into: dst must be a contiguous CPU tensor");
  char* out = static_cast<char*>(dst.data_ptr());
  const int64_t nbytes = static_cast<int64_t>(dst.nbytes());
  pybind11::gil_scoped_release no_gil;
  int64_t done = 0;
  while (done < nbytes) {
    const ssize_t r = ::pread(static_cast<int>(fd), out + done,
                              static_cast<size_t>(nbytes - done),
                              static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -static_cast<int64_t>(errno);
    }
    if (r == 0) break;  // the file ends here
    done += r;
  }
  return done;
}

int64_t pwrite_segments(int64_t fd, const at::Tensor& table) {
  check_file_table(fd, table, "pwrite_segments");
  const int64_t n = table.size(0);
  const int64_t* rows = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(rows[3 * i + 1] >= 0 && rows[3 * i + 2] >= 0,
                      "pwrite_segments: row ", i, " has a negative offset or length");
    TORCH_CHECK_VALUE(rows[3 * i] != 0 || rows[3 * i + 2] == 0,
                      "pwrite_segments: row ", i, " has a null pointer");
  }
  pybind11::gil_scoped_release no_gil;
  for (int64_t i = 0; i < n; ++i) {
    const int rc = pwrite_fully(static_cast<int>(fd), reinterpret_cast<const char*>(rows[3 * i]),
                                rows[3 * i + 2], rows[3 * i + 1]);
    if (rc != 0) return rc;
  }
  return 0;
}

int64_t map_write_segments(int64_t fd, const at::Tensor& table, int64_t file_size) {
  check_file_table(fd, table, "map_write_segments");
  const int64_t n = table.size(0);
  if (n == 0) return 0;
  const int64_t* rows = table.data_ptr<int64_t>();
  // The span of the file the rows touch; every row must lie inside the file: a store to a
  // mapped page past its end is a SIGBUS, not an error code.
  int64_t lo = INT64_MAX, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t offset = rows[3 * i + 1], nbytes = rows[3 * i + 2];
    TORCH_CHECK_VALUE(offset >= 0 && nbytes >= 0 && nbytes <= file_size - offset,
                      "map_write_segments: row ", i, " writes bytes [", offset, ", ",
                      offset + nbytes, ") outside the file's ", file_size, " bytes");
    TORCH_CHECK_VALUE(rows[3 * i] != 0 || nbytes == 0,
                      "map_write_segments: row ", i, " has a null pointer");
    if (nbytes == 0) continue;
    lo = std::min(lo, offset);
    hi = std::max(hi, offset + nbytes);
  }
  if (hi == 0) return 0;
  pybind11::gil_scoped_release no_gil;
  // The file's real size, read now: the caller's size is what the writers agreed on, and a
  // file shortened behind our back must fail here, not fault in the copy below.
  struct stat st;
  if (::fstat(static_cast<int>(fd), &st) != 0) return errno;
  if (st.st_size < hi) return EINVAL;
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  const int64_t start = lo - lo % page;
  void* map = ::mmap(nullptr, static_cast<size_t>(hi - start), PROT_READ | PROT_WRITE,
                     MAP_SHARED, static_cast<int>(fd), static_cast<off_t>(start));
  if (map == MAP_FAILED) return errno;
  char* base = static_cast<char*>(map) - start;  // base + offset: the file's byte there
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(base + rows[3 * i + 1], reinterpret_cast<const void*>(rows[3 * i]),
                static_cast<size_t>(rows[3 * i + 2]));
  }
  return ::munmap(map, static_cast<size_t>(hi - start)) == 0 ? 0 : errno;
}

int64_t exchange_paths(const std::string& a, const std::string& b) {
#if defined(__linux__) && defined(SYS_renameat2)
  constexpr unsigned int kRenameExchange = 1u << 1;  // RENAME_EXCHANGE (linux/fs.h)
  pybind11::gil_scoped_release no_gil;
  const long rc = ::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(),
                            kRenameExchange);
  return rc == 0 ? 0 : errno;
#else
  (void)a;
  (void)b;
  return ENOSYS;
#endif
}

}  // namespace distributed_ext

// Many small writes of one file in one native call: the exporter's scatter of packed pieces.
//
// A checkpoint of 100k small tensors lands as 100k runs at scattered file offsets; one
// Python-level pwrite per run costs more than the bytes. Python decides where each run goes
// (the table); this file only writes, without the GIL, so the receive loop keeps going.
#include "file_segments.h"

#include <torch/extension.h>

#include <cerrno>
#include <fcntl.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

namespace distributed_ext {

int64_t pwrite_segments(int64_t fd, const at::Tensor& table) {
  TORCH_CHECK_VALUE(table.device().is_cpu() && table.scalar_type() == at::kLong &&
                        table.dim() == 2 && table.size(1) == 3 && table.is_contiguous(),
                    "pwrite_segments: the table must be a contiguous CPU int64 tensor of shape "
                    "[n, 3], got ", table.scalar_type(), " ", table.sizes());
  TORCH_CHECK_VALUE(fd >= 0, "pwrite_segments: fd must be an open descriptor, got ", fd);
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
    const char* src = reinterpret_cast<const char*>(rows[3 * i]);
    const int64_t offset = rows[3 * i + 1];
    const int64_t nbytes = rows[3 * i + 2];
    int64_t done = 0;
    while (done < nbytes) {
      const ssize_t w = ::pwrite(static_cast<int>(fd), src + done,
                                 static_cast<size_t>(nbytes - done),
                                 static_cast<off_t>(offset + done));
      if (w < 0) {
        if (errno == EINTR) continue;
        return errno;
      }
      if (w == 0) return EIO;
      done += w;
    }
  }
  return 0;
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

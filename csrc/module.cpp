// The pybind11 module distributed_ext._C: the narrow native API (pointers, lengths, tensors).
#include <torch/extension.h>

#include <sys/mman.h>

#include <algorithm>

#include "device_copy.h"
#include "device_pack.h"
#include "file_segments.h"
#include "heartbeat.h"
#include "huge_pages.h"
#include "quantize.h"
#include "segments.h"
#include "write_queue.h"

#ifndef DEXT_TORCH_VERSION
#error "setup.py defines DEXT_TORCH_VERSION (the torch the extension is compiled against)"
#endif
#ifndef DEXT_CUDA_VERSION
#define DEXT_CUDA_VERSION
#endif

#define DEXT_STR2(x) #x
#define DEXT_STR(x) DEXT_STR2(x)

namespace {

// A plain string in the binary, so that distributed_ext/_native.py can say what a module that
// fails to load was built for by reading the file, without loading it.
extern "C" __attribute__((used)) const char kDextBuildStamp[] =
    "DEXT_BUILD_STAMP{torch=" DEXT_STR(DEXT_TORCH_VERSION) ";cuda=" DEXT_STR(DEXT_CUDA_VERSION)
    ";python=" DEXT_STR(PY_MAJOR_VERSION) "." DEXT_STR(PY_MINOR_VERSION) "}";

pybind11::dict build_info() {
  pybind11::dict info;
  info["torch"] = std::string(DEXT_STR(DEXT_TORCH_VERSION));
  info["cuda"] = std::string(DEXT_STR(DEXT_CUDA_VERSION));
  info["python"] = std::to_string(PY_MAJOR_VERSION) + "." + std::to_string(PY_MINOR_VERSION);
  info["with_cuda"] = distributed_ext::built_with_cuda();
  info["abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
  return info;
}

// Faults the pages of [data, data + nbytes) in now, several threads at once, so that the
// single transport thread that writes a receive into them later does not pay one page fault
// per 4 KiB (or 2 MiB) as it goes. MADV_POPULATE_WRITE (Linux 5.14+) does it in the kernel
// without writing a byte; on an older kernel it is refused and the pages fault in later.
void populate(char* data, int64_t nbytes) {
#ifdef __linux__
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, absent from older headers
  constexpr uintptr_t kPage = 4096;
  constexpr int64_t kPiece = int64_t{64} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kPage - 1) & ~(kPage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + nbytes) & ~(kPage - 1);
  if (end <= begin) return;
  const int64_t span = static_cast<int64_t>(end - begin);
  at::parallel_for(0, (span + kPiece - 1) / kPiece, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uintptr_t a = begin + static_cast<uintptr_t>(i * kPiece);
      const uintptr_t b = std::min(end, a + static_cast<uintptr_t>(kPiece));
      (void)madvise(reinterpret_cast<void*>(a), b - a, kPopulateWrite);  // advice only
    }
  });
#else
  (void)data;
  (void)nbytes;
#endif
}

// A bytearray of nbytes whose contents are NOT initialized: bytearray(n) would memset every
// page before a receive overwrites it anyway. The caller fills every byte before exposing it.
//
// Large buffers are advised to use transparent huge pages: first-touch page faults of 4 KiB
// pages run at ~1-2 GB/s on a small VM, slower than the link, and a receive pays them all.
// With `prefault`, the pages are faulted in here, in parallel (measured on the 2-core VM:
// 256 MiB in 0.024 s, against ~0.15 s of faults taken one by one inside a receive).
pybind11::object empty_bytearray(int64_t nbytes, bool prefault, bool huge_pages) {
  TORCH_CHECK_VALUE(nbytes >= 0, "empty_bytearray: negative size ", nbytes);
  PyObject* obj = PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(nbytes));
  if (obj == nullptr) throw pybind11::error_already_set();
  char* data = PyByteArray_AS_STRING(obj);
  if (huge_pages) distributed_ext::advise_huge_pages(data, nbytes);
  if (prefault && nbytes > 0) {
    pybind11::gil_scoped_release no_gil;
    populate(data, nbytes);
  }
  return pybind11::reinterpret_steal<pybind11::object>(obj);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "distributed_ext compiled core: segment packing and device copies";
  m.def("build_info", &build_info, "What this module was compiled for.");
  m.def("pack_segments", &distributed_ext::pack_segments, pybind11::arg("dst"),
        pybind11::arg("table"),
        "Copy rows (src_ptr, dst_offset, nbytes) into dst; GIL released.");
  m.def("unpack_segments", &distributed_ext::unpack_segments, pybind11::arg("src"),
        pybind11::arg("table"),
        "Copy rows (dst_ptr, src_offset, nbytes) out of src; GIL released.");
  m.def("exchange_paths", &distributed_ext::exchange_paths, pybind11::arg("a"),
        pybind11::arg("b"), "Swap two paths atomically (renameat2 RENAME_EXCHANGE); errno or 0.");
  m.def("pread_into", &distributed_ext::pread_into, pybind11::arg("fd"), pybind11::arg("dst"),
        pybind11::arg("offset"),
        "pread dst's bytes from offset of fd; GIL released; the bytes read, or -errno.");
  m.def("pwrite_segments", &distributed_ext::pwrite_segments, pybind11::arg("fd"),
        pybind11::arg("table"),
        "pwrite rows (src_ptr, file_offset, nbytes) to fd; GIL released; 0 or an errno.");
  m.def("map_write_segments", &distributed_ext::map_write_segments, pybind11::arg("fd"),
        pybind11::arg("table"), pybind11::arg("file_size"),
        "Copy rows (src_ptr, file_offset, nbytes) into fd through a shared mapping; GIL "
        "released; 0 or an errno.");
  m.def("copy_bytes", &distributed_ext::copy_bytes, pybind11::arg("dst_ptr"),
        pybind11::arg("src_ptr"), pybind11::arg("nbytes"),
        "Copy nbytes between raw host pointers; GIL released.");
  m.def("huge_buffer", &distributed_ext::huge_buffer, pybind11::arg("nbytes"),
        "A uint8 tensor of nbytes in a mapping of its own, 2 MiB-aligned, advised to "
        "transparent huge pages before anything touches it; unmapped with its storage.");
  m.def("empty_bytearray", &empty_bytearray, pybind11::arg("nbytes"),
        pybind11::arg("prefault") = false, pybind11::arg("huge_pages") = true,
        "A bytearray of nbytes, contents uninitialized (the caller fills every byte).");
  m.def("start_heartbeat", &distributed_ext::start_heartbeat, pybind11::arg("store"),
        pybind11::arg("client"), pybind11::arg("key"), pybind11::arg("interval_ms"),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Beat (client.add(key, 1)) every interval_ms from a native thread while store lives.");
  m.def("heartbeat_running", &distributed_ext::heartbeat_running, pybind11::arg("store"),
        pybind11::arg("key"), pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Whether the heartbeat already runs for this store and key.");
  m.def("stop_heartbeat", &distributed_ext::stop_heartbeat,
        pybind11::call_guard<pybind11::gil_scoped_release>(), "Stop the heartbeat thread.");
  m.def("set_heartbeat_note", &distributed_ext::set_heartbeat_note, pybind11::arg("key"),
        pybind11::arg("note"), "Post a note under key with the next beat.");
  m.def("heartbeat_count", &distributed_ext::heartbeat_count, "Beats sent so far.");
  m.def("heartbeat_failed", &distributed_ext::heartbeat_failed,
        "Whether the heartbeat gave up after repeated failed beats.");
  m.def("map_through_table", &distributed_ext::map_through_table, pybind11::arg("src"),
        pybind11::arg("table"), pybind11::arg("into") = pybind11::none(),
        "uint8 table[bits of each 2-byte element of src] (an elementwise function tabulated).");
  m.def("fp8_divide", &distributed_ext::fp8_divide, pybind11::arg("src"),
        pybind11::arg("scale"), pybind11::arg("bf16_quotient"), pybind11::arg("table"),
        pybind11::arg("into") = pybind11::none(),
        "FP8 bytes of bfloat16 src / scale (torch's arithmetic); Inf/NaN from table.");
  m.def("nvfp4_rows", &distributed_ext::nvfp4_rows, pybind11::arg("src"),
        pybind11::arg("scale_2"), pybind11::arg("block"),
        "NVFP4 of the rows of src: (packed 4-bit codes, per-block E4M3 scales) as uint8.");
  m.def("nvfp4_scales", &distributed_ext::nvfp4_scales, pybind11::arg("src"),
        pybind11::arg("scale_2"), pybind11::arg("block"),
        "The per-block E4M3 scales of nvfp4_rows alone, as uint8.");
  m.def("int4_rows", &distributed_ext::int4_rows, pybind11::arg("src"),
        pybind11::arg("scale"), pybind11::arg("block"),
        "INT4 AWQ of the rows of src under per-group float32 scales: row pairs packed, uint8.");
  m.def("built_with_cuda", &distributed_ext::built_with_cuda);
  m.def("copy_async", &distributed_ext::copy_async, pybind11::arg("dst_ptr"),
        pybind11::arg("src_ptr"), pybind11::arg("nbytes"), pybind11::arg("stream"),
        "Enqueue a cudaMemcpyAsync on a stream (CUDA build only).");
  m.def("device_pack_pieces", &distributed_ext::device_pack_pieces, pybind11::arg("table_ptr"),
        pybind11::arg("npieces"), pybind11::arg("stream"),
        "One kernel copying rows (src_ptr, dst_ptr, nbytes) of a device table (CUDA build only).");
  pybind11::class_<distributed_ext::WriteQueue>(
      m, "WriteQueue",
      "Direct writes done in order by a native thread of their own (no GIL between them).")
      .def(pybind11::init<int64_t>(), pybind11::arg("bounce_bytes"))
      .def("submit", &distributed_ext::WriteQueue::submit, pybind11::arg("direct_fd"),
           pybind11::arg("buffered_fd"), pybind11::arg("src"), pybind11::arg("nbytes"),
           pybind11::arg("offset"),
           "Queue whole aligned blocks (src, nbytes) for offset; returns the job's ticket.")
      .def("wait", &distributed_ext::WriteQueue::wait, pybind11::arg("ticket"),
           pybind11::call_guard<pybind11::gil_scoped_release>(),
           "Wait for the jobs up to ticket: (errno or 0, the failed job's ticket).")
      .def("close", &distributed_ext::WriteQueue::close,
           pybind11::call_guard<pybind11::gil_scoped_release>(),
           "Wait for every job, then stop the thread (idempotent).")
      .def("efault_retries", &distributed_ext::WriteQueue::efault_retries,
           "(jobs refused direct with EFAULT and written through the page cache, the last's "
           "ticket).");
}

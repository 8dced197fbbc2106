// Segment copies: many (pointer, length) sources packed into one buffer, and the inverse.
//
// This is the byte work of the transport and of the state serializer. Python decides what
// moves (which segments, at which offsets); this file only copies, with the GIL released and
// the work split over ATen's intra-op thread pool, because on a host a single memcpy thread
// rarely saturates the memory bus.
//
// Lifetime rule: the raw source/destination pointers in a segment table are borrowed. The
// caller keeps every object they point into alive (and unmodified, for sources) until the
// call returns. The calls are synchronous, so returning ends the borrow.
#include "segments.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace distributed_ext {
namespace {

// Pieces larger than this are split so a single huge segment still uses every thread.
constexpr int64_t kPieceBytes = int64_t{4} << 20;  // 4 MiB
// The least a thread of the pool is given to copy (see run_pieces).
constexpr int64_t kTaskBytes = int64_t{1} << 20;  // 1 MiB

struct Piece {
  char* dst;
  const char* src;
  int64_t nbytes;
};

void check_table(const at::Tensor& table, const char* op) {
  TORCH_CHECK_VALUE(table.device().is_cpu(), op, ": the segment table must be a CPU tensor");
  TORCH_CHECK_VALUE(table.scalar_type() == at::kLong, op,
                    ": the segment table must be int64, got ", table.scalar_type());
  TORCH_CHECK_VALUE(table.dim() == 2 && table.size(1) == 3, op,
                    ": the segment table must have shape [n, 3], got ", table.sizes());
  TORCH_CHECK_VALUE(table.is_contiguous(), op, ": the segment table must be contiguous");
}

void check_buffer(const at::Tensor& buffer, const char* op, const char* name) {
  TORCH_CHECK_VALUE(buffer.device().is_cpu(), op, ": ", name,
                    " must be a CPU tensor (pinned or pageable), got ", buffer.device());
  TORCH_CHECK_VALUE(buffer.scalar_type() == at::kByte, op, ": ", name,
                    " must be uint8, got ", buffer.scalar_type());
  TORCH_CHECK_VALUE(buffer.is_contiguous(), op, ": ", name, " must be contiguous");
}

// Splits every segment into pieces of at most kPieceBytes. `buffer_is_dst` says whether the
// buffer side (column 1 offsets) is the destination (pack) or the source (unpack).
std::vector<Piece> plan_pieces(const at::Tensor& buffer, const at::Tensor& table,
                               bool buffer_is_dst, const char* op) {
  char* base = static_cast<char*>(buffer.data_ptr());
  const int64_t capacity = buffer.numel();
  const int64_t n = table.size(0);
  const int64_t* rows = table.data_ptr<int64_t>();
  std::vector<Piece> pieces;
  pieces.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ptr = rows[3 * i];
    const int64_t offset = rows[3 * i + 1];
    const int64_t nbytes = rows[3 * i + 2];
    TORCH_CHECK_VALUE(nbytes >= 0, op, ": segment ", i, " has a negative length ", nbytes);
    TORCH_CHECK_VALUE(offset >= 0 && offset <= capacity && nbytes <= capacity - offset, op,
                      ": segment ", i, " [", offset, ", ", offset, " + ", nbytes,
                      ") lies outside the buffer of ", capacity, " bytes");
    if (nbytes == 0) continue;
    TORCH_CHECK_VALUE(ptr != 0, op, ": segment ", i, " has a null pointer");
    for (int64_t done = 0; done < nbytes; done += kPieceBytes) {
      const int64_t len = std::min(kPieceBytes, nbytes - done);
      char* outside = reinterpret_cast<char*>(ptr) + done;
      char* inside = base + offset + done;
      if (buffer_is_dst) {
        pieces.push_back({inside, outside, len});
      } else {
        pieces.push_back({outside, inside, len});
      }
    }
  }
  return pieces;
}

void copy_range(const std::vector<Piece>& pieces, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    std::memcpy(pieces[i].dst, pieces[i].src, static_cast<size_t>(pieces[i].nbytes));
  }
}

void run_pieces(const std::vector<Piece>& pieces) {
  if (pieces.empty()) return;
  const int64_t n = static_cast<int64_t>(pieces.size());
  int64_t total = 0;
  for (const auto& p : pieces) total += p.nbytes;
  // The pool only pays where each task copies at least kTaskBytes: a message of a thousand
  // 1 KiB tensors is ~1 MiB, which one thread copies in well under the cost of waking the
  // pool (and, with several ranks per host, of their threads competing for the cores).
  if (total < 2 * kTaskBytes || n == 1) {
    copy_range(pieces, 0, n);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, n * kTaskBytes / total);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    copy_range(pieces, begin, end);
  });
}

}  // namespace

void pack_segments(const at::Tensor& dst, const at::Tensor& table) {
  check_buffer(dst, "pack_segments", "dst");
  check_table(table, "pack_segments");
  auto pieces = plan_pieces(dst, table, /*buffer_is_dst=*/true, "pack_segments");
  pybind11::gil_scoped_release no_gil;
  run_pieces(pieces);
}

void unpack_segments(const at::Tensor& src, const at::Tensor& table) {
  check_buffer(src, "unpack_segments", "src");
  check_table(table, "unpack_segments");
  auto pieces = plan_pieces(src, table, /*buffer_is_dst=*/false, "unpack_segments");
  pybind11::gil_scoped_release no_gil;
  run_pieces(pieces);
}

void copy_bytes(int64_t dst_ptr, int64_t src_ptr, int64_t nbytes) {
  TORCH_CHECK_VALUE(nbytes >= 0, "copy_bytes: negative length ", nbytes);
  if (nbytes == 0) return;
  TORCH_CHECK_VALUE(dst_ptr != 0 && src_ptr != 0, "copy_bytes: null pointer");
  std::vector<Piece> pieces;
  for (int64_t done = 0; done < nbytes; done += kPieceBytes) {
    pieces.push_back({reinterpret_cast<char*>(dst_ptr) + done,
                      reinterpret_cast<const char*>(src_ptr) + done,
                      std::min(kPieceBytes, nbytes - done)});
  }
  pybind11::gil_scoped_release no_gil;
  run_pieces(pieces);
}

}  // namespace distributed_ext

#include "huge_pages.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

namespace distributed_ext {

void advise_huge_pages(char* data, int64_t nbytes) {
#ifdef MADV_HUGEPAGE
  if (nbytes < static_cast<int64_t>(2 * kHugePage)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + nbytes) & ~(kHugePage - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)nbytes;
#endif
}

HugeMapping map_huge(int64_t nbytes) {
  HugeMapping mapping;
  if (nbytes < 0) {
    errno = EINVAL;
    return mapping;
  }
  // Rounded up to whole huge pages, plus one to align the start to.
  const size_t bytes = (static_cast<size_t>(nbytes) + 2 * kHugePage - 1) / kHugePage * kHugePage;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return mapping;
#ifdef MADV_HUGEPAGE
  (void)::madvise(p, bytes, MADV_HUGEPAGE);  // (advice only)
#endif
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  mapping.map = p;
  mapping.bytes = bytes;
  mapping.data = reinterpret_cast<char*>((start + kHugePage - 1) & ~(kHugePage - 1));
  return mapping;
}

void unmap_huge(HugeMapping& mapping) {
  if (mapping.map != nullptr) (void)::munmap(mapping.map, mapping.bytes);
  mapping = HugeMapping{};
}

torch::Tensor huge_buffer(int64_t nbytes) {
  TORCH_CHECK_VALUE(nbytes >= 0, "huge_buffer: nbytes must be >= 0, got ", nbytes);
  HugeMapping mapping = map_huge(nbytes);
  if (mapping.data == nullptr) {
    const int err = errno;
    throw std::runtime_error("huge_buffer: mmap of " + std::to_string(nbytes) +
                             " bytes failed: " + std::strerror(err));
  }
  void* map = mapping.map;
  const size_t bytes = mapping.bytes;
  return torch::from_blob(
      mapping.data, {nbytes}, [map, bytes](void*) { (void)::munmap(map, bytes); },
      torch::TensorOptions().dtype(torch::kUInt8));
}

}  // namespace distributed_ext

// Host memory in transparent huge pages, for the buffers a direct write reads and a receive
// fills: the device gets a direct write's source as one segment per physically contiguous
// range (hundreds for 1 MB of 4 KiB pages), and first-touch faults of 4 KiB pages are
// slower than the link.
#pragma once

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>

namespace distributed_ext {

constexpr size_t kHugePage = size_t{2} << 20;  // x86-64, arm64 with 4 KiB pages

// Advises the whole 2 MiB pages inside [data, data + nbytes) to use huge pages (advice
// only: THP off or memory not mmap-backed leaves ordinary pages). Memory touched before the
// advice keeps its 4 KiB pages: a buffer that must get huge pages is a HugeMapping.
void advise_huge_pages(char* data, int64_t nbytes);

// A private anonymous mapping of its own holding at least `nbytes` from `data` (2 MiB-aligned),
// advised to huge pages before anything touches it. Only what is touched takes memory.
struct HugeMapping {
  void* map = nullptr;  // what to unmap: `bytes` from here
  size_t bytes = 0;
  char* data = nullptr;  // nullptr where the mapping failed (errno says why)
};
HugeMapping map_huge(int64_t nbytes);
void unmap_huge(HugeMapping& mapping);  // (then empty; nothing where it is empty)

// A uint8 CPU tensor of `nbytes` on a HugeMapping, unmapped with its storage's last user.
torch::Tensor huge_buffer(int64_t nbytes);

}  // namespace distributed_ext

#pragma once
#include <cstdint>

namespace distributed_ext {

// Launches one kernel on `stream` that copies every piece of a device-resident int64 table of
// rows (src_ptr, dst_ptr, nbytes) -- device addresses -- and returns at once. Lifetime rule:
// the table and every buffer it names stay alive (sources unmodified) until the stream has
// passed the kernel. CPU build: raises.
void device_pack_pieces(int64_t table_ptr, int64_t npieces, int64_t stream);

}  // namespace distributed_ext

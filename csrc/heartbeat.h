#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

namespace distributed_ext {

// Starts (or keeps) this process's heartbeat: a native thread that adds 1 to `key` in `store`
// every `interval_ms`, with no GIL, so that a rank busy in Python (or in a long native call
// holding the GIL) still beats, and a rank that died stops. Peers read the counter to tell a
// dead rank from a slow one.
//
// Lifetime: the thread holds only a weak reference to the store. When the process group that
// owns the store is destroyed, the next beat finds it gone and the thread ends, so it never
// recreates a FileStore's file or keeps a TCPStore connection open. Calling again with the
// same store and key is a no-op; another store (a new process group) replaces the old beat.
void start_heartbeat(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
                     int64_t interval_ms);

// Stops the heartbeat thread (waits for it to leave, at most one beat's store call).
void stop_heartbeat();

// Beats sent by this process's current heartbeat (0 if none runs); for tests.
int64_t heartbeat_count();

}  // namespace distributed_ext

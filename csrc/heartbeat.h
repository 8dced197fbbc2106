#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

namespace distributed_ext {

// Starts (or keeps) this process's heartbeat: a native thread that adds 1 to `key` in `store`
// every `interval_ms`, with no GIL, so that a rank busy in Python (or in a long native call
// holding the GIL) still beats, and a rank that died stops. Peers read the counter to tell a
// dead rank from a slow one.
//
// `store` is the process group's store; the beats go through `client`, a clone of it (its own
// connection): a TCPStore client serializes its calls, so a beat through the group's own
// client waits behind any other thread's blocking call (a `wait` of `new_group`) and a live
// rank would look silent.
//
// Lifetime: the thread holds a weak reference to `store` (identity and liveness only) and owns
// `client`. When the process group that owns `store` is destroyed, the next beat finds it gone
// and the thread ends, so it never recreates a FileStore's file or keeps a connection open.
// After `kMaxFailures` failed beats in a row (the store's host is gone) it stops beating: the
// store then logs one warning per failure, and nobody can read the counter anyway.
// Calling again with the same store and key is a no-op; another store replaces the old beat.
void start_heartbeat(const c10::intrusive_ptr<c10d::Store>& store,
                     const c10::intrusive_ptr<c10d::Store>& client, const std::string& key,
                     int64_t interval_ms);

// Whether the heartbeat runs (or gave up) for this `store` and `key`: then start_heartbeat
// would be a no-op, and the caller need not make a client for it.
bool heartbeat_running(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key);

// Stops the heartbeat thread (waits for it to leave, at most one beat's store call).
void stop_heartbeat();

// Hands the running heartbeat a note (where this rank is: its current call) to post under
// `key` with its next beat, at most one interval later; only the newest note is posted. Costs
// the caller a mutex, never a store call. A no-op when no heartbeat runs.
void set_heartbeat_note(const std::string& key, const std::string& note);

// Beats sent by this process's current heartbeat (0 if none runs); for tests.
int64_t heartbeat_count();

// Whether the current heartbeat gave up after repeated failures (for tests and messages).
bool heartbeat_failed();

}  // namespace distributed_ext

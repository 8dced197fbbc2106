// A GIL-free liveness heartbeat through the process group's own store (see heartbeat.h).
#include "heartbeat.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace distributed_ext {
namespace {

constexpr int kMaxFailures = 3;

struct Beat {
  Beat(const c10::intrusive_ptr<c10d::Store>& strong, c10::intrusive_ptr<c10d::Store> own)
      : store(strong), client(std::move(own)) {}
  c10::weak_intrusive_ptr<c10d::Store> store;  // the group's: is it still there?
  c10::intrusive_ptr<c10d::Store> client;      // ours: the beats go through it
  c10d::Store* target = nullptr;  // identity only, never dereferenced
  std::string key;
  std::chrono::milliseconds interval{1000};
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;
  bool done = false;  // set by the thread as it leaves
  std::atomic<int64_t> beats{0};
  // The note (where this rank is: set_heartbeat_note), posted by the next beat if newer.
  std::string note_key;
  std::string note;
  uint64_t note_version = 0;   // under mutex
  uint64_t posted_version = 0; // the thread's own
  std::atomic<bool> failed{false};
  std::thread thread;
};

std::mutex g_mutex;
// Never destroyed at exit on purpose: a std::thread still joinable in a static destructor
// terminates the process. Python's atexit stops the beat first (distributed_ext/_watch.py).
Beat* g_beat = nullptr;

void run(Beat* beat) {
  std::unique_lock<std::mutex> lock(beat->mutex);
  int failures = 0;
  while (!beat->stop) {
    lock.unlock();
    if (!beat->store.lock()) {  // the process group that owned the store is gone: so is our
      lock.lock();              // reason to beat
      break;
    }
    try {
      beat->client->add(beat->key, 1);
      beat->beats.fetch_add(1);
      failures = 0;
      std::string key, note;
      uint64_t version;
      {
        std::lock_guard<std::mutex> guard(beat->mutex);
        version = beat->note_version;
        if (version != beat->posted_version) {
          key = beat->note_key;
          note = beat->note;
        }
      }
      if (version != beat->posted_version) {
        beat->client->set(key, std::vector<uint8_t>(note.begin(), note.end()));
        beat->posted_version = version;
      }
    } catch (...) {
      // A store that cannot be reached now (its host is gone, or shutting down): a peer
      // reading our counter will see it stall, which is the truth as far as it can tell.
      // Repeated failures: the host is gone for good; stop, rather than log one warning
      // per beat until the process exits.
      if (++failures >= kMaxFailures) {
        beat->failed.store(true);
        lock.lock();
        break;
      }
    }
    lock.lock();
    beat->wake.wait_for(lock, beat->interval, [beat] { return beat->stop; });
  }
  beat->done = true;
  beat->wake.notify_all();
}

bool running_locked(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key) {
  if (!g_beat || g_beat->target != store.get() || g_beat->key != key) return false;
  std::lock_guard<std::mutex> lock(g_beat->mutex);
  // Beating into this store (or given up on it after repeated failures: its host is gone).
  return !g_beat->stop && static_cast<bool>(g_beat->store.lock());
}

void stop_locked() {
  if (!g_beat) return;
  bool done;
  {
    std::unique_lock<std::mutex> lock(g_beat->mutex);
    g_beat->stop = true;
    g_beat->wake.notify_all();
    // A beat blocked in a store call (its host gone) must not hold up the caller -- at exit
    // above all: wait one second, then let the thread go, and keep its state alive for it.
    done = g_beat->wake.wait_for(lock, std::chrono::seconds(1), [] { return g_beat->done; });
  }
  if (done) {
    if (g_beat->thread.joinable()) g_beat->thread.join();
    delete g_beat;
  } else {
    g_beat->thread.detach();  // leaked on purpose: the thread still reads it
  }
  g_beat = nullptr;
}

}  // namespace

void start_heartbeat(const c10::intrusive_ptr<c10d::Store>& store,
                     const c10::intrusive_ptr<c10d::Store>& client, const std::string& key,
                     int64_t interval_ms) {
  TORCH_CHECK_VALUE(store, "start_heartbeat: store is null");
  TORCH_CHECK_VALUE(client, "start_heartbeat: client is null");
  TORCH_CHECK_VALUE(interval_ms > 0, "start_heartbeat: interval_ms must be positive, got ",
                    interval_ms);
  std::lock_guard<std::mutex> guard(g_mutex);
  if (running_locked(store, key)) return;
  stop_locked();
  auto* beat = new Beat(store, client);
  beat->target = store.get();
  beat->key = key;
  beat->interval = std::chrono::milliseconds(interval_ms);
  beat->thread = std::thread(run, beat);
  g_beat = beat;
}

bool heartbeat_running(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key) {
  std::lock_guard<std::mutex> guard(g_mutex);
  return running_locked(store, key);
}

void stop_heartbeat() {
  std::lock_guard<std::mutex> guard(g_mutex);
  stop_locked();
}

void set_heartbeat_note(const std::string& key, const std::string& note) {
  std::lock_guard<std::mutex> guard(g_mutex);
  if (!g_beat) return;
  std::lock_guard<std::mutex> lock(g_beat->mutex);
  g_beat->note_key = key;
  g_beat->note = note;
  g_beat->note_version += 1;
}

int64_t heartbeat_count() {
  std::lock_guard<std::mutex> guard(g_mutex);
  return g_beat ? g_beat->beats.load() : 0;
}

bool heartbeat_failed() {
  std::lock_guard<std::mutex> guard(g_mutex);
  return g_beat ? g_beat->failed.load() : false;
}

}  // namespace distributed_ext

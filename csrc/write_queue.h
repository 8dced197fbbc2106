#pragma once
#include <cstdint>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <tuple>

#include "huge_pages.h"

namespace distributed_ext {

// Writes of one thread's messages, done by a native thread of their own, in order.
//
// Why: a direct write issued from Python must take the GIL back when it returns before the
// next one can start; with the export's staging (Python between its compiled steps) busy
// beside it, each write then waits for the GIL, and the disk idles. Here the writes follow
// one another with no Python in between, while the caller stages the next message.
//
// Each job is (a direct descriptor, a buffered one, src, nbytes, offset): the whole aligned
// blocks of one run, written with O_DIRECT from `src` when it is block-aligned, else copied
// through the queue's own bounce buffer piece by piece. The bounce buffer is a HugeMapping
// (huge_pages.h): the device gets a direct write as one segment per physically contiguous
// range. Where the filesystem refuses
// the direct write (EINVAL) or the kernel will not pin the source memory for it (EFAULT),
// through the buffered descriptor instead. Both descriptors are
// duplicated at submit and closed once the job is done, so the caller may close its own.
//
// Lifetime rule: a job's source bytes are borrowed until wait() covering its ticket returns;
// the caller keeps them alive and unmodified until then (the destructor waits for every job).
class WriteQueue {
 public:
  explicit WriteQueue(int64_t bounce_bytes);
  ~WriteQueue();
  WriteQueue(const WriteQueue&) = delete;
  WriteQueue& operator=(const WriteQueue&) = delete;

  // Queues a job; returns its ticket (1, 2, ...). ValueError on bad arguments (nothing
  // queued), OSError where a descriptor cannot be duplicated.
  int64_t submit(int64_t direct_fd, int64_t buffered_fd, int64_t src, int64_t nbytes,
                 int64_t offset);

  // Blocks (GIL released) until every job up to `ticket` is done. Returns (0, 0) or
  // (errno, ticket of the first job that failed): after a failure no later job writes
  // anything.
  std::tuple<int64_t, int64_t> wait(int64_t ticket);

  // Waits for every job, then stops the thread (idempotent; the destructor calls it).
  void close();

  // (how many jobs the kernel refused to write direct with EFAULT, written through the page
  // cache instead; the ticket of the last): for the caller to say so.
  std::tuple<int64_t, int64_t> efault_retries();

 private:
  struct Job {
    int direct_fd, buffered_fd;
    const char* src;
    int64_t nbytes, offset, ticket;
  };
  void run();
  int write_job(const Job& job, bool* efault_retried);

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Job> jobs_;
  int64_t submitted_ = 0, done_ = 0;
  int error_ = 0;
  int64_t error_ticket_ = 0;
  int64_t efault_retries_ = 0, last_efault_ticket_ = 0;
  bool closed_ = false;  // no more jobs: the thread ends once the queued ones are done
  HugeMapping bounce_;  // bounce_bytes_ of huge pages, mapped on first use
  int64_t bounce_bytes_;
  std::thread thread_;
};

}  // namespace distributed_ext

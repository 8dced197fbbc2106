// A native writer thread for the export's direct writes (see write_queue.h).
#include "write_queue.h"

#include "file_segments.h"

#include <torch/extension.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

namespace distributed_ext {

namespace {

constexpr int64_t kAlign = 4096;  // as distributed_ext/_direct_io.py's ALIGN

}  // namespace

WriteQueue::WriteQueue(int64_t bounce_bytes) : bounce_bytes_(bounce_bytes) {
  TORCH_CHECK_VALUE(bounce_bytes >= kAlign && bounce_bytes % kAlign == 0,
                    "WriteQueue: bounce_bytes must be a positive multiple of ", kAlign,
                    ", got ", bounce_bytes);
  thread_ = std::thread([this] { run(); });
}

WriteQueue::~WriteQueue() { close(); }

int64_t WriteQueue::submit(int64_t direct_fd, int64_t buffered_fd, int64_t src, int64_t nbytes,
                           int64_t offset) {
  TORCH_CHECK_VALUE(direct_fd >= 0 && buffered_fd >= 0,
                    "WriteQueue.submit: both descriptors must be open, got ", direct_fd, " and ",
                    buffered_fd);
  TORCH_CHECK_VALUE(src != 0 && nbytes > 0 && nbytes % kAlign == 0 && offset >= 0 &&
                        offset % kAlign == 0,
                    "WriteQueue.submit: a job writes whole aligned blocks from a real address: "
                    "got src ", src, ", nbytes ", nbytes, ", offset ", offset);
  // (called with the GIL held: a failed duplication is raised as Python's OSError)
  const int d = ::fcntl(static_cast<int>(direct_fd), F_DUPFD_CLOEXEC, 0);
  if (d < 0) {
    PyErr_SetFromErrno(PyExc_OSError);
    throw pybind11::error_already_set();
  }
  const int b = ::fcntl(static_cast<int>(buffered_fd), F_DUPFD_CLOEXEC, 0);
  if (b < 0) {
    const int e = errno;
    ::close(d);
    errno = e;
    PyErr_SetFromErrno(PyExc_OSError);
    throw pybind11::error_already_set();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) {
    ::close(d);
    ::close(b);
    TORCH_CHECK_VALUE(false, "WriteQueue.submit: the queue is closed");
  }
  const int64_t ticket = ++submitted_;
  jobs_.push_back(Job{d, b, reinterpret_cast<const char*>(src), nbytes, offset, ticket});
  changed_.notify_all();
  return ticket;
}

int WriteQueue::write_job(const Job& job, bool* efault_retried) {
  const bool aligned = reinterpret_cast<uintptr_t>(job.src) % kAlign == 0;
  int rc = 0;
  if (aligned) {
    rc = pwrite_fully(job.direct_fd, job.src, job.nbytes, job.offset);
  } else {
    if (bounce_.data == nullptr) {
      bounce_ = map_huge(bounce_bytes_);  // (touched by nothing before: huge pages granted)
      if (bounce_.data == nullptr) return ENOMEM;
    }
    for (int64_t at = 0; at < job.nbytes && rc == 0; at += bounce_bytes_) {
      const int64_t n = std::min(bounce_bytes_, job.nbytes - at);
      std::memcpy(bounce_.data, job.src + at, static_cast<size_t>(n));
      rc = pwrite_fully(job.direct_fd, bounce_.data, n, job.offset + at);
    }
  }
  // EINVAL: this filesystem refuses this direct write. EFAULT: the kernel would not pin the
  // source memory for it (a mapping it cannot take for DMA -- measured: [vvar] -- though a
  // copy can read it). Either way the page cache, then (rewriting blocks already written
  // direct is harmless: every byte of the job is written again); memory that cannot be read
  // at all fails there too, and that EFAULT is the job's.
  if (rc != EINVAL && rc != EFAULT) return rc;
  const int again = pwrite_fully(job.buffered_fd, job.src, job.nbytes, job.offset);
  *efault_retried = rc == EFAULT && again == 0;  // (said only where it then landed)
  return again;
}

void WriteQueue::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [this] { return closed_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // closed, and nothing left
    const Job job = jobs_.front();
    jobs_.pop_front();
    const bool skip = error_ != 0;  // after a failure, nothing more is written
    lock.unlock();
    bool efault_retried = false;
    const int rc = skip ? 0 : write_job(job, &efault_retried);
    ::close(job.direct_fd);
    ::close(job.buffered_fd);
    lock.lock();
    if (efault_retried) {
      ++efault_retries_;
      last_efault_ticket_ = job.ticket;
    }
    if (rc != 0 && error_ == 0) {
      error_ = rc;
      error_ticket_ = job.ticket;
    }
    done_ = job.ticket;
    changed_.notify_all();
  }
}

std::tuple<int64_t, int64_t> WriteQueue::wait(int64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  const int64_t upto = std::min(ticket, submitted_);
  changed_.wait(lock, [this, upto] { return done_ >= upto; });
  if (error_ != 0 && error_ticket_ <= upto) return {error_, error_ticket_};
  return {0, 0};
}

std::tuple<int64_t, int64_t> WriteQueue::efault_retries() {
  std::lock_guard<std::mutex> lock(mutex_);
  return {efault_retries_, last_efault_ticket_};
}

void WriteQueue::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
    changed_.notify_all();
  }
  if (thread_.joinable()) thread_.join();  // (runs every queued job first)
  unmap_huge(bounce_);
}

}  // namespace distributed_ext

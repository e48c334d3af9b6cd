// A small pool of worker threads for the products: run(threads, work) calls work(i) for
// i in 0..threads-1, the calling thread taking i = 0, and returns when every call has.
//
// A decode step makes a few hundred products of tens of microseconds each, so starting
// threads per call (tens of microseconds each) or waking them through the kernel on every call
// would cost as much as the work. Workers spin on an atomic generation counter for a while
// after each job (SPIN_ROUNDS pauses, ~0.1-0.3 ms), then sleep on a condition variable.
// One job at a time: a second caller waits for the first (MLX may evaluate on several
// streams, each on its own thread).

#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace muser::cpu {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool;
    return pool;
  }

  void run(int threads, const std::function<void(int)>& work) {
    if (threads <= 1) {
      work(0);
      return;
    }
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    grow(threads - 1);
    work_ = &work;
    active_ = threads;
    // Every worker acknowledges every job (those past `threads` without working), so none
    // can lag into the next job's settings.
    remaining_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    sleep_cv_.notify_all();
    work(0);
    while (remaining_.load(std::memory_order_acquire) != 0) {
      cpu_relax();
    }
    work_ = nullptr;
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stopping_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    sleep_cv_.notify_all();
    for (auto& worker : workers_) {
      worker.join();
    }
  }

 private:
  static constexpr int SPIN_ROUNDS = 1 << 14;

  void grow(int workers) {
    while (static_cast<int>(workers_.size()) < workers) {
      int index = static_cast<int>(workers_.size()) + 1;
      // The generation it must answer next is the one after now's, however late it starts.
      unsigned long seen = generation_.load(std::memory_order_acquire);
      workers_.emplace_back([this, index, seen] { loop(index, seen); });
    }
  }

  void loop(int index, unsigned long seen) {
    while (true) {
      unsigned long now = seen;
      for (int spin = 0; spin < SPIN_ROUNDS; ++spin) {
        now = generation_.load(std::memory_order_acquire);
        if (now != seen) {
          break;
        }
        cpu_relax();
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleep_cv_.wait(lock, [&] {
          return generation_.load(std::memory_order_acquire) != seen;
        });
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      if (stopping_) {
        return;
      }
      if (index < active_) {
        (*work_)(index);
      }
      remaining_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex job_mutex_;
  std::mutex sleep_mutex_;
  std::condition_variable sleep_cv_;
  std::vector<std::thread> workers_;
  std::atomic<unsigned long> generation_{0};
  std::atomic<int> remaining_{0};
  const std::function<void(int)>* work_ = nullptr;
  int active_ = 0;
  bool stopping_ = false;
};

} // namespace muser::cpu

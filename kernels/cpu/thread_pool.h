// A small pool of worker threads for the products: run(tasks, threads, work) calls work(i)
// once for each i in 0..tasks-1, on the calling thread and up to threads - 1 workers, and
// returns when every call has.
//
// A decode step makes a few hundred products of tens of microseconds each, so starting
// threads per call would cost as much as the work. Workers spin on the job word for a while
// after each job (SPIN_ROUNDS pauses, ~10-30 us) and then sleep on a condition variable. Not
// longer: between products the thread that builds the next step needs a core, and on two
// cores a worker spinning for 0.1-0.3 ms after every job took it (perf: 19 % of SmolLM2's
// decode samples in that loop; 2^9 rounds instead of 2^14 decoded ~6-25 % faster). A caller
// never waits for a sleeping worker to wake: it claims the tasks itself.
// Tasks are claimed one at a time from the job word (generation | tasks | next task), so a
// worker that the OS has not scheduled (the machine busy with other processes) holds nothing
// up: the caller claims the tasks it has not, and waits only for tasks already claimed.
// One job at a time: a second caller waits for the first (MLX may evaluate on several
// streams, each on its own thread).

#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
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

  // tasks < 2^24.
  void run(int tasks, int threads, const std::function<void(int)>& work) {
    if (threads <= 1 || tasks <= 1) {
      for (int i = 0; i < tasks; ++i) {
        work(i);
      }
      return;
    }
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    grow(threads - 1);
    uint64_t generation = (generation_of(job_.load(std::memory_order_relaxed)) + 1) & 0xffff;
    work_[generation % 2] = &work;
    done_.store(0, std::memory_order_relaxed);
    // Sequentially consistent with a worker's sleeping_ increment and job_ check (Dekker's
    // pattern): either the worker sees this job or this sees it sleeping and wakes it.
    job_.store(pack(generation, tasks, 0));
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      sleep_cv_.notify_all();
    }
    work_on(work);
    for (int spin = 0; done_.load(std::memory_order_acquire) != tasks; ++spin) {
      if (spin < SPIN_ROUNDS) {
        cpu_relax();
      } else {
        std::this_thread::yield();  // a worker with a claimed task is waiting for a core
      }
    }
  }

  ~ThreadPool() {
    stopping_.store(true, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      sleep_cv_.notify_all();
    }
    for (auto& worker : workers_) {
      worker.join();
    }
  }

 private:
  static constexpr int SPIN_ROUNDS = 1 << 9;

  // The job word: generation (16 bits), task count (24), next unclaimed task (24).
  static uint64_t pack(uint64_t generation, uint64_t tasks, uint64_t next) {
    return (generation << 48) | (tasks << 24) | next;
  }
  static uint64_t generation_of(uint64_t job) { return job >> 48; }

  // The caller's share: claim and run tasks until none is left unclaimed.
  void work_on(const std::function<void(int)>& work) {
    uint64_t job = job_.load(std::memory_order_acquire);
    while (true) {
      uint64_t tasks = (job >> 24) & 0xffffff, next = job & 0xffffff;
      if (next >= tasks) {
        return;
      }
      if (job_.compare_exchange_weak(job, job + 1, std::memory_order_acq_rel)) {
        work(static_cast<int>(next));
        done_.fetch_add(1, std::memory_order_acq_rel);
        job = job_.load(std::memory_order_acquire);
      }
    }
  }

  void grow(int workers) {
    while (static_cast<int>(workers_.size()) < workers) {
      workers_.emplace_back([this] { loop(); });
    }
  }

  void loop() {
    uint64_t seen = 0;  // the last generation this worker joined
    while (!stopping_.load(std::memory_order_acquire)) {
      uint64_t job = job_.load(std::memory_order_acquire);
      for (int spin = 0; spin < SPIN_ROUNDS && generation_of(job) == seen; ++spin) {
        cpu_relax();
        job = job_.load(std::memory_order_acquire);
      }
      if (generation_of(job) == seen) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleeping_.fetch_add(1);
        sleep_cv_.wait(lock, [&] {
          return stopping_.load() || generation_of(job_.load()) != seen;
        });
        sleeping_.fetch_sub(1);
        continue;
      }
      seen = generation_of(job);
      // The work function of generation `seen` stays in place while any of its tasks is
      // claimed: its caller waits for them, and the next job uses the other slot.
      claim(seen);
    }
  }

  void claim(uint64_t generation) {
    uint64_t job = job_.load(std::memory_order_acquire);
    while (generation_of(job) == generation) {
      uint64_t tasks = (job >> 24) & 0xffffff, next = job & 0xffffff;
      if (next >= tasks) {
        return;
      }
      if (job_.compare_exchange_weak(job, job + 1, std::memory_order_acq_rel)) {
        (*work_[generation % 2])(static_cast<int>(next));
        done_.fetch_add(1, std::memory_order_acq_rel);
        job = job_.load(std::memory_order_acquire);
      }
    }
  }

  std::mutex job_mutex_;
  std::mutex sleep_mutex_;
  std::condition_variable sleep_cv_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> job_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stopping_{false};
  const std::function<void(int)>* work_[2] = {nullptr, nullptr};
};

} // namespace muser::cpu

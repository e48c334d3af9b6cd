// runtime.cpp — runs one launch of a kernel compiled against metal.h (see tests/emulate.py).
//
// Threadgroups run one after another; the threads of a threadgroup are fibers (ucontext) on
// this OS thread. The scheduler runs each runnable thread, in order (or in reverse order),
// until it returns or blocks in a barrier or a SIMD-group function; when none can run, it
// releases a SIMD group whose 32 lanes all wait in the same SIMD-group function, else the
// threadgroup if every thread that has not returned waits at the same barrier, else it
// reports how the threads diverged. Each argument buffer ends exactly at a PROT_NONE page, so
// a read or write past its end faults (its start is as aligned as its size: 16 bytes when the
// size is a multiple of 16); the fault is reported with the thread and the buffer.
#include <csetjmp>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <pthread.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "metal.h"  // after the system headers: its address-space macros are common words

#ifndef sigev_notify_thread_id
#define sigev_notify_thread_id _sigev_un._tid
#endif

namespace muser_emu {
const Thread* self;

namespace {
constexpr int MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 256 * 1024;
constexpr size_t THREADGROUP_MEMORY_LIMIT = 32 * 1024;  // Metal's (CUDA's static __shared__: 48 KiB)

enum State { RUNNABLE, AT_BARRIER, AT_SIMD, RETURNED };

struct Fiber {
  Thread attributes;
  ucontext_t context;
  State state;
  unsigned long barriers, calls;  // barriers and SIMD-group functions passed
  const char* op;                 // the SIMD-group function it waits in
};

struct Buffer {
  char *map, *data;  // map: guard page, data pages, guard page; data ends at the second guard
  size_t map_bytes, size, item;
  const char* name;
  bool writable;
};

Fiber fibers[MAX_THREADS];
char* stacks[MAX_THREADS];  // each above a guard page; made on first use and kept
unsigned char slots[MAX_THREADS / SIMD_WIDTH][2][SIMD_WIDTH][SLOT_BYTES];  // 2: alternate calls
ucontext_t scheduler;
Fiber* running;
void (*entry)(void* const*);
void* arguments[64];
Buffer buffers[64];
int buffer_count;
unsigned long threadgroup_epoch;
size_t threadgroup_bytes;
sigjmp_buf abort_launch;
volatile sig_atomic_t active;
pthread_t owner;
char error[4096];
size_t page;
const int SIGNALS[] = {SIGSEGV, SIGBUS, SIGALRM};
struct sigaction saved[3];

int who(char* out, size_t n, const Fiber* f) {
  if (!f) return snprintf(out, n, "the scheduler");
  const Thread& t = f->attributes;
  return snprintf(out, n, "thread %u (SIMD group %u, lane %u) of threadgroup (%u, %u, %u), thread_position_in_grid (%u, %u, %u)",
                  t.thread_index_in_threadgroup, t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup,
                  t.threadgroup_position_in_grid.x, t.threadgroup_position_in_grid.y, t.threadgroup_position_in_grid.z,
                  t.thread_position_in_grid.x, t.thread_position_in_grid.y, t.thread_position_in_grid.z);
}

int where(char* out, size_t n, const Fiber& f) {
  switch (f.state) {
    case RETURNED: return snprintf(out, n, "has returned");
    case AT_BARRIER: return snprintf(out, n, "waits at its barrier #%lu", f.barriers);
    case AT_SIMD: return snprintf(out, n, "waits in %s (its SIMD-group call #%lu)", f.op, f.calls);
    default: return snprintf(out, n, "runs");
  }
}

// "A <state>, while B <state>": two threads that should have met at the same point.
bool diverged(const char* what, const Fiber& a, const Fiber& b) {
  size_t n = snprintf(error, sizeof error, "%s: ", what);
  n += who(error + n, sizeof error - n, &a);
  n += snprintf(error + n, sizeof error - n, " ");
  n += where(error + n, sizeof error - n, a);
  n += snprintf(error + n, sizeof error - n, ", while ");
  n += who(error + n, sizeof error - n, &b);
  n += snprintf(error + n, sizeof error - n, " ");
  where(error + n, sizeof error - n, b);
  return false;
}

void block(State state) {
  Fiber* f = running;
  f->state = state;
  swapcontext(&f->context, &scheduler);
}

void fiber_main() {
  entry(arguments);
  running->state = RETURNED;  // then uc_link resumes the scheduler
}

// Every thread of one threadgroup, to the end. False with `error` set if they diverged.
bool run_threadgroup(uint n, bool reverse) {
  for (;;) {
    for (uint k = 0; k < n; ++k) {
      Fiber& f = fibers[reverse ? n - 1 - k : k];
      if (f.state != RUNNABLE) continue;
      running = &f;
      self = &f.attributes;
      swapcontext(&scheduler, &f.context);
    }
    running = nullptr;
    bool released = false;
    for (uint first = 0; first < n; first += SIMD_WIDTH) {
      uint last = first + SIMD_WIDTH < n ? first + SIMD_WIDTH : n;
      const Fiber* caller = nullptr;
      for (uint i = first; i < last && !caller; ++i) caller = fibers[i].state == AT_SIMD ? &fibers[i] : nullptr;
      if (!caller) continue;
      if (last - first < uint(SIMD_WIDTH)) {
        snprintf(error, sizeof error, "a SIMD-group function in a SIMD group of %u lanes (threadgroup size not a "
                 "multiple of 32; the CUDA rendering's full-mask shuffles need 32): ", last - first);
        who(error + strlen(error), sizeof error - strlen(error), caller);
        return false;
      }
      for (uint i = first; i < last; ++i) {
        const Fiber& f = fibers[i];
        if (f.state != AT_SIMD || f.calls != caller->calls || strcmp(f.op, caller->op) != 0)
          return diverged("lanes of a SIMD group diverged at a SIMD-group function (the CUDA rendering's "
                          "shuffles take all 32 lanes: a SIMD group returns whole or not at all)", f, *caller);
      }
      for (uint i = first; i < last; ++i) fibers[i].state = RUNNABLE;
      released = true;
    }
    if (released) continue;
    const Fiber* waiting = nullptr;
    for (uint i = 0; i < n && !waiting; ++i) waiting = fibers[i].state == AT_BARRIER ? &fibers[i] : nullptr;
    if (!waiting) return true;  // all returned
    for (uint i = 0; i < n; ++i) {
      const Fiber& f = fibers[i];
      if (f.state != AT_BARRIER || f.barriers != waiting->barriers)
        return diverged("a barrier that not every thread of the threadgroup reaches (a threadgroup "
                          "returns whole before a barrier, or not at all)", f, *waiting);
    }
    for (uint i = 0; i < n; ++i) fibers[i].state = RUNNABLE;
  }
}

void describe_fault(int signal, const siginfo_t* info, const ucontext_t* context) {
  size_t n = who(error, sizeof error, running);
  char* address = static_cast<char*>(info->si_addr);
  bool write = false;
#if defined(__x86_64__)
  write = (context->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#endif
  const char* access = write ? "writes" : "reads";
  if (signal == SIGALRM) {
    snprintf(error + n, sizeof error - n, " was running when the launch ran out of CPU time (an endless loop?)");
    return;
  }
  for (int i = 0; i < buffer_count; ++i) {
    const Buffer& b = buffers[i];
    if (address < b.map || address >= b.map + b.map_bytes) continue;
    long offset = address - b.data;
    if (offset < 0)
      snprintf(error + n, sizeof error - n, " %s `%s` %ld bytes before its start", access, b.name, -offset);
    else if (size_t(offset) < b.size)
      snprintf(error + n, sizeof error - n, " writes `%s` (byte %ld), an input: inputs are read-only", b.name, offset);
    else
      snprintf(error + n, sizeof error - n, " %s `%s` at byte %ld (element %ld), past its end (%zu bytes, %zu elements)",
               access, b.name, offset, offset / long(b.item), b.size, b.size / b.item);
    return;
  }
  for (int i = 0; i < MAX_THREADS; ++i) {
    if (stacks[i] && address >= stacks[i] - page && address < stacks[i]) {
      snprintf(error + n, sizeof error - n, " overflows its %zu KiB stack (a large local array?)", STACK_BYTES / 1024);
      return;
    }
  }
  if (info->si_code == SI_KERNEL)
    snprintf(error + n, sizeof error - n, " faults without an address (a misaligned vector load or store?)");
  else
    snprintf(error + n, sizeof error - n, " %s address %p, outside every buffer (signal %d)", access, info->si_addr, signal);
}

void on_signal(int signal, siginfo_t* info, void* context) {
  int index = signal == SIGSEGV ? 0 : signal == SIGBUS ? 1 : 2;
  if (!active || !pthread_equal(pthread_self(), owner)) {
    if (signal != SIGALRM) sigaction(signal, &saved[index], nullptr);  // not ours: refault into the old handler
    return;
  }
  describe_fault(signal, info, static_cast<ucontext_t*>(context));
  siglongjmp(abort_launch, 1);
}

bool allocate(Buffer& b, const void* host, size_t size, size_t item, const char* name, bool writable) {
  size_t data_bytes = (size + page - 1) / page * page;
  b.map_bytes = data_bytes + 2 * page;
  void* map = mmap(nullptr, b.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) return false;
  b.map = static_cast<char*>(map);
  b.data = b.map + page + data_bytes - size;
  b.size = size;
  b.item = item ? item : 1;
  b.name = name;
  b.writable = writable;
  mprotect(b.map, page, PROT_NONE);
  mprotect(b.map + page + data_bytes, page, PROT_NONE);
  std::memcpy(b.data, host, size);
  if (!writable) mprotect(b.map + page, data_bytes, PROT_READ);
  return true;
}
}  // namespace

void barrier() {
  ++running->barriers;
  block(AT_BARRIER);
}

const unsigned char* arrive(const char* op, const void* value, size_t size) {
  Fiber* f = running;
  unsigned char* lanes = &slots[f->attributes.simdgroup_index_in_threadgroup][f->calls % 2][0][0];
  std::memcpy(lanes + f->attributes.thread_index_in_simdgroup * SLOT_BYTES, value, size);
  f->op = op;
  ++f->calls;
  block(AT_SIMD);
  return lanes;
}

void threadgroup_memory(void* memory, size_t size, unsigned long& epoch) {
  if (epoch == threadgroup_epoch) return;
  epoch = threadgroup_epoch;
  std::memset(memory, 0xFF, size);
  threadgroup_bytes += size;
  if (threadgroup_bytes > THREADGROUP_MEMORY_LIMIT) fail("declares threadgroup arrays beyond Metal's 32 KiB");
}

void check_alignment(const void* pointer, size_t align) {
  const char* p = static_cast<const char*>(pointer);
  const Buffer* in = nullptr;
  for (int i = 0; i < buffer_count && !in; ++i) in = p >= buffers[i].map && p < buffers[i].map + buffers[i].map_bytes ? &buffers[i] : nullptr;
  size_t offset = in ? size_t(p - in->data) : size_t(p - static_cast<const char*>(nullptr));
  if (offset % align == 0) return;
  char message[256];
  if (in)
    snprintf(message, sizeof message, "makes a pointer to %zu-byte aligned values at byte %zu of `%s` (misaligned)", align, offset, in->name);
  else
    snprintf(message, sizeof message, "makes a pointer to %zu-byte aligned values at a misaligned address %p", align, pointer);
  fail(message);
}

void fail(const char* message) {
  size_t n = who(error, sizeof error, running);
  snprintf(error + n, sizeof error - n, " %s", message);
  siglongjmp(abort_launch, 1);
}
}  // namespace muser_emu

using namespace muser_emu;

// One launch. Buffers: the kernel's arguments in signature order (host copies, sizes, element
// sizes, names; writable ones are copied back). grid counts threads; threadgroups are
// ceil(grid / threadgroup) per dimension, all whole (MLX's CUDA launch) unless `partial`
// (Metal's dispatch_threads: the last ones cut to the grid). Returns 0, or 1 with `message`.
extern "C" int muser_emu_launch(void (*kernel_entry)(void* const*), int count, void* const* host,
                                const size_t* sizes, const size_t* items, const int* writable,
                                const char* const* names, const unsigned* grid, const unsigned* group,
                                int reverse, int partial, double cpu_seconds, char* message, size_t message_size) {
  page = size_t(sysconf(_SC_PAGESIZE));
  error[0] = '\0';
  uint per_group = group[0] * group[1] * group[2];
  if (count > 64 || per_group == 0 || per_group > uint(MAX_THREADS)) {
    snprintf(message, message_size, "bad launch: %d buffers, threadgroup of %u threads (1..1024)", count, per_group);
    return 1;
  }
  buffer_count = 0;
  for (int i = 0; i < count; ++i, ++buffer_count) {
    if (!allocate(buffers[i], host[i], sizes[i], items[i], names[i], writable[i])) {
      snprintf(message, message_size, "out of memory for `%s`", names[i]);
      for (int j = 0; j < i; ++j) munmap(buffers[j].map, buffers[j].map_bytes);
      return 1;
    }
    arguments[i] = buffers[i].data;
  }
  for (uint i = 0; i < per_group; ++i) {
    if (stacks[i]) continue;
    char* map = static_cast<char*>(mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    mprotect(map, page, PROT_NONE);
    stacks[i] = map + page;
  }

  static char alternate[64 * 1024];
  stack_t signal_stack = {alternate, 0, sizeof alternate}, saved_stack;
  sigaltstack(&signal_stack, &saved_stack);
  struct sigaction action = {};
  action.sa_sigaction = on_signal;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  for (int i = 0; i < 3; ++i) sigaction(SIGNALS[i], &action, &saved[i]);
  sigevent event = {};
  event.sigev_notify = SIGEV_THREAD_ID;
  event.sigev_signo = SIGALRM;
  event.sigev_notify_thread_id = int(gettid());
  timer_t timer;
  bool timed = timer_create(CLOCK_THREAD_CPUTIME_ID, &event, &timer) == 0;
  itimerspec limit = {};
  limit.it_value.tv_sec = time_t(cpu_seconds);
  limit.it_value.tv_nsec = long((cpu_seconds - double(time_t(cpu_seconds))) * 1e9) % 1000000000;
  if (limit.it_value.tv_sec == 0 && limit.it_value.tv_nsec == 0) limit.it_value.tv_nsec = 1;
  if (timed) timer_settime(timer, 0, &limit, nullptr);
  owner = pthread_self();
  entry = kernel_entry;
  running = nullptr;

  bool ok = true;
  active = 1;
  if (sigsetjmp(abort_launch, 1) == 0) {
    uint groups[3], whole[3] = {group[0], group[1], group[2]};
    for (int d = 0; d < 3; ++d) groups[d] = (grid[d] + group[d] - 1) / group[d];
    for (uint gz = 0; gz < groups[2] && ok; ++gz)
      for (uint gy = 0; gy < groups[1] && ok; ++gy)
        for (uint gx = 0; gx < groups[0] && ok; ++gx) {
          uint origin[3] = {gx * group[0], gy * group[1], gz * group[2]}, size[3];
          for (int d = 0; d < 3; ++d) size[d] = partial && grid[d] - origin[d] < group[d] ? grid[d] - origin[d] : group[d];
          uint n = size[0] * size[1] * size[2];
          ++threadgroup_epoch;
          threadgroup_bytes = 0;
          for (uint i = 0; i < n; ++i) {
            Fiber& f = fibers[i];
            Thread& t = f.attributes;
            t.thread_position_in_threadgroup = uint3(i % size[0], i / size[0] % size[1], i / (size[0] * size[1]));
            t.threadgroup_position_in_grid = uint3(gx, gy, gz);
            t.thread_position_in_grid = uint3(origin[0], origin[1], origin[2]) + t.thread_position_in_threadgroup;
            t.threads_per_threadgroup = uint3(size[0], size[1], size[2]);
            t.dispatch_threads_per_threadgroup = uint3(whole[0], whole[1], whole[2]);
            t.threadgroups_per_grid = uint3(groups[0], groups[1], groups[2]);
            t.threads_per_grid = t.grid_size = uint3(grid[0], grid[1], grid[2]);
            t.grid_origin = uint3(0u);
            t.thread_index_in_threadgroup = i;
            t.thread_index_in_simdgroup = i % SIMD_WIDTH;
            t.simdgroup_index_in_threadgroup = i / SIMD_WIDTH;
            t.simdgroups_per_threadgroup = (n + SIMD_WIDTH - 1) / SIMD_WIDTH;
            t.dispatch_simdgroups_per_threadgroup = (per_group + SIMD_WIDTH - 1) / SIMD_WIDTH;
            t.threads_per_simdgroup = t.thread_execution_width = SIMD_WIDTH;
            t.thread_index_in_quadgroup = i % 4;
            t.quadgroup_index_in_threadgroup = i / 4;
            t.quadgroups_per_threadgroup = (n + 3) / 4;
            t.dispatch_quadgroups_per_threadgroup = (per_group + 3) / 4;
            f.state = RUNNABLE;
            f.barriers = f.calls = 0;
            f.op = "";
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = stacks[i];
            f.context.uc_stack.ss_size = STACK_BYTES;
            f.context.uc_link = &scheduler;
            makecontext(&f.context, fiber_main, 0);
          }
          ok = run_threadgroup(n, reverse != 0);
        }
  } else {
    ok = false;
  }
  active = 0;
  if (timed) timer_delete(timer);
  for (int i = 0; i < 3; ++i) sigaction(SIGNALS[i], &saved[i], nullptr);
  sigaltstack(&saved_stack, nullptr);

  for (int i = 0; i < count && ok; ++i) {
    if (buffers[i].writable) std::memcpy(host[i], buffers[i].data, buffers[i].size);
  }
  for (int i = 0; i < count; ++i) munmap(buffers[i].map, buffers[i].map_bytes);
  buffer_count = 0;
  if (!ok) snprintf(message, message_size, "%s", error);
  return ok ? 0 : 1;
}

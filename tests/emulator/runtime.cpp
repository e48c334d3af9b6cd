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
#include <algorithm>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
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
size_t threadgroup_bytes, page;
sigjmp_buf abort_launch;
volatile sig_atomic_t active;
pthread_t owner;
char error[4096];
size_t length;  // of the message in `error`
const int SIGNALS[] = {SIGSEGV, SIGBUS, SIGALRM};
struct sigaction saved[3];  // the handlers before the launch

void say(const char* format, ...) {
  va_list args;
  va_start(args, format);
  int n = vsnprintf(error + length, sizeof error - length, format, args);
  va_end(args);
  length = std::min(sizeof error - 1, length + size_t(n > 0 ? n : 0));
}

void say_thread(const Fiber* f) {
  if (!f) return say("the scheduler");
  const Thread& t = f->attributes;
  say("thread %u (SIMD group %u, lane %u) of threadgroup (%u, %u, %u), thread_position_in_grid (%u, %u, %u)",
      t.thread_index_in_threadgroup, t.simdgroup_index_in_threadgroup, t.thread_index_in_simdgroup,
      t.threadgroup_position_in_grid.x, t.threadgroup_position_in_grid.y, t.threadgroup_position_in_grid.z,
      t.thread_position_in_grid.x, t.thread_position_in_grid.y, t.thread_position_in_grid.z);
}

// "<what>: A <state>, while B <state>": two threads that should have met at the same point.
bool diverged(const char* what, const Fiber& a, const Fiber& b) {
  say("%s: ", what);
  for (const Fiber* f : {&a, &b}) {
    say_thread(f);
    if (f->state == RETURNED) say(" has returned");
    if (f->state == AT_BARRIER) say(" waits at its barrier #%lu", f->barriers);
    if (f->state == AT_SIMD) say(" waits in %s (its SIMD-group call #%lu)", f->op, f->calls);
    if (f == &a) say(", while ");
  }
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
      uint last = std::min(first + SIMD_WIDTH, n);
      const Fiber* caller = nullptr;
      for (uint i = first; i < last && !caller; ++i) caller = fibers[i].state == AT_SIMD ? &fibers[i] : nullptr;
      if (!caller) continue;
      if (last - first < uint(SIMD_WIDTH)) {
        say("a SIMD-group function in a SIMD group of %u lanes (the threadgroup is no multiple of 32; the "
            "CUDA rendering's shuffles take 32): ", last - first);
        say_thread(caller);
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

const Buffer* buffer_at(const char* address) {
  for (int i = 0; i < buffer_count; ++i)
    if (address >= buffers[i].map && address < buffers[i].map + buffers[i].map_bytes) return &buffers[i];
  return nullptr;
}

void on_signal(int signal, siginfo_t* info, void* context) {
  if (!active || !pthread_equal(pthread_self(), owner)) {
    // Not ours: restore the old handler, and the fault, repeated on return, reaches it.
    if (signal != SIGALRM) sigaction(signal, &saved[signal == SIGSEGV ? 0 : 1], nullptr);
    return;
  }
  say_thread(running);
  const char* address = static_cast<const char*>(info->si_addr);
  const char* access = "reads";
#if defined(__x86_64__)
  if (static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_ERR] & 2) access = "writes";
#endif
  const Buffer* b = buffer_at(address);
  long offset = b ? address - b->data : 0;
  if (signal == SIGALRM)
    say(" was running when the launch ran out of CPU time (an endless loop?)");
  else if (b && offset < 0)
    say(" %s `%s` %ld bytes before its start", access, b->name, -offset);
  else if (b && size_t(offset) < b->size)
    say(" writes input `%s` (byte %ld), which it never casts to a writable `device T*`", b->name, offset);
  else if (b)
    say(" %s `%s` at byte %ld (element %ld), past its end (%zu bytes, %zu elements)", access, b->name, offset,
        offset / long(b->item), b->size, b->size / b->item);
  else if (running && address >= stacks[running - fibers] - page && address < stacks[running - fibers])
    say(" overflows its %zu KiB stack (a large local array?)", STACK_BYTES / 1024);
  else
    say(" %s address %p, outside every buffer (signal %d)", access, info->si_addr, signal);
  siglongjmp(abort_launch, 1);
}

// Installs (or restores) the handlers of faults and of the CPU-time limit.
void signal_handlers(bool install) {
  static char alternate[64 * 1024];
  static stack_t saved_stack;
  struct sigaction action = {};
  action.sa_sigaction = on_signal;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  for (int i = 0; i < 3; ++i) sigaction(SIGNALS[i], install ? &action : &saved[i], install ? &saved[i] : nullptr);
  stack_t signal_stack = {alternate, 0, sizeof alternate};
  sigaltstack(install ? &signal_stack : &saved_stack, install ? &saved_stack : nullptr);
}

bool allocate(Buffer& b, const void* host, size_t size, size_t item, const char* name, bool writable) {
  size_t data_bytes = (size + page - 1) / page * page;
  b.map_bytes = data_bytes + 2 * page;
  void* map = mmap(nullptr, b.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) return false;
  b = {static_cast<char*>(map), static_cast<char*>(map) + page + data_bytes - size, b.map_bytes, size,
       item ? item : 1, name, writable};
  mprotect(b.map, page, PROT_NONE);
  mprotect(b.map + page + data_bytes, page, PROT_NONE);
  std::memcpy(b.data, host, size);
  if (!writable) mprotect(b.map + page, data_bytes, PROT_READ);
  return true;
}

// Thread i of a threadgroup of size[3] threads at `group` (all uint3 of the launch).
void start_thread(uint i, uint3 size, uint3 group, uint3 whole, uint3 groups, uint3 grid) {
  Fiber& f = fibers[i];
  Thread& t = f.attributes;
  uint n = size.x * size.y * size.z, dispatched = whole.x * whole.y * whole.z;
  t.thread_position_in_threadgroup = uint3(i % size.x, i / size.x % size.y, i / (size.x * size.y));
  t.threadgroup_position_in_grid = group;
  t.thread_position_in_grid = group * whole + t.thread_position_in_threadgroup;
  t.threads_per_threadgroup = size;
  t.dispatch_threads_per_threadgroup = whole;
  t.threadgroups_per_grid = groups;
  t.threads_per_grid = t.grid_size = grid;
  t.grid_origin = uint3(0u);
  t.thread_index_in_threadgroup = i;
  t.thread_index_in_simdgroup = i % SIMD_WIDTH;
  t.simdgroup_index_in_threadgroup = i / SIMD_WIDTH;
  t.simdgroups_per_threadgroup = (n + SIMD_WIDTH - 1) / SIMD_WIDTH;
  t.dispatch_simdgroups_per_threadgroup = (dispatched + SIMD_WIDTH - 1) / SIMD_WIDTH;
  t.threads_per_simdgroup = t.thread_execution_width = SIMD_WIDTH;
  t.thread_index_in_quadgroup = i % 4;
  t.quadgroup_index_in_threadgroup = i / 4;
  t.quadgroups_per_threadgroup = (n + 3) / 4;
  t.dispatch_quadgroups_per_threadgroup = (dispatched + 3) / 4;
  f.state = RUNNABLE;
  f.barriers = f.calls = 0;
  f.op = "";
  if (!stacks[i]) {
    char* map = static_cast<char*>(mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    mprotect(map, page, PROT_NONE);
    stacks[i] = map + page;
  }
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = stacks[i];
  f.context.uc_stack.ss_size = STACK_BYTES;
  f.context.uc_link = &scheduler;
  makecontext(&f.context, fiber_main, 0);
}

// Every threadgroup of the grid in turn (last to first when `reverse`): false with `error` set
// at the first that fails.
bool run_grid(uint3 grid, uint3 whole, bool reverse, bool partial) {
  uint3 groups = (grid + whole - 1u) / whole;
  for (uint z = 0; z < groups.z; ++z)
    for (uint y = 0; y < groups.y; ++y)
      for (uint x = 0; x < groups.x; ++x) {
        // In reverse, the threadgroups run last to first as well: a kernel that counts on an
        // order of threadgroups (which a GPU does not give) sees both.
        uint3 group(reverse ? groups.x - 1u - x : x, reverse ? groups.y - 1u - y : y, reverse ? groups.z - 1u - z : z);
        uint3 size = whole;
        for (int d = 0; d < 3 && partial; ++d) size[d] = std::min(whole[d], grid[d] - group[d] * whole[d]);
        ++threadgroup_epoch;
        threadgroup_bytes = 0;
        uint n = size.x * size.y * size.z;
        for (uint i = 0; i < n; ++i) start_thread(i, size, group, whole, groups, grid);
        if (!run_threadgroup(n, reverse)) return false;
      }
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
  const Buffer* b = buffer_at(p);
  size_t offset = b ? size_t(p - b->data) : size_t(reinterpret_cast<uintptr_t>(p));
  if (offset % align == 0) return;
  say_thread(running);
  if (b) say(" makes a pointer to %zu-byte aligned values at byte %zu of `%s` (misaligned)", align, offset, b->name);
  else say(" makes a pointer to %zu-byte aligned values at a misaligned address %p", align, pointer);
  siglongjmp(abort_launch, 1);
}

void fail(const char* message) {
  say_thread(running);
  say(" %s", message);
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
                                const char* const* names, const uint* grid, const uint* group,
                                int reverse, int partial, double cpu_seconds, char* message, size_t message_size) {
  page = size_t(sysconf(_SC_PAGESIZE));
  length = 0;
  uint per_group = group[0] * group[1] * group[2];
  if (count > 64 || per_group == 0 || per_group > uint(MAX_THREADS)) {
    snprintf(message, message_size, "bad launch: %d buffers, threadgroup of %u threads (1..1024)", count, per_group);
    return 1;
  }
  for (buffer_count = 0; buffer_count < count; ++buffer_count) {
    int i = buffer_count;
    if (!allocate(buffers[i], host[i], sizes[i], items[i], names[i], writable[i])) break;
    arguments[i] = buffers[i].data;
  }
  bool ok = buffer_count == count;
  if (!ok) say("out of memory for `%s`", names[buffer_count]);

  sigevent event = {};  // the CPU-time limit: SIGALRM to this thread
  event.sigev_notify = SIGEV_THREAD_ID;
  event.sigev_signo = SIGALRM;
  event.sigev_notify_thread_id = int(gettid());
  timer_t timer;
  bool timed = timer_create(CLOCK_THREAD_CPUTIME_ID, &event, &timer) == 0;
  itimerspec limit = {};
  limit.it_value.tv_sec = time_t(cpu_seconds);
  limit.it_value.tv_nsec = std::max(1L, long((cpu_seconds - double(time_t(cpu_seconds))) * 1e9) % 1000000000L);
  owner = pthread_self();
  entry = kernel_entry;
  running = nullptr;
  signal_handlers(true);
  if (ok && sigsetjmp(abort_launch, 1) == 0) {  // a fault, fail() or the timer jump back here
    active = 1;
    if (timed) timer_settime(timer, 0, &limit, nullptr);
    ok = run_grid(uint3(grid[0], grid[1], grid[2]), uint3(group[0], group[1], group[2]), reverse, partial);
  } else {
    ok = false;
  }
  active = 0;
  if (timed) timer_delete(timer);
  signal_handlers(false);

  for (int i = 0; i < buffer_count; ++i) {
    if (ok && buffers[i].writable) std::memcpy(host[i], buffers[i].data, buffers[i].size);
    munmap(buffers[i].map, buffers[i].map_bytes);
  }
  buffer_count = 0;
  if (!ok) snprintf(message, message_size, "%s", error);
  return ok ? 0 : 1;
}

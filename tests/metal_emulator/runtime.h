// The emulator's scheduler, included after the kernel text by the generated launcher.
//
// One threadgroup at a time; its threads are ucontext fibers. A pass runs every
// runnable fiber, in the schedule's order, until it blocks at a threadgroup_barrier or
// a SIMD-group collective (or returns). Then:
//  - a SIMD group whose live lanes all wait at the same collective is released (the
//    lanes that returned are inactive; lanes at different collectives or different
//    collective counts are an error: divergent control flow around a collective);
//  - when every live thread waits at a barrier, all are released (a thread that
//    returned before a barrier the others wait at is an error).
// Nothing runnable and nothing releasable is a deadlock error. Threadgroup memory (the
// kernel's function-local statics, located by runner.py) is filled with 0xff bytes (NaN,
// -1) before every threadgroup, so a read that a missing barrier leaves stale shows up. Faults (guard pages around the
// buffers, fiber stack guards) are caught and reported with their address.
#pragma once

#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

namespace mlxemu {

struct Attributes {
  uint3 dispatch_threads_per_threadgroup, grid_origin, grid_size, thread_position_in_grid,
      thread_position_in_threadgroup, threadgroup_position_in_grid, threadgroups_per_grid,
      threads_per_grid, threads_per_threadgroup;
  uint dispatch_quadgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup,
      quadgroup_index_in_threadgroup, quadgroups_per_threadgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, thread_execution_width, thread_index_in_quadgroup,
      thread_index_in_simdgroup, thread_index_in_threadgroup, threads_per_simdgroup;
};

enum FiberState { RUNNABLE = 0, AT_BARRIER = 1, AT_SIMD = 2, DONE = 3 };

struct Fiber {
  ucontext_t ctx;
  ThreadState ts;
  Attributes a;
  int state;
  int op;
  unsigned barriers;
};

enum Schedule { FORWARD = 0, REVERSE = 1, RANDOM = 2 };

constexpr int kMaxThreads = 1024;
constexpr size_t kThreadgroupMemoryLimit = 32768;

static Fiber fibers[kMaxThreads];
static char* stacks = nullptr;  // kMaxThreads stacks, each above a PROT_NONE guard page (runner.py maps them)
static size_t stack_size = 0, page_size = 0;
static ucontext_t scheduler;
static Fiber* running = nullptr;
static void (*thread_main)(Fiber*) = nullptr;
static sigjmp_buf fault_jump;
static volatile sig_atomic_t fault_signal = 0;
static void* volatile fault_address = nullptr;
static char* error_text = nullptr;
static int error_len = 0;
static const uint64_t* tg_regions = nullptr;  // (address, size) pairs of threadgroup memory
static int tg_count = 0;

static void sync(int kind, int op) {
  Fiber* f = running;
  f->state = kind == SYNC_BARRIER ? AT_BARRIER : AT_SIMD;
  f->op = op;
  if (kind == SYNC_BARRIER) f->barriers++;
  swapcontext(&f->ctx, &scheduler);
}

static void trampoline() {
  thread_main(running);
  running->state = DONE;  // returning resumes uc_link: the scheduler
}

static void on_fault(int sig, siginfo_t* info, void*) {
  fault_signal = sig;
  fault_address = info->si_addr;
  siglongjmp(fault_jump, 1);
}

static void fail(const char* fmt, unsigned a = 0, unsigned b = 0, unsigned c = 0, unsigned d = 0) {
  snprintf(error_text, error_len, fmt, a, b, c, d);
}

struct Rng {  // xorshift64*: reproducible random schedules
  uint64_t s;
  unsigned next(unsigned n) {
    s ^= s >> 12; s ^= s << 25; s ^= s >> 27;
    return unsigned((s * 2685821657736338717ull) >> 33) % n;
  }
};

// Release what can be released; returns the number of fibers made runnable, or -1 on error.
static int release(int n, unsigned simdgroups) {
  int released = 0;
  for (unsigned sg = 0; sg < simdgroups; ++sg) {
    int lo = int(sg) * kSimdWidth, hi = lo + kSimdWidth < n ? lo + kSimdWidth : n;
    bool all_waiting = true, any = false;
    int op = -1;
    unsigned phase = 0, mask = 0;
    for (int i = lo; i < hi; ++i) {
      Fiber& f = fibers[i];
      if (f.state == DONE) continue;
      if (f.state != AT_SIMD) { all_waiting = false; break; }
      if (!any) { op = f.op; phase = f.ts.phase; any = true; }
      if (f.op != op || f.ts.phase != phase) {
        fail("divergent SIMD collectives in simdgroup %u: lanes wait at different collectives "
             "(op %u, entry %u vs op %u)", sg, unsigned(op), phase, unsigned(f.op));
        return -1;
      }
      mask |= 1u << (i - lo);
    }
    if (!all_waiting || !any) continue;
    active_lanes[sg][(phase - 1) & 1u] = mask;
    for (int i = lo; i < hi; ++i)
      if (fibers[i].state == AT_SIMD) { fibers[i].state = RUNNABLE; released++; }
  }
  if (released) return released;
  int at_barrier = 0, done = 0;
  for (int i = 0; i < n; ++i) {
    if (fibers[i].state == AT_BARRIER) at_barrier++;
    else if (fibers[i].state == DONE) done++;
  }
  if (at_barrier && at_barrier + done == n) {
    if (done) {
      fail("threadgroup_barrier reached by %u of %u threads: %u threads returned before it", unsigned(at_barrier),
           unsigned(n), unsigned(done));
      return -1;
    }
    unsigned count = fibers[0].barriers;
    for (int i = 0; i < n; ++i) {
      if (fibers[i].barriers != count) {
        fail("threads wait at different barriers (thread 0 at its barrier %u, thread %u at %u)", count, unsigned(i),
             fibers[i].barriers);
        return -1;
      }
      fibers[i].state = RUNNABLE;
    }
    return n;
  }
  return 0;
}

static int run_threadgroup(const unsigned* tgpos, const unsigned* nominal, const unsigned* actual,
                           const unsigned* grid, const unsigned* groups, int schedule, Rng& rng) {
  int n = int(actual[0] * actual[1] * actual[2]);
  unsigned simdgroups = unsigned((n + kSimdWidth - 1) / kSimdWidth);
  unsigned nominal_n = nominal[0] * nominal[1] * nominal[2];
  for (int r = 0; r < tg_count; ++r)
    __builtin_memset(reinterpret_cast<void*>(tg_regions[2 * r]), 0xff, size_t(tg_regions[2 * r + 1]));
  for (int i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    unsigned x = unsigned(i) % actual[0], y = (unsigned(i) / actual[0]) % actual[1], z = unsigned(i) / (actual[0] * actual[1]);
    Attributes& a = f.a;
    a.thread_position_in_threadgroup = uint3(x, y, z);
    a.threadgroup_position_in_grid = uint3(tgpos[0], tgpos[1], tgpos[2]);
    a.thread_position_in_grid = uint3(tgpos[0] * nominal[0] + x, tgpos[1] * nominal[1] + y, tgpos[2] * nominal[2] + z);
    a.threads_per_threadgroup = uint3(actual[0], actual[1], actual[2]);
    a.dispatch_threads_per_threadgroup = uint3(nominal[0], nominal[1], nominal[2]);
    a.threads_per_grid = a.grid_size = uint3(grid[0], grid[1], grid[2]);
    a.grid_origin = uint3(0u, 0u, 0u);
    a.threadgroups_per_grid = uint3(groups[0], groups[1], groups[2]);
    a.thread_index_in_threadgroup = unsigned(i);
    a.thread_index_in_simdgroup = unsigned(i) % kSimdWidth;
    a.simdgroup_index_in_threadgroup = unsigned(i) / kSimdWidth;
    a.simdgroups_per_threadgroup = simdgroups;
    a.dispatch_simdgroups_per_threadgroup = (nominal_n + kSimdWidth - 1) / kSimdWidth;
    a.threads_per_simdgroup = a.thread_execution_width = kSimdWidth;
    a.thread_index_in_quadgroup = unsigned(i) % 4;
    a.quadgroup_index_in_threadgroup = unsigned(i) / 4;
    a.quadgroups_per_threadgroup = unsigned(n + 3) / 4;
    a.dispatch_quadgroups_per_threadgroup = (nominal_n + 3) / 4;
    f.ts.lane = a.thread_index_in_simdgroup;
    f.ts.simdgroup = a.simdgroup_index_in_threadgroup;
    f.ts.phase = 0;
    f.state = RUNNABLE;
    f.op = 0;
    f.barriers = 0;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks + i * (stack_size + page_size) + page_size;
    f.ctx.uc_stack.ss_size = stack_size;
    f.ctx.uc_link = &scheduler;
    makecontext(&f.ctx, trampoline, 0);
  }
  static int order[kMaxThreads];
  for (;;) {
    int ran = 0;
    for (int i = 0; i < n; ++i) order[i] = schedule == REVERSE ? n - 1 - i : i;
    if (schedule == RANDOM)
      for (int i = n - 1; i > 0; --i) { int j = int(rng.next(unsigned(i + 1))); int t = order[i]; order[i] = order[j]; order[j] = t; }
    for (int k = 0; k < n; ++k) {
      Fiber& f = fibers[order[k]];
      if (f.state != RUNNABLE) continue;
      running = &f;
      current = &f.ts;
      swapcontext(&scheduler, &f.ctx);
      ran++;
    }
    int live = 0;
    for (int i = 0; i < n; ++i) live += fibers[i].state != DONE;
    if (!live) return 0;
    int released = release(n, simdgroups);
    if (released < 0) return 1;
    if (!released && !ran) {
      int barrier = 0, simd = 0;
      for (int i = 0; i < n; ++i) { barrier += fibers[i].state == AT_BARRIER; simd += fibers[i].state == AT_SIMD; }
      fail("deadlock: %u threads wait at a threadgroup_barrier while %u wait at SIMD collectives of simdgroups "
           "with lanes elsewhere (%u live of %u)", unsigned(barrier), unsigned(simd), unsigned(live), unsigned(n));
      return 1;
    }
  }
}

// Returns 0 on success, 1 with a message in err, 2 on a fault (signal and address in fault[]).
static int launch(void (*main)(Fiber*), const unsigned* grid, const unsigned* tg, int schedule, unsigned seed,
                  char* stack_area, unsigned stack_kb, const uint64_t* regions, int nregions, char* err, int errlen,
                  uint64_t* fault) {
  error_text = err;
  error_len = errlen;
  err[0] = 0;
  thread_main = main;
  tg_regions = regions;
  tg_count = nregions;
  size_t tg_bytes = 0;
  for (int r = 0; r < nregions; ++r) tg_bytes += size_t(regions[2 * r + 1]);
  if (tg_bytes > kThreadgroupMemoryLimit) {
    fail("threadgroup memory is %u bytes, more than the 32 KB Metal allows", unsigned(tg_bytes));
    return 1;
  }
  unsigned nominal[3], groups[3];
  for (int d = 0; d < 3; ++d) {
    nominal[d] = tg[d] < grid[d] ? tg[d] : grid[d];
    if (grid[d] == 0) return 0;
    groups[d] = (grid[d] + nominal[d] - 1) / nominal[d];
  }
  if (uint64_t(tg[0]) * tg[1] * tg[2] > uint64_t(kMaxThreads)) {
    fail("threadgroup of %u x %u x %u threads: more than 1024", tg[0], tg[1], tg[2]);
    return 1;
  }
  stacks = stack_area;
  stack_size = size_t(stack_kb) * 1024;
  page_size = size_t(sysconf(_SC_PAGESIZE));
  Rng rng{uint64_t(seed) * 0x9E3779B97F4A7C15ull + 1};
  struct sigaction act, old_segv, old_bus, old_fpe, old_ill;
  __builtin_memset(&act, 0, sizeof(act));
  act.sa_sigaction = on_fault;
  act.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&act.sa_mask);
  static char alt_stack[1 << 16];
  stack_t ss, old_ss;
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof(alt_stack);
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  sigaction(SIGSEGV, &act, &old_segv);
  sigaction(SIGBUS, &act, &old_bus);
  sigaction(SIGFPE, &act, &old_fpe);
  sigaction(SIGILL, &act, &old_ill);
  int rc = 0;
  if (sigsetjmp(fault_jump, 1)) {
    fault[0] = uint64_t(fault_signal);
    fault[1] = uint64_t(reinterpret_cast<uintptr_t>(fault_address));
    uintptr_t addr = reinterpret_cast<uintptr_t>(fault_address), base = reinterpret_cast<uintptr_t>(stacks);
    fault[2] = addr >= base && addr < base + kMaxThreads * (stack_size + page_size) ? 1 : 0;
    rc = 2;
  } else {
    for (unsigned gz = 0; gz < groups[2] && !rc; ++gz)
      for (unsigned gy = 0; gy < groups[1] && !rc; ++gy)
        for (unsigned gx = 0; gx < groups[0] && !rc; ++gx) {
          unsigned pos[3] = {gx, gy, gz}, actual[3];
          for (int d = 0; d < 3; ++d) {
            unsigned start = pos[d] * nominal[d];
            actual[d] = grid[d] - start < nominal[d] ? grid[d] - start : nominal[d];
          }
          rc = run_threadgroup(pos, nominal, actual, grid, groups, schedule, rng);
        }
  }
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaction(SIGFPE, &old_fpe, nullptr);
  sigaction(SIGILL, &old_ill, nullptr);
  sigaltstack(&old_ss, nullptr);
  return rc;
}

}  // namespace mlxemu

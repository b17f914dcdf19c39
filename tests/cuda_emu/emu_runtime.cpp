// emu_runtime.cpp -- the scheduler of the CPU emulator of mtpkern's CUDA kernels
// (the emulated subset and its limits: include/emu_cuda.h).
//
// A launch runs its blocks one after another on the calling thread. Each thread of
// a block is a fiber: a stack of its own and a hand-written x86-64 context switch
// (emu_switch below; other architectures are not supported). A round resumes every
// runnable thread once, in the current order (forward, reversed or shuffled; the
// same order decides the order of the blocks); a thread runs until it exits, waits
// at __syncthreads, or reaches a warp collective, then hands over directly to the
// next runnable thread of the round. The 32nd lane to reach a warp collective
// computes it for the warp and goes on. When no thread is runnable, a barrier that
// every live thread waits at is released; anything else is a deadlock.
//
// Errors (a deadlock, a divergent collective, a misaligned vector access, a UBSan
// check in the default build) stop the launch: the failing thread's stack is
// abandoned, emu_last_error() says what happened (kernel, block, thread) and the
// launch returns 1, which emu_backend.py raises as EmulatorError. In the ASan build
// the sanitizers' own reports abort the process instead, and the fiber switches are
// announced to ASan (__sanitizer_start/finish_switch_fiber) so that it follows them.
#include "emu_cuda.h"

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

#if !defined(__x86_64__)
#error "the CUDA emulator's fiber switch is x86-64 only"
#endif

// emu_switch(save, to): push the callee-saved registers, store the stack pointer in
// *save, load `to`, pop the registers saved there and return into that context.
extern "C" void emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl emu_switch
.hidden emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch,.-emu_switch
.section .note.GNU-stack,"",@progbits
.text
)");

namespace emu {

enum State { kReady, kAtBarrier, kAtCollective, kDone };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable address (a guard page lies below)
  uint3 tid{0, 0, 0};
  State state = kReady;
  int kind = 0;           // collective
  uint32_t value = 0, arg = 0, result = 0;
  const uint32_t* gather_src = nullptr;  // warp_gather: this lane's words, and where all lanes' go
  uint32_t* gather_dst = nullptr;
  int bar_result = 0;
};

uint3 g_block_idx{0, 0, 0};
dim3 g_block_dim, g_grid_dim;

namespace {

constexpr size_t kStack = 256 * 1024;
constexpr size_t kGuard = 4096;
constexpr size_t kSmemLimit = 48 * 1024;  // static shared memory, and dynamic without the opt-in
size_t g_dyn_limit = kSmemLimit;             // the launching kernel's max dynamic shared size attribute
size_t g_optin_limit = kSmemLimit;           // static + dynamic once that attribute is raised (the device's)

struct ShutdownError {};

const char* g_kernel = nullptr;        // the running launch (null outside run_grid)
Body g_body = nullptr;
void* g_kernel_fn = nullptr;
void** g_args = nullptr;
Fiber* g_cur = nullptr;
std::vector<Fiber> g_fibers;
std::vector<char*> g_stacks;
std::vector<unsigned> g_seq;           // this round's thread order
long g_pos = -1;                       // index in g_seq of the running thread
std::vector<int> g_arrived;            // per warp: lanes waiting at a collective
unsigned g_live = 0, g_at_barrier = 0;
int g_barrier_count = 0;
void* g_sched_sp = nullptr;            // the launching thread's context
const void* g_sched_stack = nullptr;   // and its stack, for ASan
size_t g_sched_stack_size = 0;
bool g_abort = false;
bool g_stacks_dirty = false;           // an aborted launch left ASan-poisoned frames
std::string g_error;

// dynamic and static shared memory of the current block
char* g_dyn = nullptr;
size_t g_dyn_size = 0;
uint64_t g_block_serial = 0;
struct SharedVar { void* p; uint64_t block; };
std::vector<SharedVar> g_shared;
size_t g_static_smem = 0;

int g_order = 0;                       // 0 forward, 1 reversed, 2 shuffled
uint64_t g_rng = 0x9e3779b97f4a7c15ull;

uint64_t next_random() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}

void order(std::vector<unsigned>& seq) {
  const size_t n = seq.size();
  for (size_t i = 0; i < n; ++i) seq[i] = static_cast<unsigned>(g_order == 1 ? n - 1 - i : i);
  if (g_order == 2)
    for (size_t i = n - 1; i > 0; --i) std::swap(seq[i], seq[next_random() % (i + 1)]);
}

// Switch from the running context to `to` (a fiber, or the scheduler when null).
// `dying`: the running context is never resumed (an exited or aborted thread).
void jump(void** save, Fiber* to, bool dying) {
  void* target = to ? to->sp : g_sched_sp;
#if EMU_ASAN
  void* fake = nullptr;
  if (to) __sanitizer_start_switch_fiber(dying ? nullptr : &fake, to->stack, kStack);
  else __sanitizer_start_switch_fiber(dying ? nullptr : &fake, g_sched_stack, g_sched_stack_size);
#else
  (void)dying;
#endif
  g_cur = to;
  emu_switch(save, target);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

Fiber* next_runnable() {
  while (++g_pos < static_cast<long>(g_seq.size())) {
    Fiber& f = g_fibers[g_seq[g_pos]];
    if (f.state == kReady) return &f;
  }
  return nullptr;
}

// The running thread stops (its state says why): on to the next runnable thread of
// the round, or back to the scheduler at the end of the round.
void yield_thread(bool dying = false) {
  Fiber* me = g_cur;
  jump(&me->sp, next_runnable(), dying);
  g_cur = me;
}

[[noreturn]] void entry() {
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  g_body(g_kernel_fn, g_args);
  g_cur->state = kDone;
  --g_live;
  yield_thread(true);
  std::abort();  // never resumed
}

const char* state_name(State s) {
  switch (s) {
    case kReady: return "ready";
    case kAtBarrier: return "__syncthreads";
    case kAtCollective: return "warp collective";
    case kDone: return "exited";
  }
  return "?";
}

const char* collective_name(int kind) {
  switch (kind) {
    case kShflXor: return "__shfl_xor_sync";
    case kBallot: return "__ballot_sync";
    case kGather: return "warp_gather (mma)";
  }
  return "?";
}

void complete_collective(unsigned warp) {
  Fiber* lanes = &g_fibers[32 * warp];
  const int kind = lanes[0].kind;
  for (int l = 1; l < 32; ++l)
    if (lanes[l].kind != kind)
      fail("warp %u: lanes 0 and %d are in different warp collectives (%s / %s)", warp, l,
           collective_name(kind), collective_name(lanes[l].kind));
  if (kind == kGather) {
    const uint32_t n = lanes[0].value;
    for (int l = 1; l < 32; ++l)
      if (lanes[l].value != n) fail("warp_gather: lane 0 gives %u words, lane %d %u", n, l, lanes[l].value);
    for (int l = 0; l < 32; ++l)
      for (int s = 0; s < 32; ++s) std::memcpy(lanes[l].gather_dst + s * n, lanes[s].gather_src, n * 4);
  } else if (kind == kShflXor) {
    for (int l = 0; l < 32; ++l) {
      const unsigned src = l ^ lanes[l].arg;
      if (src >= 32) fail("__shfl_xor_sync lane mask %u (lane %d)", lanes[l].arg, l);
      lanes[l].result = lanes[src].value;
    }
  } else {
    uint32_t bits = 0;
    for (int l = 0; l < 32; ++l) bits |= (lanes[l].value ? 1u : 0u) << l;
    for (int l = 0; l < 32; ++l) lanes[l].result = bits;
  }
  for (int l = 0; l < 32; ++l) lanes[l].state = kReady;
  g_arrived[warp] = 0;
}

void* map_stack() {
  void* s = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (s == MAP_FAILED) fail("mmap of a thread stack failed");
  if (mprotect(s, kGuard, PROT_NONE)) fail("mprotect of a stack guard page failed");
  return static_cast<char*>(s) + kGuard;
}

void run_block(unsigned nthreads) {
  while (g_stacks.size() < nthreads) g_stacks.push_back(static_cast<char*>(map_stack()));
#if EMU_ASAN
  if (g_stacks_dirty)
    for (char* s : g_stacks) ASAN_UNPOISON_MEMORY_REGION(s, kStack);
  g_stacks_dirty = false;
#endif
  g_fibers.assign(nthreads, Fiber{});
  for (unsigned t = 0; t < nthreads; ++t) {
    Fiber& f = g_fibers[t];
    f.tid = uint3{t, 0, 0};
    f.stack = g_stacks[t];
    // Stack tops staggered by t * 1088 bytes: equal offsets would map every thread's
    // frames to the same cache sets.
    char* top = f.stack + kStack - (t * 1088u) % 65536u;
    void** sp = reinterpret_cast<void**>(top - 16);
    sp[0] = reinterpret_cast<void*>(&entry);  // emu_switch's ret: entry starts with rsp % 16 == 8
    sp[1] = nullptr;
    sp -= 6;                                  // r15 r14 r13 r12 rbx rbp
    for (int i = 0; i < 6; ++i) sp[i] = nullptr;
    f.sp = sp;
  }
  g_seq.resize(nthreads);
  g_arrived.assign(nthreads / 32, 0);
  g_live = nthreads;
  g_at_barrier = 0;
  g_barrier_count = 0;
  order(g_seq);
  for (;;) {
    if (g_order == 2) order(g_seq);
    g_pos = -1;
    if (Fiber* first = next_runnable()) {
      jump(&g_sched_sp, first, false);
      if (g_abort) throw ShutdownError{};
      continue;
    }
    if (g_live == 0) return;
    if (g_at_barrier == g_live) {
      for (Fiber& f : g_fibers)
        if (f.state == kAtBarrier) { f.bar_result = g_barrier_count; f.state = kReady; }
      g_at_barrier = 0;
      g_barrier_count = 0;
      continue;
    }
    std::string msg;  // per warp, runs of lanes in the same state
    for (unsigned w = 0; w < nthreads / 32; ++w) {
      msg += "\n  warp " + std::to_string(w) + ":";
      for (int l = 0; l < 32;) {
        const State s = g_fibers[32 * w + l].state;
        int e = l;
        while (e + 1 < 32 && g_fibers[32 * w + e + 1].state == s) ++e;
        msg += " lanes " + std::to_string(l) + "-" + std::to_string(e) + " " + state_name(s) + (e < 31 ? "," : "");
        l = e + 1;
      }
    }
    fail("deadlock: threads wait at different barriers / collectives, or for exited lanes:%s", msg.c_str());
  }
}

}  // namespace

void fail(const char* fmt, ...) {
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  char where[256];
  std::snprintf(where, sizeof where, "kernel %s, block (%u, %u, %u)", g_kernel ? g_kernel : "?", g_block_idx.x,
                g_block_idx.y, g_block_idx.z);
  g_error = where;
  if (g_cur) g_error += ", thread " + std::to_string(g_cur->tid.x);
  g_error += ": ";
  g_error += buf;
  if (!g_kernel) {  // not inside a launch: nothing to unwind to
    std::fprintf(stderr, "[cuda-emu] %s\n", g_error.c_str());
    std::abort();
  }
  if (g_cur) {  // abandon this thread's stack; the scheduler unwinds the launch
    g_abort = true;
    g_stacks_dirty = true;
    Fiber* me = g_cur;
    jump(&me->sp, nullptr, true);
    std::abort();  // never resumed
  }
  throw ShutdownError{};
}

const uint3& thread_idx() {
  if (!g_cur) fail("threadIdx outside a thread");
  return g_cur->tid;
}

void* dynamic_shared() { return g_dyn; }

void shared_declared(void* p, size_t bytes, const char* name) {
  for (SharedVar& v : g_shared)
    if (v.p == p) {
      if (v.block == g_block_serial) return;
      v.block = g_block_serial;
      std::memset(p, 0xff, bytes);
      return;
    }
  g_shared.push_back(SharedVar{p, g_block_serial});
  std::memset(p, 0xff, bytes);
  // Count each variable once per kernel (a static per instantiation).
  g_static_smem += bytes;
  const size_t total = g_dyn_limit > kSmemLimit ? g_optin_limit : kSmemLimit;
  if (g_static_smem > kSmemLimit || g_static_smem + g_dyn_size > total)
    fail("__shared__ %s: %zu bytes of static + %zu of dynamic shared memory, over %zu KiB", name, g_static_smem,
         g_dyn_size, total / 1024);
}

uint32_t warp_collective(int kind, uint32_t value, uint32_t arg) {
  Fiber* me = g_cur;
  if (!me) fail("warp collective outside a thread");
  me->kind = kind;
  me->value = value;
  me->arg = arg;
  me->state = kAtCollective;
  const unsigned warp = me->tid.x / 32;
  if (++g_arrived[warp] == 32) {
    complete_collective(warp);  // every lane ready again; this one goes on
    return me->result;
  }
  yield_thread();
  return me->result;
}

void warp_gather(const uint32_t* mine, int n, uint32_t* all) {
  Fiber* me = g_cur;
  if (!me) fail("warp collective outside a thread");
  if (n <= 0) fail("warp_gather of %d words", n);
  me->gather_src = mine;
  me->gather_dst = all;
  warp_collective(kGather, static_cast<uint32_t>(n), 0);
}

int block_barrier(int predicate) {
  Fiber* me = g_cur;
  if (!me) fail("__syncthreads outside a thread");
  me->state = kAtBarrier;
  ++g_at_barrier;
  g_barrier_count += predicate;  // 0 or 1: __syncthreads_count returns the sum, __syncthreads_or its != 0
  yield_thread();
  return me->bar_result;
}

int run_grid(const char* name, dim3 grid, dim3 block, size_t dynamic_smem, Body body, void* kernel,
             void** args) {
  g_error.clear();
  g_abort = false;
  g_cur = nullptr;
  g_kernel = name;
  g_block_idx = uint3{0, 0, 0};
  int rc = 0;
  try {
    if (block.y != 1 || block.z != 1) fail("%ux%ux%u block: only 1-D blocks are emulated", block.x, block.y, block.z);
    if (block.x == 0 || block.x > 1024) fail("block of %u threads", block.x);
    if (block.x % 32) fail("blockDim.x = %u is not a multiple of 32 (required by the kernels)", block.x);
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) fail("empty grid (%u, %u, %u)", grid.x, grid.y, grid.z);
    if (grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
      fail("grid (%u, %u, %u) over the CUDA limits", grid.x, grid.y, grid.z);
    if (dynamic_smem > g_dyn_limit)
      fail("%zu bytes of dynamic shared memory, over the kernel's %zu (over 48 KiB needs the opt-in attribute)",
           dynamic_smem, g_dyn_limit);
#if EMU_ASAN
    pthread_attr_t attr;
    pthread_getattr_np(pthread_self(), &attr);
    void* lo = nullptr;
    pthread_attr_getstack(&attr, &lo, &g_sched_stack_size);
    pthread_attr_destroy(&attr);
    g_sched_stack = lo;
#endif
    g_grid_dim = grid;
    g_block_dim = block;
    g_body = body;
    g_kernel_fn = kernel;
    g_args = args;
    g_static_smem = 0;
    g_shared.clear();
    g_dyn_size = dynamic_smem;
    g_dyn = dynamic_smem ? static_cast<char*>(std::aligned_alloc(16, (dynamic_smem + 15) / 16 * 16)) : nullptr;
    const uint64_t nblocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
    std::vector<unsigned> bseq;
    const bool permuted = g_order != 0 && nblocks <= (1u << 24);
    if (permuted) {
      bseq.resize(nblocks);
      order(bseq);
    }
    for (uint64_t i = 0; i < nblocks; ++i) {
      const uint64_t b = permuted ? bseq[i] : i;
      g_block_idx = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                          static_cast<unsigned>(b / grid.x / grid.y)};
      ++g_block_serial;
      if (g_dyn) std::memset(g_dyn, 0xff, dynamic_smem);  // unwritten shared memory reads as NaN / -1
      run_block(block.x);
    }
  } catch (const ShutdownError&) {
    rc = 1;
  }
  std::free(g_dyn);
  g_dyn = nullptr;
  g_dyn_size = 0;
  g_kernel = nullptr;
  g_cur = nullptr;
  return rc;
}

}  // namespace emu

// UBSan handlers of the default (non-ASan) build: the kernels are compiled with
// -fsanitize=alignment,bounds,... -fno-sanitize-recover and without UBSan's runtime, so
// a failed check calls one of these (layouts: GCC's libsanitizer, ubsan_handlers.h)
// and becomes an EmulatorError naming the kernel, block, thread and source line.
#if !EMU_ASAN
namespace {
struct SourceLocation { const char* file; uint32_t line; uint32_t column; };
struct TypeDescriptor { uint16_t kind; uint16_t info; char name[1]; };
struct OverflowData { SourceLocation loc; const TypeDescriptor* type; };
struct OutOfBoundsData { SourceLocation loc; const TypeDescriptor* array_type; const TypeDescriptor* index_type; };
struct TypeMismatchData { SourceLocation loc; const TypeDescriptor* type; unsigned char log_alignment;
                          unsigned char check_kind; };
struct ShiftData { SourceLocation loc; const TypeDescriptor* lhs_type; const TypeDescriptor* rhs_type; };
struct LocationData { SourceLocation loc; };

// An integer handed to a handler: inline when it fits a pointer (all of ours do).
long long int_value(const TypeDescriptor* t, uintptr_t v) {
  const unsigned bits = 1u << (t->info >> 1);
  const bool is_signed = t->info & 1;
  if (bits >= 64) return static_cast<long long>(v);
  const uint64_t mask = (1ull << bits) - 1;
  const uint64_t u = v & mask;
  return is_signed && (u >> (bits - 1)) ? static_cast<long long>(u | ~mask) : static_cast<long long>(u);
}

[[noreturn]] void ub(const SourceLocation& loc, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void ub(const SourceLocation& loc, const char* fmt, ...) {
  char what[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  const char* file = loc.file ? std::strrchr(loc.file, '/') : nullptr;
  emu::fail("UBSan: %s at %s:%u:%u", what, file ? file + 1 : (loc.file ? loc.file : "?"), loc.line, loc.column);
}

[[noreturn]] void overflow(const OverflowData* d, const char* op, uintptr_t a, uintptr_t b) {
  ub(d->loc, "%s overflow: %lld %s %lld in %s", d->type->info & 1 ? "signed integer" : "unsigned integer",
     int_value(d->type, a), op, int_value(d->type, b), d->type->name);
}
}  // namespace

extern "C" {
void __ubsan_handle_add_overflow_abort(OverflowData* d, uintptr_t a, uintptr_t b) { overflow(d, "+", a, b); }
void __ubsan_handle_sub_overflow_abort(OverflowData* d, uintptr_t a, uintptr_t b) { overflow(d, "-", a, b); }
void __ubsan_handle_mul_overflow_abort(OverflowData* d, uintptr_t a, uintptr_t b) { overflow(d, "*", a, b); }
void __ubsan_handle_negate_overflow_abort(OverflowData* d, uintptr_t a) {
  ub(d->loc, "negation of %lld overflows %s", int_value(d->type, a), d->type->name);
}
void __ubsan_handle_divrem_overflow_abort(OverflowData* d, uintptr_t a, uintptr_t b) {
  ub(d->loc, "division %lld / %lld (by zero, or overflowing %s)", int_value(d->type, a), int_value(d->type, b),
     d->type->name);
}
void __ubsan_handle_out_of_bounds_abort(OutOfBoundsData* d, uintptr_t index) {
  ub(d->loc, "index %lld out of bounds of %s", int_value(d->index_type, index), d->array_type->name);
}
void __ubsan_handle_type_mismatch_v1_abort(TypeMismatchData* d, uintptr_t pointer) {
  const uintptr_t align = uintptr_t{1} << d->log_alignment;
  if (!pointer) ub(d->loc, "null pointer access of %s", d->type->name);
  if (pointer & (align - 1))
    ub(d->loc, "misaligned access of %s at %p (needs %zu-byte alignment)", d->type->name,
       reinterpret_cast<void*>(pointer), static_cast<size_t>(align));
  ub(d->loc, "access of %s at %p: object too small", d->type->name, reinterpret_cast<void*>(pointer));
}
void __ubsan_handle_shift_out_of_bounds_abort(ShiftData* d, uintptr_t a, uintptr_t b) {
  ub(d->loc, "shift %lld by %lld out of range for %s", int_value(d->lhs_type, a), int_value(d->rhs_type, b),
     d->lhs_type->name);
}
void __ubsan_handle_pointer_overflow_abort(LocationData* d, uintptr_t base, uintptr_t result) {
  ub(d->loc, "pointer arithmetic overflows: %p -> %p", reinterpret_cast<void*>(base),
     reinterpret_cast<void*>(result));
}
void __ubsan_handle_builtin_unreachable(LocationData* d) { ub(d->loc, "__builtin_unreachable reached"); }
void __ubsan_handle_missing_return(LocationData* d) { ub(d->loc, "end of a value-returning function reached"); }
}
#endif

extern "C" {
const char* emu_last_error() { return emu::g_error.c_str(); }
// order: 0 forward, 1 reversed, 2 shuffled (threads between synchronisation points, and blocks)
void emu_set_order(int order, unsigned long long seed) {
  emu::g_order = order;
  emu::g_rng = seed ? seed : 0x9e3779b97f4a7c15ull;
}
int emu_asan() { return EMU_ASAN; }
// the next launch's max dynamic shared memory (CuPy's RawKernel.max_dynamic_shared_size_bytes)
// and the device's opt-in limit on static + dynamic shared memory
void emu_set_dyn_smem_limit(unsigned long bytes, unsigned long optin) {
  emu::g_dyn_limit = bytes;
  emu::g_optin_limit = optin;
}
}

// cuda_emu_engine.h -- the definitions behind cuda_emu.h: grid scheduling, the fiber and thread
// execution modes, barriers, shuffles and shared-memory poisoning. Included by exactly one
// translation unit (emu_ops.cpp).
#pragma once

#include <cxxabi.h>
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "cuda_emu.h"
#ifdef CUDA_EMU_TRAFFIC
#include "cuda_emu_traffic.h"
#endif

#if defined(__SANITIZE_ADDRESS__) && !defined(CUDA_EMU_TRAFFIC)  // (the traffic build's kernel-address sets it too)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMU_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define CUDA_EMU_TSAN 1
#endif

namespace cuda_emu {

Config& config() {
  static Config c;
  return c;
}

Stats& stats() {
  static Stats s;
  return s;
}

namespace {

thread_local ThreadCtx* tl_current = nullptr;

// Thrown inside a CUDA thread when another thread of its block has already failed.
struct Aborted {};

std::string site_str(const std::source_location& s) {
  const char* f = std::strrchr(s.file_name(), '/');
  return std::string(f ? f + 1 : s.file_name()) + ":" + std::to_string(s.line());
}

bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() && std::strcmp(a.file_name(), b.file_name()) == 0;
}

std::string hex32(unsigned m) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", m);
  return buf;
}

// ---- shared memory ----------------------------------------------------------------------------
// The kernels' __shared__ variables are function-local statics of dppo::(anonymous namespace)
// (the kernels header). They are found once in this library's own symbol table and filled with 0xff bytes
// (a NaN in float and double) before every block. (A named section would be simpler, but GCC ignores section
// attributes on statics of function templates.) cuda_emu.h's __shared__ puts a marker static beside each
// one, in the same function: a writable function-local static of that namespace in a function with fewer
// markers than statics is not shared memory, and is refused rather than poisoned (in device code a plain
// static is one global variable that every block of the grid shares; on the host, state the poisoning
// would silently overwrite).
struct SharedVar {
  unsigned char* addr;
  size_t size;
  std::string name;  // demangled
};

// This library's own ELF image (its symbol table: the kernels' __shared__ variables and names), read once.
struct SelfImage {
  std::vector<char> img;
  uintptr_t load_base = 0;  // the address the library's addresses are relative to

  template <typename F>  // f(const Elf64_Sym&, const char* name, const Elf64_Shdr& section of the symbol)
  void for_each_symbol(F&& f) const {
    const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(img.data());
    const auto* sh = reinterpret_cast<const Elf64_Shdr*>(img.data() + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum; ++i) {
      if (sh[i].sh_type != SHT_SYMTAB) continue;
      const char* strtab = img.data() + sh[sh[i].sh_link].sh_offset;
      const auto* sym = reinterpret_cast<const Elf64_Sym*>(img.data() + sh[i].sh_offset);
      const size_t nsym = sh[i].sh_size / sizeof(Elf64_Sym);
      for (size_t k = 0; k < nsym; ++k) {
        if (sym[k].st_shndx == SHN_UNDEF || sym[k].st_shndx >= eh->e_shnum) continue;
        f(sym[k], strtab + sym[k].st_name, sh[sym[k].st_shndx]);
      }
    }
  }
};

const SelfImage& self_image() {
  static const SelfImage image = [] {
    Dl_info info;
    link_map* lm = nullptr;
    if (dladdr1(reinterpret_cast<void*>(&self_image), &info, reinterpret_cast<void**>(&lm), RTLD_DL_LINKMAP) == 0 ||
        lm == nullptr) {
      fail("cannot locate the emulator library (dladdr1)");
    }
    std::ifstream f(info.dli_fname, std::ios::binary);
    SelfImage im{std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>()),
                 static_cast<uintptr_t>(lm->l_addr)};
    if (im.img.size() < sizeof(Elf64_Ehdr)) fail(std::string("cannot read ") + info.dli_fname);
    return im;
  }();
  return image;
}

std::string demangled(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string out = status == 0 && d != nullptr ? d : mangled;
  std::free(d);
  return out;
}

// Every writable function-local static of dppo::(anonymous namespace) that is shared memory; fails when the
// namespace holds one that is not (see above).
std::vector<SharedVar> find_shared_vars() {
  static const char kPrefix[] = "_ZZN4dppo12_GLOBAL__N_1";
  static const char kMark[] = "cuda_emu_shared_mark_";
  struct Fn {
    int marks = 0;
    std::vector<SharedVar> vars;
  };
  std::map<std::string, Fn> by_function;  // demangled enclosing function -> its statics
  const SelfImage& im = self_image();
  im.for_each_symbol([&](const Elf64_Sym& sym, const char* name, const Elf64_Shdr& section) {
    if (ELF64_ST_TYPE(sym.st_info) != STT_OBJECT || sym.st_size == 0) return;
    if ((section.sh_flags & (SHF_WRITE | SHF_ALLOC)) != (SHF_WRITE | SHF_ALLOC)) return;
    if (std::strncmp(name, kPrefix, sizeof kPrefix - 1) != 0) return;
    const std::string d = demangled(name);
    const size_t cut = d.rfind("::");
    Fn& fn = by_function[d.substr(0, cut)];
    if (d.compare(cut + 2, sizeof kMark - 1, kMark) == 0) {
      ++fn.marks;
    } else {
      fn.vars.push_back({reinterpret_cast<unsigned char*>(im.load_base + sym.st_value), sym.st_size, d});
    }
  });
  std::vector<SharedVar> out;
  std::string refused;
  for (const auto& [function, fn] : by_function) {
    if (static_cast<int>(fn.vars.size()) > fn.marks) {
      for (const SharedVar& v : fn.vars) refused += (refused.empty() ? "" : ", ") + v.name;
    } else {
      out.insert(out.end(), fn.vars.begin(), fn.vars.end());
    }
  }
  if (!refused.empty()) {
    fail(
        "function-local statics of the kernels' namespace that are not __shared__ (in a function with fewer "
        "__shared__ declarations than writable statics): " +
        refused +
        ". In device code a plain static is one global variable that every block of the grid shares; host-side "
        "state there would be overwritten by the emulator's poisoning of shared memory before every block. "
        "Declare shared memory __shared__, and keep host-side state out of dppo's anonymous namespace (or "
        "constexpr).");
  }
  return out;
}

// The kernel at `fn`, demangled without its namespaces, return type and parameters:
// "dppo_loss_forward_kernel<float, float, true>" ("?" when the symbol table does not name it).
std::string kernel_name(const void* fn) {
  std::string mangled;
  const SelfImage& im = self_image();
  const auto addr = reinterpret_cast<uintptr_t>(fn);
  im.for_each_symbol([&](const Elf64_Sym& sym, const char* name, const Elf64_Shdr&) {
    if (ELF64_ST_TYPE(sym.st_info) == STT_FUNC && im.load_base + sym.st_value == addr) mangled = name;
  });
  if (mangled.empty()) return "?";
  std::string out = demangled(mangled.c_str());
  for (const char* ns : {"dppo::(anonymous namespace)::", "dppo::", "c10::"}) {
    for (size_t at = out.find(ns); at != std::string::npos; at = out.find(ns)) out.erase(at, std::strlen(ns));
  }
  if (out.rfind("void ", 0) == 0) out.erase(0, 5);
  const size_t args = out.find(">(");
  if (args != std::string::npos) out.erase(args + 1);
  return out;
}

const std::vector<SharedVar>& shared_vars() {
  static const std::vector<SharedVar> v = find_shared_vars();
  return v;
}

// Not instrumented: the bytes may include a sanitizer's redzone around the variable.
__attribute__((no_sanitize_address, no_sanitize_thread, noinline)) void poison_shared() {
  for (const SharedVar& s : shared_vars()) {
    volatile unsigned char* p = s.addr;
    for (size_t i = 0; i < s.size; ++i) p[i] = 0xff;
  }
}

// ---- fiber mode -------------------------------------------------------------------------------

constexpr size_t kStackBytes = 256 * 1024;

struct FiberRun;

struct Fiber final : ThreadCtx {
  enum State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kExited };
  FiberRun* run = nullptr;
  unsigned tid = 0;
  State state = kRunnable;
  std::source_location site;
  const char* what = "";
  unsigned mask = 0;
  unsigned parity = 0;  // which exchange buffer the next shuffle uses
  bool started = false;
  ucontext_t ctx;                  // the entry context (makecontext): used once, to start
  jmp_buf jb;                      // where the fiber yielded: resumed with _longjmp
  unsigned char* stack = nullptr;  // kStackBytes, below it one guard page
  void* fake_stack = nullptr;

  void yield();
  void sync_block(const std::source_location& s) override {
    state = kAtBlockBarrier;
    site = s;
    what = "__syncthreads";
    yield();
  }
  void sync_warp(unsigned m, const std::source_location& s, const char* w) override {
    state = kAtWarpBarrier;
    site = s;
    what = w;
    mask = m;
    yield();
  }
  unsigned char* next_exchange() override;
};

struct FiberRun {
  std::vector<Fiber> fibers;
  std::vector<unsigned char> slots;  // [2][warps][32][8]
  jmp_buf sched;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
  void* sched_fake = nullptr;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  unsigned cur = 0, live = 0;
  std::string error;
};

FiberRun* g_fiber_run = nullptr;  // fiber mode runs on one OS thread at a time (g_launch_mutex)

unsigned char* Fiber::next_exchange() {
  const size_t half = run->slots.size() / 2;
  unsigned char* p = run->slots.data() + parity * half + (tid / 32) * 32 * 8;
  parity ^= 1;
  return p;
}

// Switches between the scheduler and the fibers use _setjmp / _longjmp (no signal-mask system
// call, unlike swapcontext: a block does tens of thousands of switches); swapcontext's context is
// used only to start a fiber on its own stack.
void Fiber::yield() {
#ifdef CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(&fake_stack, run->sched_bottom, run->sched_size);
#endif
  if (_setjmp(jb) == 0) _longjmp(run->sched, 1);
#ifdef CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, &run->sched_bottom, &run->sched_size);
#endif
}

// Runs fiber f until it yields or exits.
__attribute__((noinline)) void resume(FiberRun& r, Fiber& f) {
#ifdef CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(&r.sched_fake, f.stack, kStackBytes);
#endif
  if (_setjmp(r.sched) == 0) {
    if (!f.started) {
      f.started = true;
      setcontext(&f.ctx);
    }
    _longjmp(f.jb, 1);
  }
#ifdef CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(r.sched_fake, nullptr, nullptr);
#endif
}

void fiber_entry() {
  FiberRun* r = g_fiber_run;
  Fiber& f = r->fibers[r->cur];
#ifdef CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &r->sched_bottom, &r->sched_size);
#endif
  try {
    r->body(r->arg);
  } catch (const std::exception& e) {
    if (r->error.empty()) r->error = "thread " + std::to_string(f.tid) + ": " + e.what();
  } catch (...) {
    if (r->error.empty()) r->error = "thread " + std::to_string(f.tid) + ": unknown exception";
  }
  f.state = Fiber::kExited;
  --r->live;
#ifdef CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, r->sched_bottom, r->sched_size);
#endif
  _longjmp(r->sched, 1);
}

struct StackPool {
  std::vector<unsigned char*> stacks;
  unsigned char* get(size_t i) {
    while (stacks.size() <= i) {
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      void* m =
          mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) fail("mmap of a fiber stack failed");
      mprotect(m, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
      stacks.push_back(static_cast<unsigned char*>(m) + page);
    }
    return stacks[i];
  }
};

StackPool& stack_pool() {
  static StackPool p;
  return p;
}

// Describes where each thread of a stuck block waits, grouped into runs of equal state.
std::string describe(const std::vector<Fiber>& fs) {
  std::ostringstream os;
  size_t i = 0;
  while (i < fs.size()) {
    size_t j = i;
    auto key = [&](const Fiber& f) {
      if (f.state == Fiber::kExited) return std::string("exited");
      if (f.state == Fiber::kRunnable) return std::string("runnable");
      return std::string(f.what) + " at " + site_str(f.site);
    };
    const std::string k = key(fs[i]);
    while (j + 1 < fs.size() && key(fs[j + 1]) == k) ++j;
    os << (i ? "; " : "") << "threads " << i << "-" << j << ": " << k;
    i = j + 1;
  }
  return os.str();
}

// Releases every barrier whose participants have all arrived; errors on a mismatched rendezvous.
bool release_fiber_barriers(FiberRun& r, const std::string& where) {
  std::vector<Fiber>& fs = r.fibers;
  unsigned at_block = 0;
  for (const Fiber& f : fs) at_block += f.state == Fiber::kAtBlockBarrier;
  if (r.live > 0 && at_block == r.live) {
    const Fiber* first = nullptr;
    for (const Fiber& f : fs) {
      if (f.state != Fiber::kAtBlockBarrier) continue;
      if (first == nullptr) {
        first = &f;
      } else if (!same_site(first->site, f.site)) {
        fail(where + ": threads " + std::to_string(first->tid) + " and " + std::to_string(f.tid) +
             " meet at different __syncthreads (" + site_str(first->site) + " vs " + site_str(f.site) + ")");
      }
    }
    for (Fiber& f : fs) f.state = Fiber::kRunnable;
    return true;
  }
  bool released = false;
  const size_t warps = (fs.size() + 31) / 32;
  for (size_t w = 0; w < warps; ++w) {
    unsigned live_mask = 0, waiting = 0;
    for (size_t l = 0; l < 32 && w * 32 + l < fs.size(); ++l) {
      const Fiber& f = fs[w * 32 + l];
      if (f.state != Fiber::kExited) live_mask |= 1u << l;
      if (f.state == Fiber::kAtWarpBarrier) waiting |= 1u << l;
    }
    if (waiting == 0 || waiting != live_mask) continue;
    const Fiber& first = fs[w * 32 + static_cast<size_t>(__builtin_ctz(waiting))];
    for (size_t l = 0; l < 32 && w * 32 + l < fs.size(); ++l) {
      const Fiber& f = fs[w * 32 + l];
      if (f.state != Fiber::kAtWarpBarrier) continue;
      if (f.mask != first.mask || !same_site(f.site, first.site) || std::strcmp(f.what, first.what) != 0) {
        fail(where + ": lanes of warp " + std::to_string(w) + " meet at different warp operations (" + first.what +
             " at " + site_str(first.site) + " mask " + hex32(first.mask) + " vs " + f.what + " at " +
             site_str(f.site) + " mask " + hex32(f.mask) + ")");
      }
    }
    if (first.mask != live_mask) {
      fail(where + ": " + first.what + " at " + site_str(first.site) + " in warp " + std::to_string(w) + " with mask " +
           hex32(first.mask) + ", but the warp's live lanes are " + hex32(live_mask));
    }
    for (size_t l = 0; l < 32 && w * 32 + l < fs.size(); ++l) {
      if (fs[w * 32 + l].state == Fiber::kAtWarpBarrier) fs[w * 32 + l].state = Fiber::kRunnable;
    }
    released = true;
  }
  return released;
}

void run_block_fibers(unsigned nthreads, void (*body)(void*), void* arg, const std::string& where) {
  FiberRun r;
  r.fibers.resize(nthreads);
  r.slots.assign(2 * ((nthreads + 31) / 32) * 32 * 8, 0);
  r.body = body;
  r.arg = arg;
  r.live = nthreads;
  for (unsigned t = 0; t < nthreads; ++t) {
    Fiber& f = r.fibers[t];
    f.run = &r;
    f.tid = t;
    f.stack = stack_pool().get(t);
#ifdef CUDA_EMU_ASAN
    __asan_unpoison_memory_region(f.stack, kStackBytes);  // frames abandoned by an earlier failed block
#endif
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  FiberRun* saved = g_fiber_run;
  g_fiber_run = &r;
  struct Restore {
    FiberRun* saved;
    ~Restore() {
      g_fiber_run = saved;
      tl_current = nullptr;
    }
  } restore{saved};
  while (r.live > 0) {
    bool ran = false;
    for (unsigned t = 0; t < nthreads; ++t) {
      Fiber& f = r.fibers[t];
      if (f.state != Fiber::kRunnable) continue;
      r.cur = t;
      threadIdx = uint3{t, 0, 0};
      tl_current = &f;
      resume(r, f);
      ran = true;
      if (!r.error.empty()) fail(where + ", " + r.error);
    }
    if (r.live == 0) break;
    const bool released = release_fiber_barriers(r, where);
    if (!ran && !released) fail(where + ": deadlock: " + describe(r.fibers));
  }
}

// ---- thread mode ------------------------------------------------------------------------------

struct ThreadRun;

struct Worker final : ThreadCtx {
  ThreadRun* run = nullptr;
  unsigned tid = 0;
  unsigned parity = 0;
  void sync_block(const std::source_location& s) override;
  void sync_warp(unsigned m, const std::source_location& s, const char* w) override;
  unsigned char* next_exchange() override;
};

// Each warp has a lock of its own: warps of a block meet only at __syncthreads, as on a GPU. (With one
// lock for the whole block, every shuffle would order the warps for ThreadSanitizer and hide a race
// between warps, such as a shared buffer rewritten without the __syncthreads that guards its last read.)
// Lock order: ThreadRun::m, then a warp's m.
struct WarpBarrier {
  std::mutex m;
  unsigned live = 0, arrived = 0, mask = 0;
  uint64_t gen = 0;
  std::source_location site;
  const char* what = "";
  std::condition_variable cv;
};

struct ThreadRun {
  std::mutex m;
  std::condition_variable cv_go, cv_done, cv_block;
  unsigned nthreads = 0;
  uint64_t block_seq = 0;  // the coordinator starts block k by setting this to k + 1
  unsigned finished = 0;
  bool quit = false;
  std::atomic<bool> abort{false};  // read under a warp's lock too
  std::string error, where;
  dim3 grid, block;
  uint3 bidx{0, 0, 0};
  // block barrier
  unsigned live = 0, arrived = 0;
  uint64_t gen = 0;
  std::source_location site;
  std::vector<WarpBarrier> warps;
  std::vector<unsigned char> slots;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;

  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                  std::chrono::duration<double>(config().timeout_s));
  }
  // With m held: record the first error and wake everyone.
  void set_error(const std::string& e) {
    if (error.empty()) error = where + ", " + e;
    abort = true;
    cv_block.notify_all();
    for (WarpBarrier& w : warps) {
      std::lock_guard<std::mutex> wl(w.m);  // a lane between its predicate check and its wait must not miss this
      w.cv.notify_all();
    }
  }
  // With no lock held.
  void report(const std::string& e) {
    std::lock_guard<std::mutex> lk(m);
    set_error(e);
  }
  // With w.m held: releases the warp's barrier once every live lane arrived. Returns the error to report
  // (after w.m is released), or "".
  std::string release_warp_locked(WarpBarrier& w, unsigned warp) {
    if (w.arrived == 0 || w.arrived != w.live) return {};
    if (w.mask != w.live) {
      return std::string(w.what) + " at " + site_str(w.site) + " in warp " + std::to_string(warp) + " with mask " +
             hex32(w.mask) + ", but the warp's live lanes are " + hex32(w.live);
    }
    w.arrived = 0;
    ++w.gen;
    w.cv.notify_all();
    return {};
  }
  void release_block_locked() {
    if (arrived == 0 || arrived != live) return;
    arrived = 0;
    ++gen;
    cv_block.notify_all();
  }
};

unsigned char* Worker::next_exchange() {
  const size_t half = run->slots.size() / 2;
  unsigned char* p = run->slots.data() + parity * half + (tid / 32) * 32 * 8;
  parity ^= 1;
  return p;
}

void Worker::sync_block(const std::source_location& s) {
  ThreadRun& r = *run;
  std::unique_lock<std::mutex> lk(r.m);
  if (r.abort) throw Aborted{};
  if (r.arrived == 0) {
    r.site = s;
  } else if (!same_site(r.site, s)) {
    r.set_error("thread " + std::to_string(tid) + " meets the others at a different __syncthreads (" + site_str(s) +
                " vs " + site_str(r.site) + ")");
    throw Aborted{};
  }
  ++r.arrived;
  const uint64_t my_gen = r.gen;
  r.release_block_locked();
  if (!r.cv_block.wait_until(lk, r.deadline(), [&] { return r.gen != my_gen || r.abort; })) {
    r.set_error("deadlock: thread " + std::to_string(tid) + " waited " + std::to_string(config().timeout_s) +
                " s at __syncthreads " + site_str(s) + " (" + std::to_string(r.arrived) + " of " +
                std::to_string(r.live) + " live threads arrived)");
  }
  if (r.abort) throw Aborted{};
}

void Worker::sync_warp(unsigned mask, const std::source_location& s, const char* what) {
  ThreadRun& r = *run;
  const unsigned warp = tid / 32, lane = tid % 32;
  WarpBarrier& w = r.warps[warp];
  std::unique_lock<std::mutex> lk(w.m);
  if (r.abort) throw Aborted{};
  std::string err;
  if (w.arrived == 0) {
    w.mask = mask;
    w.site = s;
    w.what = what;
  } else if (w.mask != mask || !same_site(w.site, s) || std::strcmp(w.what, what) != 0) {
    err = "lanes of warp " + std::to_string(warp) + " meet at different warp operations (" + w.what + " at " +
          site_str(w.site) + " mask " + hex32(w.mask) + " vs " + what + " at " + site_str(s) + " mask " + hex32(mask) +
          ")";
  }
  if (err.empty()) {
    w.arrived |= 1u << lane;
    const uint64_t my_gen = w.gen;
    err = r.release_warp_locked(w, warp);
    if (err.empty() && !w.cv.wait_until(lk, r.deadline(), [&] { return w.gen != my_gen || r.abort; })) {
      err = "deadlock: lane " + std::to_string(lane) + " of warp " + std::to_string(warp) + " waited " +
            std::to_string(config().timeout_s) + " s at " + what + " " + site_str(s) + " (lanes arrived " +
            hex32(w.arrived) + ", live " + hex32(w.live) + ")";
    }
  }
  lk.unlock();
  if (!err.empty()) r.report(err);
  if (r.abort) throw Aborted{};
}

void worker_main(ThreadRun* r, unsigned tid) {
  Worker self;
  self.run = r;
  self.tid = tid;
  tl_current = &self;
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(r->m);
      r->cv_go.wait(lk, [&] { return r->quit || r->block_seq != seen; });
      if (r->quit) return;
      seen = r->block_seq;
      blockIdx = r->bidx;
    }
    threadIdx = uint3{tid, 0, 0};
    self.parity = 0;
    blockDim = r->block;
    gridDim = r->grid;
    try {
      r->body(r->arg);
    } catch (const Aborted&) {
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lk(r->m);
      r->set_error("thread " + std::to_string(tid) + ": " + e.what());
    }
    // The thread exits: it drops out of the block barrier and its warp's barrier.
    {
      std::lock_guard<std::mutex> lk(r->m);
      --r->live;
      r->release_block_locked();
    }
    std::string err;
    {
      WarpBarrier& w = r->warps[tid / 32];
      std::lock_guard<std::mutex> wl(w.m);
      w.live &= ~(1u << (tid % 32));
      err = r->release_warp_locked(w, tid / 32);
    }
    std::lock_guard<std::mutex> lk(r->m);
    if (!err.empty()) r->set_error(err);
    if (++r->finished == r->nthreads) r->cv_done.notify_all();
  }
}

std::mutex g_launch_mutex;
uint64_t g_launch_counter = 0;

}  // namespace

std::vector<std::string> shared_var_names() {
  std::vector<std::string> out;
  for (const SharedVar& s : shared_vars()) out.push_back(s.name);
  return out;
}

ThreadCtx* current() {
  if (tl_current == nullptr) fail("a CUDA intrinsic was called outside a kernel launch");
  return tl_current;
}

void fail(const std::string& msg) { throw Error(msg); }

void run_grid(const void* kernel, dim3 grid, dim3 block, cudaStream_t stream, void (*body)(void*), void* arg) {
  std::lock_guard<std::mutex> launch_lock(g_launch_mutex);
  if (stream != current_stream()) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "stream %p, not the current stream %p", static_cast<void*>(stream),
                  static_cast<void*>(current_stream()));
    fail("launch: " + kernel_name(kernel) + " on " + buf +
         " (the op's Device::stream()): on a GPU it would run unordered with the op's other kernels and the "
         "caller's work");
  }
#ifdef CUDA_EMU_TRAFFIC
  if (config().mode != Mode::kFiber) fail("the traffic build counts accesses in fiber mode only");
  traffic::begin(kernel_name(kernel), grid, block);
  struct EndLaunch {
    ~EndLaunch() { traffic::end(); }
  } end_launch;
#endif
  if (block.y != 1 || block.z != 1 || block.x == 0 || block.x > 1024) {
    fail("launch: only 1-D blocks of 1..1024 threads are emulated, got (" + std::to_string(block.x) + ", " +
         std::to_string(block.y) + ", " + std::to_string(block.z) + ")");
  }
  if (grid.x == 0 || grid.x > 2147483647u || grid.y == 0 || grid.y > 65535 || grid.z != 1) {
    fail("launch: invalid grid (" + std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " +
         std::to_string(grid.z) + ")");
  }
#ifdef CUDA_EMU_TSAN
  if (config().mode == Mode::kFiber) fail("fiber mode does not run under ThreadSanitizer: use thread mode");
#endif
  const uint64_t launch_id = g_launch_counter++;
  std::vector<uint3> order;
  order.reserve(static_cast<size_t>(grid.x) * grid.y);
  for (unsigned y = 0; y < grid.y; ++y) {
    for (unsigned x = 0; x < grid.x; ++x) order.push_back(uint3{x, y, 0});
  }
  std::mt19937_64 rng(config().seed * 0x9E3779B97F4A7C15ull + launch_id);
  std::shuffle(order.begin(), order.end(), rng);
  Stats& st = stats();
  ++st.launches;
  st.shared_vars = static_cast<int64_t>(shared_vars().size());
  blockDim = block;
  gridDim = grid;
  auto where_of = [&](const uint3& b) {
    return "block (" + std::to_string(b.x) + ", " + std::to_string(b.y) + ") of grid (" + std::to_string(grid.x) +
           ", " + std::to_string(grid.y) + ") x " + std::to_string(block.x) + " threads";
  };

  if (config().mode == Mode::kFiber) {
    for (const uint3& b : order) {
      poison_shared();
      for (const SharedVar& s : shared_vars()) st.shared_bytes_poisoned += static_cast<int64_t>(s.size);
#ifdef CUDA_EMU_TRAFFIC
      traffic::begin_block();
#endif
      blockIdx = b;
      run_block_fibers(block.x, body, arg, where_of(b));
      ++st.blocks;
      st.threads += block.x;
    }
    return;
  }

  ThreadRun r;
  r.nthreads = block.x;
  r.grid = grid;
  r.block = block;
  r.warps = std::vector<WarpBarrier>((block.x + 31) / 32);
  r.slots.assign(2 * r.warps.size() * 32 * 8, 0);
  r.body = body;
  r.arg = arg;
  std::vector<std::thread> workers;
  workers.reserve(block.x);
  for (unsigned t = 0; t < block.x; ++t) workers.emplace_back(worker_main, &r, t);
  for (const uint3& b : order) {
    std::unique_lock<std::mutex> lk(r.m);
    poison_shared();
    for (const SharedVar& s : shared_vars()) st.shared_bytes_poisoned += static_cast<int64_t>(s.size);
    r.where = where_of(b);
    r.bidx = b;
    r.live = block.x;
    r.arrived = 0;
    for (size_t w = 0; w < r.warps.size(); ++w) {
      const unsigned lanes = std::min<unsigned>(32, block.x - static_cast<unsigned>(w) * 32);
      r.warps[w].live = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
      r.warps[w].arrived = 0;
    }
    r.finished = 0;
    ++r.block_seq;
    r.cv_go.notify_all();
    r.cv_done.wait(lk, [&] { return r.finished == r.nthreads; });
    ++st.blocks;
    st.threads += block.x;
    if (r.abort) break;
  }
  {
    std::lock_guard<std::mutex> lk(r.m);
    r.quit = true;
    r.cv_go.notify_all();
  }
  for (std::thread& w : workers) w.join();
  if (!r.error.empty()) fail(r.error);
}

}  // namespace cuda_emu

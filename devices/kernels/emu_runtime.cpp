// The host emulator's launcher (follows touchstone.cu in one translation unit). The including
// file defines TS_KERNEL_LIST(X) with one X(name) per kernel; each gets a trampoline that reads
// its arguments from a `void**` array, as cuLaunchKernel does.
//
// Besides running kernels it checks what a GPU would punish and a host forgives:
// - memory faults: an access outside every allocation (the Rust side ends each allocation at an
//   inaccessible page) or a misaligned 16-byte access (ts_load16/ts_store16) ends the launch
//   with an error naming the kernel, block, thread and address, as a GPU's "illegal address" /
//   "misaligned address" would, instead of crashing the process;
// - scheduling: a GPU runs a block's threads in no promised order, so the threads between two
//   barriers (and the blocks of a grid) can run forward, in reverse or shuffled; a kernel whose
//   result depends on the order has a race.
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <ucontext.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

// The static shared memory (prelude_host.h puts every __shared__ variable in this section).
extern char __start_ts_shared[] __attribute__((weak, visibility("hidden")));
extern char __stop_ts_shared[] __attribute__((weak, visibility("hidden")));

namespace {

// Fibers are entered once per launch with swapcontext and afterwards switched with
// _setjmp/_longjmp, which save no signal mask and so make no system call: a barrier costs a few
// nanoseconds instead of a syscall per thread.
struct Fiber {
    ucontext_t init;
    jmp_buf env;
    char* stack;
    int started;
    int state;  // 0 runnable, 1 waiting at a barrier, 2 finished the current block
    dim3 tid;
};

const size_t STACK_BYTES = 128 * 1024;

thread_local jmp_buf scheduler;
thread_local ucontext_t scheduler_ctx;
thread_local Fiber* current;
thread_local std::vector<char> dynamic_shared;
thread_local std::vector<std::unique_ptr<char[]>> stacks;
thread_local void (*current_kernel)(void**);
thread_local void** current_args;

// Where a fault inside a launch jumps to (set per launch on the launching thread's own stack),
// and what the fault was.
thread_local sigjmp_buf launch_abort;
thread_local int in_launch;
thread_local const char* fault_what;
thread_local uintptr_t fault_addr;

struct sigaction previous_segv, previous_bus;

// SIGSEGV/SIGBUS: inside a launch on this thread, abandon the launch; anywhere else, hand the
// signal to whoever handled it before (Rust's stack-overflow handler, or the default action).
void on_fault(int sig, siginfo_t* info, void* uctx) {
    if (in_launch) {
        fault_what = sig == SIGBUS ? "bus error" : "memory fault";
        fault_addr = (uintptr_t)info->si_addr;
        siglongjmp(launch_abort, 1);
    }
    struct sigaction* prev = sig == SIGBUS ? &previous_bus : &previous_segv;
    if (prev->sa_flags & SA_SIGINFO) {
        prev->sa_sigaction(sig, info, uctx);
    } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
    } else {
        // Returning re-executes the faulting instruction, which now gets the default action.
        signal(sig, SIG_DFL);
    }
}

void install_fault_handler() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &previous_segv);
        sigaction(SIGBUS, &sa, &previous_bus);
    });
}

// A deterministic shuffle (xorshift64*, fixed seed per launch): the same schedule every run.
struct Shuffler {
    uint64_t s;
    unsigned below(unsigned n) {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        return (unsigned)(((s * 2685821657736338717ull) >> 32) % n);
    }
    void shuffle(std::vector<unsigned>& v) {
        for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below((unsigned)i)]);
    }
};

enum Schedule { FORWARD = 0, REVERSE = 1, SHUFFLE = 2 };

// The order in which to visit n items (threads of an interval, or blocks of a grid).
void order(std::vector<unsigned>& v, unsigned n, int schedule, Shuffler& rng) {
    v.resize(n);
    for (unsigned i = 0; i < n; ++i) v[i] = schedule == REVERSE ? n - 1 - i : i;
    if (schedule == SHUFFLE) rng.shuffle(v);
}

// Write-write races in shared memory (`gpu-emu:racecheck`): two threads changing the same 4-byte
// word between the same two barriers, e.g. an unsynchronised `s[0] += x`. The emulator runs each
// thread's interval whole, so the sum would come out right here while a GPU loses updates; the
// thread orders cannot show it, this can. Each region is compared with its snapshot after every
// thread's turn and every changed word remembers who changed it. (A read of what another thread
// wrote in the same interval changes no memory: the thread orders are what finds those.)
struct Region {
    char* base;
    size_t bytes;
    const char* what;
    std::vector<char> seen;        // the region as of the last check
    std::vector<int> writer;       // per word: the thread that changed it ...
    std::vector<unsigned> stamp;   // ... in the interval with this number
};

struct RaceCheck {
    std::vector<Region> regions;
    unsigned interval = 0;
    // Checks [base, base + bytes) from now on (taking its current contents as seen).
    void add(char* base, size_t bytes, const char* what) {
        bytes &= ~(size_t)3;
        for (const Region& g : regions)
            if (g.base == base) return;
        if (!base || !bytes) return;
        regions.push_back(Region{base, bytes, what, std::vector<char>(base, base + bytes), std::vector<int>(bytes / 4), std::vector<unsigned>(bytes / 4)});
    }
    // At a block's start (after the shared memory was poisoned).
    void begin_block() {
        for (Region& g : regions) memcpy(g.seen.data(), g.base, g.bytes);
    }
    void begin_interval() {
        ++interval;
    }
    // After thread t's turn: 0, or -2 with the first conflict described in err. Unchanged
    // 256-byte chunks are skipped with memcmp, so a turn costs about one pass over the regions.
    int after(int t, const char* kernel, char* err, int err_len) {
        const size_t CHUNK = 256;
        for (Region& g : regions) {
            for (size_t off = 0; off < g.bytes; off += CHUNK) {
                size_t len = g.bytes - off < CHUNK ? g.bytes - off : CHUNK;
                if (memcmp(g.base + off, g.seen.data() + off, len) == 0) continue;
                for (size_t b = off; b < off + len; b += 4) {
                    if (memcmp(g.base + b, g.seen.data() + b, 4) == 0) continue;
                    size_t w = b / 4;
                    if (g.stamp[w] == interval && g.writer[w] != t) {
                        snprintf(err, err_len,
                                 "%s: block (%u,%u,%u): threads %d and %d both wrote the word at byte %zu of %s shared memory between two barriers (a "
                                 "race: on a GPU one of the writes is lost)",
                                 kernel, blockIdx.x, blockIdx.y, blockIdx.z, g.writer[w], t, b, g.what);
                        return -2;
                    }
                    g.writer[w] = t;
                    g.stamp[w] = interval;
                    memcpy(g.seen.data() + b, g.base + b, 4);
                }
            }
        }
        return 0;
    }
};

// The race check of the launch running on this thread (null when not checking).
thread_local RaceCheck* current_races;

// A fiber runs the kernel once per block it is resumed for; it never returns.
void fiber_main() {
    for (;;) {
        current_kernel(current_args);
        current->state = 2;
        if (!_setjmp(current->env)) _longjmp(scheduler, 1);
    }
}

void resume(Fiber& f) {
    current = &f;
    threadIdx = f.tid;
    f.state = 0;
    if (!_setjmp(scheduler)) {
        if (!f.started) {
            f.started = 1;
            swapcontext(&scheduler_ctx, &f.init);
        } else {
            _longjmp(f.env, 1);
        }
    }
}

template <typename... A, size_t... I>
void invoke(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_reference<A>::type*>(args[I])...);
}

template <typename... A>
void invoke(void (*f)(A...), void** args) {
    invoke(f, args, std::index_sequence_for<A...>{});
}

struct Entry {
    const char* name;
    void (*call)(void**);
};

#define TS_TRAMPOLINE(name) {#name, [](void** a) { invoke(name, a); }},
const Entry kernels[] = {TS_KERNEL_LIST(TS_TRAMPOLINE)};

}  // namespace

void __syncthreads() {
    current->state = 1;
    if (!_setjmp(current->env)) _longjmp(scheduler, 1);
}

void* ts_emu_dynamic_shared() {
    return dynamic_shared.data();
}

void ts_emu_shared(void* p, unsigned long bytes) {
    if (current_races) current_races->add((char*)p, bytes, "a static array in");
}

void ts_emu_fault(const char* what, const void* p) {
    fault_what = what;
    fault_addr = (uintptr_t)p;
    siglongjmp(launch_abort, 1);
}

// Runs one launch. Returns 0; -1 with a message in `err` when it could not run; -2 when the
// kernel itself is at fault (memory fault, misaligned access, barrier divergence). After a
// memory fault *fault holds the faulting address (the caller names its allocation).
extern "C" int ts_emu_launch(const char* name, const unsigned* grid, const unsigned* block, unsigned shared_bytes, void** args, int schedule,
                             int racecheck, char* err, int err_len, uint64_t* fault) {
    void (*call)(void**) = nullptr;
    for (const Entry& e : kernels)
        if (strcmp(e.name, name) == 0) call = e.call;
    if (!call) {
        snprintf(err, err_len, "no kernel named `%s`", name);
        return -1;
    }
    unsigned n_threads = block[0] * block[1] * block[2];
    if (n_threads == 0 || n_threads > 1024) {
        snprintf(err, err_len, "%s: block of %u threads (1..=1024)", name, n_threads);
        return -1;
    }
    // What a GPU refuses at launch: an empty or oversized grid, more dynamic shared memory than
    // a launch gets without opting in (48 KiB on CUDA and ROCm).
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[0] > 0x7FFFFFFFu || grid[1] > 65535 || grid[2] > 65535) {
        snprintf(err, err_len, "%s: grid (%u,%u,%u) (x 1..=2^31-1, y and z 1..=65535)", name, grid[0], grid[1], grid[2]);
        return -1;
    }
    // A legal grid can still hold more blocks than the emulator counts (unsigned): refuse it
    // rather than run a wrapped-around number of them.
    if ((unsigned long long)grid[0] * grid[1] * grid[2] > 0xFFFFFFFFull) {
        snprintf(err, err_len, "%s: grid (%u,%u,%u) has more blocks than the emulator runs (2^32)", name, grid[0], grid[1], grid[2]);
        return -1;
    }
    if (shared_bytes > 48 * 1024) {
        snprintf(err, err_len, "%s: %u bytes of dynamic shared memory (at most 49152)", name, shared_bytes);
        return -1;
    }
    install_fault_handler();
    // One launch at a time in the process: static shared memory is a single section.
    static std::mutex launch_lock;
    std::lock_guard<std::mutex> hold(launch_lock);
    // Every way out of the launch (return, or a fault's siglongjmp back here) leaves this
    // thread's launch state cleared.
    struct Reset {
        ~Reset() {
            in_launch = 0;
            current_races = nullptr;
            current = nullptr;
        }
    } reset;
    dynamic_shared.assign(shared_bytes + 16, 0);
    while (stacks.size() < n_threads) stacks.emplace_back(new char[STACK_BYTES]);
    std::vector<Fiber> fibers(n_threads);
    for (unsigned i = 0; i < n_threads; ++i) {
        Fiber& f = fibers[i];
        f.stack = stacks[i].get();
        f.started = 0;
        f.tid = dim3{i % block[0], (i / block[0]) % block[1], i / (block[0] * block[1])};
        getcontext(&f.init);
        f.init.uc_stack.ss_sp = f.stack;
        f.init.uc_stack.ss_size = STACK_BYTES;
        f.init.uc_link = nullptr;
        makecontext(&f.init, fiber_main, 0);
    }
    current_kernel = call;
    current_args = args;
    gridDim = dim3{grid[0], grid[1], grid[2]};
    blockDim = dim3{block[0], block[1], block[2]};
    Shuffler rng{0x9E3779B97F4A7C15ull};
    std::vector<unsigned> blocks, threads;
    threads.reserve(n_threads);  // no reallocation after sigsetjmp
    unsigned n_blocks = grid[0] * grid[1] * grid[2];
    order(blocks, n_blocks, schedule, rng);
    // Static shared arrays join the check as the kernel declares them (SHARED, prelude_host.h).
    RaceCheck races;
    races.regions.reserve(16);
    if (racecheck) races.add(dynamic_shared.data(), dynamic_shared.size(), "dynamic");
    current_races = racecheck ? &races : nullptr;
    // A fault anywhere below (in any fiber) comes back here with the signal mask restored.
    if (sigsetjmp(launch_abort, 1)) {
        in_launch = 0;
        snprintf(err, err_len, "%s: block (%u,%u,%u), thread %u: %s at address %#llx", name, blockIdx.x, blockIdx.y, blockIdx.z, current ? current->tid.x : 0,
                 fault_what, (unsigned long long)fault_addr);
        *fault = fault_addr;
        return -2;
    }
    in_launch = 1;
    current = nullptr;
    for (unsigned b : blocks) {
        unsigned bx = b % grid[0], by = (b / grid[0]) % grid[1], bz = b / (grid[0] * grid[1]);
        blockIdx = dim3{bx, by, bz};
        // Fresh, poisoned shared memory per block: a kernel that reads it before writing it
        // sees NaNs, not what the previous block left.
        memset(dynamic_shared.data(), 0xFF, dynamic_shared.size());
        if (__start_ts_shared) memset(__start_ts_shared, 0xFF, __stop_ts_shared - __start_ts_shared);
        races.begin_block();
        for (Fiber& f : fibers) f.state = 0;
        for (;;) {
            order(threads, n_threads, schedule, rng);
            races.begin_interval();
            for (unsigned t : threads) {
                if (fibers[t].state == 2) continue;
                resume(fibers[t]);
                if (races.after((int)t, name, err, err_len)) return -2;
            }
            unsigned done = 0;
            for (const Fiber& f : fibers) done += f.state == 2;
            if (done == n_threads) break;
            if (done != 0) {
                snprintf(err, err_len, "%s: block (%u,%u,%u): %u of %u threads returned while the others wait at __syncthreads()", name, bx, by, bz, done,
                         n_threads);
                return -2;
            }
        }
    }
    return 0;
}

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

void ts_emu_fault(const char* what, const void* p) {
    fault_what = what;
    fault_addr = (uintptr_t)p;
    siglongjmp(launch_abort, 1);
}

// Runs one launch. Returns 0; -1 with a message in `err` when it could not run; -2 when the
// kernel itself is at fault (memory fault, misaligned access, barrier divergence). After a
// memory fault *fault holds the faulting address (the caller names its allocation).
extern "C" int ts_emu_launch(const char* name, const unsigned* grid, const unsigned* block, unsigned shared_bytes, void** args, int schedule,
                             char* err, int err_len, uint64_t* fault) {
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
    install_fault_handler();
    // One launch at a time in the process: static shared memory is a single section.
    static std::mutex launch_lock;
    std::lock_guard<std::mutex> hold(launch_lock);
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
    // A fault anywhere below (in any fiber) comes back here with the signal mask restored.
    if (sigsetjmp(launch_abort, 1)) {
        in_launch = 0;
        snprintf(err, err_len, "%s: block (%u,%u,%u), thread %u: %s at address %#llx", name, blockIdx.x, blockIdx.y, blockIdx.z, current ? current->tid.x : 0,
                 fault_what, (unsigned long long)fault_addr);
        *fault = fault_addr;
        current = nullptr;
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
        for (Fiber& f : fibers) f.state = 0;
        for (;;) {
            order(threads, n_threads, schedule, rng);
            for (unsigned t : threads)
                if (fibers[t].state != 2) resume(fibers[t]);
            unsigned done = 0;
            for (const Fiber& f : fibers) done += f.state == 2;
            if (done == n_threads) break;
            if (done != 0) {
                in_launch = 0;
                snprintf(err, err_len, "%s: block (%u,%u,%u): %u of %u threads returned while the others wait at __syncthreads()", name, bx, by, bz, done,
                         n_threads);
                return -2;
            }
        }
    }
    in_launch = 0;
    return 0;
}

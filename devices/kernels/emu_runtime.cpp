// The host emulator's launcher (follows touchstone.cu in one translation unit). The including
// file defines TS_KERNEL_LIST(X) with one X(name) per kernel; each gets a trampoline that reads
// its arguments from a `void**` array, as cuLaunchKernel does.
#include <setjmp.h>
#include <ucontext.h>
#include <stdio.h>
#include <stdlib.h>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

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

extern "C" int ts_emu_launch(const char* name, const unsigned* grid, const unsigned* block, unsigned shared_bytes, void** args, char* err, int err_len) {
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
    for (unsigned bz = 0; bz < grid[2]; ++bz)
        for (unsigned by = 0; by < grid[1]; ++by)
            for (unsigned bx = 0; bx < grid[0]; ++bx) {
                blockIdx = dim3{bx, by, bz};
                // Fresh, poisoned dynamic shared memory per block: a kernel that reads it before
                // writing it sees NaNs.
                memset(dynamic_shared.data(), 0xFF, dynamic_shared.size());
                for (Fiber& f : fibers) f.state = 0;
                for (;;) {
                    for (Fiber& f : fibers)
                        if (f.state != 2) resume(f);
                    unsigned done = 0;
                    for (const Fiber& f : fibers) done += f.state == 2;
                    if (done == n_threads) break;
                    if (done != 0) {
                        snprintf(err, err_len, "%s: block (%u,%u,%u): %u of %u threads returned while the others wait at __syncthreads()", name, bx, by, bz, done,
                                 n_threads);
                        return -1;
                    }
                }
            }
    return 0;
}

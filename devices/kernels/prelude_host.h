// Prelude for the host emulator (`gpu-emu`): compiles touchstone.cu as ordinary C++ so the GPU
// kernels' logic runs, and is judged, on a machine without a GPU.
//
// Model: the grid's blocks run one after another; a block's threads are cooperative fibers
// (ucontext) on one OS thread, switched only at __syncthreads(), which is exactly the guarantee
// CUDA gives. `__shared__` variables are statics, so the block's fibers share them.
// A kernel whose threads do not all reach the same barriers is reported as a bug (CUDA leaves it
// undefined); see emu_runtime.cpp.
#include <math.h>
#include <string.h>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

struct dim3 {
    unsigned x, y, z;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

extern thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
void __syncthreads();
void* ts_emu_dynamic_shared();
// Ends the current launch with an error (a GPU would fault): see emu_runtime.cpp.
[[noreturn]] void ts_emu_fault(const char* what, const void* p);

static inline float ts_bits_to_float(u32 b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

#ifdef TS_EMU_ULPS
// gpu-emu:ulpN: expf and tanhf TS_EMU_ULPS = N ulp off (ulp2: as far off as CUDA documents they
// may be), up or down as a hash of the input says (the same every run). Infinities, NaN and
// exact zeros are left as computed, and tanhf stays within [-1, 1]. The macros end before the
// launcher (emu.rs).
static inline float ts_emu_off(float y, float x) {
    if (y == 0.0f || !(fabsf(y) <= 3.40282347e38f)) return y;
    u32 h;
    memcpy(&h, &x, 4);
    h *= 0x9E3779B1u;
    float toward = (h >> 31) ? INFINITY : -INFINITY;
    float z = y;
    for (int i = 0; i < TS_EMU_ULPS; ++i) z = nextafterf(z, toward);
    return fabsf(z) <= 3.40282347e38f ? z : y;
}
static inline float ts_emu_expf(float x) {
    return ts_emu_off(expf(x), x);
}
static inline float ts_emu_tanhf(float x) {
    float y = ts_emu_off(tanhf(x), x);
    return y > 1.0f ? 1.0f : y < -1.0f ? -1.0f : y;
}
#define expf(x) ts_emu_expf(x)
#define tanhf(x) ts_emu_tanhf(x)
#endif

#define __global__
#define __device__ static inline
#define __forceinline__
#define TS_UNROLL
// Static shared memory lives in one section, which the launcher poisons (0xFF bytes: NaN floats)
// before every block, as a GPU gives each block uninitialised shared memory; launches are
// therefore serialised (emu_runtime.cpp).
#define __shared__ static __attribute__((section("ts_shared")))
// A static shared array, also made known to the race check (every thread registers it as it
// passes the declaration; the runtime keeps the first).
void ts_emu_shared(void* p, unsigned long bytes);
#define SHARED(T, name, n) \
    __shared__ T name[n];  \
    ts_emu_shared(name, sizeof(name))
#define DYNAMIC_SHARED(T, name) T* name = (T*)ts_emu_dynamic_shared()

// 16-byte accesses: a GPU faults on a misaligned one ("misaligned address"), x86 would not, so
// the emulator checks.
static inline uint4 ts_load16(const void* p) {
    if ((unsigned long)p & 15) ts_emu_fault("misaligned 16-byte load", p);
    uint4 v;
    memcpy(&v, p, 16);
    return v;
}
// A 16-byte load of weights read once (a cache hint on CUDA; the same checked load here).
#define ts_load16_stream(p) ts_load16(p)
static inline void ts_store16(void* p, uint4 v) {
    if ((unsigned long)p & 15) ts_emu_fault("misaligned 16-byte store", p);
    memcpy(p, &v, 16);
}

// IEEE half bits to float, exact (subnormals, infinities and NaN included); GPUs use their
// conversion instruction instead (prelude_cuda.h, prelude_hip.h), which gives the same values.
static inline float ts_half(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 exp = ((u32)h >> 10) & 0x1Fu;
    u32 mant = (u32)h & 0x3FFu;
    if (exp == 0x1Fu) return ts_bits_to_float(sign | 0x7F800000u | (mant << 13));
    if (exp != 0) return ts_bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
    // Subnormal half: mant * 2^-24, exact in f32.
    float v = (float)mant * 5.9604644775390625e-8f;
    return sign ? -v : v;
}

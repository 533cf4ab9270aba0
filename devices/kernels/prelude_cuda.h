// Prelude for NVRTC (CUDA), after prelude_gpu.h: f16 bits to float with the hardware conversion
// (what cuda_fp16.h's __half2float does), so the f16 GEMV is not limited by integer work.
__device__ __forceinline__ float ts_half(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// A 16-byte load of weights, which a GEMV reads once: through the read-only path and not kept in
// L1, so L1 keeps the activations every row reads again.
__device__ __forceinline__ uint4 ts_load16_stream(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Prelude for NVRTC (CUDA), after prelude_gpu.h: f16 bits to float with the hardware conversion
// (what cuda_fp16.h's __half2float does), so the f16 GEMV is not limited by integer work.
__device__ __forceinline__ float ts_half(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

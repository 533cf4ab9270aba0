// Prelude for NVRTC (CUDA): what touchstone.cu expects from its platform. NVRTC provides the
// CUDA built-ins (threadIdx, __syncthreads, uint4, expf...) without any header.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
#define ts_bits_to_float(b) __uint_as_float(b)
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
// f16 bits to float with the hardware conversion (what cuda_fp16.h's __half2float does), so the
// f16 GEMV is not limited by integer work.
__device__ __forceinline__ float ts_half(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

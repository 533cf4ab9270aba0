// Prelude for hiprtc (ROCm), after prelude_gpu.h: the same kernel source as CUDA, as ggml's HIP
// build reuses its CUDA sources. Kernels use no warp intrinsics, so the 64-wide AMD wavefront
// changes nothing. f16 bits to float with the hardware conversion (clang's _Float16 on AMDGPU).
__device__ __forceinline__ float ts_half(u16 h) {
    return (float)__builtin_bit_cast(_Float16, h);
}
// A 16-byte load of weights read once (CUDA's prelude keeps them out of L1; a plain load here).
#define ts_load16_stream(p) ts_load16(p)

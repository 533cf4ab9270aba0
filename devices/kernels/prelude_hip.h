// Prelude for hiprtc (ROCm): the same kernel source as CUDA, as ggml's HIP build reuses its CUDA
// sources. hiprtc provides the HIP built-ins (threadIdx, __syncthreads, uint4, expf...) under the
// CUDA names; kernels use no warp intrinsics, so the 64-wide AMD wavefront changes nothing.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
#define ts_bits_to_float(b) __uint_as_float(b)
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
// f16 bits to float with the hardware conversion (clang's _Float16 on AMDGPU).
__device__ __forceinline__ float ts_half(u16 h) {
    return (float)__builtin_bit_cast(_Float16, h);
}

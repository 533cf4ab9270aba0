// The part of the prelude CUDA (NVRTC) and ROCm (hiprtc) share: both compilers provide the
// built-ins (threadIdx, __syncthreads, uint4, expf...) under the CUDA names without any header.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
#define ts_bits_to_float(b) __uint_as_float(b)
#define SHARED(T, name, n) __shared__ T name[n]
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
// 16-byte global accesses (the pointer must be 16-byte aligned; the emulator checks).
#define ts_load16(p) (*(const uint4*)(p))
#define ts_store16(p, v) (*(uint4*)(p) = (v))
// Unroll the loop that follows fully (its trip count is a constant), so an array it indexes stays
// in registers.
#define TS_UNROLL _Pragma("unroll")

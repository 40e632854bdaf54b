// The SIMD width of the kernels (symlib.kernels compiles every source with -march=native): one register, 64
// bytes with AVX-512, 32 with AVX/AVX2, 16 otherwise. Wider GCC vectors than the registers are register
// pairs, and the kernels' accumulators then spill to memory: on a 2-core AVX2 machine 64-byte vectors made
// the OptuNet step 4-6x slower and the pairwise kernel 6-10x slower (slower than numpy's path).
#pragma once

#if defined(__AVX512F__)
#define SYMLIB_VECTOR_BYTES 64
#elif defined(__AVX__)
#define SYMLIB_VECTOR_BYTES 32
#else
#define SYMLIB_VECTOR_BYTES 16
#endif

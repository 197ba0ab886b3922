// CUDA kernels of the CuPy backend (compiled by NVRTC with --fmad=false; the
// loader inlines the header below). Both are grid-stride loops over tiles of
// PI_TILE elements with 64-bit indices; all arithmetic lives in the header so
// the host harness checks the same code. Launch with blockDim.x == PI_BLOCK.

#include "paraminit_kernels.cuh"

// One parameter: local elements [l_begin, l_begin + n) of its region into out.
// dims is the (start, ext, stride) triples of the region's outer dimensions
// (may be null when n_outer == 0); values the flat payload, indexed g - vshift;
// lo, hi and seed the truncated normal's bounds and raw seed (other kinds ignore them).
extern "C" __global__ void __launch_bounds__(PI_BLOCK)
pi_fill(unsigned char* out, long long n, long long l_begin, int kind, int otype, unsigned long long key,
        double p0, double p1, const double* values, long long vshift, const long long* dims, int n_outer,
        long long base, long long run_len, double lo, double hi, unsigned long long seed) {
    PiJob j;
    j.out_off = 0;
    j.n = n;
    j.l_begin = l_begin;
    j.kind = kind;
    j.otype = otype;
    j.key = key;
    j.p0 = p0;
    j.p1 = p1;
    j.vshift = vshift;
    j.base = base;
    j.run_len = run_len;
    j.n_outer = n_outer;
    j.dims_off = 0;
    j.lo = lo;
    j.hi = hi;
    j.seed = seed;
    const pi_i64 tiles = (n + PI_TILE - 1) / PI_TILE;
    for (pi_i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        pi_run_tile(j, dims, values, out, t, (int)threadIdx.x);
    }
}

// A whole plan in one launch: meta packs njobs descriptors, their tile starts
// and their dims (cupy_backend.pack); each tile finds its job by binary search.
extern "C" __global__ void __launch_bounds__(PI_BLOCK)
pi_fill_plan(unsigned char* arena, const long long* meta, int njobs, long long total_tiles, const double* values) {
    for (pi_i64 t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        pi_plan_tile(arena, meta, njobs, values, t, (int)threadIdx.x);
    }
}

// Per-element arithmetic of SAMPLER.md for the CUDA backend, shared by the kernels
// (paraminit_kernels.cu, compiled by NVRTC through CuPy) and by a host-only test
// harness (nvcc, tests/test_cuda_harness.py) that checks these very functions on
// the CPU, bit for bit, against vectors.json and reference.py.
//
// Everything below is __host__ __device__. Device code uses explicit rounding
// intrinsics so no multiply-add is ever contracted into an FMA (the spec rounds
// each operation on its own); host code uses plain operators and must be built
// with -ffp-contract=off. Only log and cos differ between the two sides: CUDA's
// double log/cos (within an ulp or two) on the device, the C library on the host.
//
// No system header is needed under NVRTC (__CUDACC_RTC__): the math functions
// and intrinsics are built in there.

#ifndef PARAMINIT_KERNELS_CUH
#define PARAMINIT_KERNELS_CUH

#if !defined(__CUDACC_RTC__)
#include <cmath>
#include <cstring>
#endif

#if defined(__CUDACC__)
#define PI_HD __host__ __device__ __forceinline__
#else
#define PI_HD inline
#endif

typedef unsigned long long pi_u64;
typedef long long pi_i64;
typedef unsigned int pi_u32;

// Launch geometry: a tile is PI_EPT elements per thread of a PI_BLOCK-thread
// block; the host packs plans in tiles of PI_TILE (cupy_backend.py mirrors these).
#define PI_BLOCK 256
#define PI_EPT 8
#define PI_TILE (PI_BLOCK * PI_EPT)

// Value kinds (plan.Kind) and output types.
#define PI_CONST 0
#define PI_AFFINE 1
#define PI_NORMAL 2
#define PI_FLAT 3

#define PI_F32 0
#define PI_F64 1
#define PI_F16 2
#define PI_BF16 3

// One job of a packed plan: PI_DESC_WORDS int64 words (doubles and the key
// stored as their bit patterns). Layout mirrored by cupy_backend.pack().
#define PI_DESC_WORDS 16
#define PI_W_OUT 0      // byte offset of the job's output in the arena
#define PI_W_N 1        // elements to write
#define PI_W_LBEGIN 2   // first local (region) element
#define PI_W_KIND 3
#define PI_W_OTYPE 4
#define PI_W_KEY 5      // stream key, uint64 bits
#define PI_W_P0 6       // binary64 bits
#define PI_W_P1 7       // binary64 bits
#define PI_W_VSHIFT 8   // flat payload: values[g - vshift]
#define PI_W_BASE 9     // Runs.base
#define PI_W_RUNLEN 10  // Runs.run_len
#define PI_W_NOUTER 11  // number of outer dimensions
#define PI_W_DIMS 12    // offset of (start, ext, stride) triples in the dims section

#if defined(__CUDA_ARCH__)
#define PI_LDG(p) __ldg(p)
#else
#define PI_LDG(p) (*(p))
#endif

// ---------------------------------------------------------------------------
// Exactly rounded binary64 primitives.

PI_HD pi_u64 pi_bits(double x) {
#if defined(__CUDA_ARCH__)
    return (pi_u64)__double_as_longlong(x);
#else
    pi_u64 b;
    std::memcpy(&b, &x, sizeof b);
    return b;
#endif
}

PI_HD double pi_double(pi_u64 b) {
#if defined(__CUDA_ARCH__)
    return __longlong_as_double((long long)b);
#else
    double x;
    std::memcpy(&x, &b, sizeof x);
    return x;
#endif
}

PI_HD double pi_add(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}

PI_HD double pi_sub(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dsub_rn(a, b);
#else
    return a - b;
#endif
}

PI_HD double pi_mul(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

PI_HD double pi_sqrt(double a) {
#if defined(__CUDA_ARCH__)
    return __dsqrt_rn(a);
#else
    return std::sqrt(a);
#endif
}

PI_HD double pi_log(double a) {
#if defined(__CUDA_ARCH__)
    return log(a);
#else
    return std::log(a);
#endif
}

PI_HD double pi_cos(double a) {
#if defined(__CUDA_ARCH__)
    return cos(a);
#else
    return std::cos(a);
#endif
}

// binary64 -> binary32, one round-to-nearest-even (x86-64 SSE conversion on the host).
PI_HD float pi_f32(double v) {
#if defined(__CUDA_ARCH__)
    return __double2float_rn(v);
#else
    return static_cast<float>(v);
#endif
}

// ---------------------------------------------------------------------------
// Counter-based generator (SAMPLER.md section 1).

PI_HD pi_u64 pi_mix(pi_u64 x) {
    pi_u64 z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

PI_HD pi_u32 pi_draw(pi_u64 key, pi_u64 i) { return (pi_u32)pi_mix(key + i); }

// d / 2^32 without an int -> float conversion: 1 + d * 2^-32 is exact in binary64
// (52 fraction bits), built from bits, and subtracting 1 is exact too.
PI_HD double pi_unit_of(pi_u32 d) {
    return pi_sub(pi_double(0x3FF0000000000000ULL | ((pi_u64)d << 20)), 1.0);
}

PI_HD double pi_unit(pi_u64 key, pi_u64 i) { return pi_unit_of(pi_draw(key, i)); }

// ---------------------------------------------------------------------------
// Values (section 2); key is key(seed), g the global row-major index.

PI_HD double pi_affine(pi_u64 key, pi_u64 g, double p0, double p1) {
    return pi_add(p0, pi_mul(pi_unit(key, g), p1));
}

#define PI_TWO_PI 6.283185307179586    // 2.0 * math.pi, bits 0x401921FB54442D18
#define PI_U1_FLOOR 1e-6

PI_HD double pi_normal_z(pi_u64 key, pi_u64 g) {
    double u1 = pi_unit(key, 2 * g);
    const double u2 = pi_unit(key, 2 * g + 1);
    if (u1 <= PI_U1_FLOOR) u1 = PI_U1_FLOOR;
    return pi_mul(pi_sqrt(pi_mul(-2.0, pi_log(u1))), pi_cos(pi_mul(PI_TWO_PI, u2)));
}

PI_HD double pi_normal(pi_u64 key, pi_u64 g, double mean, double std_dev) {
    return pi_add(mean, pi_mul(std_dev, pi_normal_z(key, g)));
}

// ---------------------------------------------------------------------------
// Casts (section 4): binary64 -> 16-bit float, one round-to-nearest-even on the
// binary64 bits (never through binary32, which would round twice). `mant`
// fraction bits, smallest normal exponent `emin`; carries into the exponent
// field, and on to infinity, fall out of the integer addition.

PI_HD unsigned short pi_half_bits(double v, int mant, int emin, pi_u32 inf_bits) {
    const pi_u64 b = pi_bits(v);
    const pi_u32 sign = (pi_u32)(b >> 48) & 0x8000u;
    const int big_e = (int)((b >> 52) & 0x7FF);
    const pi_u64 frac = b & 0xFFFFFFFFFFFFFULL;
    if (big_e == 0x7FF) return (unsigned short)(sign | inf_bits | (frac != 0 ? (1u << (mant - 1)) : 0u));
    const int e = big_e - 1023;
    if (e < emin - mant - 1) return (unsigned short)sign;  // below half the smallest subnormal
    const pi_u64 sig = frac | (1ULL << 52);
    int shift = 52 - mant;
    pi_u64 lead = (pi_u64)(e - emin);  // biased exponent minus one, for normal results
    if (e < emin) {
        shift += emin - e;  // at most 53
        lead = 0;
    }
    pi_u64 rounded = sig >> shift;
    const pi_u64 rem = sig & ((1ULL << shift) - 1);
    const pi_u64 half = 1ULL << (shift - 1);
    if (rem > half || (rem == half && (rounded & 1) != 0)) rounded += 1;
    pi_u64 out = (lead << mant) + rounded;
    if (out > inf_bits) out = inf_bits;
    return (unsigned short)(sign | (pi_u32)out);
}

PI_HD unsigned short pi_f16_bits(double v) { return pi_half_bits(v, 10, -14, 0x7C00u); }
PI_HD unsigned short pi_bf16_bits(double v) { return pi_half_bits(v, 7, -126, 0x7F80u); }

// ---------------------------------------------------------------------------
// Regions (section 5) as plan.Runs: local element l lies in run l / run_len;
// outer digits of the run index map to global rows.

PI_HD pi_u64 pi_udiv(pi_u64 a, pi_u64 b) {
    // 32-bit division is several times cheaper on the GPU; most operands fit.
    if (((a | b) >> 32) == 0) return (pi_u64)((pi_u32)a / (pi_u32)b);
    return a / b;
}

struct PiJob {
    pi_i64 out_off;
    pi_i64 n;
    pi_i64 l_begin;
    int kind;
    int otype;
    pi_u64 key;
    double p0;
    double p1;
    pi_i64 vshift;
    pi_i64 base;
    pi_i64 run_len;
    int n_outer;
    pi_i64 dims_off;
};

PI_HD PiJob pi_load_job(const pi_i64* w) {
    PiJob j;
    j.out_off = PI_LDG(w + PI_W_OUT);
    j.n = PI_LDG(w + PI_W_N);
    j.l_begin = PI_LDG(w + PI_W_LBEGIN);
    j.kind = (int)PI_LDG(w + PI_W_KIND);
    j.otype = (int)PI_LDG(w + PI_W_OTYPE);
    j.key = (pi_u64)PI_LDG(w + PI_W_KEY);
    j.p0 = pi_double((pi_u64)PI_LDG(w + PI_W_P0));
    j.p1 = pi_double((pi_u64)PI_LDG(w + PI_W_P1));
    j.vshift = PI_LDG(w + PI_W_VSHIFT);
    j.base = PI_LDG(w + PI_W_BASE);
    j.run_len = PI_LDG(w + PI_W_RUNLEN);
    j.n_outer = (int)PI_LDG(w + PI_W_NOUTER);
    j.dims_off = PI_LDG(w + PI_W_DIMS);
    return j;
}

// Global flat index of local element l; dims holds the job's (start, ext, stride) triples.
PI_HD pi_i64 pi_global(pi_i64 l, const PiJob& j, const pi_i64* dims) {
    pi_u64 r = pi_udiv((pi_u64)l, (pi_u64)j.run_len);
    pi_i64 g = j.base + (l - (pi_i64)r * j.run_len);
    for (int d = j.n_outer - 1; d >= 0; --d) {
        const pi_i64* t = dims + 3 * d;
        const pi_u64 ext = (pi_u64)PI_LDG(t + 1);
        const pi_u64 q = pi_udiv(r, ext);
        g += ((pi_i64)(r - q * ext) + PI_LDG(t)) * PI_LDG(t + 2);
        r = q;
    }
    return g;
}

template <int KIND>
PI_HD double pi_value(const PiJob& j, const double* values, pi_i64 g) {
    if (KIND == PI_AFFINE) return pi_affine(j.key, (pi_u64)g, j.p0, j.p1);
    if (KIND == PI_NORMAL) return pi_normal(j.key, (pi_u64)g, j.p0, j.p1);
    if (KIND == PI_FLAT) return PI_LDG(values + (g - j.vshift));
    return j.p0;
}

template <int OTYPE>
PI_HD void pi_store(unsigned char* out, pi_i64 k, double v) {
    if (OTYPE == PI_F32) {
        reinterpret_cast<float*>(out)[k] = pi_f32(v);
    } else if (OTYPE == PI_F64) {
        reinterpret_cast<double*>(out)[k] = v;
    } else if (OTYPE == PI_F16) {
        reinterpret_cast<unsigned short*>(out)[k] = pi_f16_bits(v);
    } else {
        reinterpret_cast<unsigned short*>(out)[k] = pi_bf16_bits(v);
    }
}

PI_HD void pi_store_rt(int otype, unsigned char* out, pi_i64 k, double v) {
    switch (otype) {
        case PI_F32: pi_store<PI_F32>(out, k, v); break;
        case PI_F64: pi_store<PI_F64>(out, k, v); break;
        case PI_F16: pi_store<PI_F16>(out, k, v); break;
        default: pi_store<PI_BF16>(out, k, v); break;
    }
}

// What thread `tid` of a block writes for tile `tile` of a job: elements
// tile * PI_TILE + e * PI_BLOCK + tid, so each store instruction of a warp is
// contiguous. Every element depends only on (key, global index). The
// memory-bound kinds are specialized per output type and unrolled (PI_EPT
// independent elements in flight); normal is compute-bound, so it keeps one
// copy of log/cos and picks the output type at run time (a uniform branch).
template <int KIND, int OTYPE>
PI_HD void pi_tile(const PiJob& j, const pi_i64* dims, const double* values, unsigned char* arena,
                   pi_i64 tile, int tid) {
    unsigned char* out = arena + j.out_off;
    const pi_i64 k0 = tile * PI_TILE + tid;
    if (j.n_outer == 0) {  // one run: g = base + l
        const pi_i64 g0 = j.base + j.l_begin;
        if (KIND == PI_NORMAL) {
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
            for (int e = 0; e < PI_EPT; ++e) {
                const pi_i64 k = k0 + (pi_i64)e * PI_BLOCK;
                if (k < j.n) pi_store_rt(j.otype, out, k, pi_value<KIND>(j, values, g0 + k));
            }
        } else {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
            for (int e = 0; e < PI_EPT; ++e) {
                const pi_i64 k = k0 + (pi_i64)e * PI_BLOCK;
                if (k < j.n) pi_store<OTYPE>(out, k, pi_value<KIND>(j, values, g0 + k));
            }
        }
    } else {  // several runs: a division per element, regions only
        const pi_i64* d = dims + j.dims_off;
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
        for (int e = 0; e < PI_EPT; ++e) {
            const pi_i64 k = k0 + (pi_i64)e * PI_BLOCK;
            if (k < j.n) {
                const double v = pi_value<KIND>(j, values, pi_global(j.l_begin + k, j, d));
                if (KIND == PI_NORMAL) pi_store_rt(j.otype, out, k, v); else pi_store<OTYPE>(out, k, v);
            }
        }
    }
}

PI_HD void pi_run_tile(const PiJob& j, const pi_i64* dims, const double* values, unsigned char* arena,
                       pi_i64 tile, int tid) {
    if (j.kind == PI_NORMAL) {
        pi_tile<PI_NORMAL, PI_F64>(j, dims, values, arena, tile, tid);  // output type chosen inside
        return;
    }
#define PI_CASE(K, O) \
    case (K) * 4 + (O): pi_tile<K, O>(j, dims, values, arena, tile, tid); break;
    switch (j.kind * 4 + j.otype) {
        PI_CASE(PI_CONST, PI_F32) PI_CASE(PI_CONST, PI_F64) PI_CASE(PI_CONST, PI_F16) PI_CASE(PI_CONST, PI_BF16)
        PI_CASE(PI_AFFINE, PI_F32) PI_CASE(PI_AFFINE, PI_F64) PI_CASE(PI_AFFINE, PI_F16) PI_CASE(PI_AFFINE, PI_BF16)
        PI_CASE(PI_FLAT, PI_F32) PI_CASE(PI_FLAT, PI_F64) PI_CASE(PI_FLAT, PI_F16) PI_CASE(PI_FLAT, PI_BF16)
        default: break;
    }
#undef PI_CASE
}

// ---------------------------------------------------------------------------
// Packed plans: meta = [njobs descriptors | tile_start (njobs + 1) | dims].

// The job owning tile t: the last j with tile_start[j] <= t.
PI_HD int pi_find_job(const pi_i64* tile_start, int njobs, pi_i64 t) {
    int lo = 0;
    int hi = njobs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (PI_LDG(tile_start + mid) <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Thread tid's share of global tile t of a packed plan (the body of pi_fill_plan).
PI_HD void pi_plan_tile(unsigned char* arena, const pi_i64* meta, int njobs, const double* values,
                        pi_i64 t, int tid) {
    const pi_i64* tile_start = meta + (pi_i64)njobs * PI_DESC_WORDS;
    const pi_i64* dims = tile_start + njobs + 1;
    const int d = pi_find_job(tile_start, njobs, t);
    const PiJob j = pi_load_job(meta + (pi_i64)d * PI_DESC_WORDS);
    pi_run_tile(j, dims, values, arena, t - PI_LDG(tile_start + d), tid);
}

#endif  // PARAMINIT_KERNELS_CUH

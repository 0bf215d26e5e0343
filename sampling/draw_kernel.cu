// Per-row draws of a sampled step in one launch each (sampling/cupy_draw.py):
//   * categorical_sample: one index per row of non-negative weights by the inverse-CDF rule of
//     sampling/categorical.py: the smallest j with w[j] > 0 and c[j] > t, c accumulated in
//     float64 and t = u * (the row's float64 sum); if rounding leaves none, the largest j with
//     w[j] > 0. One block per row (grid-strided past the grid): a pass sums the row, then passes
//     of CD_RUN * CD_THREADS entries scan it in index order and stop at the first that holds t.
//   * splitmix64_uniforms: SplitMix64's outputs as float32 (sampling/rng.py), bit for bit the
//     torch computation: unsigned 64-bit arithmetic wraps the same way.
//
// Self-contained like rejection_kernel.cu: NVRTC, hiprtc, nvcc or hipcc; every reduction goes
// through shared memory (no warp intrinsics, no warp-size assumption). Its block scan and sum are
// that kernel's, copied, so that each source compiles standalone (as tests/sampling/
// test_kernel_compile.py builds every .cu with nvcc and hipcc).

#if defined(__HIPCC__) && !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif

#define CD_THREADS 256
#define CD_RUN 16  // entries per thread per scan pass
#define CD_NONE 0x7fffffffffffffffULL

// All launch arguments in one by-value struct; every field is 8 bytes (no padding anywhere).
struct CdParams {
    const float* weights;    // [N, V] float32 >= 0, rows contiguous
    const float* uniforms;   // [N] float32 in [0, 1)
    long long* index;        // [N] int64 out
    unsigned char* has_mass; // [N] bool out: the row's sum is > 0
    long long rows;
    long long vocab;
    long long vec;           // 1: V % 4 == 0 and the weights 16-byte aligned (float4 loads)
};

__device__ double cd_block_exclusive_scan(double value, double* scratch) {
    const int t = threadIdx.x;
    scratch[t] = value;
    __syncthreads();
    for (int offset = 1; offset < CD_THREADS; offset <<= 1) {
        const double add = t >= offset ? scratch[t - offset] : 0.0;
        __syncthreads();
        scratch[t] += add;
        __syncthreads();
    }
    const double exclusive = t > 0 ? scratch[t - 1] : 0.0;
    __syncthreads();
    if (t == CD_THREADS - 1) scratch[CD_THREADS] = exclusive + value;  // the block total
    __syncthreads();
    return exclusive;
}

__device__ double cd_block_sum(double value, double* scratch) {
    const int t = threadIdx.x;
    scratch[t] = value;
    __syncthreads();
    for (int stride = CD_THREADS / 2; stride > 0; stride >>= 1) {
        if (t < stride) scratch[t] += scratch[t + stride];
        __syncthreads();
    }
    const double result = scratch[0];
    __syncthreads();
    return result;
}

extern "C" __global__ void __launch_bounds__(CD_THREADS) categorical_sample(const CdParams params) {
    __shared__ double scratch[CD_THREADS + 1];
    __shared__ unsigned long long pick[2];  // first index past t; last positive index + 1 (0: none)
    const int t = threadIdx.x;
    const long long vocab = params.vocab;
    for (long long r = blockIdx.x; r < params.rows; r += gridDim.x) {
        const float* w = params.weights + r * vocab;
        double own = 0.0;
        if (params.vec) {
            const float4* w4 = reinterpret_cast<const float4*>(w);
            for (long long i = t; i < vocab / 4; i += CD_THREADS) {
                const float4 x = w4[i];
                own += static_cast<double>(x.x) + static_cast<double>(x.y) + static_cast<double>(x.z) +
                       static_cast<double>(x.w);
            }
        } else {
            for (long long j = t; j < vocab; j += CD_THREADS) own += static_cast<double>(w[j]);
        }
        const double total = cd_block_sum(own, scratch);
        if (t == 0) {
            pick[0] = CD_NONE;
            pick[1] = 0;
        }
        __syncthreads();
        const double threshold = static_cast<double>(params.uniforms[r]) * total;
        double pass_before = 0.0;
        if (total > 0.0) {
            for (long long offset = 0; offset < vocab; offset += CD_RUN * CD_THREADS) {
                const long long begin = offset + static_cast<long long>(t) * CD_RUN;
                float x[CD_RUN];
                if (params.vec && begin + CD_RUN <= vocab) {
                    const float4* w4 = reinterpret_cast<const float4*>(w + begin);
#pragma unroll
                    for (int v = 0; v < CD_RUN / 4; ++v) {
                        const float4 f = w4[v];
                        x[4 * v] = f.x;
                        x[4 * v + 1] = f.y;
                        x[4 * v + 2] = f.z;
                        x[4 * v + 3] = f.w;
                    }
                } else {
#pragma unroll
                    for (int u = 0; u < CD_RUN; ++u) x[u] = begin + u < vocab ? w[begin + u] : 0.0f;
                }
                double run = 0.0;
#pragma unroll
                for (int u = 0; u < CD_RUN; ++u) run += static_cast<double>(x[u]);
                double cumulative = pass_before + cd_block_exclusive_scan(run, scratch);
                pass_before += scratch[CD_THREADS];
                unsigned long long first_hit = CD_NONE;
                long long last_positive = -1;
#pragma unroll
                for (int u = 0; u < CD_RUN; ++u) {
                    cumulative += static_cast<double>(x[u]);
                    if (x[u] > 0.0f) {
                        last_positive = begin + u;
                        if (cumulative > threshold && first_hit == CD_NONE) first_hit = begin + u;
                    }
                }
                if (first_hit != CD_NONE) atomicMin(&pick[0], static_cast<unsigned long long>(first_hit));
                if (last_positive >= 0) atomicMax(&pick[1], static_cast<unsigned long long>(last_positive + 1));
                __syncthreads();
                if (pick[0] != CD_NONE) break;  // the same value in every thread after the barrier
            }
        }
        if (t == 0) {
            const unsigned long long hit = pick[0];
            const unsigned long long last = pick[1];
            params.index[r] = static_cast<long long>(hit != CD_NONE ? hit : (last > 0 ? last - 1 : 0));
            params.has_mass[r] = total > 0.0;
        }
        __syncthreads();  // pick and scratch are reused by the next row
    }
}

// SplitMix64 (sampling/rng.py). `rows_in` is [B, 1 + n] int64 (positions: the row's key, then
// its n counters; output j is number counters[j] + 1 from the key) or [B, 2] (stream: the state
// before the row's next value and its count; output j < count is number j + 1 from that state,
// the rest 0). out is [B, n] float32: the top 24 bits of the mixed state over 2**24.
// A stream batch of at most SM_INLINE rows travels in the launch's parameters (`rows_in` null):
// a step's few int64 then need no host -> device copy, whose pinned staging and queued copy cost
// more host time than the kernel.
#define SM_GAMMA 0x9E3779B97F4A7C15ULL
#define SM_INLINE 64

struct SmParams {
    const long long* rows_in;  // [B, 1 + n] or [B, 2] int64 in device memory; null: `inline_rows`
    float* out;                // [B, n] float32
    long long rows;
    long long n;
    long long stream;          // 1: rows_in is [B, 2] (state, count)
    long long inline_rows[2 * SM_INLINE];  // [B, 2] stream rows (state, count) when rows_in is null
};

__device__ long long sm_row_value(const SmParams& params, long long i) {
    return params.rows_in != nullptr ? params.rows_in[i] : params.inline_rows[i];
}

extern "C" __global__ void splitmix64_uniforms(const SmParams params) {
    float* out = params.out;
    const long long n = params.n;
    const long long total = params.rows * n;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long b = i / n;
        const long long j = i - b * n;
        unsigned long long z;
        if (params.stream) {
            const long long count = sm_row_value(params, 2 * b + 1);
            if (j >= count) {
                out[i] = 0.0f;
                continue;
            }
            z = static_cast<unsigned long long>(sm_row_value(params, 2 * b)) +
                static_cast<unsigned long long>(j) * SM_GAMMA;
        } else {
            const long long* row = params.rows_in + b * (1 + n);
            z = static_cast<unsigned long long>(row[0]) + (static_cast<unsigned long long>(row[1 + j]) + 1ULL) * SM_GAMMA;
        }
        z ^= z >> 30;
        z *= 0xBF58476D1CE4E5B9ULL;
        z ^= z >> 27;
        z *= 0x94D049BB133111EBULL;
        out[i] = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // below 2**24: exact
    }
}

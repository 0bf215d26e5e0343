// Rejection sampling for speculative decoding (DESIGN.md §2), one fused kernel.
//
// Self-contained: compiles with nvcc, NVRTC, hipcc and hiprtc. No warp intrinsics and no
// warp-size assumption (AMD wavefronts are 64 wide): every reduction and scan goes through
// shared memory, so the same source is correct on CUDA and ROCm.
//
// Grid: x = a run of consecutive vocabulary chunks, y = batch row (grid-stride over rows
// past 65535).
// Every block of a row re-derives the row's first rejection n from K scalar loads (L2
// hits), so no block waits on another for it. Then:
//   * rows that need no residual (all accepted, or a greedy rejection) are finished by
//     block x == 0 alone; the other blocks never touch the vocabulary;
//   * rows whose first rejection is stochastic: each block sums each of its chunks of
//     r = relu(q - p) (point mass: q with the draft id zeroed) in float64 and publishes them;
//     the last block of the row to arrive (threadfence + per-row counter) prefix-scans the chunk sums,
//     finds the chunk that holds t = u[n+1] * S and rescans only that chunk. So the row is
//     read once, plus one chunk. The last block resets the counter to 0, so the workspace
//     stays valid across calls and CUDA-graph replays without a memset.
//
// Sampling rule, as in sampling/categorical.py: the smallest j with r[j] > 0 and
// c[j] > t (c accumulated in float64); else the last j with r[j] > 0; if S is not > 0,
// the target sampler's token. Draft ids are clamped before they address memory, so even
// unchecked bad ids cannot read out of bounds.

#if defined(__HIPCC__) && !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif

#define RS_THREADS 256
#ifndef RS_MIN_BLOCKS
#define RS_MIN_BLOCKS 2  // resident blocks per SM the register budget must allow (128 registers)
#endif
#ifndef RS_MAX_CHUNK
#define RS_MAX_CHUNK 8192  // entries per chunk at most (the wrapper's MAX_CHUNK)
#endif
#define RS_VEC_PER_THREAD (RS_MAX_CHUNK / (4 * RS_THREADS))  // float4 loads per thread per chunk
#define RS_RUN (RS_MAX_CHUNK / RS_THREADS)              // entries per thread in the rescan

// All launch arguments in one by-value struct: one argument to marshal from Python.
// Every field is 8 bytes, so the layout is the same on every compiler (no padding).
struct RsParams {
    const void* draft_ids;          // [B, K] int32 or int64
    long long draft_ids_64;
    const float* draft_probs;       // [B, K, V] or nullptr (point mass)
    const float* target_probs;      // [B, K+1, V]
    const void* target_ids;         // [B, K+1] int32 or int64
    long long target_ids_64;
    const float* uniforms;          // [B, K+1]
    const unsigned char* do_sample; // [B]
    long long batch;
    long long num_draft;            // K
    long long vocab;                // V
    long long chunk_size;           // multiple of 1024, <= RS_MAX_CHUNK
    long long num_chunks;
    long long chunks_per_block;     // gridDim.x = ceil(num_chunks / chunks_per_block)
    long long vec;                  // rows 16-byte aligned and V % 4 == 0: float4 loads
    int* out_ids;                   // [B, K+1]
    int* out_emitted;               // [B]
    double* chunk_sums;             // [B, num_chunks] workspace
    int* row_counters;              // [B] workspace, all 0 between calls
};

struct RowIds {
    const void* ptr;
    int is64;
    __device__ long long operator[](long long i) const {
        return is64 ? static_cast<const long long*>(ptr)[i] : static_cast<long long>(static_cast<const int*>(ptr)[i]);
    }
};

__device__ __forceinline__ long long clamp_id(long long id, long long vocab) {
    return id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
}

// relu(q - p) as torch computes it (NaN propagates); point mass: q with the draft id zeroed.
__device__ __forceinline__ float residual(float q, float p, int j, int draft, int dense) {
    if (!dense) return j == draft ? 0.0f : q;
    float x = q - p;
    return x < 0.0f ? 0.0f : x;
}

__device__ __forceinline__ long long min_ll(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ int min_i(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max_i(int a, int b) { return a > b ? a : b; }

// Exclusive scan of one double per thread (Hillis-Steele in shared memory); the block
// total goes to scratch[RS_THREADS]. Every thread must call it.
__device__ double block_exclusive_scan(double value, double* scratch) {
    const int t = threadIdx.x;
    scratch[t] = value;
    __syncthreads();
    for (int offset = 1; offset < RS_THREADS; offset <<= 1) {
        const double add = t >= offset ? scratch[t - offset] : 0.0;
        __syncthreads();
        scratch[t] += add;
        __syncthreads();
    }
    const double exclusive = t > 0 ? scratch[t - 1] : 0.0;
    __syncthreads();
    if (t == RS_THREADS - 1) scratch[RS_THREADS] = exclusive + value;
    __syncthreads();
    return exclusive;
}

__device__ double block_sum(double value, double* scratch) {
    const int t = threadIdx.x;
    scratch[t] = value;
    __syncthreads();
    for (int stride = RS_THREADS / 2; stride > 0; stride >>= 1) {
        if (t < stride) scratch[t] += scratch[t + stride];
        __syncthreads();
    }
    const double result = scratch[0];
    __syncthreads();
    return result;
}

// The chunk-local view used by the loops below: 32-bit offsets keep register use low.
struct Chunk {
    const float* q;  // target row + begin
    const float* p;  // draft row + begin (dense only)
    int size;        // end - begin <= RS_MAX_CHUNK
    int draft;       // draft id - begin when the draft id falls in this chunk, else -1
};

__device__ __forceinline__ Chunk make_chunk(const float* q_row, const float* p_row, long long begin, long long end,
                                            long long draft, int dense) {
    Chunk c;
    c.q = q_row + begin;
    c.p = dense ? p_row + begin : nullptr;
    c.size = static_cast<int>(end - begin);
    c.draft = (draft >= begin && draft < end) ? static_cast<int>(draft - begin) : -1;
    return c;
}

// One thread's share of a chunk, in registers: float4 j = 4 * (threadIdx.x + u * RS_THREADS).
struct Tile {
    float4 q[RS_VEC_PER_THREAD];
    float4 p[RS_VEC_PER_THREAD];
};

// Issue every load of the thread's share at once (used when `vec`: the chunk size is a
// multiple of 4 and rows are 16-byte aligned); point mass never reads p.
__device__ __forceinline__ void load_tile(const Chunk& c, int dense, Tile& tile) {
#pragma unroll
    for (int u = 0; u < RS_VEC_PER_THREAD; ++u) {
        const int j = 4 * (threadIdx.x + u * RS_THREADS);
        if (j < c.size) {
            tile.q[u] = *reinterpret_cast<const float4*>(c.q + j);
            if (dense) tile.p[u] = *reinterpret_cast<const float4*>(c.p + j);
        }
    }
}

__device__ __forceinline__ double tile_residual_sum(const Chunk& c, int dense, const Tile& tile) {
    double sum = 0.0;
#pragma unroll
    for (int u = 0; u < RS_VEC_PER_THREAD; ++u) {
        const int j = 4 * (threadIdx.x + u * RS_THREADS);
        if (j < c.size) {
            sum += static_cast<double>(residual(tile.q[u].x, dense ? tile.p[u].x : 0.0f, j, c.draft, dense));
            sum += static_cast<double>(residual(tile.q[u].y, dense ? tile.p[u].y : 0.0f, j + 1, c.draft, dense));
            sum += static_cast<double>(residual(tile.q[u].z, dense ? tile.p[u].z : 0.0f, j + 2, c.draft, dense));
            sum += static_cast<double>(residual(tile.q[u].w, dense ? tile.p[u].w : 0.0f, j + 3, c.draft, dense));
        }
    }
    return sum;
}

// Scalar path (V not a multiple of 4, or unaligned rows: no real vocabulary); kept light.
__device__ double chunk_residual_sum_scalar(const Chunk& c, int dense) {
    double sum = 0.0;
#pragma unroll 4
    for (int j = threadIdx.x; j < c.size; j += RS_THREADS)
        sum += static_cast<double>(residual(c.q[j], dense ? c.p[j] : 0.0f, j, c.draft, dense));
    return sum;
}

// Chunk sums of this block's run of chunks [first, last) of one row into row_sums.
__device__ void sum_chunks(const float* q_row, const float* p_row, long long draft, int dense, int vec, int first,
                           int last, long long chunk_size, long long vocab, double* row_sums, double* scratch) {
    for (int chunk = first; chunk < last; ++chunk) {
        const long long begin = chunk * chunk_size;
        const Chunk c = make_chunk(q_row, p_row, begin, min_ll(begin + chunk_size, vocab), draft, dense);
        double own;
        if (vec) {
            Tile tile;
            load_tile(c, dense, tile);
            own = tile_residual_sum(c, dense, tile);
        } else {
            own = chunk_residual_sum_scalar(c, dense);
        }
        const double partial = block_sum(own, scratch);
        if (threadIdx.x == 0) row_sums[chunk] = partial;
    }
}

// The residual over this thread's run [t * RS_RUN, (t + 1) * RS_RUN) of a chunk, into
// registers (0 past the end); loads issued together, float4 when `vec`.
__device__ void load_run(const Chunk& c, int dense, int vec, float* r) {
    const int run_begin = threadIdx.x * RS_RUN;
    if (vec) {
#pragma unroll
        for (int u = 0; u < RS_RUN / 4; ++u) {
            const int j = run_begin + 4 * u;
            if (j < c.size) {
                const float4 q = *reinterpret_cast<const float4*>(c.q + j);
                const float4 p = dense ? *reinterpret_cast<const float4*>(c.p + j) : float4{0.f, 0.f, 0.f, 0.f};
                r[4 * u] = residual(q.x, p.x, j, c.draft, dense);
                r[4 * u + 1] = residual(q.y, p.y, j + 1, c.draft, dense);
                r[4 * u + 2] = residual(q.z, p.z, j + 2, c.draft, dense);
                r[4 * u + 3] = residual(q.w, p.w, j + 3, c.draft, dense);
            } else {
                r[4 * u] = r[4 * u + 1] = r[4 * u + 2] = r[4 * u + 3] = 0.0f;
            }
        }
        return;
    }
#pragma unroll
    for (int u = 0; u < RS_RUN; ++u) {
        const int j = run_begin + u;
        r[u] = j < c.size ? residual(c.q[j], dense ? c.p[j] : 0.0f, j, c.draft, dense) : 0.0f;
    }
}

// Run by the last block of a row: find the chunk holding t, rescan it, return the index.
// s_pick[0..3] must hold {num_chunks, -1, INT_MAX, -1} on entry.
__device__ long long sample_residual(const float* q_row, const float* p_row, long long draft, int dense,
                                     const volatile double* sums, int num_chunks, long long chunk_size,
                                     long long vocab, int vec, float uniform, long long fallback,
                                     double* scratch, int* s_pick) {
    const int t = threadIdx.x;
    // 1) Prefix over the chunk sums; each thread owns a contiguous segment of chunks.
    const int per_thread = (num_chunks + RS_THREADS - 1) / RS_THREADS;
    const int seg_begin = min_i(t * per_thread, num_chunks);
    const int seg_end = min_i(seg_begin + per_thread, num_chunks);
    double own = 0.0;
    for (int c = seg_begin; c < seg_end; ++c) own += sums[c];
    const double seg_before = block_exclusive_scan(own, scratch);
    const double total = scratch[RS_THREADS];  // S, the residual mass
    if (!(total > 0.0)) return fallback;  // no residual mass (or NaN): the target token
    const double threshold = static_cast<double>(uniform) * total;
    double running = seg_before;
    for (int c = seg_begin; c < seg_end; ++c) {
        running += sums[c];
        if (running > threshold) { atomicMin(&s_pick[0], c); break; }
    }
    for (int c = seg_end - 1; c >= seg_begin; --c) {
        if (sums[c] > 0.0) { atomicMax(&s_pick[1], c); break; }
    }
    __syncthreads();
    const int chunk = s_pick[0] < num_chunks ? s_pick[0] : max_i(s_pick[1], 0);
    if (seg_begin <= chunk && chunk < seg_end) {  // the owner knows the mass before the chunk
        double before = seg_before;
        for (int c = seg_begin; c < chunk; ++c) before += sums[c];
        scratch[RS_THREADS + 1] = before;
    }
    __syncthreads();
    const double chunk_before = scratch[RS_THREADS + 1];

    // 2) Rescan that chunk; thread t owns the run [begin + t * RS_RUN, + RS_RUN), in registers.
    const long long begin = chunk * chunk_size;
    const long long end = min_ll(begin + chunk_size, vocab);
    float r[RS_RUN];
    load_run(make_chunk(q_row, p_row, begin, end, draft, dense), dense, vec, r);
    double run_sum = 0.0;
#pragma unroll
    for (int u = 0; u < RS_RUN; ++u) run_sum += static_cast<double>(r[u]);
    double c = chunk_before + block_exclusive_scan(run_sum, scratch);
    int first_hit = 0x7fffffff;
    int last_positive = -1;
#pragma unroll
    for (int u = 0; u < RS_RUN; ++u) {
        c += static_cast<double>(r[u]);
        if (r[u] > 0.0f) {
            last_positive = t * RS_RUN + u;
            if (c > threshold && first_hit == 0x7fffffff) first_hit = t * RS_RUN + u;
        }
    }
    if (first_hit != 0x7fffffff) atomicMin(&s_pick[2], first_hit);
    if (last_positive >= 0) atomicMax(&s_pick[3], last_positive);
    __syncthreads();
    const int local = s_pick[2] != 0x7fffffff ? s_pick[2] : max_i(s_pick[3], 0);
    return begin + local;
}

extern "C" __global__ void __launch_bounds__(RS_THREADS, RS_MIN_BLOCKS) rejection_sample_kernel(const RsParams params) {
    const float* __restrict__ draft_probs = params.draft_probs;
    const float* __restrict__ target_probs = params.target_probs;
    const float* __restrict__ uniforms = params.uniforms;
    const unsigned char* __restrict__ do_sample = params.do_sample;
    int* __restrict__ out_ids = params.out_ids;
    int* __restrict__ out_emitted = params.out_emitted;
    double* chunk_sums = params.chunk_sums;
    int* row_counters = params.row_counters;
    const int batch = static_cast<int>(params.batch);
    const long long vocab = params.vocab;
    const long long chunk_size = params.chunk_size;
    const int num_chunks = static_cast<int>(params.num_chunks);
    const int chunks_per_block = static_cast<int>(params.chunks_per_block);
    const int vec = static_cast<int>(params.vec);
    __shared__ double scratch[RS_THREADS + 2];
    __shared__ int s_first_reject;
    __shared__ int s_pick[4];
    __shared__ int s_is_last;
    const RowIds draft_ids{params.draft_ids, static_cast<int>(params.draft_ids_64)};
    const RowIds target_ids{params.target_ids, static_cast<int>(params.target_ids_64)};
    const int K = static_cast<int>(params.num_draft);
    const int dense = draft_probs != nullptr;

    for (int b = blockIdx.y; b < batch; b += gridDim.y) {
        const bool stochastic = do_sample[b] != 0;
        __syncthreads();  // the previous row's readers of shared state are done
        // First rejection n (K when every draft is accepted): drafts tested in parallel.
        if (threadIdx.x == 0) {
            s_first_reject = K;
            s_pick[0] = num_chunks;
            s_pick[1] = -1;
            s_pick[2] = 0x7fffffff;
            s_pick[3] = -1;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < K; i += RS_THREADS) {
            const long long d = draft_ids[static_cast<long long>(b) * K + i];
            bool accepted;
            if (stochastic) {
                const long long dc = clamp_id(d, vocab);
                const float q = target_probs[(static_cast<long long>(b) * (K + 1) + i) * vocab + dc];
                const float p = dense ? draft_probs[(static_cast<long long>(b) * K + i) * vocab + dc] : 1.0f;
                accepted = uniforms[static_cast<long long>(b) * (K + 1) + i] * p < q;
            } else {
                accepted = target_ids[static_cast<long long>(b) * (K + 1) + i] == d;
            }
            if (!accepted) atomicMin(&s_first_reject, i);
        }
        __syncthreads();
        const int n = s_first_reject;
        const bool needs_residual = stochastic && n < K;
        int* out_row = out_ids + static_cast<long long>(b) * (K + 1);

        if (blockIdx.x == 0) {  // accepted prefix, padding, and the bonus / greedy recovery
            for (int i = threadIdx.x; i <= K; i += RS_THREADS) {
                if (i < n) out_row[i] = static_cast<int>(draft_ids[static_cast<long long>(b) * K + i]);
                else if (i > n) out_row[i] = -1;
                else if (!needs_residual) out_row[i] = static_cast<int>(target_ids[static_cast<long long>(b) * (K + 1) + n]);
            }
            if (threadIdx.x == 0) out_emitted[b] = n + 1;
        }
        if (!needs_residual) continue;  // uniform across the block: no divergent barrier

        const long long draft = clamp_id(draft_ids[static_cast<long long>(b) * K + n], vocab);
        const float* q_row = target_probs + (static_cast<long long>(b) * (K + 1) + n) * vocab;
        const float* p_row = dense ? draft_probs + (static_cast<long long>(b) * K + n) * vocab : nullptr;
        double* row_sums = chunk_sums + static_cast<long long>(b) * num_chunks;
        // This block's consecutive chunks: one prologue and one arrival per block.
        const int first_chunk = static_cast<int>(blockIdx.x) * chunks_per_block;
        const int last_chunk = min_i(first_chunk + chunks_per_block, num_chunks);
        sum_chunks(q_row, p_row, draft, dense, vec, first_chunk, last_chunk, chunk_size, vocab, row_sums, scratch);
        if (threadIdx.x == 0) {
            __threadfence();  // publish the sums before counting this block in
            s_is_last = atomicAdd(&row_counters[b], 1) == static_cast<int>(gridDim.x) - 1;
        }
        __syncthreads();
        if (!s_is_last) continue;
        __threadfence();  // see every other block's sum
        const long long token = sample_residual(
            q_row, p_row, draft, dense, row_sums, num_chunks, chunk_size, vocab, vec,
            uniforms[static_cast<long long>(b) * (K + 1) + n + 1],
            target_ids[static_cast<long long>(b) * (K + 1) + n], scratch, s_pick);
        if (threadIdx.x == 0) {
            out_row[n] = static_cast<int>(token);
            row_counters[b] = 0;  // ready for the next call
        }
        __syncthreads();
    }
}

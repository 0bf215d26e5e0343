// Rejection sampling for speculative decoding (DESIGN.md §2): one fused kernel, in two
// instantiations (dense draft distributions, point-mass drafts).
//
// Self-contained: compiles with nvcc, NVRTC, hipcc and hiprtc. No warp intrinsics and no
// warp-size assumption (AMD wavefronts are 64 wide): every reduction and scan goes through
// shared memory, so the same source is correct on CUDA and ROCm.
//
// Grid: x = a run of consecutive vocabulary chunks, y = batch row (grid-stride over rows
// past 65535). Every block of a row re-derives the row's first rejection n from K scalar
// loads, so no block waits on another for it. Then:
//   * rows that need no residual (all accepted, or a greedy rejection) are finished by
//     block x == 0 alone; the other blocks never touch the vocabulary;
//   * rows whose first rejection is stochastic: each block sums each of its chunks of
//     r = relu(q - p) (point mass: q with the draft id zeroed; p is never read) in float64
//     and publishes the sums; the last block of the row to arrive (threadfence + per-row
//     counter) prefix-scans the chunk sums, finds the chunk that holds t = u[n+1] * S and
//     rescans only that chunk. So the row is read once, plus one chunk. The last block
//     puts the counter back to 0, so the workspace stays valid across calls and CUDA-graph
//     replays without a memset.
//
// Sampling rule, as in sampling/categorical.py: the smallest j with r[j] > 0 and
// c[j] > t (c accumulated in float64); else the last j with r[j] > 0; if S is not > 0,
// the target sampler's token. Draft ids are clamped before they address memory, so even
// unchecked bad ids cannot read out of bounds.

#if defined(__HIPCC__) && !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif

#define RS_THREADS 256
#ifndef RS_MIN_BLOCKS_DENSE
#define RS_MIN_BLOCKS_DENSE 3  // resident blocks per SM the register budget must allow (80 registers)
#endif
#ifndef RS_MIN_BLOCKS_POINT
#define RS_MIN_BLOCKS_POINT 3
#endif
#ifndef RS_DENSE_CHUNK
#define RS_DENSE_CHUNK 4096  // entries per chunk at most, dense (q and p in registers)
#endif
#ifndef RS_POINT_CHUNK
#define RS_POINT_CHUNK 8192  // entries per chunk at most, point mass (only q in registers)
#endif
#define RS_NONE 0x7fffffff

// Per-instantiation sizes: a thread holds its whole share of a chunk in registers, so all
// of its loads are in flight at once.
template <bool kDense>
struct Mode {
    static constexpr int kMaxChunk = kDense ? RS_DENSE_CHUNK : RS_POINT_CHUNK;
    static constexpr int kVecPerThread = kMaxChunk / (4 * RS_THREADS);  // float4 loads per array
};

#define RS_RUN 16  // entries per thread per rescan pass (a pass covers RS_RUN * RS_THREADS)

// All launch arguments in one by-value struct: one argument to marshal from Python.
// Every field is 8 bytes, so the layout is the same on every compiler (no padding).
struct RsParams {
    const void* draft_ids;           // [B, K] int32 or int64
    long long draft_ids_64;
    const float* draft_probs;        // [B, K, V] (dense instantiation only)
    const float* target_probs;       // [B, K+1, V]
    const void* target_ids;          // [B, K+1] int32 or int64
    long long target_ids_64;
    const float* uniforms;           // [B, K+1]
    const unsigned char* do_sample;  // [B]
    long long batch;
    long long num_draft;             // K
    long long vocab;                 // V
    long long chunk_size;            // multiple of 1024, <= Mode::kMaxChunk
    long long num_chunks;
    long long chunks_per_block;      // gridDim.x = ceil(num_chunks / chunks_per_block)
    long long vec;                   // rows 16-byte aligned and V % 4 == 0: float4 loads
    int* out_ids;                    // [B, K+1]
    int* out_emitted;                // [B]
    double* chunk_sums;              // [B, num_chunks] workspace
    int* row_counters;               // [B] workspace, all 0 between calls
};

struct Shared {
    double scratch[RS_THREADS + 2];
    int first_reject;
    int pick[4];  // chunk: first hit, last positive; entry: first hit, last positive
    int is_last;
};

struct Ids {
    const void* ptr;
    int is64;
    __device__ long long operator[](long long i) const {
        return is64 ? static_cast<const long long*>(ptr)[i] : static_cast<long long>(static_cast<const int*>(ptr)[i]);
    }
};

__device__ __forceinline__ long long min_ll(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ int min_i(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max_i(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ long long clamp_id(long long id, long long vocab) {
    return id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
}

// relu(q - p) as torch computes it (NaN propagates); point mass: q with the draft id zeroed.
template <bool kDense>
__device__ __forceinline__ float residual(float q, float p, int j, int draft) {
    if (!kDense) return j == draft ? 0.0f : q;
    const float x = q - p;
    return x < 0.0f ? 0.0f : x;
}

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

// A chunk [begin, end) of one row, with 32-bit offsets to keep register use low.
struct Chunk {
    const float* q;  // target row + begin
    const float* p;  // draft row + begin (dense only)
    int size;        // end - begin
    int draft;       // draft id - begin when the draft id falls in this chunk, else -1
};

__device__ __forceinline__ Chunk make_chunk(const float* q_row, const float* p_row, long long begin, long long end,
                                            long long draft) {
    Chunk c;
    c.q = q_row + begin;
    c.p = p_row == nullptr ? nullptr : p_row + begin;
    c.size = static_cast<int>(end - begin);
    c.draft = (draft >= begin && draft < end) ? static_cast<int>(draft - begin) : -1;
    return c;
}

// One thread's share of a chunk: float4 u at offset 4 * (threadIdx.x + u * RS_THREADS).
template <bool kDense>
struct Tile {
    float4 q[Mode<kDense>::kVecPerThread];
    float4 p[kDense ? Mode<kDense>::kVecPerThread : 1];
};

// Issue every load of the thread's share at once (`vec`: size % 4 == 0, aligned rows).
template <bool kDense>
__device__ __forceinline__ void load_tile(const Chunk& c, Tile<kDense>& tile) {
#pragma unroll
    for (int u = 0; u < Mode<kDense>::kVecPerThread; ++u) {
        const int j = 4 * (threadIdx.x + u * RS_THREADS);
        if (j < c.size) {
            tile.q[u] = *reinterpret_cast<const float4*>(c.q + j);
            if (kDense) tile.p[kDense ? u : 0] = *reinterpret_cast<const float4*>(c.p + j);
        }
    }
}

template <bool kDense>
__device__ __forceinline__ double tile_residual_sum(const Chunk& c, const Tile<kDense>& tile) {
    double sum = 0.0;
#pragma unroll
    for (int u = 0; u < Mode<kDense>::kVecPerThread; ++u) {
        const int j = 4 * (threadIdx.x + u * RS_THREADS);
        if (j < c.size) {
            const float4 q = tile.q[u];
            const float4 p = kDense ? tile.p[kDense ? u : 0] : float4{0.f, 0.f, 0.f, 0.f};
            sum += static_cast<double>(residual<kDense>(q.x, p.x, j, c.draft));
            sum += static_cast<double>(residual<kDense>(q.y, p.y, j + 1, c.draft));
            sum += static_cast<double>(residual<kDense>(q.z, p.z, j + 2, c.draft));
            sum += static_cast<double>(residual<kDense>(q.w, p.w, j + 3, c.draft));
        }
    }
    return sum;
}

// Scalar path (V not a multiple of 4, or unaligned rows: no real vocabulary); kept light.
template <bool kDense>
__device__ double chunk_residual_sum_scalar(const Chunk& c) {
    double sum = 0.0;
#pragma unroll 4
    for (int j = threadIdx.x; j < c.size; j += RS_THREADS)
        sum += static_cast<double>(residual<kDense>(c.q[j], kDense ? c.p[j] : 0.0f, j, c.draft));
    return sum;
}

// Chunk sums of this block's run of chunks [first, last) of one row into row_sums.
template <bool kDense>
__device__ void sum_chunks(const float* q_row, const float* p_row, long long draft, int vec, int first, int last,
                           long long chunk_size, long long vocab, double* row_sums, double* scratch) {
    for (int chunk = first; chunk < last; ++chunk) {
        const long long begin = chunk * chunk_size;
        const Chunk c = make_chunk(q_row, p_row, begin, min_ll(begin + chunk_size, vocab), draft);
        double own;
        if (vec) {
            Tile<kDense> tile;
            load_tile<kDense>(c, tile);
            own = tile_residual_sum<kDense>(c, tile);
        } else {
            own = chunk_residual_sum_scalar<kDense>(c);
        }
        const double partial = block_sum(own, scratch);
        if (threadIdx.x == 0) row_sums[chunk] = partial;
    }
}

// The residual over this thread's run [offset + t * RS_RUN, + RS_RUN) of a chunk, into
// registers (0 past the end); loads issued together, float4 when `vec`.
template <bool kDense>
__device__ void load_run(const Chunk& c, int offset, int vec, float* r) {
    constexpr int kRun = RS_RUN;
    const int run_begin = offset + threadIdx.x * kRun;
    if (vec) {
#pragma unroll
        for (int u = 0; u < kRun / 4; ++u) {
            const int j = run_begin + 4 * u;
            if (j < c.size) {
                const float4 q = *reinterpret_cast<const float4*>(c.q + j);
                const float4 p = kDense ? *reinterpret_cast<const float4*>(c.p + j) : float4{0.f, 0.f, 0.f, 0.f};
                r[4 * u] = residual<kDense>(q.x, p.x, j, c.draft);
                r[4 * u + 1] = residual<kDense>(q.y, p.y, j + 1, c.draft);
                r[4 * u + 2] = residual<kDense>(q.z, p.z, j + 2, c.draft);
                r[4 * u + 3] = residual<kDense>(q.w, p.w, j + 3, c.draft);
            } else {
                r[4 * u] = r[4 * u + 1] = r[4 * u + 2] = r[4 * u + 3] = 0.0f;
            }
        }
        return;
    }
#pragma unroll
    for (int u = 0; u < kRun; ++u) {
        const int j = run_begin + u;
        r[u] = j < c.size ? residual<kDense>(c.q[j], kDense ? c.p[j] : 0.0f, j, c.draft) : 0.0f;
    }
}

// Run by the last block of a row: find the chunk holding t, rescan it, return the index.
template <bool kDense>
__device__ long long sample_residual(const float* q_row, const float* p_row, long long draft,
                                     const volatile double* sums, int num_chunks, long long chunk_size,
                                     long long vocab, int vec, float uniform, long long fallback, Shared& sh) {
    const int t = threadIdx.x;
    // 1) Prefix over the chunk sums; each thread owns a contiguous segment of chunks.
    const int per_thread = (num_chunks + RS_THREADS - 1) / RS_THREADS;
    const int seg_begin = min_i(t * per_thread, num_chunks);
    const int seg_end = min_i(seg_begin + per_thread, num_chunks);
    double own = 0.0;
    for (int c = seg_begin; c < seg_end; ++c) own += sums[c];
    const double seg_before = block_exclusive_scan(own, sh.scratch);
    const double total = sh.scratch[RS_THREADS];  // S, the residual mass
    if (!(total > 0.0)) return fallback;  // no residual mass (or NaN): the target token
    const double threshold = static_cast<double>(uniform) * total;
    double running = seg_before;
    for (int c = seg_begin; c < seg_end; ++c) {
        running += sums[c];
        if (running > threshold) { atomicMin(&sh.pick[0], c); break; }
    }
    for (int c = seg_end - 1; c >= seg_begin; --c) {
        if (sums[c] > 0.0) { atomicMax(&sh.pick[1], c); break; }
    }
    __syncthreads();
    const int chunk = sh.pick[0] < num_chunks ? sh.pick[0] : max_i(sh.pick[1], 0);
    if (seg_begin <= chunk && chunk < seg_end) {  // the owner knows the mass before the chunk
        double before = seg_before;
        for (int c = seg_begin; c < chunk; ++c) before += sums[c];
        sh.scratch[RS_THREADS + 1] = before;
    }
    __syncthreads();
    const double chunk_before = sh.scratch[RS_THREADS + 1];

    // 2) Rescan that chunk in passes of RS_RUN * RS_THREADS entries; in a pass thread t
    //    owns a run of RS_RUN entries, held in registers. Stop at the first pass that hits.
    const long long begin = chunk * chunk_size;
    const Chunk c = make_chunk(q_row, p_row, begin, min_ll(begin + chunk_size, vocab), draft);
    double pass_before = chunk_before;
    for (int offset = 0; offset < c.size; offset += RS_RUN * RS_THREADS) {
        float r[RS_RUN];
        load_run<kDense>(c, offset, vec, r);
        double run_sum = 0.0;
#pragma unroll
        for (int u = 0; u < RS_RUN; ++u) run_sum += static_cast<double>(r[u]);
        double cumulative = pass_before + block_exclusive_scan(run_sum, sh.scratch);
        pass_before += sh.scratch[RS_THREADS];
        int first_hit = RS_NONE;
        int last_positive = -1;
        const int run_begin = offset + t * RS_RUN;
#pragma unroll
        for (int u = 0; u < RS_RUN; ++u) {
            cumulative += static_cast<double>(r[u]);
            if (r[u] > 0.0f) {
                last_positive = run_begin + u;
                if (cumulative > threshold && first_hit == RS_NONE) first_hit = run_begin + u;
            }
        }
        if (first_hit != RS_NONE) atomicMin(&sh.pick[2], first_hit);
        if (last_positive >= 0) atomicMax(&sh.pick[3], last_positive);
        __syncthreads();
        if (sh.pick[2] != RS_NONE) break;  // uniform: read after the barrier
    }
    return begin + (sh.pick[2] != RS_NONE ? sh.pick[2] : max_i(sh.pick[3], 0));
}

template <bool kDense>
__device__ void rejection_sample_body(const RsParams& params, Shared& sh) {
    const float* __restrict__ draft_probs = params.draft_probs;
    const float* __restrict__ target_probs = params.target_probs;
    const float* __restrict__ uniforms = params.uniforms;
    const Ids draft_ids{params.draft_ids, static_cast<int>(params.draft_ids_64)};
    const Ids target_ids{params.target_ids, static_cast<int>(params.target_ids_64)};
    const int batch = static_cast<int>(params.batch);
    const int K = static_cast<int>(params.num_draft);
    const long long vocab = params.vocab;
    const int num_chunks = static_cast<int>(params.num_chunks);
    const int vec = static_cast<int>(params.vec);

    for (int b = blockIdx.y; b < batch; b += gridDim.y) {
        const long long row = static_cast<long long>(b);
        const bool stochastic = params.do_sample[b] != 0;
        __syncthreads();  // the previous row's readers of shared state are done
        if (threadIdx.x == 0) {
            sh.first_reject = K;
            sh.pick[0] = num_chunks;
            sh.pick[1] = -1;
            sh.pick[2] = RS_NONE;
            sh.pick[3] = -1;
        }
        __syncthreads();
        // First rejection n (K when every draft is accepted): the drafts are tested in parallel.
        for (int i = threadIdx.x; i < K; i += RS_THREADS) {
            const long long d = draft_ids[row * K + i];
            bool accepted;
            if (stochastic) {
                const long long dc = clamp_id(d, vocab);
                const float q = target_probs[(row * (K + 1) + i) * vocab + dc];
                const float p = kDense ? draft_probs[(row * K + i) * vocab + dc] : 1.0f;
                accepted = uniforms[row * (K + 1) + i] * p < q;  // equal ids do not bypass it
            } else {
                accepted = target_ids[row * (K + 1) + i] == d;
            }
            if (!accepted) atomicMin(&sh.first_reject, i);
        }
        __syncthreads();
        const int n = sh.first_reject;
        const bool needs_residual = stochastic && n < K;
        int* out_row = params.out_ids + row * (K + 1);

        if (blockIdx.x == 0) {  // accepted prefix, padding, and the bonus / greedy recovery
            for (int i = threadIdx.x; i <= K; i += RS_THREADS) {
                if (i < n) out_row[i] = static_cast<int>(draft_ids[row * K + i]);
                else if (i > n) out_row[i] = -1;
                else if (!needs_residual) out_row[i] = static_cast<int>(target_ids[row * (K + 1) + n]);
            }
            if (threadIdx.x == 0) params.out_emitted[b] = n + 1;
        }
        if (!needs_residual) continue;  // uniform across the block: no divergent barrier

        const long long draft = clamp_id(draft_ids[row * K + n], vocab);
        const float* q_row = target_probs + (row * (K + 1) + n) * vocab;
        const float* p_row = kDense ? draft_probs + (row * K + n) * vocab : nullptr;
        double* row_sums = params.chunk_sums + row * num_chunks;
        const int chunks_per_block = static_cast<int>(params.chunks_per_block);
        const int first_chunk = static_cast<int>(blockIdx.x) * chunks_per_block;
        sum_chunks<kDense>(q_row, p_row, draft, vec, first_chunk, min_i(first_chunk + chunks_per_block, num_chunks),
                           params.chunk_size, vocab, row_sums, sh.scratch);
        if (threadIdx.x == 0) {
            __threadfence();  // publish the sums before counting this block in
            sh.is_last = atomicAdd(&params.row_counters[b], 1) == static_cast<int>(gridDim.x) - 1;
        }
        __syncthreads();
        if (!sh.is_last) continue;
        __threadfence();  // see every other block's sums
        const long long token = sample_residual<kDense>(
            q_row, p_row, draft, row_sums, num_chunks, params.chunk_size, vocab, vec,
            uniforms[row * (K + 1) + n + 1], target_ids[row * (K + 1) + n], sh);
        if (threadIdx.x == 0) {
            out_row[n] = static_cast<int>(token);
            params.row_counters[b] = 0;  // ready for the next call
        }
    }
}

extern "C" __global__ void __launch_bounds__(RS_THREADS, RS_MIN_BLOCKS_DENSE)
rejection_sample_dense(const RsParams params) {
    __shared__ Shared sh;
    rejection_sample_body<true>(params, sh);
}

extern "C" __global__ void __launch_bounds__(RS_THREADS, RS_MIN_BLOCKS_POINT)
rejection_sample_point_mass(const RsParams params) {
    __shared__ Shared sh;
    rejection_sample_body<false>(params, sh);
}

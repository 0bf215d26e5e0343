// Rejection sampling for speculative decoding (DESIGN.md §2), one fused kernel.
//
// Self-contained: compiles with nvcc, NVRTC, hipcc and hiprtc. No warp intrinsics and no
// warp-size assumption (AMD wavefronts are 64 wide): every reduction and scan goes through
// shared memory, so the same source is correct on CUDA and ROCm.
//
// Grid: x = chunk of the vocabulary, y = batch row (grid-stride over rows past 65535).
// Every block of a row re-derives the row's first rejection n from K scalar loads (L2
// hits), so no block waits on another for it. Then:
//   * rows that need no residual (all accepted, or a greedy rejection) are finished by
//     block x == 0 alone; the other blocks never touch the vocabulary;
//   * rows whose first rejection is stochastic: each block sums its chunk of
//     r = relu(q - p) (point mass: q with the draft id zeroed) in float64 and publishes it;
//     the last block to arrive (threadfence + per-row counter) prefix-scans the chunk sums,
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
__device__ __forceinline__ float residual(float q, float p, long long j, long long draft, int dense) {
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

__device__ __forceinline__ float residual_at(const float* q_row, const float* p_row, long long j, long long draft,
                                             int dense) {
    return residual(q_row[j], dense ? p_row[j] : 0.0f, j, draft, dense);
}

// Sum of the residual over [begin, end) of one row; float4 loads when `vec` (16-byte
// aligned rows, begin a multiple of 4); point-mass rows never read p.
__device__ double chunk_residual_sum(const float* q_row, const float* p_row, long long begin, long long end,
                                     long long draft, int dense, int vec) {
    double sum = 0.0;
    long long j = begin + threadIdx.x;
    if (vec) {
        const long long vec_end = begin + ((end - begin) & ~3LL);
        for (j = begin + 4LL * threadIdx.x; j < vec_end; j += 4LL * RS_THREADS) {
            const float4 q = *reinterpret_cast<const float4*>(q_row + j);
            if (dense) {
                const float4 p = *reinterpret_cast<const float4*>(p_row + j);
                sum += static_cast<double>(residual(q.x, p.x, j, draft, 1));
                sum += static_cast<double>(residual(q.y, p.y, j + 1, draft, 1));
                sum += static_cast<double>(residual(q.z, p.z, j + 2, draft, 1));
                sum += static_cast<double>(residual(q.w, p.w, j + 3, draft, 1));
            } else {
                sum += static_cast<double>(residual(q.x, 0.0f, j, draft, 0));
                sum += static_cast<double>(residual(q.y, 0.0f, j + 1, draft, 0));
                sum += static_cast<double>(residual(q.z, 0.0f, j + 2, draft, 0));
                sum += static_cast<double>(residual(q.w, 0.0f, j + 3, draft, 0));
            }
        }
        j = vec_end + threadIdx.x;  // scalar tail when end - begin is not a multiple of 4
    }
    for (; j < end; j += RS_THREADS) sum += static_cast<double>(residual_at(q_row, p_row, j, draft, dense));
    return sum;
}

// Run by the last block of a row: find the chunk holding t, rescan it, return the index.
// s_pick[0..3] must hold {num_chunks, -1, INT_MAX, -1} on entry.
__device__ long long sample_residual(const float* q_row, const float* p_row, long long draft, int dense,
                                     const volatile double* sums, int num_chunks, long long chunk_size,
                                     long long vocab, float uniform, long long fallback, double* scratch,
                                     int* s_pick) {
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

    // 2) Rescan that chunk; each thread owns a contiguous run of elements.
    const long long begin = chunk * chunk_size;
    const long long end = min_ll(begin + chunk_size, vocab);
    const long long run = (end - begin + RS_THREADS - 1) / RS_THREADS;
    const long long run_begin = min_ll(begin + t * run, end);
    const long long run_end = min_ll(run_begin + run, end);
    double run_sum = 0.0;
    for (long long j = run_begin; j < run_end; ++j) run_sum += static_cast<double>(residual_at(q_row, p_row, j, draft, dense));
    double c = chunk_before + block_exclusive_scan(run_sum, scratch);
    long long last_positive = -1;
    for (long long j = run_begin; j < run_end; ++j) {
        const float r = residual_at(q_row, p_row, j, draft, dense);
        c += static_cast<double>(r);
        if (r > 0.0f) {
            last_positive = j;
            if (c > threshold) { atomicMin(&s_pick[2], static_cast<int>(j - begin)); break; }
        }
    }
    if (last_positive >= 0) atomicMax(&s_pick[3], static_cast<int>(last_positive - begin));
    __syncthreads();
    const int local = s_pick[2] != 0x7fffffff ? s_pick[2] : max_i(s_pick[3], 0);
    return begin + local;
}

extern "C" __global__ void __launch_bounds__(RS_THREADS) rejection_sample_kernel(
    const void* draft_ids_ptr, int draft_ids_64,
    const float* __restrict__ draft_probs,  // [B, K, V] or nullptr (point mass)
    const float* __restrict__ target_probs,  // [B, K+1, V]
    const void* target_ids_ptr, int target_ids_64,
    const float* __restrict__ uniforms,  // [B, K+1]
    const unsigned char* __restrict__ do_sample,  // [B]
    int batch, int num_draft, long long vocab, long long chunk_size, int num_chunks, int vec,
    int* __restrict__ out_ids,  // [B, K+1]
    int* __restrict__ out_emitted,  // [B]
    double* chunk_sums,  // [B, num_chunks] workspace
    int* row_counters)  // [B] workspace, all 0 between calls
{
    __shared__ double scratch[RS_THREADS + 2];
    __shared__ int s_first_reject;
    __shared__ int s_pick[4];
    __shared__ int s_is_last;
    const RowIds draft_ids{draft_ids_ptr, draft_ids_64};
    const RowIds target_ids{target_ids_ptr, target_ids_64};
    const int K = num_draft;
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
        const long long begin = blockIdx.x * chunk_size;
        const long long end = min_ll(begin + chunk_size, vocab);
        const double partial = block_sum(chunk_residual_sum(q_row, p_row, begin, end, draft, dense, vec), scratch);
        double* row_sums = chunk_sums + static_cast<long long>(b) * num_chunks;
        if (threadIdx.x == 0) {
            row_sums[blockIdx.x] = partial;
            __threadfence();  // publish the sum before counting this block in
            s_is_last = atomicAdd(&row_counters[b], 1) == num_chunks - 1;
        }
        __syncthreads();
        if (!s_is_last) continue;
        __threadfence();  // see every other block's sum
        const long long token = sample_residual(
            q_row, p_row, draft, dense, row_sums, num_chunks, chunk_size, vocab,
            uniforms[static_cast<long long>(b) * (K + 1) + n + 1],
            target_ids[static_cast<long long>(b) * (K + 1) + n], scratch, s_pick);
        if (threadIdx.x == 0) {
            out_row[n] = static_cast<int>(token);
            row_counters[b] = 0;  // ready for the next call
        }
        __syncthreads();
    }
}

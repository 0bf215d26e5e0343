// Tree (multi-draft) verification for speculative decoding (docs/design.md §2, "Tree
// verification"): one kernel, in two instantiations (dense draft laws, point-mass drafts).
// sampling/tree.py states the law; this is its GPU form, launched by sampling/cupy_tree.py.
//
// Self-contained like rejection_kernel.cu: compiles with nvcc, NVRTC, hipcc and hiprtc. No
// warp intrinsics and no warp-size assumption (AMD wavefronts are 64 wide): reductions and
// scans go through shared memory.
//
// One block per tree row (grid-stride past 65535 rows). All threads walk the row's nodes in
// increasing index together: they read the same values and hold the same context, mass Z and
// flags in registers, so every decision is uniform across the block without a broadcast. A
// rejection rewrites the row's residual W in the workspace in one pass over the vocabulary
// (from q when the context is fresh) and stores the float64 sums of its 1024-entry chunks,
// the chunks of sampling/categorical.py; their total is the next Z. When every child of the
// context is rejected, the recovery token is drawn by the two-level inverse-CDF rule from
// those chunk sums and one rescan of the chunk holding the threshold.
//
// The law's float32 products and differences are rounded one by one (no FMA contraction),
// so W, Z and every acceptance test equal the torch reference bit for bit; only the float64
// sums are added in another order (docs/design.md §2). Ids are clamped before they address
// memory and parents are only compared, so unchecked bad inputs never read out of bounds.

#if defined(__HIPCC__) && !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif

#define TS_THREADS 512
#define TS_CHUNK 1024                               // sampling/categorical.py CHUNK
#define TS_GROUP (TS_CHUNK / 4)                     // threads covering one chunk with a float4 each
#define TS_GROUPS (TS_THREADS / TS_GROUP)           // chunks one float4 step of the block covers
#define TS_LOADS 4                                  // float4 steps per pass iteration: loads in flight
#define TS_SPAN (TS_CHUNK * TS_GROUPS * TS_LOADS)   // vocabulary entries per pass iteration
#define TS_PER_THREAD (TS_CHUNK / TS_THREADS)       // entries per thread when one chunk is rescanned
#define TS_NONE 0x7fffffff

// All launch arguments in one by-value struct: one argument to marshal from Python.
// Every field is 8 bytes, so the layout is the same on every compiler (no padding).
struct TsParams {
    const void* draft_ids;                // [B, N] int32 or int64
    long long draft_ids_64;
    const void* parents;                  // [B, N] int32 or int64, -1 = the root
    long long parents_64;
    const void* num_nodes;                // [B] int32 or int64, or null (= N)
    long long num_nodes_64;
    const float* draft_probs;             // [B, N, V] (dense instantiation only)
    const float* target_probs;            // [B, N+1, V]
    const void* target_ids;               // [B, N+1] int32 or int64
    long long target_ids_64;
    const float* accept_uniforms;         // [B, N]
    const float* recover_uniforms;        // [B, N+1]
    const unsigned char* do_sample;       // [B]
    long long batch;
    long long num_nodes_max;              // N
    long long vocab;                      // V
    long long num_chunks;                 // ceil(V / TS_CHUNK)
    long long vec;                        // V % 4 == 0 and 16-byte aligned rows: float4 accesses
    int* out_ids;                         // [B, N+1]
    int* out_emitted;                     // [B]
    int* out_nodes;                       // [B, N]
    float* residual;                      // [B, V] workspace: W
    double* chunk_sums;                   // [B, num_chunks] workspace: float64 sums of W's chunks
};

struct Shared {
    double scratch[TS_LOADS][TS_THREADS];
    double before;  // residual mass before the chunk that holds the threshold
    int pick[4];    // chunk: first hit, last positive; entry: first hit, last positive
};

struct Ids {
    const void* ptr;
    long long is64;
    __device__ long long operator[](long long i) const {
        return is64 ? static_cast<const long long*>(ptr)[i] : static_cast<long long>(static_cast<const int*>(ptr)[i]);
    }
};

__device__ __forceinline__ long long clamp_ll(long long v, long long lo, long long hi) {
    return v < lo ? lo : (v > hi ? hi : v);
}
__device__ __forceinline__ int min_i(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max_i(int a, int b) { return a > b ? a : b; }

// Float32 products and differences rounded on their own: nvcc and NVRTC contract a - b * c
// into an FMA by default, the _rn intrinsics never are. Clang (hipcc, hiprtc) honours the
// pragma instead; HIP's own __fmul_rn is a plain a * b that it could still contract.
#if defined(__HIP__)
__device__ __forceinline__ float mul_rn(float a, float b) {
#pragma clang fp contract(off)
    return a * b;
}
__device__ __forceinline__ float sub_rn(float a, float b) {
#pragma clang fp contract(off)
    return a - b;
}
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
#endif

// max(0, W - f32(Z * p)) as the reference computes it (torch.clamp_min: NaN propagates).
__device__ __forceinline__ float reduce(float w, float z, float p) {
    const float x = sub_rn(w, mul_rn(z, p));
    return x < 0.0f ? 0.0f : x;
}

// Entries j..j+3 of a row, 0 past its end; one float4 access when `vec` (then V % 4 == 0).
__device__ __forceinline__ float4 load4(const float* row, long long j, long long vocab, long long vec) {
    if (vec && j < vocab) return *reinterpret_cast<const float4*>(row + j);
    float4 v;
    v.x = j < vocab ? row[j] : 0.0f;
    v.y = j + 1 < vocab ? row[j + 1] : 0.0f;
    v.z = j + 2 < vocab ? row[j + 2] : 0.0f;
    v.w = j + 3 < vocab ? row[j + 3] : 0.0f;
    return v;
}

__device__ __forceinline__ void store4(float* row, long long j, long long vocab, long long vec, float4 v) {
    if (vec && j < vocab) {
        *reinterpret_cast<float4*>(row + j) = v;
        return;
    }
    if (j < vocab) row[j] = v.x;
    if (j + 1 < vocab) row[j + 1] = v.y;
    if (j + 2 < vocab) row[j + 2] = v.z;
    if (j + 3 < vocab) row[j + 3] = v.w;
}

// Exclusive scan of one double per thread (Hillis-Steele in shared memory); `total` gets the
// block's sum in every thread. Every thread must call it.
__device__ double block_exclusive_scan(double value, double* s, double& total) {
    const int t = threadIdx.x;
    s[t] = value;
    __syncthreads();
    for (int offset = 1; offset < TS_THREADS; offset <<= 1) {
        const double add = t >= offset ? s[t - offset] : 0.0;
        __syncthreads();
        s[t] += add;
        __syncthreads();
    }
    const double exclusive = t > 0 ? s[t - 1] : 0.0;
    total = s[TS_THREADS - 1];
    __syncthreads();  // s is reused by the caller
    return exclusive;
}

// One rejection: w_row = max(0, src - f32(Z) * p) over the row (src: q of a fresh context,
// else w_row itself; point mass: only entry `token` changes), the float64 sums of its
// chunks into `sums`. Returns the new Z (their total) in every thread.
template <bool kDense>
__device__ double reject(const float* src, const float* p_row, float* w_row, double* sums, long long token, float z,
                         long long vocab, long long vec, Shared& sh) {
    const int t = threadIdx.x;
    const int lane = t % TS_GROUP;
    double total = 0.0;  // accumulated by thread 0, in chunk order
    __syncthreads();  // every thread has read W[token] for the test before W is rewritten
    for (long long base = 0; base < vocab; base += TS_SPAN) {
        float4 w[TS_LOADS];
        float4 p[kDense ? TS_LOADS : 1];
#pragma unroll
        for (int u = 0; u < TS_LOADS; ++u) {  // issue every load of the step at once
            const long long j = base + 4 * (t + u * TS_THREADS);
            w[u] = load4(src, j, vocab, vec);
            if (kDense) p[kDense ? u : 0] = load4(p_row, j, vocab, vec);
        }
#pragma unroll
        for (int u = 0; u < TS_LOADS; ++u) {
            const long long j = base + 4 * (t + u * TS_THREADS);
            float4 r = w[u];
            if (kDense) {
                const float4 pu = p[kDense ? u : 0];
                r.x = reduce(r.x, z, pu.x);
                r.y = reduce(r.y, z, pu.y);
                r.z = reduce(r.z, z, pu.z);
                r.w = reduce(r.w, z, pu.w);
            } else if (token >= j && token < j + 4) {  // p is one-hot: Z * 0 leaves the rest as is
                const long long d = token - j;
                if (d == 0) r.x = reduce(r.x, z, 1.0f);
                if (d == 1) r.y = reduce(r.y, z, 1.0f);
                if (d == 2) r.z = reduce(r.z, z, 1.0f);
                if (d == 3) r.w = reduce(r.w, z, 1.0f);
            }
            store4(w_row, j, vocab, vec, r);
            sh.scratch[u][t] = static_cast<double>(r.x) + static_cast<double>(r.y) + static_cast<double>(r.z) +
                               static_cast<double>(r.w);
        }
        __syncthreads();
        // Thread t's float4 of step u lies in chunk u * TS_GROUPS + t / TS_GROUP of this span:
        // reduce each group of TS_GROUP partial sums to its chunk's sum.
        for (int stride = TS_GROUP / 2; stride > 0; stride >>= 1) {
            if (lane < stride) {
#pragma unroll
                for (int u = 0; u < TS_LOADS; ++u) sh.scratch[u][t] += sh.scratch[u][t + stride];
            }
            __syncthreads();
        }
        if (t == 0) {
            for (int u = 0; u < TS_LOADS; ++u) {
                for (int g = 0; g < TS_GROUPS; ++g) {
                    const long long chunk = base / TS_CHUNK + u * TS_GROUPS + g;
                    if (chunk * TS_CHUNK < vocab) {
                        const double sum = sh.scratch[u][g * TS_GROUP];
                        sums[chunk] = sum;
                        total += sum;
                    }
                }
            }
        }
        __syncthreads();  // scratch is reused by the next step
    }
    if (t == 0) sh.scratch[0][0] = total;
    __syncthreads();
    const double mass = sh.scratch[0][0];
    __syncthreads();
    return mass;
}

// The recovery token: the rule of sampling/categorical.py over W, from its chunk sums and one
// rescan of the chunk that holds t = u * S; `fallback` when S is not > 0.
__device__ long long sample_residual(const float* w_row, const double* sums, int num_chunks, long long vocab,
                                     float uniform, long long fallback, Shared& sh) {
    const int t = threadIdx.x;
    if (t == 0) {
        sh.pick[0] = num_chunks;
        sh.pick[1] = -1;
        sh.pick[2] = TS_NONE;
        sh.pick[3] = -1;
    }
    // 1) Prefix over the chunk sums; each thread owns a contiguous segment of chunks.
    const int per_thread = (num_chunks + TS_THREADS - 1) / TS_THREADS;
    const int seg_begin = min_i(t * per_thread, num_chunks);
    const int seg_end = min_i(seg_begin + per_thread, num_chunks);
    double own = 0.0;
    for (int c = seg_begin; c < seg_end; ++c) own += sums[c];
    double total;
    const double seg_before = block_exclusive_scan(own, sh.scratch[0], total);
    if (!(total > 0.0)) return fallback;  // no residual mass (or NaN): the target token
    const double threshold = static_cast<double>(uniform) * total;
    double running = seg_before;
    for (int c = seg_begin; c < seg_end; ++c) {
        running += sums[c];
        if (running > threshold) {
            atomicMin(&sh.pick[0], c);
            break;
        }
    }
    for (int c = seg_end - 1; c >= seg_begin; --c) {
        if (sums[c] > 0.0) {
            atomicMax(&sh.pick[1], c);
            break;
        }
    }
    __syncthreads();
    const int chunk = sh.pick[0] < num_chunks ? sh.pick[0] : max_i(sh.pick[1], 0);
    if (seg_begin <= chunk && chunk < seg_end) {  // the owner knows the mass before the chunk
        double before = seg_before;
        for (int c = seg_begin; c < chunk; ++c) before += sums[c];
        sh.before = before;
    }
    __syncthreads();

    // 2) Rescan that chunk: thread t owns TS_PER_THREAD consecutive entries.
    const long long begin = static_cast<long long>(chunk) * TS_CHUNK;
    const int first = t * TS_PER_THREAD;
    float r[TS_PER_THREAD];
    double run_sum = 0.0;
#pragma unroll
    for (int e = 0; e < TS_PER_THREAD; ++e) {
        r[e] = begin + first + e < vocab ? w_row[begin + first + e] : 0.0f;
        run_sum += static_cast<double>(r[e]);
    }
    double chunk_total;
    double cumulative = sh.before + block_exclusive_scan(run_sum, sh.scratch[0], chunk_total);
    int first_hit = TS_NONE;
    int last_positive = -1;
#pragma unroll
    for (int e = 0; e < TS_PER_THREAD; ++e) {
        cumulative += static_cast<double>(r[e]);
        if (r[e] > 0.0f) {
            last_positive = first + e;
            if (cumulative > threshold && first_hit == TS_NONE) first_hit = first + e;
        }
    }
    if (first_hit != TS_NONE) atomicMin(&sh.pick[2], first_hit);
    if (last_positive >= 0) atomicMax(&sh.pick[3], last_positive);
    __syncthreads();
    return begin + (sh.pick[2] != TS_NONE ? sh.pick[2] : max_i(sh.pick[3], 0));
}

template <bool kDense>
__device__ void tree_body(const TsParams& params, Shared& sh) {
    const Ids draft_ids{params.draft_ids, params.draft_ids_64};
    const Ids parents{params.parents, params.parents_64};
    const Ids counts{params.num_nodes, params.num_nodes_64};
    const Ids target_ids{params.target_ids, params.target_ids_64};
    const int batch = static_cast<int>(params.batch);
    const int N = static_cast<int>(params.num_nodes_max);
    const long long vocab = params.vocab;
    const int num_chunks = static_cast<int>(params.num_chunks);

    for (int b = blockIdx.x; b < batch; b += gridDim.x) {
        const long long row = static_cast<long long>(b);
        __syncthreads();  // the previous row's readers of shared state are done
        const bool stochastic = params.do_sample[b] != 0;
        const int count = params.num_nodes == nullptr ? N : static_cast<int>(clamp_ll(counts[row], 0, N));
        const float* q = params.target_probs + row * (N + 1) * vocab;
        float* w_row = params.residual + row * vocab;
        double* sums = params.chunk_sums + row * num_chunks;
        int* out_ids = params.out_ids + row * (N + 1);
        int* out_nodes = params.out_nodes + row * N;

        int context = -1;   // the current node, -1 = the root
        bool fresh = true;  // W is still q after the context (Z = 1): read from target_probs
        bool rejected = false;  // some child of the context was rejected: W is a residual
        float z = 1.0f;     // f32(Z)
        int accepted = 0;
        for (int n = 0; n < count; ++n) {
            if (parents[row * N + n] != context) continue;  // children of the context only
            const long long id = draft_ids[row * N + n];
            bool accept;
            if (stochastic) {
                const long long x = clamp_ll(id, 0, vocab - 1);
                const float* src = fresh ? q + (context + 1) * vocab : w_row;
                const float* p_row = kDense ? params.draft_probs + (row * N + n) * vocab : nullptr;
                const float p_x = kDense ? p_row[x] : 1.0f;
                accept = mul_rn(mul_rn(params.accept_uniforms[row * N + n], p_x), z) < src[x];
                if (!accept) {
                    z = static_cast<float>(reject<kDense>(src, p_row, w_row, sums, x, z, vocab, params.vec, sh));
                    fresh = false;
                    rejected = true;
                }
            } else {
                accept = id == target_ids[row * (N + 1) + context + 1];
            }
            if (accept) {
                if (threadIdx.x == 0) {
                    out_ids[accepted] = static_cast<int>(id);
                    out_nodes[accepted] = n;
                }
                ++accepted;
                context = n;
                fresh = true;
                rejected = false;
                z = 1.0f;
            }
        }
        const long long position = row * (N + 1) + context + 1;
        long long token = target_ids[position];  // the bonus, or the greedy / no-mass recovery
        if (stochastic && rejected)  // uniform across the block: no divergent barrier
            token = sample_residual(w_row, sums, num_chunks, vocab, params.recover_uniforms[position], token, sh);
        for (int i = accepted + 1 + threadIdx.x; i <= N; i += TS_THREADS) out_ids[i] = -1;
        for (int i = accepted + threadIdx.x; i < N; i += TS_THREADS) out_nodes[i] = -1;
        if (threadIdx.x == 0) {
            out_ids[accepted] = static_cast<int>(token);
            params.out_emitted[b] = accepted + 1;
        }
    }
}

extern "C" __global__ void __launch_bounds__(TS_THREADS) tree_rejection_sample_dense(const TsParams params) {
    __shared__ Shared sh;
    tree_body<true>(params, sh);
}

extern "C" __global__ void __launch_bounds__(TS_THREADS) tree_rejection_sample_point_mass(const TsParams params) {
    __shared__ Shared sh;
    tree_body<false>(params, sh);
}

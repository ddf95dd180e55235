// Selective scan (Mamba-1's S6 recurrence) in CUDA with mamba-ssm's structure; the launchers and the Python side
// are in selective_scan_cuda.py, the same algorithm in torch (the CPU-tested reference) in selective_scan_lanes.py.
//
//   h_t = a_t h_{t-1} + x_t,  a_t = exp(delta_t A),  x_t = delta_t u_t B_t,  y_t = C_t h_t,  out = (y + D u) silu(z)
//
// Layout: a block holds WARPS channels of one batch row and one group of B, C; a warp owns one channel; the
// sequence is cut into chunks of CHUNK = 32 lanes x STEPS steps, each lane owning STEPS consecutive steps. For every
// state n, a lane composes its steps' maps h -> a h + x serially in registers, the warp scans the 32 lane aggregates
// with shuffles, and the chunk's entering state (carried across chunks in shared memory) seeds it. Forward stores
// the state entering every chunk after the first, (b, d, chunks - 1, n), from which backward recomputes h.
//
// Backward walks the chunks in reverse. Per state it recomputes the chunk's h_{t-1} (kept per step in registers),
// then runs dh_t = a_{t+1} dh_{t+1} + C_t dy_t the same way from the right: a_{t+1} is the next step's decay in the
// same thread, or one shuffle down at the lane's edge, and the carry from the next chunk is a_t dh_t of its first
// step. The decay gradient is dh_t a_t h_{t-1} from those registers (never h_t - x_t, which cancels when a_t ~ 0).
// du, ddelta and dA stay in registers (dA reduced over the warp per state); dB, dC are sums over channels. A backward
// block takes WARPS x rounds channels (up to 32: each warp takes `rounds` channels in turn): per state each warp puts
// its 256-step dB, dC rows in shared memory, and after one barrier every thread adds its 4 entries of the WARPS rows,
// in a fixed order, into the block's (n, 2 x CHUNK) tile; the tile is written to global memory once per chunk, one
// partial per block, which torch sums. No global read-modify-write and no atomics, so the result is deterministic.
// The row buffers alternate between two slots, so one barrier per state suffices.
//
// Precision: inputs fp32, bf16 or fp16, loaded in their dtype and computed in fp32; A, D, delta_bias fp32.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace tread_scan {

constexpr int STEPS = 8;              // consecutive steps per lane
constexpr int LANES = 32;
constexpr int CHUNK = STEPS * LANES;  // 256 steps per chunk
constexpr int WARPS = 4;              // channels per block
constexpr unsigned FULL = 0xffffffffu;
constexpr float LOG2E = 1.4426950408889634f;

struct Params {
  // Inputs: u, delta, z, dout (b, d, l); B, C (b, g, n, l); A (d, n); D, delta_bias (d,). Absent ones are null.
  const void *u, *delta, *z, *B, *C, *dout;
  const float *A, *D, *delta_bias;
  // Forward outputs: out (b, d, l); states (b, d, chunks - 1, n), the state entering each chunk after the first.
  void *out;
  float *states;
  // Backward outputs: du, ddelta, dz (b, d, l) in the inputs' dtype; per batch row dA (b, d, n), dD, dbias (b, d);
  // dB, dC partials (b, g, channel blocks, n, l).
  void *du, *ddelta, *dz;
  float *dA, *dD, *dbias, *dB, *dC;
  int batch, d, groups, length, n, chunks;
  int fwd_blocks;      // forward's blocks per group: ceil((d / groups) / WARPS)
  int rounds;          // backward: each warp takes `rounds` channels in turn, so a block sums WARPS * rounds channels
  int channel_blocks;  // backward's blocks per group: ceil((d / groups) / (WARPS * rounds))
  bool softplus;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

// A lane's STEPS values starting at step t0 of a row of `length`; zero past the end. Whole 16-byte vectors when the
// row and its start are aligned (`vec`, decided on the host), else one element at a time.
template <typename T>
__device__ __forceinline__ void load_steps(const T* row, int t0, int length, bool vec, float (&v)[STEPS]) {
  if (vec && t0 + STEPS <= length) {
    constexpr int PER = 16 / sizeof(T);  // elements per 16-byte vector
    #pragma unroll
    for (int j = 0; j < STEPS / PER; ++j) {
      uint4 raw = *reinterpret_cast<const uint4*>(row + t0 + j * PER);
      const T* e = reinterpret_cast<const T*>(&raw);
      #pragma unroll
      for (int i = 0; i < PER; ++i) v[j * PER + i] = to_float(e[i]);
    }
  } else {
    #pragma unroll
    for (int i = 0; i < STEPS; ++i) v[i] = t0 + i < length ? to_float(row[t0 + i]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void store_steps(T* row, int t0, int length, bool vec, const float (&v)[STEPS]) {
  if (vec && t0 + STEPS <= length) {
    constexpr int PER = 16 / sizeof(T);
    #pragma unroll
    for (int j = 0; j < STEPS / PER; ++j) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
      #pragma unroll
      for (int i = 0; i < PER; ++i) e[i] = from_float<T>(v[j * PER + i]);
      *reinterpret_cast<uint4*>(row + t0 + j * PER) = raw;
    }
  } else {
    #pragma unroll
    for (int i = 0; i < STEPS; ++i)
      if (t0 + i < length) row[t0 + i] = from_float<T>(v[i]);
  }
}

// 2^x by the hardware's approximation (2 ulp), flushing results below 2^-126 to zero: a decay that small is zero to
// fp32 anyway, and exp2f's denormal handling costs three more instructions per step.
__device__ __forceinline__ float exp2_ftz(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else  // a host build: tests/scan_cuda_on_cpu.cpp runs these kernels on CPU threads
  return exp2f(x);
#endif
}

__device__ __forceinline__ float softplus(float v) { return v > 20.f ? v : log1pf(__expf(v)); }
__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + __expf(-v)); }

// The step sizes of a lane's steps: delta (+ bias, softplus), zero past the end so that a = 1, x = 0 there.
__device__ __forceinline__ void step_sizes(const float (&raw)[STEPS], float bias, bool softplus_on, int t0, int length,
                                          float (&dt)[STEPS]) {
  #pragma unroll
  for (int i = 0; i < STEPS; ++i) {
    float v = raw[i] + bias;
    dt[i] = t0 + i < length ? (softplus_on ? softplus(v) : v) : 0.f;
  }
}

// Inclusive scan of the lanes' maps h -> P h + Q, left to right (forward) or right to left (backward).
__device__ __forceinline__ void scan_lanes_up(int lane, float& P, float& Q) {
  #pragma unroll
  for (int off = 1; off < LANES; off <<= 1) {
    float p = __shfl_up_sync(FULL, P, off), q = __shfl_up_sync(FULL, Q, off);
    if (lane >= off) { Q = P * q + Q; P = P * p; }
  }
}
__device__ __forceinline__ void scan_lanes_down(int lane, float& P, float& Q) {
  #pragma unroll
  for (int off = 1; off < LANES; off <<= 1) {
    float p = __shfl_down_sync(FULL, P, off), q = __shfl_down_sync(FULL, Q, off);
    if (lane + off < LANES) { Q = P * q + Q; P = P * p; }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  #pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) v += __shfl_xor_sync(FULL, v, off);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(WARPS * LANES) scan_fwd_kernel(Params p, bool vec) {
  extern __shared__ __align__(16) float smem[];  // (WARPS, n): each warp's carried state per state index
  const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES;
  const int k = p.d / p.groups;
  const int grp = blockIdx.x / p.fwd_blocks, j = (blockIdx.x % p.fwd_blocks) * WARPS + warp;
  const bool active = j < k;
  const int ch = grp * k + (active ? j : 0), b = blockIdx.y;
  const size_t row = ((size_t)b * p.d + ch) * p.length;
  const T* u = static_cast<const T*>(p.u) + row;
  const T* delta = static_cast<const T*>(p.delta) + row;
  const T* Bg = static_cast<const T*>(p.B) + ((size_t)b * p.groups + grp) * p.n * p.length;
  const T* Cg = static_cast<const T*>(p.C) + ((size_t)b * p.groups + grp) * p.n * p.length;
  const float bias = p.delta_bias ? p.delta_bias[ch] : 0.f, Dc = p.D ? p.D[ch] : 0.f;
  float* carry = smem + warp * p.n;
  for (int s = lane; s < p.n; s += LANES) carry[s] = 0.f;
  __syncwarp();

  for (int c = 0; c < p.chunks; ++c) {
    const int t0 = c * CHUNK + lane * STEPS;
    float uv[STEPS], dt[STEPS], y[STEPS];
    load_steps(u, t0, p.length, vec, uv);
    load_steps(delta, t0, p.length, vec, dt);
    step_sizes(dt, bias, p.softplus, t0, p.length, dt);
    float w[STEPS];  // delta_t u_t, shared by every state
    #pragma unroll
    for (int i = 0; i < STEPS; ++i) y[i] = 0.f, w[i] = dt[i] * uv[i];
    #pragma unroll 2
    for (int s = 0; s < p.n; ++s) {
      const float A2 = p.A[ch * p.n + s] * LOG2E;
      float x[STEPS], Cv[STEPS], a[STEPS];
      load_steps(Bg + (size_t)s * p.length, t0, p.length, vec, x);
      load_steps(Cg + (size_t)s * p.length, t0, p.length, vec, Cv);
      // The lane's map h -> P h + Q over its steps, composed serially.
      float P = 1.f, Q = 0.f;
      #pragma unroll
      for (int i = 0; i < STEPS; ++i) {
        a[i] = exp2_ftz(dt[i] * A2);
        x[i] *= w[i];  // x_t = delta_t u_t B_t
        Q = a[i] * Q + x[i];
        P *= a[i];
      }
      scan_lanes_up(lane, P, Q);
      const float h_in = carry[s];
      const float h_end = P * h_in + Q;                 // state after the lane's last step
      float h = __shfl_up_sync(FULL, h_end, 1);         // the state entering the lane: the left lane's last
      if (lane == 0) h = h_in;
      #pragma unroll
      for (int i = 0; i < STEPS; ++i) {
        h = a[i] * h + x[i];
        y[i] += Cv[i] * h;
      }
      const float h_next = __shfl_sync(FULL, h_end, LANES - 1);
      __syncwarp();  // every lane has read carry[s] before lane 0 overwrites it
      if (lane == 0) {
        carry[s] = h_next;
        if (active && p.states && c + 1 < p.chunks) p.states[(((size_t)b * p.d + ch) * (p.chunks - 1) + c) * p.n + s] = h_next;
      }
      __syncwarp();
    }
    #pragma unroll
    for (int i = 0; i < STEPS; ++i) y[i] += Dc * uv[i];
    if (p.z) {
      float zv[STEPS];
      load_steps(static_cast<const T*>(p.z) + row, t0, p.length, vec, zv);
      #pragma unroll
      for (int i = 0; i < STEPS; ++i) y[i] *= zv[i] * sigmoid(zv[i]);
    }
    if (active) store_steps(static_cast<T*>(p.out) + row, t0, p.length, vec, y);
  }
}

template <typename T>
__global__ void __launch_bounds__(WARPS * LANES) scan_bwd_kernel(Params p, bool vec) {
  // Shared memory: two slots of (WARPS, 2 CHUNK) rows, one state's dB, dC terms per warp; the block's (n, 2 CHUNK)
  // dB, dC tile of the chunk; per channel of the block, (n,) dh carries, (n,) dA sums and the dD, dbias sums.
  extern __shared__ __align__(16) float smem[];
  const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES, cpp = WARPS * p.rounds;
  float* rows = smem;
  float* tile = rows + 2 * WARPS * 2 * CHUNK;
  float* per_channel = tile + (size_t)p.n * 2 * CHUNK;  // (cpp, 2 n + 2)
  const int k = p.d / p.groups;
  const int grp = blockIdx.x / p.channel_blocks, cb = blockIdx.x % p.channel_blocks, b = blockIdx.y;
  const T* Bg = static_cast<const T*>(p.B) + ((size_t)b * p.groups + grp) * p.n * p.length;
  const T* Cg = static_cast<const T*>(p.C) + ((size_t)b * p.groups + grp) * p.n * p.length;
  const size_t part = (((size_t)b * p.groups + grp) * p.channel_blocks + cb) * p.n * p.length;
  // This thread's 4 consecutive entries of every state's 2 CHUNK tile row (the WARPS rows' sum, then the tile).
  static_assert(2 * CHUNK == 4 * WARPS * LANES, "one float4 of the dB, dC rows per thread");
  const int e = 4 * threadIdx.x;
  for (int i = threadIdx.x; i < cpp * (2 * p.n + 2); i += WARPS * LANES) per_channel[i] = 0.f;
  __syncthreads();
  int slot = 0;

  for (int c = p.chunks - 1; c >= 0; --c) {
    for (int r = 0; r < p.rounds; ++r) {
      const int local = r * WARPS + warp, j = cb * cpp + local;
      const bool active = j < k;
      const int ch = grp * k + (active ? j : 0);
      const size_t row = ((size_t)b * p.d + ch) * p.length;
      const T* u = static_cast<const T*>(p.u) + row;
      const T* delta = static_cast<const T*>(p.delta) + row;
      const float bias = p.delta_bias ? p.delta_bias[ch] : 0.f, Dc = p.D ? p.D[ch] : 0.f;
      float* carry = per_channel + local * (2 * p.n + 2);  // a_{t+1} dh_{t+1} entering from the chunk after
      float* dA_sum = carry + p.n;
      float* sums = dA_sum + p.n;  // dD, dbias
      const int t0 = c * CHUNK + lane * STEPS;
      float dD = 0.f, dbias = 0.f;
      float uv[STEPS], raw[STEPS], dt[STEPS], dy[STEPS], dx[STEPS], ddt[STEPS], y[STEPS];
      load_steps(u, t0, p.length, vec, uv);
      load_steps(delta, t0, p.length, vec, raw);
      step_sizes(raw, bias, p.softplus, t0, p.length, dt);
      load_steps(static_cast<const T*>(p.dout) + row, t0, p.length, vec, dy);
      if (!active) {
        #pragma unroll
        for (int i = 0; i < STEPS; ++i) uv[i] = dt[i] = dy[i] = 0.f;  // a = 1, x = 0, no gradient: zero contributions
      }
      if (p.z) {  // dy = dout silu(z)
        float zv[STEPS];
        load_steps(static_cast<const T*>(p.z) + row, t0, p.length, vec, zv);
        #pragma unroll
        for (int i = 0; i < STEPS; ++i) dy[i] *= zv[i] * sigmoid(zv[i]);
      }
      float w[STEPS];  // delta_t u_t, shared by every state
      #pragma unroll
      for (int i = 0; i < STEPS; ++i) dx[i] = ddt[i] = y[i] = 0.f, w[i] = dt[i] * uv[i];

      #pragma unroll 1
      for (int s = 0; s < p.n; ++s) {
        const float As = active ? p.A[ch * p.n + s] : 0.f, A2 = As * LOG2E;
        float Bv[STEPS], Cv[STEPS], a[STEPS], hp[STEPS];  // hp[i] = h_{t-1} of the lane's step i
        load_steps(Bg + (size_t)s * p.length, t0, p.length, vec, Bv);
        load_steps(Cg + (size_t)s * p.length, t0, p.length, vec, Cv);
        // Forward again from the stored entering state: the lane's map, the warp scan, then h per step.
        float P = 1.f, Q = 0.f;
        #pragma unroll
        for (int i = 0; i < STEPS; ++i) {
          a[i] = exp2_ftz(dt[i] * A2);
          Q = a[i] * Q + w[i] * Bv[i];
          P *= a[i];
        }
        scan_lanes_up(lane, P, Q);
        const float h_in = c > 0 && active ? p.states[(((size_t)b * p.d + ch) * (p.chunks - 1) + c - 1) * p.n + s] : 0.f;
        float h = __shfl_up_sync(FULL, P * h_in + Q, 1);
        if (lane == 0) h = h_in;
        #pragma unroll
        for (int i = 0; i < STEPS; ++i) {
          hp[i] = h;
          h = a[i] * h + w[i] * Bv[i];
        }
        // h is now the lane's last state; h_t of step i is hp[i + 1] for i < STEPS - 1.
        // Adjoint from the right: dh_t = a_{t+1} dh_{t+1} + C_t dy_t. The right lane's first decay is one shuffle.
        float a_edge = __shfl_down_sync(FULL, a[0], 1);
        if (lane == LANES - 1) a_edge = 1.f;  // the next chunk's carry already holds a_{t+1} dh_{t+1}
        float cy[STEPS];  // C_t dy_t
        P = 1.f, Q = 0.f;
        #pragma unroll
        for (int i = STEPS - 1; i >= 0; --i) {
          const float an = i == STEPS - 1 ? a_edge : a[i + 1];
          cy[i] = Cv[i] * dy[i];
          Q = an * Q + cy[i];
          P *= an;
        }
        scan_lanes_down(lane, P, Q);
        const float right = carry[s];
        float dh = __shfl_down_sync(FULL, P * right + Q, 1);  // dh of the right lane's first step
        if (lane == LANES - 1) dh = right;
        float dA = 0.f, rB[STEPS], rC[STEPS];  // this warp's dB, dC terms of the lane's steps
        #pragma unroll
        for (int i = STEPS - 1; i >= 0; --i) {
          const float an = i == STEPS - 1 ? a_edge : a[i + 1];
          const float h_t = i == STEPS - 1 ? h : hp[i + 1];
          dh = an * dh + cy[i];
          dx[i] += dh * Bv[i];                 // d(delta u)_t = sum_n dh_t B_t
          const float g = dh * a[i] * hp[i];   // d(delta_t A) = dh_t a_t h_{t-1}
          ddt[i] += g * As;
          dA += g * dt[i];
          if (p.z) y[i] += Cv[i] * h_t;        // y, recomputed for dz
          rB[i] = dh * w[i];
          rC[i] = dy[i] * h_t;
        }
        // Into this warp's rows as 16-byte vectors (a lane's 8 steps are 32 contiguous bytes).
        float4* out_rows = reinterpret_cast<float4*>(rows + (slot * WARPS + warp) * 2 * CHUNK + lane * STEPS);
        #pragma unroll
        for (int q = 0; q < STEPS / 4; ++q) {
          out_rows[q] = make_float4(rB[4 * q], rB[4 * q + 1], rB[4 * q + 2], rB[4 * q + 3]);
          out_rows[CHUNK / 4 + q] = make_float4(rC[4 * q], rC[4 * q + 1], rC[4 * q + 2], rC[4 * q + 3]);
        }
        __syncwarp();  // every lane has read carry[s] before lane 0 overwrites it
        if (lane == 0) carry[s] = a[0] * dh;   // the previous chunk's a_{t+1} dh_{t+1} at its last step
        dA = warp_sum(dA);
        if (lane == 0) dA_sum[s] += dA;
        __syncthreads();
        // The WARPS channels' dB, dC rows for state s added in a fixed order into the block's tile (a thread owns its
        // entries, so the tile needs no barrier of its own).
        {
          float4 sum = *reinterpret_cast<const float4*>(rows + slot * WARPS * 2 * CHUNK + e);
          #pragma unroll
          for (int v = 1; v < WARPS; ++v) {
            const float4 q = *reinterpret_cast<const float4*>(rows + (slot * WARPS + v) * 2 * CHUNK + e);
            sum.x += q.x, sum.y += q.y, sum.z += q.z, sum.w += q.w;
          }
          float4* cell = reinterpret_cast<float4*>(tile + (size_t)s * 2 * CHUNK + e);
          if (r > 0) {
            const float4 q = *cell;
            sum.x += q.x, sum.y += q.y, sum.z += q.z, sum.w += q.w;
          }
          *cell = sum;
        }
        slot ^= 1;  // the next state writes the other slot; the barrier above ordered this slot's last reads
      }

      float du[STEPS], dd[STEPS];
      #pragma unroll
      for (int i = 0; i < STEPS; ++i) {
        du[i] = dx[i] * dt[i] + dy[i] * Dc;
        float g = dx[i] * uv[i] + ddt[i];  // gradient of the step size after softplus
        if (p.softplus) g *= sigmoid(raw[i] + bias);
        dd[i] = t0 + i < p.length ? g : 0.f;
        dbias += dd[i];
        dD += dy[i] * uv[i];
      }
      if (p.z) {  // dz = dout (y + D u) silu'(z)
        float zv[STEPS], go[STEPS], dz[STEPS];
        load_steps(static_cast<const T*>(p.z) + row, t0, p.length, vec, zv);
        load_steps(static_cast<const T*>(p.dout) + row, t0, p.length, vec, go);
        #pragma unroll
        for (int i = 0; i < STEPS; ++i) {
          const float sg = sigmoid(zv[i]);
          dz[i] = go[i] * (y[i] + Dc * uv[i]) * sg * (1.f + zv[i] * (1.f - sg));
        }
        if (active) store_steps(static_cast<T*>(p.dz) + row, t0, p.length, vec, dz);
      }
      if (active) {
        store_steps(static_cast<T*>(p.du) + row, t0, p.length, vec, du);
        store_steps(static_cast<T*>(p.ddelta) + row, t0, p.length, vec, dd);
      }
      dD = warp_sum(dD);
      dbias = warp_sum(dbias);
      if (lane == 0) sums[0] += dD, sums[1] += dbias;
    }
    // The chunk's dB, dC over the block's channels, written once: this thread's entries of every state's row.
    const int t = c * CHUNK + e % CHUNK;
    for (int s = 0; s < p.n; ++s) {
      const float4 sum = *reinterpret_cast<const float4*>(tile + (size_t)s * 2 * CHUNK + e);
      float* dst = (e < CHUNK ? p.dB : p.dC) + part + (size_t)s * p.length + t;
      if (vec && t + 4 <= p.length) {
        *reinterpret_cast<float4*>(dst) = sum;  // 16-byte aligned: `vec` implies length % 4 == 0
      } else {
        if (t < p.length) dst[0] = sum.x;
        if (t + 1 < p.length) dst[1] = sum.y;
        if (t + 2 < p.length) dst[2] = sum.z;
        if (t + 3 < p.length) dst[3] = sum.w;
      }
    }
  }
  __syncwarp();
  for (int r = 0; r < p.rounds; ++r) {
    const int local = r * WARPS + warp, j = cb * cpp + local;
    if (j >= k) break;
    const int ch = grp * k + j;
    const float* carry = per_channel + local * (2 * p.n + 2);
    for (int s = lane; s < p.n; s += LANES) p.dA[((size_t)b * p.d + ch) * p.n + s] = carry[p.n + s];
    if (lane == 0) {
      if (p.dD) p.dD[(size_t)b * p.d + ch] = carry[2 * p.n];
      if (p.dbias) p.dbias[(size_t)b * p.d + ch] = carry[2 * p.n + 1];
    }
  }
}

// Shared memory in bytes: forward's carried states; backward's dB / dC rows, dh carries and dA sums.
inline size_t fwd_smem(int n) { return sizeof(float) * WARPS * n; }
inline size_t bwd_smem(int n, int rounds) {
  return sizeof(float) * (2 * WARPS * 2 * CHUNK + (size_t)n * 2 * CHUNK + WARPS * rounds * (2 * n + 2));
}

template __global__ void scan_fwd_kernel<float>(Params, bool);
template __global__ void scan_fwd_kernel<__nv_bfloat16>(Params, bool);
template __global__ void scan_fwd_kernel<__half>(Params, bool);
template __global__ void scan_bwd_kernel<float>(Params, bool);
template __global__ void scan_bwd_kernel<__nv_bfloat16>(Params, bool);
template __global__ void scan_bwd_kernel<__half>(Params, bool);

}  // namespace tread_scan

// The CUDA selective scan's kernels (backbones/ops/selective_scan_cuda.cu) compiled for the CPU: each CUDA thread a
// std::thread, shuffles and barriers emulated with std::barrier, so tests/test_selective_scan_cuda.py can run the
// kernels' own code (indexing, carries, lane scans, the dB / dC tile) without a GPU. fp32 and bf16; slow, for tests.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <cuda_bf16.h>  // first: its host definitions of float4, uint4, make_float4, __align__

#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__

struct Dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local Dim3 threadIdx, blockIdx;

namespace emu {
constexpr int MAX_THREADS = 128;
std::barrier<>* block_barrier;
std::barrier<>* warp_barrier[MAX_THREADS / 32];
float exchange[MAX_THREADS];
template <typename Pick> float shuffle(float v, Pick pick) {
  const int lane = threadIdx.x % 32, base = threadIdx.x - lane;
  exchange[threadIdx.x] = v;
  warp_barrier[threadIdx.x / 32]->arrive_and_wait();
  const int src = pick(lane);
  const float out = src >= 0 && src < 32 ? exchange[base + src] : v;
  warp_barrier[threadIdx.x / 32]->arrive_and_wait();
  return out;
}
}  // namespace emu

inline float __shfl_up_sync(unsigned, float v, int off) { return emu::shuffle(v, [&](int l) { return l - off; }); }
inline float __shfl_down_sync(unsigned, float v, int off) { return emu::shuffle(v, [&](int l) { return l + off; }); }
inline float __shfl_xor_sync(unsigned, float v, int off) { return emu::shuffle(v, [&](int l) { return l ^ off; }); }
inline float __shfl_sync(unsigned, float v, int src) { return emu::shuffle(v, [&](int) { return src; }); }
inline void __syncwarp() { emu::warp_barrier[threadIdx.x / 32]->arrive_and_wait(); }
inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
inline float __expf(float x) { return std::exp(x); }

#include "../backbones/ops/selective_scan_cuda.cu"

namespace tread_scan {
alignas(16) float smem[1 << 16];  // one block at a time runs, so one block's shared memory
}

using tread_scan::Params;

template <typename Kernel> static void run(Kernel kernel, int blocks_x, int blocks_y, const Params& p, bool vec) {
  constexpr int threads = tread_scan::WARPS * 32;
  for (int by = 0; by < blocks_y; ++by)
    for (int bx = 0; bx < blocks_x; ++bx) {
      std::barrier<> block(threads);
      std::vector<std::unique_ptr<std::barrier<>>> warps;
      emu::block_barrier = &block;
      for (int w = 0; w < tread_scan::WARPS; ++w) {
        warps.push_back(std::make_unique<std::barrier<>>(32));
        emu::warp_barrier[w] = warps.back().get();
      }
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
          threadIdx = {unsigned(t), 0, 0};
          blockIdx = {unsigned(bx), unsigned(by), 0};
          kernel(p, vec);
        });
      for (auto& th : pool) th.join();
    }
}

// The launchers' arithmetic (selective_scan_cuda.py's `params`); u, delta, z, B, C, dout in one dtype (fp32 or bf16).
static Params make(const void* u, const void* delta, const void* z, const void* B, const void* C, const float* A,
                   const float* D, const float* bias, int batch, int d, int groups, int length, int n, int softplus) {
  Params p{};
  p.u = u; p.delta = delta; p.z = z; p.B = B; p.C = C; p.A = A; p.D = D; p.delta_bias = bias;
  p.batch = batch; p.d = d; p.groups = groups; p.length = length; p.n = n; p.softplus = softplus;
  p.chunks = (length + tread_scan::CHUNK - 1) / tread_scan::CHUNK;
  const int k = d / groups;
  p.fwd_blocks = (k + tread_scan::WARPS - 1) / tread_scan::WARPS;
  p.rounds = p.fwd_blocks < 8 ? p.fwd_blocks : 8;
  p.channel_blocks = (k + tread_scan::WARPS * p.rounds - 1) / (tread_scan::WARPS * p.rounds);
  return p;
}

extern "C" int channel_blocks(int d, int groups) { return make(0, 0, 0, 0, 0, 0, 0, 0, 1, d, groups, 1, 1, 0).channel_blocks; }

extern "C" void scan_fwd(const void* u, const void* delta, const void* z, const void* B, const void* C,
                         const float* A, const float* D, const float* bias, void* out, float* states, int batch, int d,
                         int groups, int length, int n, int softplus, int vec, int bf16) {
  Params p = make(u, delta, z, B, C, A, D, bias, batch, d, groups, length, n, softplus);
  p.out = out; p.states = states;
  if (bf16) run(tread_scan::scan_fwd_kernel<__nv_bfloat16>, groups * p.fwd_blocks, batch, p, vec);
  else run(tread_scan::scan_fwd_kernel<float>, groups * p.fwd_blocks, batch, p, vec);
}

extern "C" void scan_bwd(const void* u, const void* delta, const void* z, const void* B, const void* C,
                         const float* A, const float* D, const float* bias, const void* dout, float* states,
                         void* du, void* ddelta, void* dz, float* dA, float* dD, float* dbias, float* dB, float* dC,
                         int batch, int d, int groups, int length, int n, int softplus, int vec, int bf16) {
  Params p = make(u, delta, z, B, C, A, D, bias, batch, d, groups, length, n, softplus);
  p.dout = dout; p.states = p.chunks > 1 ? states : nullptr;
  p.du = du; p.ddelta = ddelta; p.dz = dz; p.dA = dA; p.dD = dD; p.dbias = dbias; p.dB = dB; p.dC = dC;
  if (bf16) run(tread_scan::scan_bwd_kernel<__nv_bfloat16>, groups * p.channel_blocks, batch, p, vec);
  else run(tread_scan::scan_bwd_kernel<float>, groups * p.channel_blocks, batch, p, vec);
}

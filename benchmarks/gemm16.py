"""The 16-bit GEMMs the native kernel can run on a tile: MKL's ``cblas_gemm_bf16bf16f32`` (on B as it lies) against
torch's brgemm (``at::native::cpublas::brgemm``, oneDNN's micro-kernel, on B packed by ``cpublas::pack``), and the
packing itself, on the kernel's per-tile shapes, one thread.

    python benchmarks/gemm16.py [--reps 2000]

Builds a small C++ extension (torch.utils.cpp_extension, about 30 s the first time). Prints, per shape (M, N, K):
MKL's time, brgemm's, packing B's, and whether the two results are equal; then float32's pair (MKL's sgemm,
torch's float32 brgemm) in GFLOP/s. Exits with a message where torch's brgemm
takes no bfloat16 on this CPU (``cpublas::could_pack``) or libtorch exports no MKL 16-bit GEMM.
"""

from __future__ import annotations

import argparse
import sys

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>
#include <chrono>
extern "C" void sgemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                      const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                      const int* ldc);
extern "C" void cblas_gemm_bf16bf16f32(int layout, int ta, int tb, int m, int n, int k, float alpha, const void* a,
                                       int lda, const void* b, int ldb, float beta, float* c, int ldc)
    __attribute__((weak));
namespace cb = at::native::cpublas;
bool ready() { return cblas_gemm_bf16bf16f32 != nullptr && cb::could_pack(at::kBFloat16); }
double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
// C (M, N) = A (M, K) @ Bt (N, K)^T, reps times each way: {MKL us, brgemm us, pack us, max |difference|}
std::vector<double> run(torch::Tensor A, torch::Tensor Bt, int64_t reps) {
  const int64_t M = A.size(0), K = A.size(1), N = Bt.size(0), NB = 64;
  auto C = torch::zeros({M, N}), C2 = torch::zeros({M, N});
  auto B = Bt.t().contiguous(), packed = torch::empty({K * N}, torch::kBFloat16);
  auto a = static_cast<const at::BFloat16*>(A.data_ptr()), bt = static_cast<const at::BFloat16*>(Bt.data_ptr());
  auto b = static_cast<const at::BFloat16*>(B.data_ptr());
  auto p = static_cast<at::BFloat16*>(packed.data_ptr());
  const auto pack = [&] {
    for (int64_t n0 = 0; n0 < N; n0 += NB)
      cb::pack(K, NB, N, NB, at::kBFloat16, at::kBFloat16, b + n0, p + n0 * K);
  };
  std::vector<double> out;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r)
    cblas_gemm_bf16bf16f32(101, 111, 112, M, N, K, 1.f, a, K, bt, K, 0.f, C.data_ptr<float>(), N);
  out.push_back(seconds(t0) / reps * 1e6);
  pack();
  t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r)
    for (int64_t n0 = 0; n0 < N; n0 += NB)
      cb::brgemm(M, NB, K, K, NB, N, false, a, p + n0 * K, C2.data_ptr<float>() + n0, true);
  cb::brgemm_release(true);
  out.push_back(seconds(t0) / reps * 1e6);
  t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) pack();
  out.push_back(seconds(t0) / reps * 1e6);
  out.push_back((C - C2).abs().max().item<float>());
  return out;
}
// The same in float32: MKL's sgemm against torch's float32 brgemm (B as it lies, no packing): {MKL us, brgemm us}
std::vector<double> run32(torch::Tensor A, torch::Tensor B, int64_t reps) {
  const int64_t M = A.size(0), K = A.size(1), N = B.size(1), NB = 64;
  auto C = torch::zeros({M, N});
  const float *a = A.data_ptr<float>(), *b = B.data_ptr<float>();
  float* c = C.data_ptr<float>();
  const char no = 'N';
  const int im = N, in = M, ik = K, la = N, lb = K, lc = N;
  const float one = 1, zero = 0;
  std::vector<double> out;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) sgemm(&no, &no, &im, &in, &ik, &one, b, &la, a, &lb, &zero, c, &lc);
  out.push_back(seconds(t0) / reps * 1e6);
  t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r)
    for (int64_t n0 = 0; n0 < N; n0 += NB)
      cb::brgemm(M, std::min(NB, N - n0), K, K, N, N, false, a, b + n0, c + n0, false);
  cb::brgemm_release(false);
  out.push_back(seconds(t0) / reps * 1e6);
  return out;
}
"""

# (M, N, K): the forward's q k^T (256 queries, 64 keys a call, D = 64), P v (512 keys, 64 columns), the same for a
# causal call's 64-query tiles, and a wider q k^T block
SHAPES = [(256, 64, 64), (256, 64, 512), (64, 64, 64), (64, 64, 512), (256, 512, 64)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args(argv)
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("relattn_gemm16_bench", cpp_sources=_SOURCE, functions=["run", "run32", "ready"],
                      extra_cflags=["-O2"])
    if not ext.ready():
        print("torch's brgemm takes no bfloat16 on this CPU, or libtorch exports no MKL 16-bit GEMM: nothing to "
              "compare")
        return 0
    from relattn.backends import cpu

    torch.set_num_threads(1)
    print("CPU", cpu.features().describe())
    print(f"torch {torch.__version__}, 1 thread, bfloat16 in, float32 out; mean of {args.reps} calls")
    print(f"{'M x N x K':>16}  {'MKL us':>8}  {'brgemm us':>9}  {'MKL / brgemm':>12}  {'pack B us':>9}  equal")
    g = torch.Generator().manual_seed(0)
    for m, n, k in SHAPES:
        a = torch.randn(m, k, generator=g).bfloat16()
        bt = torch.randn(n, k, generator=g).bfloat16()
        ext.run(a, bt, 20)  # warm-up: the kernels are generated on first use
        mkl, brgemm, pack, diff = ext.run(a, bt, args.reps)
        print(f"{f'{m} x {n} x {k}':>16}  {mkl:8.2f}  {brgemm:9.2f}  {mkl / brgemm:12.2f}  {pack:9.2f}  "
              f"{'yes' if diff == 0 else f'max diff {diff:.2g}'}")
    print("float32: MKL's sgemm against torch's float32 brgemm (no packing), GFLOP/s")
    for m, n, k in SHAPES:
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        ext.run32(a, b, 20)
        mkl, brgemm = ext.run32(a, b, max(1, args.reps // 10))
        flop = 2 * m * n * k / 1e3  # per microsecond: GFLOP/s
        print(f"{f'{m} x {n} x {k}':>16}  {flop / mkl:8.0f}  {flop / brgemm:9.0f}  {mkl / brgemm:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

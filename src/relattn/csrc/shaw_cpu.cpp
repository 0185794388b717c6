// Shaw attention in one flash pass on the CPU: the "native" backend's kernels.
//
// Notation (as in relattn/backends/_common.py): q (B,H,N,D), k (B,Hkv,M,D), v (B,Hkv,M,Dv) with H % Hkv == 0 (query
// head h reads key/value head h / (H / Hkv): grouped-query attention), tables (Hk|Hv,R,D|Dv) with R = 2K+1 and
// Hk, Hv in {1, H}; query i sits at position p = i + query_offset; key j has offset r = j - p and table row
// t(r) = clamp(r, -K, K) + K.
//
// Packed calls (varlen_fwd, varlen_bwd; flash-attention's varlen layout): q (1,H,T,D), k (1,Hkv,T_k,D), v likewise, as
// strided views of the packed (T,H,D) tensors, and cumulative lengths cu_seqlens_q, cu_seqlens_k (S + 1 entries):
// sequence s is query rows cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1 (n_s of them) and key rows of cu_seqlens_k
// likewise (m_s), its query i at position i + m_s - n_s + query_offset. Each sequence is exactly the dense call on
// its own rows: a task reads its sequence through views moved to the sequence's first rows and writes out, lse, dq,
// dk, dv ((1, H|Hkv, T|T_k, .)) at the sequence's rows. A dense call is the same with one sequence per batch entry
// (Seq, Batch). Buffers are sized for the longest sequence.
//
// The work is one parallel_for over tasks -- (sequence, head, tile of queries) forward, (sequence, key/value head,
// segment of keys) backward -- cut into one run of consecutive tasks of about equal cost per thread (balanced_parts):
// ragged sequences make tasks of unequal cost, and the runs depend only on the shapes and the thread count.
//
// Forward, per (sequence, head, tile of queries): QA = scale * q_tile @ a^K.T (R scores per row: every relative
// key term a row can meet). For each block of keys: S = scale * q_tile @ k_block.T, then per row the relative
// term is added in three runs -- keys left of the band (constant QA[t=0]), the band (a contiguous slice of
// the QA row), keys right of the band (constant QA[t=2K]) -- and the online softmax goes on as in flash
// attention. The value term is carried the same way: PW[i, t] accumulates the weight of the keys with table
// row t (again three runs), rescaled with the output; at the end out += PW @ a^V. Nothing of size (N, M)
// or (N, M, D) exists: per thread a (Tq, Tk) score tile and (Tq, R) rows.
//
// Backward, per (sequence, key/value head) -- or per (sequence, key/value head, segment of keys) when there are too few
// heads to keep the threads busy -- over the query heads of the group in order, tile by tile (so dk and dv of a
// key/value head are the sum over its query heads, in a fixed order): P is recomputed from the saved log-sum-exp; dP = dO @ v.T plus
// DOA[i, t] = dO_i . a^V_t in the same three runs; dS = P * (dP - rowsum(dO * O)). dQA[i, t] (the sums of dS
// per table row) gives dq += scale * dQA @ a^K and d a^K += scale * dQA.T @ q; PW (the sums of P) gives
// d a^V += PW.T @ dO. Table gradients are summed per thread's run of tasks, then across the runs in order.
//
// The position-to-content term (DeBERTa's p2c, BERT's relative_key_query; a table a^Q, rel_q, with the key term's
// rows): KA = scale * k @ a^Q.T, (M, R) per head, is formed by each thread for the head it works on (one GEMM per
// head and thread in the forward, per head and key segment in the backward); per row, keys left of the band add
// KA[j, 0], the band the diagonal KA[j, j - p + K], keys right of it KA[j, 2K] (the two edge columns are kept as
// contiguous rows). Its gradient is binned per key row: dKA[j, t] sums dS over the rows that meet key j at
// table row t, held by the backward task that owns key j, then dk += scale * dKA @ a^Q and d a^Q += scale * dKA.T @ k
// per head -- deterministic, no atomics.
//
// The scalar bias (T5's and MPNet's; rel_bias, (Hb, R) with Hb in {1, H}) is read at the key term's row and added
// unscaled: to each tile's QA row (QA[i, t] += b[t] over the window's table rows) before the runs spread it over the
// keys -- a zero QA row where there is no a^K. Its gradient is the per-row sum of dQA (the sums of dS per table row the
// key table's gradient is formed from), unscaled: d b[t] += sum_i dQA[i, t], per thread's run of tasks as the tables'.
// Dropout (dropout_p > 0; the mask of every backend, see Dropout below): the forward drops a row's softmax weights after
// their sum has joined the normaliser, before they meet v and the value term's PW; the backward draws the same mask
// per block into Z (0 or 1 / (1 - p)): PZ = P * Z gives dv and PW, and dS = P * (Z * dP - rowsum(dO * O)).
//
// GEMMs go to the BLAS that libtorch_cpu exports (Fortran sgemm/dgemm). Float32 uses ATen's vectorized exp;
// float64 (for tests) plain loops.
//
// 16-bit inputs (bfloat16, float16) run the GEMMs over keys (q k^T, P v, dO v^T, P^T dO, dS k, dS^T q) in 16 bits
// with float32 accumulation, as PyTorch's own CPU flash kernel does: MKL's cblas_gemm_bf16bf16f32 /
// cblas_gemm_f16f16f32, which libtorch_cpu exports on x86 (weak references: null where absent, and the caller
// converts to float32 instead). P and dS are rounded to 16 bits for their GEMMs; scores, softmax statistics, the
// relative terms (2K+1 per row, with float32 tables) and every accumulator stay float32. Where the caller asks
// (brgemm: the CPU's choice) and torch runs it, those whose B is k or v (q k^T, P v forward; q k^T, dO v^T, dS k
// backward) go to torch's batch-reduce GEMM instead (oneDNN's micro-kernel, AMX tiles where the CPU has them) on keys
// and values packed once per call (PackedKV); float32's P v and dS k likewise, on v and k as they lie (brgemm_rows).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#if __has_include(<ATen/native/CPUBlas.h>)
#include <ATen/native/CPUBlas.h>  // oneDNN's batch-reduce GEMM (brgemm) and its packing, where torch has them
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>  // x86 only: the bfloat16 rounding instruction (round_to)
#endif

extern "C" {
void sgemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
           const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
           const int* ldc);
void dgemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
           const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
           const int* ldc);
// MKL's 16-bit GEMMs (row-major layout 101, no transpose 111, transpose 112); MKL_INT is int in torch's LP64 build.
void cblas_gemm_bf16bf16f32(int layout, int ta, int tb, int m, int n, int k, float alpha, const void* a, int lda,
                            const void* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
void cblas_gemm_f16f16f32(int layout, int ta, int tb, int m, int n, int k, float alpha, const void* a, int lda,
                          const void* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace {

template <typename I>
constexpr bool is_16_bit = std::is_same_v<I, at::BFloat16> || std::is_same_v<I, at::Half>;

// Whether libtorch_cpu exports the 16-bit GEMM for ``dtype``.
bool has_gemm16(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return cblas_gemm_bf16bf16f32 != nullptr;
  if (dtype == at::kHalf) return cblas_gemm_f16f16f32 != nullptr;
  return false;
}

// Whether torch's brgemm (oneDNN's micro-kernel: AMX where the CPU has it) takes `dtype` on this CPU: for 16-bit
// types as PyTorch's own CPU flash attention asks (cpublas::could_pack: PackedKV); for float32 (no packing: B as it
// lies) by one 1x1x1 call, once (torch raises where oneDNN's micro-kernels are not built or the CPU lacks them).
bool has_brgemm(at::ScalarType dtype) {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F16F16F32) && defined(CPUBLAS_BRGEMM_F32F32F32)
  if (dtype == at::kFloat) {
    static const bool runs = [] {
      try {
        const float a = 1, b = 2;
        float c = 0;
        at::native::cpublas::brgemm(1, 1, 1, 1, 1, 1, false, &a, &b, &c, false);
        at::native::cpublas::brgemm_release(false);
        return c == 2;
      } catch (const c10::Error&) {
        return false;
      }
    }();
    return runs;
  }
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && at::native::cpublas::could_pack(dtype);
#else
  return false;
#endif
}

// ----------------------------------------------------------------------------------------------- dropout

// The 32-bit hash of the dropout mask: three xorshifts, two multiplies (uint32 arithmetic wraps mod 2^32).
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x45D9F3Bu;
  x ^= x >> 16;
  x *= 0x45D9F3Bu;
  return x ^ (x >> 16);
}

// The mask every backend draws (relattn/backends/_common.py, dropout_keep; docs/backends.md): weight (b, h, i, j) --
// batch entry (a packed call: sequence), query head, query row and key row within the sequence -- is kept where
// mix32(row(key, i) ^ col(key, j)) >= floor(p 2^32), key = key(seed, b, h), and kept weights are scaled by
// 1 / (1 - p). Row and column hashes are formed once per tile and block: an element costs one mix32. The call's
// seed tensor is (seed) or (seed, b0, i0, j0): its weight (b, h, i, j) is the mask's (b0 + b, h, i0 + i, j0 + j).
struct Dropout {
  bool on = false;
  uint32_t seed = 0, thresh = 0;
  int64_t b0 = 0, i0 = 0, j0 = 0;
  double inv = 1.0;
  uint32_t key(int64_t b, int64_t h) const {
    return mix32(mix32(mix32(seed ^ 0x243F6A88u) ^ static_cast<uint32_t>(b0 + b)) ^ static_cast<uint32_t>(h));
  }
  uint32_t row(uint32_t key, int64_t i) const { return mix32(key ^ 0x85A308D3u ^ static_cast<uint32_t>(i0 + i)); }
  // out[x] = col(key, n0 + x) for x < n: the hashes of a block's keys
  void cols(uint32_t key, int64_t n0, int64_t n, uint32_t* out) const {
    const uint32_t k2 = key + 0x9E3779B9u;
    for (int64_t x = 0; x < n; ++x) out[x] = mix32(k2 ^ static_cast<uint32_t>(j0 + n0 + x));
  }
};

// z[x] = inv where the row's weight x is kept, else 0 (x < n): uint32 lanes and a select, which the compiler
// vectorizes (AVX2: eight lanes of vpmulld).
template <typename T>
void keep_row(T* z, int64_t n, uint32_t row, const uint32_t* cols, uint32_t thresh, T inv) {
  for (int64_t x = 0; x < n; ++x) z[x] = mix32(row ^ cols[x]) >= thresh ? inv : T(0);
}

// s[x] *= inv where the row's weight x is kept, else 0 (a NaN stays NaN, as in the other backends' product).
template <typename T>
void drop_row(T* s, int64_t n, uint32_t row, const uint32_t* cols, uint32_t thresh, T inv) {
  for (int64_t x = 0; x < n; ++x) s[x] *= mix32(row ^ cols[x]) >= thresh ? inv : T(0);
}

// Row-major c[0:n] = alpha * a[0:k] @ op(B)[k, n] + beta * c: a GEMM of one row (stride 1), as every GEMM of a
// one-query (decoding) call is. Written out with ATen's vectors: MKL runs GEMVs through its generic, unvectorized
// code on some x86 CPUs (AMD's), where a decoding call spent half its time. Nothing is skipped for zero entries
// of a (0 * NaN is NaN, as in the GEMM).
template <typename T>
void gemv_row(bool tb, int64_t n, int64_t k, T alpha, const T* a, const T* b, int64_t ldb, T beta, T* c) {
  using V = at::vec::Vectorized<T>;
  constexpr int64_t w = V::size();
  const auto put = [&](int64_t j, T dot) { c[j] = beta == T(0) ? alpha * dot : alpha * dot + beta * c[j]; };
  if (tb) {  // c[j] = alpha * a . B[j, 0:k] + beta * c[j], four rows of B at a time
    const auto hsum = [](const V& s) { return at::vec::vec_reduce_all<T>([](V& x, V& y) { return x + y; }, s); };
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const T* r0 = b + j * ldb;
      const T *r1 = r0 + ldb, *r2 = r1 + ldb, *r3 = r2 + ldb;
      V s0(T(0)), s1(T(0)), s2(T(0)), s3(T(0));
      int64_t x = 0;
      for (; x + w <= k; x += w) {
        const V av = V::loadu(a + x);
        s0 = at::vec::fmadd(av, V::loadu(r0 + x), s0);
        s1 = at::vec::fmadd(av, V::loadu(r1 + x), s1);
        s2 = at::vec::fmadd(av, V::loadu(r2 + x), s2);
        s3 = at::vec::fmadd(av, V::loadu(r3 + x), s3);
      }
      T t0 = hsum(s0), t1 = hsum(s1), t2 = hsum(s2), t3 = hsum(s3);
      for (; x < k; ++x) {
        t0 += a[x] * r0[x];
        t1 += a[x] * r1[x];
        t2 += a[x] * r2[x];
        t3 += a[x] * r3[x];
      }
      put(j, t0), put(j + 1, t1), put(j + 2, t2), put(j + 3, t3);
    }
    for (; j < n; ++j) {
      const T* r = b + j * ldb;
      V s(T(0));
      int64_t x = 0;
      for (; x + w <= k; x += w) s = at::vec::fmadd(V::loadu(a + x), V::loadu(r + x), s);
      T t = hsum(s);
      for (; x < k; ++x) t += a[x] * r[x];
      put(j, t);
    }
    return;
  }
  // c[j0:j0+cols] = alpha * sum_x a[x] B[x, j0:j0+cols] + beta * c, the columns held in registers over all x
  int64_t j0 = 0;
  for (; j0 + 4 * w <= n; j0 += 4 * w) {
    V s0(T(0)), s1(T(0)), s2(T(0)), s3(T(0));
    for (int64_t x = 0; x < k; ++x) {
      const V ax(a[x]);
      const T* r = b + x * ldb + j0;
      s0 = at::vec::fmadd(ax, V::loadu(r), s0);
      s1 = at::vec::fmadd(ax, V::loadu(r + w), s1);
      s2 = at::vec::fmadd(ax, V::loadu(r + 2 * w), s2);
      s3 = at::vec::fmadd(ax, V::loadu(r + 3 * w), s3);
    }
    T buf[4 * w];
    s0.store(buf), s1.store(buf + w), s2.store(buf + 2 * w), s3.store(buf + 3 * w);
    for (int64_t u = 0; u < 4 * w; ++u) put(j0 + u, buf[u]);
  }
  for (; j0 + w <= n; j0 += w) {
    V s(T(0));
    for (int64_t x = 0; x < k; ++x) s = at::vec::fmadd(V(a[x]), V::loadu(b + x * ldb + j0), s);
    T buf[w];
    s.store(buf);
    for (int64_t u = 0; u < w; ++u) put(j0 + u, buf[u]);
  }
  for (; j0 < n; ++j0) {
    T t = 0;
    for (int64_t x = 0; x < k; ++x) t += a[x] * b[x * ldb + j0];
    put(j0, t);
  }
}

// C[m, n] = beta * C (0 where beta is 0: C may hold garbage), the GEMMs' result when k = 0.
template <typename T>
void scale_only(int64_t m, int64_t n, T beta, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
}

// Row-major C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C; lda/ldb/ldc are row strides.
// (Column-major BLAS sees the transposes: C.T = op(B).T @ op(A).T.)
template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) return scale_only(m, n, beta, c, ldc);
  if (m == 1 && !ta) return gemv_row<T>(tb, n, k, alpha, a, b, ldb, beta, c);
  const char opa = tb ? 'T' : 'N', opb = ta ? 'T' : 'N';
  const int im = static_cast<int>(n), in = static_cast<int>(m), ik = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    sgemm(&opa, &opb, &im, &in, &ik, &alpha, b, &la, a, &lb, &beta, c, &lc);
  } else {
    dgemm(&opa, &opb, &im, &in, &ik, &alpha, b, &la, a, &lb, &beta, c, &lc);
  }
}

// Row-major C[m, n] = alpha * op(A) @ op(B) + beta * C for 16-bit A and B, float32 C (float32 accumulation).
template <typename I>
void gemm16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const I* a, int64_t lda, const I* b,
            int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) return scale_only(m, n, beta, c, ldc);
  const auto f = std::is_same_v<I, at::BFloat16> ? cblas_gemm_bf16bf16f32 : cblas_gemm_f16f16f32;
  f(101, ta ? 112 : 111, tb ? 112 : 111, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a,
    static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

// The GEMMs over keys: inputs of the storage type I, result of the compute type T (I itself, or float for 16-bit I).
template <typename I, typename T>
void gemm_io(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const I* a, int64_t lda, const I* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<I, T>) {
    gemm<T>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    gemm16<I>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// brgemm's operands: k^T packed in blocks of kPackCols keys, v in blocks of kPackCols columns (oneDNN packs 16, 32, 48
// or 64 columns at a time).
constexpr int64_t kPackCols = 64;

// Row-major C[m, n] (+= where `add`) A[m, k] @ B[k, n]: 16-bit A (rows lda apart), B packed for brgemm (PackedKV: n <=
// kPackCols columns, k even), float32 C (rows ldc apart).
template <typename I, typename T>
void brgemm_packed(int64_t m, int64_t n, int64_t k, const I* a, int64_t lda, const I* b, T* c, int64_t ldc,
                   bool add) {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F16F16F32)
  if constexpr (is_16_bit<I> && std::is_same_v<T, float>)
    at::native::cpublas::brgemm(m, n, k, lda, n, ldc, add, a, b, c, true);
#endif
}

// Row-major C[m, n] (+= where `add`) A[m, k] @ B[k, n] in float32 through torch's brgemm, B as it lies (rows ldb
// apart), in one call (column blocks would read A once each): on the tile shapes of P v and dS k about 0.9 of
// MKL's sgemm's time (benchmarks/gemm16.py). Other types: nothing (never called).
template <typename I, typename T>
void brgemm_rows(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const I* b, int64_t ldb, T* c,
                 int64_t ldc, bool add) {
#if defined(CPUBLAS_BRGEMM_F32F32F32)
  if constexpr (std::is_same_v<I, float> && std::is_same_v<T, float>)
    at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, false);
#endif
}

// One (sequence, key/value head)'s keys and values as PackedKV holds them (each form null where not packed), for the
// GEMMs whose B they are: transposed (k^T for q k^T, v^T for dO v^T) in blocks of kPackCols keys, (d, kPackCols)
// each; as rows (v for P v, k for dS k) in blocks of kPackCols columns (the last d % kPackCols), (mp, cols) each, mp =
// m rounded up to even. oneDNN packs pairs of rows together (VNNI), so the rows from an even key n0 on are those of
// [n0:] packed. Head dims are multiples of 16 (uses_brgemm).
template <typename I>
struct PackedHead {
  const I *kt = nullptr, *vt = nullptr, *kr = nullptr, *vr = nullptr;
  int64_t d = 0, dv = 0, mp = 0;
  // n0: a multiple of kPackCols
  const I* keys_t(int64_t n0) const { return kt + n0 * d; }
  const I* values_t(int64_t n0) const { return vt + n0 * dv; }
  // n0 even; c0 a multiple of kPackCols
  const I* key_rows(int64_t c0, int64_t n0) const { return kr + c0 * mp + n0 * std::min(kPackCols, d - c0); }
  const I* value_rows(int64_t c0, int64_t n0) const { return vr + c0 * mp + n0 * std::min(kPackCols, dv - c0); }
};

// C[rows, width] = A[rows, k] @ the keys [n0, n0 + width) of a transposed form (PackedHead's kt or vt, k their head
// dim; `first`: keys_t(n0) or values_t(n0)), a packed block of kPackCols keys a call: C's row stride ld, and n0, are
// multiples of kPackCols (the last block's columns past width are zero keys' scores).
template <typename I, typename T>
void brgemm_over_keys(int64_t rows, int64_t k, int64_t width, const I* a, int64_t lda, const I* first, T* c,
                      int64_t ld) {
  for (int64_t x = 0; x < width; x += kPackCols)
    brgemm_packed<I, T>(rows, kPackCols, k, a, lda, first + x * k, c + x, ld, false);
}

// C[rows, d] += A[rows, width] @ the keys [n0, n0 + width) of a row form (at(c0): column block c0's rows from key n0,
// PackedHead's key_rows or value_rows), over an even count of keys: an odd width gives A a zero column (its row
// stride lda exceeds width then: the block is not a full one).
template <typename I, typename T, typename F>
void brgemm_over_columns(int64_t rows, int64_t d, int64_t width, I* a, int64_t lda, F at, T* c) {
  if (width % 2 == 1)
    for (int64_t r = 0; r < rows; ++r) a[r * lda + width] = I(0);
  for (int64_t c0 = 0; c0 < d; c0 += kPackCols)
    brgemm_packed<I, T>(rows, std::min(kPackCols, d - c0), width + width % 2, a, lda, at(c0), c + c0, d, true);
}

// Releases the AMX tile configuration torch's brgemm set on this thread: at the end of a thread's run, and after an
// MKL 16-bit GEMM between brgemm calls (MKL configures the tiles its own way; torch would not configure them again
// for the next call and its tile instructions would fault).
inline void release_brgemm() {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F16F16F32)
  at::native::cpublas::brgemm_release();
#endif
}

// rows x cols of src (row stride ld) as T: src itself when I is T, else a dense copy in buf (row stride cols).
// Returns the rows and sets ld_out to their stride.
template <typename T, typename I>
const T* rows_as(const I* src, int64_t rows, int64_t cols, int64_t ld, std::vector<T>& buf, int64_t& ld_out) {
  if constexpr (std::is_same_v<I, T>) {
    ld_out = ld;
    return src;
  } else {
    for (int64_t r = 0; r < rows; ++r) at::vec::convert(src + r * ld, buf.data() + r * cols, cols);
    ld_out = cols;
    return buf.data();
  }
}

// ----------------------------------------------------------------------------------------- row kernels

template <typename T>
using Vec = at::vec::Vectorized<T>;

// *p as V: a vector load, or the scalar itself.
template <typename V, typename T>
V load(const T* p) {
  if constexpr (std::is_same_v<V, T>) {
    return *p;
  } else {
    return V::loadu(p);
  }
}

template <typename V>
V exp_of(V y) {
  if constexpr (std::is_arithmetic_v<V>) {
    return std::exp(y);
  } else {
    return y.exp_u20();  // the exp of PyTorch's own CPU flash kernel
  }
}

constexpr auto add = [](auto a, auto b) { return a + b; };
// NaN-propagating, as ATen's vectorized maximum: a row's NaN score must make its max NaN (see ``row_is_nan``).
constexpr auto max = [](auto a, auto b) { return (b > a || b != b) ? b : a; };

// step(x, lanes) for the full vectors of [0, n) from x = 0, in four chains of lanes taken in turn (one chain would
// wait on its latency every vector; the step's own work is cheap); returns where the full vectors end.
template <typename V, typename F>
int64_t in_four_chains(int64_t n, F step, V& l0, V& l1, V& l2, V& l3) {
  const int64_t w = V::size();
  int64_t x = 0;
  for (; x + 4 * w <= n; x += 4 * w) {
    step(x, l0);
    step(x + w, l1);
    step(x + 2 * w, l2);
    step(x + 3 * w, l3);
  }
  for (; x + w <= n; x += w) step(x, l0);
  return x;
}

// s[x] = f(s[x], x) for x in [0, n), then returns ``reduce`` of ``init`` and the new values. ``f`` takes and
// returns a Vec<float> (8 or 16 lanes) or a scalar: float rows run vectorized with a scalar tail, double rows
// (tests only) as scalars. ``identity`` is the neutral element of ``reduce``.
template <typename T, typename F, typename R>
T transform_reduce(T* s, int64_t n, T init, T identity, F f, R reduce) {
  int64_t x = 0;
  T acc = init;
  if constexpr (std::is_same_v<T, float>) {
    const int64_t w = Vec<T>::size();
    Vec<T> l0(identity), l1(identity), l2(identity), l3(identity);
    const auto step = [&](int64_t at, Vec<T>& lanes) {
      const Vec<T> y = f(Vec<T>::loadu(s + at), at);
      y.store(s + at);
      lanes = reduce(lanes, y);
    };
    x = in_four_chains(n, step, l0, l1, l2, l3);
    const Vec<T> lanes = reduce(reduce(l0, l1), reduce(l2, l3));
    T buf[Vec<T>::size()];
    lanes.store(buf);
    for (int64_t u = 0; u < w; ++u) acc = reduce(acc, buf[u]);
  }
  for (; x < n; ++x) {
    s[x] = f(s[x], x);
    acc = reduce(acc, s[x]);
  }
  return acc;
}

template <typename T>
constexpr T neg_inf = -std::numeric_limits<T>::infinity();

// A row whose max score is NaN or +inf has NaN softmax weights (the reference's, as any softmax's): the kernel
// writes NaN for it instead of running the exp (ATen's vectorized exp clamps NaN to a finite value).
template <typename T>
bool row_is_nan(T row_max) {
  return !(row_max <= std::numeric_limits<T>::max());
}

// The running max of a row's scores, NaN if one is NaN: float rows keep it in vector lanes (ATen's maximum keeps a
// NaN), met by shuffles once per row in value(); double rows (tests only) as a scalar.
template <typename T>
struct RowMax {
  static constexpr bool kLanes = std::is_same_v<T, float>;
  std::conditional_t<kLanes, Vec<float>, T> acc{neg_inf<T>};

  T value() const {
    if constexpr (kLanes) {
      return at::vec::vec_reduce_all<T>([](Vec<T>& a, Vec<T>& b) { return at::vec::maximum(a, b); }, acc);
    } else {
      return acc;
    }
  }
};

// s[0:n] += b[0:n] (kVec) or c, the new values folded into the row's max m. Float rows run four chains of maxima
// (one would wait on its latency every vector: the adds are cheap), and the tail as one partial vector (its unused
// lanes -inf in the max), so the runs of a row cost one reduction, in m.value(), not one each with a scalar tail.
template <typename T, bool kVec>
void add_max(T* s, const T* b, T c, int64_t n, RowMax<T>& m) {
  if constexpr (RowMax<T>::kLanes) {
    const Vec<T> cv(c), low(neg_inf<T>);
    Vec<T> l0 = m.acc, l1 = low, l2 = low, l3 = low;  // locals: the stores to s may alias m
    const auto step = [&](int64_t at, Vec<T>& lanes) {
      const Vec<T> y = Vec<T>::loadu(s + at) + (kVec ? Vec<T>::loadu(b + at) : cv);
      y.store(s + at);
      lanes = at::vec::maximum(lanes, y);
    };
    const int64_t x = in_four_chains(n, step, l0, l1, l2, l3);
    if (x < n) {
      const int64_t rest = n - x;
      const Vec<T> y = Vec<T>::loadu(s + x, rest) + (kVec ? Vec<T>::loadu(b + x, rest) : cv);
      y.store(s + x, rest);
      l1 = at::vec::maximum(l1, Vec<T>::set(low, y, rest));
    }
    m.acc = at::vec::maximum(at::vec::maximum(l0, l1), at::vec::maximum(l2, l3));
  } else {
    for (int64_t x = 0; x < n; ++x) {
      s[x] += kVec ? b[x] : c;
      m.acc = max(m.acc, s[x]);
    }
  }
}

// A row's partial sums: vector lanes for float rows (met once per row, in lanes_sum), a scalar for double rows.
template <typename T>
using Lanes = std::conditional_t<std::is_same_v<T, float>, Vec<float>, T>;

template <typename T>
T lanes_sum(const Lanes<T>& acc) {
  if constexpr (std::is_same_v<T, float>) {
    return at::vec::vec_reduce_all<T>([](Vec<T>& a, Vec<T>& b) { return a + b; }, acc);
  } else {
    return acc;
  }
}

// s[0:n] = exp(s[0:n] - m), their sum added into acc. Float rows run four chains of sums and end in one partial
// vector, not a scalar tail, and leave their sum in lanes: a row's runs (left, band, right) each end in a tail, and
// 15 scalar exps, or a reduction of 16 lanes, each cost about as much as the row's 32 vectors of a 512-key block.
template <typename T>
void exp_into(T* s, int64_t n, T m, Lanes<T>& acc) {
  if constexpr (std::is_same_v<T, float>) {
    const Vec<T> mv(m), zero(0);
    Vec<T> l1 = zero, l2 = zero, l3 = zero;
    const auto step = [&](int64_t at, Vec<T>& lanes) {
      const Vec<T> y = exp_of(Vec<T>::loadu(s + at) - mv);
      y.store(s + at);
      lanes = lanes + y;
    };
    const int64_t x = in_four_chains(n, step, acc, l1, l2, l3);
    if (x < n) {
      const int64_t rest = n - x;
      const Vec<T> y = exp_of(Vec<T>::loadu(s + x, rest) - mv);
      y.store(s + x, rest);
      l1 = l1 + Vec<T>::set(zero, y, rest);
    }
    acc = (acc + l1) + (l2 + l3);
  } else {
    for (int64_t x = 0; x < n; ++x) {
      s[x] = std::exp(s[x] - m);
      acc += s[x];
    }
  }
}

// The sum of s[0:n] (s unchanged).
template <typename T>
T sum(T* s, int64_t n) {
  return transform_reduce(s, n, T(0), T(0), [](auto y, int64_t) { return y; }, add);
}

// ds[0:n] = p[0:n] * (ds[0:n] - d); returns the sum of the new ds.
template <typename T>
T softmax_grad_sum(T* ds, const T* p, int64_t n, T d) {
  return transform_reduce(ds, n, T(0), T(0),
                          [p, d](auto y, int64_t x) {
                            using V = decltype(y);
                            return load<V>(p + x) * (y - V(d));
                          },
                          add);
}

template <typename T>
void add_into(T* dst, const T* src, int64_t n) {
  for (int64_t x = 0; x < n; ++x) dst[x] += src[x];
}

template <typename T>
void scale_row(T* s, int64_t n, T a) {
  for (int64_t x = 0; x < n; ++x) s[x] *= a;
}

// The three runs of one row in a key block: keys [0, left) lie left of the band (table row 0), [left, right)
// in it (table row x + band0), [right, valid) right of it (row 2K); [valid, width) do not exist (causal).
struct Runs {
  int64_t left, right, valid, band0;
};

inline Runs runs_of(int64_t p, int64_t n0, int64_t width, int64_t kk, bool causal) {
  int64_t valid = causal ? std::clamp<int64_t>(p + 1 - n0, 0, width) : width;
  int64_t left = std::clamp<int64_t>(p - kk + 1 - n0, 0, valid);     // j <= p - K
  int64_t right = std::clamp<int64_t>(p + kk - n0, left, valid);     // j <  p + K
  return {left, right, valid, n0 - p + kk};
}

// Columns to compute of a GEMM whose R output columns are wanted: a multiple of 16 (BLAS runs an odd count, such as
// R = 2K + 1 = 1025, 1.1 to 1.9 times slower than 1040 here; the extra columns come from zero table rows).
inline int64_t gemm_columns(int64_t R) { return (R + 15) / 16 * 16; }

// The table rows some (query, key) pairs can meet, as the table GEMMs compute them: `cols` consecutive rows from
// `first`, of which `rows` lie inside the table (first + rows <= R; the others are zero rows of the padded tables,
// or rows no pair meets). Entry t - first of a row laid out by the window holds table row t. A pair with offset
// <= -K (table row 0) exists only where first == 0, one with offset >= K (row 2K) only where 2K < first + cols: the
// left and right runs of a row are empty everywhere else.
struct Window {
  int64_t first = 0, cols = 0, rows = 0;
};

// The window of queries at positions [p0, p1] against keys [j0, j1) (causal: key j <= p only): offsets from
// j0 - p1 to j1 - 1 - p0 (to min(0, j1 - 1 - p0) when causal), clipped to [-K, K]. Its GEMMs compute a multiple of
// 16 columns for long windows (gemm_columns; the window moves back to stay inside the `avail` rows of the tables
// as padded), so a call whose window is wider than its span of offsets (Transformer-XL's K = N - 1 and more)
// costs about (tile + keys - 1) table products per query, not 2K + 1. Empty (cols 0) when there are no keys.
inline Window window_of(int64_t kk, int64_t avail, bool causal, int64_t p0, int64_t p1, int64_t j0, int64_t j1) {
  if (j1 <= j0 || p1 < p0) return {};
  int64_t top = j1 - 1 - p0;
  if (causal) top = std::min<int64_t>(top, 0);
  const int64_t lo = std::clamp<int64_t>(j0 - p1, -kk, kk) + kk, hi = std::clamp<int64_t>(top, -kk, kk) + kk;
  const int64_t n = std::max<int64_t>(hi - lo + 1, 1), R = 2 * kk + 1;
  const int64_t cols = std::min(n > 256 ? gemm_columns(n) : n, avail);
  const int64_t first = std::max<int64_t>(0, std::min(lo, avail - cols));
  return {first, cols, std::min(cols, R - first)};
}

// The row stride of KA and of its gradient's bins for R table rows: the band is read along a diagonal, ld + 1
// apart, so ld + 1 is made an odd number of 64-byte lines (R = 1025 would put the diagonal's lines 4104 bytes
// apart: a few cache sets, evicted before the next row reuses them).
inline int64_t diagonal_ld(int64_t R, int64_t elem_size) {
  const int64_t line = 64 / elem_size;  // elements per cache line
  int64_t ld = gemm_columns(R);         // room for the GEMM's columns
  while ((ld + 1) % (2 * line) != line) ++ld;
  return ld;
}

struct Geometry {
  int64_t B, H, N, M, D, Dv, Hk, Hv, R, kk, off;  // Hk, Hv: heads of the key / value table (1 or H)
  int64_t Hkv, group;                              // key/value heads; query heads per key/value head (H / Hkv)
  bool causal, has_k, has_v;
  bool has_q = false;  // a position-to-content table a^Q
  int64_t Hq = 1;      // its heads (1 or H)
  bool has_b = false;  // a scalar bias per table row
  int64_t Hb = 1;      // its heads (1 or H)
  // Whether the tiles carry QA rows (the key term's row scores): a^K, or the scalar bias alone.
  bool has_qa() const { return has_k || has_b; }
  // What KA depends on besides the batch entry: the key/value head for a shared a^Q, else the query head.
  int64_t ka_head(int64_t h) const { return Hq == 1 ? h / group : h; }
  // The head of each table that query head h reads (0: the table is shared).
  int64_t rel_k_head(int64_t h) const { return Hk == 1 ? 0 : h; }
  int64_t rel_v_head(int64_t h) const { return Hv == 1 ? 0 : h; }
  int64_t rel_q_head(int64_t h) const { return Hq == 1 ? 0 : h; }
  int64_t rel_bias_head(int64_t h) const { return Hb == 1 ? 0 : h; }
};

// The most columns a window of `queries` rows against `keys` keys can have (window_of; at least 1).
inline int64_t window_cap(const Geometry& g, int64_t avail, int64_t queries, int64_t keys) {
  return std::min(avail, gemm_columns(std::clamp<int64_t>(queries + keys - 1, 1, g.R)));
}

// I: the type q, k, v (and dO, out) are stored in; T: the compute type (I, or float for 16-bit I) of the tables,
// the mask and everything computed.
template <typename I, typename T>
struct Views {
  const I *q, *k, *v;
  const T *tk, *tv, *mask;
  int64_t qs[3], ks[3], vs[3];  // strides of dims 0, 1, 2 (the last is 1)
  int64_t ms[4];                // the mask's strides, 0 where it broadcasts
  // The tables with zero rows out to padded_rows (padded_tables): the table GEMMs read a window (Window) of their rows.
  const T *rel_k_padded = nullptr, *rel_v_padded = nullptr, *rel_q_padded = nullptr;
  int64_t padded_rows = 0;
  const T* rel_q = nullptr;     // the position-to-content table a^Q (Hq, R, D), or null
  const T* rel_bias = nullptr;  // the scalar bias (Hb, R), or null
  // The queries the key table reads (q_pos; q itself when none is given) and their strides.
  const I* q_pos = nullptr;
  int64_t q_pos_strides[3] = {};
  // The additive mask of query row i, keys from n0 (its entry for key n0 + x is row[x * ms[3]]), or null.
  const T* mask_row(int64_t b, int64_t h, int64_t i, int64_t n0) const {
    return mask == nullptr ? nullptr : mask + b * ms[0] + h * ms[1] + i * ms[2] + n0 * ms[3];
  }
  const I* qh(int64_t b, int64_t h) const { return q + b * qs[0] + h * qs[1]; }
  const I* q_pos_head(int64_t b, int64_t h) const { return q_pos + b * q_pos_strides[0] + h * q_pos_strides[1]; }
  const I* kh(int64_t b, int64_t hkv) const { return k + b * ks[0] + hkv * ks[1]; }
  const I* vh(int64_t b, int64_t hkv) const { return v + b * vs[0] + hkv * vs[1]; }
};

template <typename I, typename T>
Views<I, T> views(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tk,
                  const at::Tensor& tv, const at::Tensor& mask) {
  Views<I, T> w{q.data_ptr<I>(), k.data_ptr<I>(), v.data_ptr<I>(), tk.defined() ? tk.data_ptr<T>() : nullptr,
                tv.defined() ? tv.data_ptr<T>() : nullptr, mask.defined() ? mask.data_ptr<T>() : nullptr,
                {}, {}, {}, {}};
  for (int d = 0; d < 3; ++d) {
    w.qs[d] = q.stride(d);
    w.ks[d] = k.stride(d);
    w.vs[d] = v.stride(d);
  }
  for (int d = 0; d < 4; ++d) w.ms[d] = mask.defined() && mask.size(d) > 1 ? mask.stride(d) : 0;
  return w;
}

// The tables a^K, a^V, a^Q with zero rows out to `cols` (each undefined where its table is): gemm_columns(R) for
// long tables (R > 256: at R = 1025 the padded GEMM takes 0.90x the time, at R = 129 1.01x, at R = 33 1.11x) with
// enough query rows to repay the copy, else R (the tables as they are). A table longer than a tile's reach
// (tile_q + M - 1 rows) is never read whole: its windows move back inside it instead, and it is not copied.
struct Padded {
  at::Tensor k, v, q;
  int64_t cols;
};

Padded padded_tables(const at::Tensor& tk, const at::Tensor& tv, const at::Tensor& tq, const Geometry& g,
                     int64_t tile_q) {
  const bool whole = g.R <= tile_q + g.M - 1;  // tile_q: as clamped to N
  const int64_t cols = g.N >= 16 && g.R > 256 && whole ? gemm_columns(g.R) : g.R;
  const auto pad = [&](const at::Tensor& t) {
    return t.defined() && cols > g.R ? at::constant_pad_nd(t, {0, 0, 0, cols - g.R}) : t;
  };
  return {pad(tk), pad(tv), pad(tq), cols};
}

// views() with the tables padded (padded_tables) and the position-to-content term (a^Q undefined: none).
template <typename I, typename T>
Views<I, T> views(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tk,
                  const at::Tensor& tv, const at::Tensor& mask, const at::Tensor& tq, const at::Tensor& qp,
                  const Padded& pad, const at::Tensor& tb) {
  Views<I, T> w = views<I, T>(q, k, v, tk, tv, mask);
  if (tb.defined()) w.rel_bias = tb.data_ptr<T>();
  w.padded_rows = pad.cols;
  if (tk.defined()) w.rel_k_padded = pad.k.data_ptr<T>();
  if (tv.defined()) w.rel_v_padded = pad.v.data_ptr<T>();
  if (tq.defined()) {
    w.rel_q = tq.data_ptr<T>();
    w.rel_q_padded = pad.q.data_ptr<T>();
  }
  const at::Tensor& pq = qp.defined() ? qp : q;
  w.q_pos = pq.data_ptr<I>();
  for (int d = 0; d < 3; ++d) w.q_pos_strides[d] = pq.stride(d);
  return w;
}

// Keys per chunk of KA: each chunk's rows hold the window of table rows its keys meet against every query (about
// N + 64 rows, not 2K + 1 nor N + M - 1), and the band is read a chunk at a time (for_pos_band).
constexpr int64_t kPosChunk = 64;

// KA rows of some keys for one query head, chunk by chunk: for key x of chunk c (keys first + c * kPosChunk on),
// ka[x * ld + t - wins[c].first] = scale * k_{first + x} . a^Q_t, and the columns t = 0 (lo) and t = 2K (hi) again,
// contiguous (zeros where the chunk's window holds no such column: no pair meets it).
template <typename T>
struct PosRows {
  const T *ka, *lo, *hi;
  const Window* wins;
  int64_t first, ld;
};

// s[0:n] += the mask row (a constant when the mask broadcasts over keys).
template <typename T>
void add_mask(T* s, const T* row, int64_t n, int64_t key_stride) {
  if (row == nullptr) return;
  if (key_stride == 0) {
    const T c = row[0];
    for (int64_t x = 0; x < n; ++x) s[x] += c;
  } else {
    add_into(s, row, n);
  }
}

// Adds the relative key term to the row's scores s[0:valid] (qa: the row's scores of the table rows in the window
// from table row `first`, or null) and returns their max (-inf if valid == 0, NaN if one is NaN). A left run
// exists only where first == 0, a right one only where the window holds row `last` = 2K (Window).
template <typename T>
T add_key_term(T* s, const Runs& r, const T* qa, int64_t first, int64_t last) {
  RowMax<T> m;
  if (qa == nullptr) {
    add_max<T, false>(s, nullptr, T(0), r.valid, m);
    return m.value();
  }
  add_max<T, false>(s, nullptr, r.left > 0 ? qa[0] : T(0), r.left, m);
  if (r.right > r.left) add_max<T, true>(s + r.left, qa + (r.left + r.band0 - first), T(0), r.right - r.left, m);
  add_max<T, false>(s + r.right, nullptr, r.valid > r.right ? qa[last - first] : T(0), r.valid - r.right, m);
  return m.value();
}

// The band of the position-to-content term over a tile of rows against keys n0 .. n0+width-1, chunk by chunk of KA:
// row a's key x meets KA[x, x + band0(a)], so rows a and a + 1 read the same cache lines of a chunk's KA rows; a
// chunk's lines stay in L1 from one row to the next, where a whole block's would not. ka: KA's rows (or its bins)
// from key `first` in PosRows' layout; f(s_x, ka_x) is called for every (row, band key).
template <typename T, typename F>
void for_pos_band(T* S, int64_t ld_s, const Runs* runs, int64_t tq, int64_t n0, int64_t width, T* ka,
                  const Window* wins, int64_t first, int64_t ld, F f) {
  T* base = ka + (n0 - first) * ld;  // key n0's row
  for (int64_t x0 = 0; x0 < width;) {
    const int64_t key = n0 + x0 - first, c = key / kPosChunk;
    const int64_t x1 = std::min(width, x0 + (c + 1) * kPosChunk - key), tf = wins[c].first;
    for (int64_t a = 0; a < tq; ++a) {
      const Runs& r = runs[a];
      T* s = S + a * ld_s;
      const int64_t d = r.band0 - tf;  // key x of the band meets table row x + band0: entry x * ld + x + d
      for (int64_t x = std::max(x0, r.left), end = std::min(x1, r.right); x < end; ++x) f(s[x], base[x * (ld + 1) + d]);
    }
    x0 = x1;
  }
}

// Adds the position-to-content term to a tile's scores S (rows ld_s apart) against keys n0 .. n0+width-1.
template <typename T>
void add_pos_term(T* S, int64_t ld_s, const Runs* runs, int64_t tq, int64_t n0, int64_t width, const PosRows<T>& pos) {
  const T *lo = pos.lo + (n0 - pos.first), *hi = pos.hi + (n0 - pos.first);
  for (int64_t a = 0; a < tq; ++a) {
    const Runs& r = runs[a];
    add_into(S + a * ld_s, lo, r.left);
    add_into(S + a * ld_s + r.right, hi + r.right, r.valid - r.right);
  }
  for_pos_band(S, ld_s, runs, tq, n0, width, const_cast<T*>(pos.ka), pos.wins, pos.first, pos.ld,
               [](T& s, T& k) { s += k; });
}

// The bins of the position-to-content gradient for a tile's dS, in PosRows' layout (dka, lo, hi: the bins of the
// keys from pos.first, in pos's windows).
template <typename T>
void bin_pos_term(T* dS, int64_t ld_s, const Runs* runs, int64_t tq, int64_t n0, int64_t width, T* dka, T* lo, T* hi,
                  const PosRows<T>& pos) {
  lo += n0 - pos.first;
  hi += n0 - pos.first;
  for (int64_t a = 0; a < tq; ++a) {
    const Runs& r = runs[a];
    add_into(lo, dS + a * ld_s, r.left);
    add_into(hi + r.right, dS + a * ld_s + r.right, r.valid - r.right);
  }
  for_pos_band(dS, ld_s, runs, tq, n0, width, dka, pos.wins, pos.first, pos.ld, [](T& ds, T& k) { k += ds; });
}

// In a row laid out by a window from table row `first`: acc[0 - first] += lo (the left run's sum of s), acc[t -
// first] += s over the band, acc[last - first] += hi (the right run's sum), each only where its run has keys.
template <typename T>
void fold_runs(T* acc, const T* s, const Runs& r, int64_t first, int64_t last, T lo, T hi) {
  if (r.left > 0) acc[0] += lo;
  if (r.right > r.left) add_into(acc + (r.left + r.band0 - first), s + r.left, r.right - r.left);
  if (r.valid > r.right) acc[last - first] += hi;
}

// The keys a tile of rows m0 .. m0+tq-1 meets: [0, kv_end) (causal: up to the last row's position).
inline int64_t kv_end(const Geometry& g, int64_t m0, int64_t tq) {
  return g.causal ? std::clamp<int64_t>(m0 + tq + g.off, 0, g.M) : g.M;
}

// The row stride of KA's rows (and of their bins): room for the widest chunk's window (diagonal_ld).
inline int64_t key_table_ld(const Geometry& g, int64_t avail, int64_t elem_size) {
  return diagonal_ld(window_cap(g, avail, g.N, kPosChunk), elem_size);
}

// The windows of keys [j0, j1) chunk by chunk (kPosChunk keys each): the table rows each chunk meets against every
// query.
inline void key_windows(const Geometry& g, int64_t avail, int64_t j0, int64_t j1, std::vector<Window>& wins) {
  wins.clear();
  for (int64_t c0 = j0; c0 < j1; c0 += kPosChunk)
    wins.push_back(window_of(g.kk, avail, g.causal, g.off, g.off + g.N - 1, c0, std::min(j1, c0 + kPosChunk)));
}

// KA rows of keys [j0, j1) for query head h into ka, lo and hi (PosRows' layout: a GEMM per chunk of keys, in the
// chunks' windows `wins` from key_windows, rows ld apart from key_table_ld; kbuf holds 16-bit keys as T).
template <typename I, typename T>
PosRows<T> key_table_rows(const Geometry& g, const Views<I, T>& w, int64_t b, int64_t h, int64_t j0, int64_t j1,
                          const std::vector<Window>& wins, int64_t ld, T scale, std::vector<T>& kbuf, T* ka, T* lo,
                          T* hi) {
  const int64_t nk = j1 - j0, hq = g.rel_q_head(h);
  int64_t ldk;
  const T* kf = rows_as<T>(w.kh(b, h / g.group) + j0 * w.ks[2], nk, g.D, w.ks[2], kbuf, ldk);
  for (int64_t c = 0, x0 = 0; x0 < nk; ++c, x0 += kPosChunk) {
    const Window& win = wins[c];
    const int64_t x1 = std::min(nk, x0 + kPosChunk), top = 2 * g.kk - win.first;
    gemm<T>(false, true, x1 - x0, win.cols, g.D, scale, kf + x0 * ldk, ldk,
            w.rel_q_padded + (hq * w.padded_rows + win.first) * g.D,
            g.D, T(0), ka + x0 * ld, ld);
    for (int64_t x = x0; x < x1; ++x) {
      lo[x] = win.first == 0 ? ka[x * ld] : T(0);
      hi[x] = top < win.cols ? ka[x * ld + top] : T(0);
    }
  }
  return {ka, lo, hi, wins.data(), j0, ld};
}

// A tile's QA rows (tq rows of win.cols entries from table row win.first): scale * q_pos . a^K_t where there is a key
// table, else zeros, plus the scalar bias b_t on the window's table rows (the columns past them are never met).
template <typename I, typename T>
void tile_key_rows(const Geometry& g, const Views<I, T>& w, int64_t h, const T* qf, int64_t ldq, int64_t tq,
                   const Window& win, T scale, T* QA) {
  if (g.has_k) {
    gemm<T>(false, true, tq, win.cols, g.D, scale, qf, ldq,
            w.rel_k_padded + (g.rel_k_head(h) * w.padded_rows + win.first) * g.D, g.D, T(0), QA,
            win.cols);
  } else {
    std::fill(QA, QA + tq * win.cols, T(0));
  }
  if (g.has_b) {
    const T* b = w.rel_bias + g.rel_bias_head(h) * g.R + win.first;
    for (int64_t a = 0; a < tq; ++a) add_into(QA + a * win.cols, b, win.rows);
  }
}

// Scores of one tile of rows (query head h, key/value head hkv) against keys n0 .. n0+width-1: S[a, x] =
// scale * q . k + mask + the relative key term (from the tile's QA rows, or none), 0 where a row may not see the
// key. For each row its runs and the max of its scores (-inf if it sees no key there).
template <typename I, typename T>
void block_scores(const Geometry& g, const Views<I, T>& w, int64_t b, int64_t h, int64_t hkv, int64_t m0, int64_t tq,
                  int64_t n0, int64_t width, T scale, const T* QA, const Window& win, const PosRows<T>* pos, T* S,
                  int64_t ld, Runs* runs, T* rmax, const PackedHead<I>* packed = nullptr) {
  const I* q = w.qh(b, h) + m0 * w.qs[2];
  if (packed != nullptr) {  // brgemm on packed keys: unscaled
    brgemm_over_keys<I, T>(tq, g.D, width, q, w.qs[2], packed->keys_t(n0), S, ld);
  } else {
    gemm_io<I, T>(false, true, tq, width, g.D, scale, q, w.qs[2], w.kh(b, hkv) + n0 * w.ks[2], w.ks[2], T(0), S, ld);
  }
  for (int64_t a = 0; a < tq; ++a) runs[a] = runs_of(m0 + a + g.off, n0, width, g.kk, g.causal);
  const bool unscaled = packed != nullptr;
  if (unscaled && pos != nullptr)
    for (int64_t a = 0; a < tq; ++a) scale_row(S + a * ld, runs[a].valid, scale);
  if (pos != nullptr) add_pos_term(S, ld, runs, tq, n0, width, *pos);
  for (int64_t a = 0; a < tq; ++a) {
    T* s = S + a * ld;
    const Runs& r = runs[a];
    if (unscaled && pos == nullptr) scale_row(s, r.valid, scale);  // in L1 for the passes below
    add_mask(s, w.mask_row(b, h, m0 + a, n0), r.valid, w.ms[3]);
    rmax[a] = add_key_term(s, r, QA == nullptr ? nullptr : QA + a * win.cols, win.first, 2 * g.kk);
    std::fill(s + r.valid, s + width, T(0));
  }
}

// src[0:n] rounded to I, to nearest even (at::vec::convert's rounding). Built with AVX512_BF16 (native.py adds
// -mavx512bf16 where the CPU has it), bfloat16 takes the CPU's own conversion, 32 floats an instruction where ATen's
// emulates it in ten; that instruction flushes subnormals (below 1.2e-38) to zero, as oneDNN's bfloat16 GEMMs do.
template <typename I>
void round_to(const float* src, I* dst, int64_t n) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<I, at::BFloat16>) {
    int64_t x = 0;
    for (; x + 32 <= n; x += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + x + 16), _mm512_loadu_ps(src + x));
      _mm512_storeu_si512(static_cast<void*>(dst + x), reinterpret_cast<const __m512i&>(v));
    }
    if (x < n) at::vec::convert(src + x, dst + x, n - x);
    return;
  }
#endif
  at::vec::convert(src, dst, n);
}

// A block's row s[0:width] as the GEMM operand's row `a` in buf (rows ld apart): rounded to I right after the row's
// pass has written it (still in L1, where a pass over the whole block would read it back from L2); nothing when I is
// T (the block itself is the operand: operand()).
template <typename I, typename T>
void round_row(const T* s, int64_t a, int64_t ld, int64_t width, std::vector<I>& buf) {
  if constexpr (!std::is_same_v<I, T>) round_to(s, buf.data() + a * ld, width);
}

// The GEMM operand of a block at S whose rows round_row has rounded into buf: S itself when I is T, else buf.
template <typename I, typename T>
const I* operand(const T* S, const std::vector<I>& buf) {
  if constexpr (std::is_same_v<I, T>) {
    return S;
  } else {
    return buf.data();
  }
}

// ------------------------------------------------------------------------------------------- the tasks
//
// forward_impl and backward_impl are each four phases, in this order in the file:
//   scheduling      which tasks there are and which run of them each thread takes (ForwardSchedule, KeySegments and
//                   backward_schedule; balanced_parts over the cost model tile_cost);
//   sequence lookup which sequence a task reads (SeqCall: the call as one sequence sees it, dense or packed);
//   workspace       each thread's buffers, sized for the longest sequence (ForwardWorkspace, BackwardWorkspace);
//   the math        one tile of queries: forward_tile, and backward_tile within backward_segment.

// ------------------------------------------------------------------ sequence lookup

// One sequence of a call: batch entry b, its n query rows from row q0 and its m key rows from row k0 of that entry,
// its first query at position off. A dense call is one sequence per batch entry (q0 = k0 = 0, n = N, m = M, off =
// query_offset); a packed call is one batch entry holding its sequences one after the other (cu_seqlens).
struct Seq {
  int64_t b, q0, k0, n, m, off;
  int64_t id;  // its batch index for the dropout mask: the batch entry of a dense call, the sequence of a packed one
};

// The sequences of a call, and the rows per (batch entry, head) of q, out, lse, dq (rows_q) and of k, v, dk, dv
// (rows_k): N and M for a dense call, T and T_k for a packed one.
struct Batch {
  std::vector<Seq> seqs;
  int64_t rows_q, rows_k;
};

// The call as one sequence sees it: the sequence; the geometry with its lengths and offset (the call's own holds the
// longest lengths, which size the buffers); the inputs (q, q_pos, k, v, the mask) moved to its first rows, so that
// row i of the sequence is row i of these.
template <typename I, typename T>
struct SeqCall {
  const Seq& seq;
  Geometry geom;
  Views<I, T> in;
};

// The call's geometry as one sequence sees it: its lengths and offset.
inline Geometry seq_geometry(const Geometry& geom, const Seq& s) {
  Geometry sg = geom;
  sg.N = s.n;
  sg.M = s.m;
  sg.off = s.off;
  return sg;
}

template <typename I, typename T>
SeqCall<I, T> seq_call(const Geometry& geom, const Views<I, T>& in, const Seq& s) {
  Views<I, T> sv = in;
  sv.q += s.q0 * in.qs[2];
  sv.q_pos += s.q0 * in.q_pos_strides[2];
  sv.k += s.k0 * in.ks[2];
  sv.v += s.k0 * in.vs[2];
  if (sv.mask != nullptr) sv.mask += s.q0 * in.ms[2] + s.k0 * in.ms[3];
  return {s, seq_geometry(geom, s), sv};
}

// ------------------------------------------------------------------ scheduling

// How many parts to split tasks of ``work`` in all (the cost model's units, kRowCost included) into: one (all on the
// calling thread) under 2^18 (about 2^17 multiply-adds: a few microseconds on one thread, less than waking the others
// costs), else one per thread. A decoding step against 512 keys (8 heads, K = 64: 2^19.6) splits its heads over two
// threads, as SDPA's own CPU kernel does, in a little over half the time of one (benchmarks/README.md); one against
// 16 keys stays on the calling thread. On a machine whose cores are all busy, both wait for the descheduled thread.
int64_t parts_for(int64_t tasks, int64_t work) {
  if (tasks <= 0) return 0;
  return work < (int64_t{1} << 18) ? 1 : std::min<int64_t>(tasks, at::get_num_threads());
}

// The bounds of `parts` runs of consecutive tasks of about equal cost (cum[t]: the cost of tasks [0, t)): part p is
// tasks [bounds[p], bounds[p + 1]). Ragged sequences make tasks of unequal cost, and at::parallel_for hands each
// thread an equal count of consecutive tasks; the parts depend on the shapes and the thread count only, so which
// task adds into which thread's table gradients is the same from one run to the next.
std::vector<int64_t> balanced_parts(const std::vector<int64_t>& cum, int64_t parts) {
  const int64_t n = static_cast<int64_t>(cum.size()) - 1, total = cum.back();
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t target = total / parts * p + total % parts * p / parts;
    const int64_t t = std::lower_bound(cum.begin(), cum.end(), target) - cum.begin();
    bounds[p] = std::clamp<int64_t>(t, bounds[p - 1], n);
  }
  return bounds;
}

// What a query row costs besides its keys and table rows, in the cost model's units (a key's multiply-adds per head
// dim): the row's softmax statistics, its runs, its share of the small GEMMs of a short sequence. Measured on the
// ragged benchmark (benchmarks/shapes.py's ``ragged``): without it the thread with the short sequences finished 5%
// (forward) to 8% (backward) after the other.
constexpr int64_t kRowCost = 128;

// The cost model: `rows` query rows against `keys` keys, with the table rows of their window (at most `table_cols`)
// where there are relative tables (`tables`).
inline int64_t tile_cost(int64_t rows, int64_t keys, bool tables, int64_t table_cols) {
  return rows * (kRowCost + keys + (tables ? std::min(table_cols, rows + keys) : 0));
}

// fn(part, first task, end task) for the runs of tasks ``bounds`` makes (balanced_parts), in parallel: a thread given
// several parts runs them as one run, under its first part's number.
template <typename F>
void for_parts(const std::vector<int64_t>& bounds, F fn) {
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1,
                   [&](int64_t p0, int64_t p1) { fn(p0, bounds[p0], bounds[p1]); });
}

// A forward task: the tile of query rows m0 .. m0 + tile_q - 1 (fewer at the end) of query head h in sequence seq.
struct ForwardTask {
  int64_t seq, h, m0;
};

// The forward's tasks, numbered sequence by sequence, head by head, tile by tile (consecutive tasks share a head, and
// its KA rows), and the threads' runs of them.
struct ForwardSchedule {
  std::vector<int64_t> first;   // first[s]: sequence s's first task; first.back(): how many tasks there are
  std::vector<int64_t> bounds;  // the threads' runs of tasks (balanced_parts)
  int64_t heads, tile_q;
  ForwardTask task(int64_t t) const {
    const int64_t s = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
    const int64_t tiles = (first[s + 1] - first[s]) / heads;  // the sequence's tiles per head
    return {s, (t - first[s]) / tiles, (t - first[s]) % tiles * tile_q};
  }
};

ForwardSchedule forward_schedule(const Geometry& geom, const Batch& batch, int64_t tile_q, int64_t table_cols) {
  const int64_t nseq = static_cast<int64_t>(batch.seqs.size());
  const bool tables = geom.has_qa() || geom.has_v;
  ForwardSchedule sched{std::vector<int64_t>(nseq + 1, 0), {}, geom.H, tile_q};
  std::vector<int64_t> cum{0};  // cum[t]: the cost of tasks [0, t) (multiply-adds per head dim)
  for (int64_t s = 0; s < nseq; ++s) {
    const Seq& seq = batch.seqs[s];
    const int64_t n = seq.n;
    const Geometry sg = seq_geometry(geom, seq);
    sched.first[s + 1] = sched.first[s] + geom.H * ((n + tile_q - 1) / tile_q);
    for (int64_t h = 0; h < geom.H; ++h) {
      for (int64_t m0 = 0; m0 < n; m0 += tile_q) {
        const int64_t rows = std::min(tile_q, n - m0);
        cum.push_back(cum.back() + tile_cost(rows, kv_end(sg, m0, rows), tables, table_cols));
      }
    }
  }
  sched.bounds = balanced_parts(cum, parts_for(sched.first[nseq], cum.back() * (geom.D + geom.Dv)));
  return sched;
}

// The backward's segments of keys: a sequence of m keys is cut into `splits` segments of whole key blocks (the last
// ones shorter, or empty).
struct KeySegments {
  int64_t splits, tile_k;
  int64_t keys(int64_t m) const { return ((m + tile_k - 1) / tile_k + splits - 1) / splits * tile_k; }
  int64_t lo(int64_t m, int64_t split) const { return split * keys(m); }
  int64_t hi(int64_t m, int64_t split) const { return std::min(m, lo(m, split) + keys(m)); }
};

// A backward task: the keys [keys_lo, keys_hi) of key/value head hkv in sequence seq (segment `split`), against the
// query heads of its group.
struct BackwardTask {
  int64_t seq, hkv, split;
};

// The backward's tasks are numbered ((sequence * Hkv + hkv) * splits + split).
inline BackwardTask backward_task(int64_t t, int64_t kv_heads, int64_t splits) {
  return {t / splits / kv_heads, t / splits % kv_heads, t % splits};
}

// The threads' runs of the backward's tasks (balanced_parts).
std::vector<int64_t> backward_schedule(const Geometry& geom, const Batch& batch, int64_t tile_q,
                                       const KeySegments& segs, int64_t table_cols) {
  const bool tables = geom.has_qa() || geom.has_v;
  // cum[t]: the cost of tasks [0, t) (multiply-adds per head dim and query head)
  std::vector<int64_t> cum{0}, segment_cost(segs.splits);
  for (const Seq& seq : batch.seqs) {
    const Geometry sg = seq_geometry(geom, seq);
    for (int64_t split = 0; split < segs.splits; ++split) {
      const int64_t lo = segs.lo(seq.m, split), hi = segs.hi(seq.m, split);
      segment_cost[split] = 1;
      for (int64_t m0 = 0; m0 < seq.n; m0 += tile_q) {
        const int64_t rows = std::min(tile_q, seq.n - m0);
        const int64_t keys = std::max<int64_t>(0, std::min(kv_end(sg, m0, rows), hi) - lo);
        if (keys > 0) segment_cost[split] += tile_cost(rows, keys, tables, table_cols);
      }
    }
    for (int64_t hkv = 0; hkv < geom.Hkv; ++hkv)
      for (int64_t split = 0; split < segs.splits; ++split) cum.push_back(cum.back() + segment_cost[split]);
  }
  const int64_t tasks = static_cast<int64_t>(batch.seqs.size()) * geom.Hkv * segs.splits;
  return balanced_parts(cum, std::min<int64_t>(tasks, at::get_num_threads()));
}

// ------------------------------------------------------------------ workspace

// The keys and values of every (sequence, key/value head) of a 16-bit call in the forms its GEMMs read them through
// brgemm (PackedHead's layout; the forward's: k^T and v rows, the backward's: k^T, v^T and k rows), packed once per
// call, rows past a sequence's last key zero: its GEMMs over keys run on oneDNN's micro-kernel (AMX tiles where the
// CPU has them), which reads B packed, in 0.2-0.4 of the time MKL's 16-bit GEMMs take on the per-tile shapes
// (benchmarks/gemm16.py). `on` false: not packed (the GEMMs go to MKL).
template <typename I>
struct PackedKV {
  bool on = false, backward = false;
  std::vector<int64_t> at, chunk_at, mp;  // per sequence: where its heads start, its first chunk, its rows
  at::Tensor data;                        // per sequence and head: k^T, v^T (backward), k rows (backward), v rows
  int64_t d = 0, dv = 0, hkv = 0;
  int64_t chunks(int64_t s) const { return (chunk_at[s + 1] - chunk_at[s]) / hkv; }  // of kPackCols keys, a head
  int64_t head_size(int64_t s) const {
    const int64_t blocks = chunks(s) * kPackCols;
    return blocks * d + (backward ? blocks * dv + mp[s] * d : mp[s] * dv);
  }
  PackedHead<I> head(int64_t s, int64_t h) const {
    const int64_t blocks = chunks(s) * kPackCols;
    I* base = data.data_ptr<I>() + at[s] + h * head_size(s);
    PackedHead<I> ph{base, nullptr, nullptr, nullptr, d, dv, mp[s]};
    if (backward) {
      ph.vt = base + blocks * d;
      ph.kr = ph.vt + blocks * dv;
    } else {
      ph.vr = base + blocks * d;
    }
    return ph;
  }
};

// rows x d of src (rows ld apart), n <= kPackCols of them, transposed into buf (d, kPackCols; zero past row n) and
// packed at dst.
template <typename I>
void pack_transposed(const I* src, int64_t ld, int64_t n, int64_t d, std::vector<I>& buf, I* dst) {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F16F16F32)
  constexpr at::ScalarType dt = c10::CppTypeToScalarType<I>::value;
  std::fill(buf.begin(), buf.begin() + d * kPackCols, I(0));
  for (int64_t x = 0; x < n; ++x)
    for (int64_t c = 0; c < d; ++c) buf[c * kPackCols + x] = src[x * ld + c];
  at::native::cpublas::pack(d, kPackCols, kPackCols, kPackCols, dt, dt, buf.data(), dst);
#endif
}

// n <= kPackCols rows of src (ld apart) as the rows of PackedHead's row form: each column block copied into buf and
// packed at its place (at(c0): the block's rows from this chunk's first), an odd count with a zero row.
template <typename I, typename F>
void pack_rows(const I* src, int64_t ld, int64_t n, int64_t d, std::vector<I>& buf, F at) {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F16F16F32)
  constexpr at::ScalarType dt = c10::CppTypeToScalarType<I>::value;
  const int64_t rows = n + n % 2;
  for (int64_t c0 = 0; c0 < d; c0 += kPackCols) {
    const int64_t cols = std::min(kPackCols, d - c0);
    for (int64_t x = 0; x < n; ++x) std::copy(src + x * ld + c0, src + x * ld + c0 + cols, &buf[x * cols]);
    std::fill(buf.begin() + n * cols, buf.begin() + rows * cols, I(0));
    at::native::cpublas::pack(rows, cols, cols, cols, dt, dt, buf.data(), const_cast<I*>(at(c0)));
  }
#endif
}

// Packs the forms the forward (or the backward) reads of every sequence and key/value head, in parallel over chunks
// of kPackCols keys.
template <typename I, typename T>
PackedKV<I> pack_keys_values(const Geometry& geom, const Views<I, T>& in, const Batch& batch, bool backward) {
  PackedKV<I> p;
  if constexpr (is_16_bit<I>) {
    p.on = true;
    p.backward = backward;
    p.d = geom.D;
    p.dv = geom.Dv;
    p.hkv = geom.Hkv;
    int64_t total = 0;
    p.chunk_at.push_back(0);
    for (const Seq& s : batch.seqs) {
      p.at.push_back(total);
      p.mp.push_back(s.m + s.m % 2);
      p.chunk_at.push_back(p.chunk_at.back() + geom.Hkv * ((s.m + kPackCols - 1) / kPackCols));
      total += geom.Hkv * p.head_size(static_cast<int64_t>(p.at.size()) - 1);
    }
    p.data = at::empty({total}, at::TensorOptions().dtype(c10::CppTypeToScalarType<I>::value));
    at::parallel_for(0, p.chunk_at.back(), 1, [&](int64_t c0, int64_t c1) {
      std::vector<I> buf(std::max(geom.D, geom.Dv) * kPackCols);  // a chunk transposed, or a column block of rows
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t s = std::upper_bound(p.chunk_at.begin(), p.chunk_at.end(), c) - p.chunk_at.begin() - 1;
        const Seq& seq = batch.seqs[s];
        const int64_t kb = p.chunks(s), h = (c - p.chunk_at[s]) / kb;
        const int64_t n0 = (c - p.chunk_at[s]) % kb * kPackCols, n = std::min(kPackCols, seq.m - n0);
        const SeqCall<I, T> call = seq_call(geom, in, seq);
        const PackedHead<I> ph = p.head(s, h);
        const I *k = call.in.kh(seq.b, h) + n0 * in.ks[2], *v = call.in.vh(seq.b, h) + n0 * in.vs[2];
        pack_transposed(k, in.ks[2], n, geom.D, buf, const_cast<I*>(ph.keys_t(n0)));
        if (backward) {
          pack_transposed(v, in.vs[2], n, geom.Dv, buf, const_cast<I*>(ph.values_t(n0)));
          pack_rows(k, in.ks[2], n, geom.D, buf, [&](int64_t col) { return ph.key_rows(col, n0); });
        } else {
          pack_rows(v, in.vs[2], n, geom.Dv, buf, [&](int64_t col) { return ph.value_rows(col, n0); });
        }
      }
    });
  }
  return p;
}

// The position-to-content term's KA rows of some keys for one head at a time (PosRows' layout), with the buffers they
// are formed in.
template <typename T>
struct KeyScores {
  std::vector<T> ka, lo, hi;  // KA rows, and their columns t = 0 and t = 2K contiguous
  std::vector<T> keys;        // 16-bit keys as T, for the GEMM with a^Q
  std::vector<Window> windows;  // the table rows each chunk of keys meets (key_windows)
  PosRows<T> rows{};          // what the tiles read
  int64_t held = -1;          // the forward's: which (sequence, KA head) the rows are of
  KeyScores(const Geometry& geom, int64_t max_keys, int64_t ld, bool narrow)
      : ka(geom.has_q ? max_keys * ld : 0), lo(geom.has_q ? max_keys : 0), hi(geom.has_q ? max_keys : 0),
        keys(narrow && geom.has_q ? max_keys * geom.D : 0) {}
  // Forms the rows of keys [j0, j1) for query head h, in the chunks' `windows`, rows ld apart.
  template <typename I>
  void form(const SeqCall<I, T>& call, int64_t h, int64_t j0, int64_t j1, int64_t ld, T scale) {
    rows = key_table_rows(call.geom, call.in, call.seq.b, h, j0, j1, windows, ld, scale, keys, ka.data(), lo.data(),
                          hi.data());
  }
};

// A forward thread's buffers, for tiles of tile_q queries against blocks of tile_k keys, their table rows
// `table_cols` wide.
template <typename I, typename T>
struct ForwardWorkspace {
  int64_t tile_q, tile_k, table_cols;
  std::vector<T> scores;         // S: a block's scores, then its weights (tile_q, tile_k)
  std::vector<T> key_rows;       // QA: each row's key-term score per table row of the window (tile_q, table_cols)
  std::vector<T> value_weights;  // PW: each row's summed weights per table row of the window (tile_q, table_cols)
  std::vector<T> acc;            // the rows' unnormalised outputs (tile_q, Dv)
  std::vector<T> row_max, row_sum, block_max;  // the online softmax's running max and sum per row; a block's max
  std::vector<T> pos_queries;    // 16-bit q_pos rows as T, for the GEMM with a^K
  std::vector<I> weights16;      // a block's weights rounded to I, for the GEMM with 16-bit v
  std::vector<Runs> runs;        // each row's runs in the block
  std::vector<uint32_t> key_hashes;  // the dropout hashes of a block's keys
  KeyScores<T> pos;              // KA rows of every key of the sequence, for the current task's head
  ForwardWorkspace(const Geometry& geom, int64_t tile_q, int64_t tile_k, int64_t table_cols, int64_t ka_ld, bool drop)
      : tile_q(tile_q), tile_k(tile_k), table_cols(table_cols), scores(tile_q * tile_k),
        key_rows(geom.has_qa() ? tile_q * table_cols : 0), value_weights(geom.has_v ? tile_q * table_cols : 0),
        acc(tile_q * geom.Dv), row_max(tile_q), row_sum(tile_q), block_max(tile_q),
        pos_queries(!std::is_same_v<I, T> && geom.has_k ? tile_q * geom.D : 0),
        weights16(!std::is_same_v<I, T> ? tile_q * tile_k : 0), runs(tile_q), key_hashes(drop ? tile_k : 0),
        pos(geom, geom.M, ka_ld, !std::is_same_v<I, T>) {}
};

// A backward thread's buffers, for tiles of tile_q queries against blocks of tile_k keys of segments of at most
// `seg_keys` keys, their table rows `table_cols` wide.
template <typename I, typename T>
struct BackwardWorkspace {
  int64_t tile_q, tile_k, table_cols;
  std::vector<T> weights;      // P: a block's softmax weights (tile_q, tile_k)
  std::vector<T> grads;        // with dropout first the dropped weights PZ; then dP, then dS (tile_q, tile_k)
  std::vector<T> keep;         // Z: the block's dropout mask, 0 or 1 / (1 - p) (tile_q, tile_k)
  std::vector<T> out_dot;      // rowsum(dO * O) per row
  std::vector<T> block_max;    // each row's max score in the block
  std::vector<Runs> runs;      // each row's runs in the block
  std::vector<T> key_rows, key_rows_grad;  // QA and dQA, the sums of dS per table row (tile_q, table_cols)
  std::vector<T> value_rows;   // DOA: dO_i . a^V_t (tile_q, table_cols)
  std::vector<T> value_weights;  // PW: each row's summed weights per table row (tile_q, table_cols)
  std::vector<T> pos_queries, dout_rows;  // 16-bit q_pos and dO rows as T, for the GEMMs with the tables
  std::vector<I> block16;      // a block's weights or dS rounded to I, for the GEMMs with 16-bit inputs
  std::vector<T> dq_rows;      // brgemm: the tile's dS @ k, unscaled (tile_q, D)
  std::vector<uint32_t> key_hashes;  // the dropout hashes of a block's keys
  KeyScores<T> pos;            // KA rows of the task's keys, for one query head at a time
  std::vector<T> pos_grad, pos_grad_lo, pos_grad_hi;  // dKA's bins, and its edge columns (PosRows' layout)
  BackwardWorkspace(const Geometry& geom, int64_t tile_q, int64_t tile_k, int64_t seg_keys, int64_t table_cols,
                    int64_t ka_ld, bool drop, bool brgemm)
      : tile_q(tile_q), tile_k(tile_k), table_cols(table_cols), weights(tile_q * tile_k), grads(tile_q * tile_k),
        keep(drop ? tile_q * tile_k : 0), out_dot(tile_q), block_max(tile_q), runs(tile_q),
        key_rows(geom.has_qa() ? tile_q * table_cols : 0), key_rows_grad(geom.has_qa() ? tile_q * table_cols : 0),
        value_rows(geom.has_v ? tile_q * table_cols : 0), value_weights(geom.has_v ? tile_q * table_cols : 0),
        pos_queries(!std::is_same_v<I, T> && geom.has_k ? tile_q * geom.D : 0),
        dout_rows(!std::is_same_v<I, T> && geom.has_v ? tile_q * geom.Dv : 0),
        block16(!std::is_same_v<I, T> ? tile_q * tile_k : 0), dq_rows(brgemm ? tile_q * geom.D : 0),
        key_hashes(drop ? tile_k : 0),
        pos(geom, seg_keys, ka_ld, !std::is_same_v<I, T>), pos_grad(geom.has_q ? seg_keys * ka_ld : 0),
        pos_grad_lo(geom.has_q ? seg_keys : 0), pos_grad_hi(geom.has_q ? seg_keys : 0) {}
};

// ------------------------------------------------------------------ the math of one tile

// One row's dropout mask in a block (keep_row, drop_row): off where dropout is.
template <typename T>
struct RowMask {
  bool on;
  uint32_t row;           // the row's hash
  const uint32_t* cols;   // the block's key hashes
  uint32_t thresh;
  T inv;                  // 1 / (1 - p)
};

template <typename T>
inline RowMask<T> row_mask(const Dropout& drop, uint32_t key, int64_t i, const uint32_t* cols) {
  if (!drop.on) return {false, 0, cols, 0, T(0)};
  return {true, drop.row(key, i), cols, drop.thresh, static_cast<T>(drop.inv)};
}

// Softmax, one row of a block, online (flash attention's): the row's scores s (runs r, max block_max) become their
// weights exp(s - max), dropped where the mask drops them after their sum has joined the normaliser; the running max
// and sum, the row's output acc (Dv) and the value term's weights pw (win.cols, or null: no a^V) are rescaled to the
// new max, and pw takes the block's weights per table row. A block where the row sees no key leaves it as it was; a
// NaN score makes the row NaN from then on.
template <typename T>
inline void softmax_block_row(T* s, const Runs& r, T block_max, T& row_max, T& row_sum, T* acc, int64_t dv, T* pw,
                              const Window& win, int64_t last, const RowMask<T>& mask) {
  if (!(block_max > neg_inf<T> && block_max <= std::numeric_limits<T>::max() && row_sum == row_sum)) {
    // no key here (max -inf), or a NaN row: from now on (max NaN or +inf), or already (sum NaN)
    if (row_is_nan(block_max)) row_max = row_sum = std::numeric_limits<T>::quiet_NaN();
    std::fill(s, s + r.valid, T(0));
    return;
  }
  const T new_max = std::max(row_max, block_max);
  const T alpha = std::exp(row_max - new_max);
  // one sum of lanes for the row; the left and right runs' own where the value term folds them undropped
  const bool runs_apart = pw != nullptr && !mask.on;
  Lanes<T> lanes_lo(0), lanes_hi(0), lanes(0);
  exp_into(s, r.left, new_max, runs_apart ? lanes_lo : lanes);
  exp_into(s + r.left, r.right - r.left, new_max, lanes);
  exp_into(s + r.right, r.valid - r.right, new_max, runs_apart ? lanes_hi : lanes);
  const T lo = runs_apart ? lanes_sum<T>(lanes_lo) : T(0), hi = runs_apart ? lanes_sum<T>(lanes_hi) : T(0);
  const T mid = lanes_sum<T>(lanes);
  // dropout: the weights that meet v and a^V are dropped, the normaliser is the undropped sum
  if (mask.on) drop_row(s, r.valid, mask.row, mask.cols, mask.thresh, mask.inv);
  if (pw != nullptr) {
    if (alpha != T(1)) scale_row(pw, win.cols, alpha);
    fold_runs(pw, s, r, win.first, last, mask.on ? sum(s, r.left) : lo,
              mask.on ? sum(s + r.right, r.valid - r.right) : hi);
  }
  row_sum = row_sum * alpha + lo + mid + hi;
  row_max = new_max;
  if (alpha != T(1)) scale_row(acc, dv, alpha);
}

// The tile's output rows out = acc / sum (rows dv apart) and their log-sum-exp max + log(sum). A row that saw no key
// gets zeros (NaN where a NaN value met the zero weights) and lse -inf; a NaN row NaN.
template <typename I, typename T>
inline void write_rows(int64_t rows, int64_t dv, const T* acc, const T* row_max, const T* row_sum, I* out, T* lse) {
  for (int64_t a = 0; a < rows; ++a) {
    I* o = out + a * dv;
    const T* src = acc + a * dv;
    if (row_sum[a] != row_sum[a]) {  // a NaN reached the row's scores
      std::fill(o, o + dv, static_cast<I>(row_sum[a]));
      lse[a] = row_sum[a];
    } else if (row_sum[a] == T(0)) {  // no key: zeros (NaN where a NaN value met the zero weights), lse -inf
      for (int64_t x = 0; x < dv; ++x) o[x] = static_cast<I>(src[x] * T(0));
      lse[a] = neg_inf<T>;
    } else {
      const T inv = T(1) / row_sum[a];
      for (int64_t x = 0; x < dv; ++x) o[x] = static_cast<I>(src[x] * inv);
      lse[a] = row_max[a] + std::log(row_sum[a]);
    }
  }
}

// A forward task: query rows m0 .. m0+rows-1 of head h against every key they may see, into out and lse (from the
// tile's first row). Per tile: QA = scale * q_pos a^K^T (+ rel_bias) on the table rows of the tile's window; per block
// of keys: S = scale * q k^T + mask + the relative key terms (block_scores), the online softmax (softmax_block_row,
// dropout inside), acc += P v; at the end acc += PW a^V, out = acc / sum, lse.
template <typename I, typename T>
void forward_tile(const SeqCall<I, T>& call, int64_t h, int64_t m0, const Dropout& drop, T scale,
                  ForwardWorkspace<I, T>& ws, I* out, T* lse, const PackedHead<I>* packed, bool direct) {
  const Geometry& geom = call.geom;
  const Views<I, T>& in = call.in;
  const int64_t b = call.seq.b, hkv = h / geom.group, last = 2 * geom.kk;
  const int64_t rows = std::min(ws.tile_q, geom.N - m0), keys_end = kv_end(geom, m0, rows), ld = ws.tile_k;
  const uint32_t drop_key = drop.on ? drop.key(call.seq.id, h) : 0;
  // the table rows the tile meets: QA and PW rows hold win.cols entries, from table row win.first
  const Window win = window_of(geom.kk, in.padded_rows, geom.causal, m0 + geom.off, m0 + rows - 1 + geom.off, 0,
                               keys_end);
  if (geom.has_qa()) {
    int64_t ldq = 0;
    const T* qf = geom.has_k ? rows_as<T>(in.q_pos_head(b, h) + m0 * in.q_pos_strides[2], rows, geom.D,
                                          in.q_pos_strides[2], ws.pos_queries, ldq)
                             : nullptr;
    tile_key_rows(geom, in, h, qf, ldq, rows, win, scale, ws.key_rows.data());
  }
  if (packed != nullptr) release_brgemm();  // after MKL's GEMMs (the tables', the task's KA rows)
  std::fill(ws.value_weights.begin(), ws.value_weights.end(), T(0));
  std::fill(ws.acc.begin(), ws.acc.end(), T(0));
  std::fill(ws.row_max.begin(), ws.row_max.end(), neg_inf<T>);
  std::fill(ws.row_sum.begin(), ws.row_sum.end(), T(0));
  const I* v = in.vh(b, hkv);
  for (int64_t n0 = 0; n0 < keys_end; n0 += ws.tile_k) {
    const int64_t width = std::min(ws.tile_k, keys_end - n0);
    block_scores(geom, in, b, h, hkv, m0, rows, n0, width, scale, geom.has_qa() ? ws.key_rows.data() : nullptr, win,
                 geom.has_q ? &ws.pos.rows : nullptr, ws.scores.data(), ld, ws.runs.data(), ws.block_max.data(),
                 packed);
    if (drop.on) drop.cols(drop_key, n0, width, ws.key_hashes.data());
    for (int64_t a = 0; a < rows; ++a) {
      softmax_block_row(ws.scores.data() + a * ld, ws.runs[a], ws.block_max[a], ws.row_max[a], ws.row_sum[a],
                        ws.acc.data() + a * geom.Dv, geom.Dv,
                        geom.has_v ? ws.value_weights.data() + a * win.cols : nullptr, win, last,
                        row_mask<T>(drop, drop_key, m0 + a, ws.key_hashes.data()));
      round_row(ws.scores.data() + a * ld, a, ld, width, ws.weights16);
    }
    const I* weights = operand<I>(ws.scores.data(), ws.weights16);
    if (packed != nullptr) {
      brgemm_over_columns<I, T>(rows, geom.Dv, width, ws.weights16.data(), ld,
                                [&](int64_t c0) { return packed->value_rows(c0, n0); }, ws.acc.data());
    } else if (direct) {  // float32 brgemm on v as it lies
      brgemm_rows<I, T>(rows, geom.Dv, width, ws.scores.data(), ld, v + n0 * in.vs[2], in.vs[2], ws.acc.data(), geom.Dv,
                     true);
    } else {
      gemm_io<I, T>(false, false, rows, geom.Dv, width, T(1), weights, ld, v + n0 * in.vs[2], in.vs[2], T(1),
                    ws.acc.data(), geom.Dv);
    }
  }
  if (geom.has_v)
    gemm<T>(false, false, rows, geom.Dv, win.rows, T(1), ws.value_weights.data(), win.cols,
            in.rel_v_padded + (geom.rel_v_head(h) * in.padded_rows + win.first) * geom.Dv, geom.Dv, T(1),
            ws.acc.data(), geom.Dv);
  write_rows(rows, geom.Dv, ws.acc.data(), ws.row_max.data(), ws.row_sum.data(), out, lse);
}

// The forward: each thread runs its tasks (forward_schedule) with its own buffers; a task reads its sequence
// (seq_call), forms the KA rows of its sequence and head where the previous task's were another's, and runs its tile.
template <typename I, typename T>
void forward_impl(const Geometry& geom, const Views<I, T>& in, const Batch& batch, const Dropout& drop, T scale,
                  int64_t tile_q, int64_t tile_k, bool brgemm, I* out, T* lse) {
  const PackedKV<I> packed = brgemm && is_16_bit<I> ? pack_keys_values(geom, in, batch, false) : PackedKV<I>{};
  // float32: brgemm on the rows of v as they lie, where they lie dense (rows a head's width apart, as measured; rows a
  // token apart, as a (B, N, H, D) projection's view gives them, keep MKL's, which copies what it reads)
  const bool direct = brgemm && std::is_same_v<I, float> && in.vs[2] == geom.Dv;
  const int64_t table_cols = window_cap(geom, in.padded_rows, tile_q, geom.M);  // columns of a tile's table rows
  const ForwardSchedule sched = forward_schedule(geom, batch, tile_q, table_cols);
  // The position-to-content term: KA's row stride, room for the longest sequence's windows.
  const int64_t ka_ld = geom.has_q ? key_table_ld(geom, in.padded_rows, sizeof(T)) : 0;
  for_parts(sched.bounds, [&](int64_t, int64_t begin, int64_t end) {
    ForwardWorkspace<I, T> ws(geom, tile_q, tile_k, table_cols, ka_ld, drop.on);
    for (int64_t t = begin; t < end; ++t) {
      const ForwardTask task = sched.task(t);
      const SeqCall<I, T> call = seq_call(geom, in, batch.seqs[task.seq]);
      const int64_t ka_of = task.seq * geom.H + geom.ka_head(task.h);
      if (geom.has_q && ka_of != ws.pos.held) {  // consecutive tasks share a head: once per head and thread
        key_windows(call.geom, in.padded_rows, 0, call.geom.M, ws.pos.windows);
        ws.pos.form(call, task.h, 0, call.geom.M, ka_ld, scale);
        ws.pos.held = ka_of;
      }
      const int64_t row0 = (call.seq.b * geom.H + task.h) * batch.rows_q + call.seq.q0 + task.m0;  // of out, lse
      const PackedHead<I> head = packed.on ? packed.head(task.seq, task.h / geom.group) : PackedHead<I>{};
      forward_tile(call, task.h, task.m0, drop, scale, ws, out + row0 * geom.Dv, lse + row0,
                   packed.on ? &head : nullptr, direct);
    }
    if (packed.on || direct) release_brgemm();
  });
}

// What the backward reads besides the inputs (dO with its strides, out, lse) and where it writes: dq (splits, B, H,
// rows_q, D) slabs, one per key segment; dq_pos likewise (the key table's share of q_pos's gradient) or null (it goes
// to dq); dk, dv; each table's gradient, one copy per thread (or one for all where `own`: each head's rows have one
// writer), null without the table.
template <typename I, typename T>
struct BackwardIO {
  const I* dout;
  int64_t dout_strides[3];
  const I* out;
  const T* lse;
  T *dq, *dq_pos, *dk, *dv;
  T *d_rel_k, *d_rel_v, *d_rel_q, *d_rel_bias;
  bool own[4];  // rel_k, rel_v, rel_q, rel_bias
};

// Where a run of tasks (part `part`) adds its table gradients.
template <typename T>
struct TableGrads {
  T *rel_k, *rel_v, *rel_q, *rel_bias;
};

template <typename I, typename T>
TableGrads<T> part_table_grads(const Geometry& geom, const BackwardIO<I, T>& io, int64_t part) {
  const int64_t R = geom.R;
  return {geom.has_k ? io.d_rel_k + (io.own[0] ? 0 : part) * geom.Hk * R * geom.D : nullptr,
          geom.has_v ? io.d_rel_v + (io.own[1] ? 0 : part) * geom.Hv * R * geom.Dv : nullptr,
          geom.has_q ? io.d_rel_q + (io.own[2] ? 0 : part) * geom.Hq * R * geom.D : nullptr,
          geom.has_b ? io.d_rel_bias + (io.own[3] ? 0 : part) * geom.Hb * R : nullptr};
}

// A backward tile's rows of one query head, from its first row: dO (rows dout_ld apart), O, lse; dq and dq_pos (dq
// itself without q_pos) to add into.
template <typename I, typename T>
struct TileRows {
  const I* dout;
  int64_t dout_ld;
  const I* out;
  const T* lse;
  T *dq, *dq_pos;
};

// A backward task's keys [lo, hi) of key/value head hkv: k and v from the head's first row, and dk and dv to add into.
template <typename I, typename T>
struct SegmentKeys {
  const I *k, *v;
  T *dk, *dv;
  int64_t lo, hi;
  const PackedHead<I>* packed = nullptr;  // the head's keys and values packed for brgemm, or null (MKL's GEMMs)
  bool direct = false;                    // float32: dS k through brgemm on k as it lies
};

// Softmax, one row of a block, recomputed: the row's scores s (runs r, max block_max) become P = exp(s - lse), and
// with dropout pz = P * Z (Z: the row's mask z, 0 or 1 / (1 - p)), else pz is s; pw (win.cols, or null: no a^V) takes
// pz's sums per table row. A row with no key here or none at all (lse -inf) has zero weights; a NaN row (lse NaN) NaN
// weights, so that NaN reaches every gradient the row feeds.
template <typename T>
inline void weights_row(T* s, T* z, T* pz, const Runs& r, int64_t width, T block_max, T lse, T* pw, const Window& win,
                        int64_t last, const RowMask<T>& mask) {
  const bool flat = r.valid == 0 || block_max == neg_inf<T> || !(lse > neg_inf<T>);
  const T p = !flat || lse == lse || r.valid == 0 ? T(0) : lse;
  // the exps, and with the value term and no dropout the left and right runs' sums in the same pass
  const bool runs_apart = pw != nullptr && !flat && !mask.on;
  Lanes<T> lanes_lo(0), lanes_hi(0), lanes(0);
  if (flat) {
    std::fill(s, s + r.valid, p);
    std::fill(s + r.valid, s + width, T(0));
  } else if (runs_apart) {
    exp_into(s, r.left, lse, lanes_lo);
    exp_into(s + r.left, r.right - r.left, lse, lanes);
    exp_into(s + r.right, r.valid - r.right, lse, lanes_hi);
  } else {
    exp_into(s, r.valid, lse, lanes);
  }
  if (runs_apart) return fold_runs(pw, s, r, win.first, last, lanes_sum<T>(lanes_lo), lanes_sum<T>(lanes_hi));
  if (mask.on) {
    keep_row(z, r.valid, mask.row, mask.cols, mask.thresh, mask.inv);
    for (int64_t x = 0; x < r.valid; ++x) pz[x] = s[x] * z[x];
    std::fill(pz + r.valid, pz + width, T(0));
  } else {
    pz = s;
  }
  if (pw != nullptr && !flat)
    fold_runs(pw, pz, r, win.first, last, sum(pz, r.left), sum(pz + r.right, r.valid - r.right));
  else if (pw != nullptr && p != T(0))
    fold_runs(pw, pz, r, win.first, last, p, p);
}

// dS, one row of a block: ds holds dP = dO v^T on entry; adds the value term DOA[t] (doa, or null: no a^V) in the
// row's runs, multiplies by the dropout mask z (or null), then dS = P * (dP - rowsum(dO * O)); dqa (or null: no QA)
// takes dS's sums per table row.
template <typename T>
inline void score_grad_row(T* ds, const T* p, const T* z, const Runs& r, int64_t width, T out_dot, const T* doa,
                           T* dqa, const Window& win, int64_t last) {
  if (doa != nullptr) add_key_term(ds, r, doa, win.first, last);
  if (z != nullptr)  // dS = P (Z dP~ - D): dP~, the gradient of the dropped weights, through the mask
    for (int64_t x = 0; x < r.valid; ++x) ds[x] *= z[x];
  const T lo = softmax_grad_sum(ds, p, r.left, out_dot);
  softmax_grad_sum(ds + r.left, p + r.left, r.right - r.left, out_dot);
  const T hi = softmax_grad_sum(ds + r.right, p + r.right, r.valid - r.right, out_dot);
  std::fill(ds + r.valid, ds + width, T(0));
  if (dqa != nullptr) fold_runs(dqa, ds, r, win.first, last, lo, hi);
}

// The tables' gradients from a backward tile's sums per table row of its window (dqa: of dS, pw: of P as dropped;
// rows win.cols apart): dq_pos += scale dQA @ a^K (dq itself without q_pos);  d a^K += scale dQA.T @ q_pos;
// d a^V += PW.T @ dO;  d rel_bias += the column sums of dQA (unscaled: the bias is added after the scale). qf, dof:
// the tile's q_pos and dO rows as T (ldq, ldo apart).
template <typename I, typename T>
inline void tile_table_grads(const Geometry& geom, const Views<I, T>& in, int64_t h, int64_t rows, const Window& win,
                             T scale, const T* dqa, const T* qf, int64_t ldq, const T* pw, const T* dof, int64_t ldo,
                             T* dq_pos, const TableGrads<T>& grads) {
  const int64_t wc = win.cols, R = geom.R;
  if (geom.has_k) {
    const int64_t hk = geom.rel_k_head(h);
    gemm<T>(false, false, rows, geom.D, win.rows, scale, dqa, wc,
            in.rel_k_padded + (hk * in.padded_rows + win.first) * geom.D, geom.D, T(1), dq_pos, geom.D);
    gemm<T>(true, false, win.rows, geom.D, rows, scale, dqa, wc, qf, ldq, T(1),
            grads.rel_k + (hk * R + win.first) * geom.D, geom.D);
  }
  if (geom.has_v)
    gemm<T>(true, false, win.rows, geom.Dv, rows, T(1), pw, wc, dof, ldo, T(1),
            grads.rel_v + (geom.rel_v_head(h) * R + win.first) * geom.Dv, geom.Dv);
  if (geom.has_b) {
    T* db = grads.rel_bias + geom.rel_bias_head(h) * R + win.first;
    for (int64_t a = 0; a < rows; ++a) add_into(db, dqa + a * wc, win.rows);
  }
}

// A backward tile: query rows m0 .. m0+rows-1 of head h against the segment's keys they may see. Per tile: rowsum(dO
// * O), QA and DOA = dO a^V^T on the window's table rows; per block of keys: the scores again (block_scores), P from
// lse (weights_row, with dropout's Z), dv += PZ^T dO, dP = dO v^T, dS (score_grad_row), the position-to-content bins
// of dS, dq += scale dS k, dk += scale dS^T q; at the end the tables' gradients from dQA and PW (and dq_pos's share).
template <typename I, typename T>
void backward_tile(const SeqCall<I, T>& call, int64_t h, int64_t m0, const SegmentKeys<I, T>& keys,
                   const TileRows<I, T>& tile, const Dropout& drop, uint32_t drop_key, T scale,
                   BackwardWorkspace<I, T>& ws, const TableGrads<T>& grads) {
  const Geometry& geom = call.geom;
  const Views<I, T>& in = call.in;
  const int64_t b = call.seq.b, hkv = h / geom.group, last = 2 * geom.kk, ld = ws.tile_k;
  const int64_t rows = std::min(ws.tile_q, geom.N - m0), keys_end = std::min(kv_end(geom, m0, rows), keys.hi);
  const I* q = in.qh(b, h) + m0 * in.qs[2];
  for (int64_t a = 0; a < rows; ++a) {
    T t = 0;
    for (int64_t x = 0; x < geom.Dv; ++x)
      t += static_cast<T>(tile.dout[a * tile.dout_ld + x]) * static_cast<T>(tile.out[a * geom.Dv + x]);
    ws.out_dot[a] = t;
  }
  // the table rows the tile meets against the segment's keys (QA, dQA, DOA, PW rows: win.cols entries)
  const Window win = window_of(geom.kk, in.padded_rows, geom.causal, m0 + geom.off, m0 + rows - 1 + geom.off, keys.lo,
                               keys_end);
  const int64_t wc = win.cols;
  int64_t ldq = 0, ldo = 0;  // the tile's position queries and dO rows as T, for the GEMMs with the tables
  const T* qf = geom.has_k ? rows_as<T>(in.q_pos_head(b, h) + m0 * in.q_pos_strides[2], rows, geom.D,
                                        in.q_pos_strides[2], ws.pos_queries, ldq)
                           : nullptr;
  const T* dof = geom.has_v ? rows_as<T>(tile.dout, rows, geom.Dv, tile.dout_ld, ws.dout_rows, ldo) : nullptr;
  if (geom.has_qa()) {
    tile_key_rows(geom, in, h, qf, ldq, rows, win, scale, ws.key_rows.data());
    std::fill(ws.key_rows_grad.begin(), ws.key_rows_grad.begin() + rows * wc, T(0));
  }
  if (geom.has_v) {
    gemm<T>(false, true, rows, wc, geom.Dv, T(1), dof, ldo,
            in.rel_v_padded + (geom.rel_v_head(h) * in.padded_rows + win.first) * geom.Dv, geom.Dv, T(0),
            ws.value_rows.data(), wc);
    std::fill(ws.value_weights.begin(), ws.value_weights.begin() + rows * wc, T(0));
  }
  T *P = ws.weights.data(), *G = ws.grads.data();
  const PackedHead<I>* packed = keys.packed;
  if (packed != nullptr) release_brgemm();  // after MKL's GEMMs (the tables', the segment's KA rows and gradients)
  if (packed != nullptr || keys.direct) std::fill(ws.dq_rows.begin(), ws.dq_rows.begin() + rows * geom.D, T(0));
  for (int64_t n0 = keys.lo; n0 < keys_end; n0 += ws.tile_k) {
    const int64_t width = std::min(ws.tile_k, keys_end - n0);
    block_scores(geom, in, b, h, hkv, m0, rows, n0, width, scale, geom.has_qa() ? ws.key_rows.data() : nullptr, win,
                 geom.has_q ? &ws.pos.rows : nullptr, P, ld, ws.runs.data(), ws.block_max.data(), packed);
    if (drop.on) drop.cols(drop_key, n0, width, ws.key_hashes.data());
    for (int64_t a = 0; a < rows; ++a) {  // P = exp(S - lse); with dropout the dropped weights PZ in G's rows
      weights_row(P + a * ld, drop.on ? ws.keep.data() + a * ld : nullptr, G + a * ld, ws.runs[a], width,
                  ws.block_max[a], tile.lse[a], geom.has_v ? ws.value_weights.data() + a * wc : nullptr, win, last,
                  row_mask<T>(drop, drop_key, m0 + a, ws.key_hashes.data()));
      round_row((drop.on ? G : P) + a * ld, a, ld, width, ws.block16);
    }
    // dv += PZ.T @ dO (PZ: the weights as dropped, P without dropout);  dP = dO @ v.T (+ the value term)
    gemm_io<I, T>(true, false, width, geom.Dv, rows, T(1), operand<I>(drop.on ? G : P, ws.block16), ld, tile.dout,
                  tile.dout_ld, T(1), keys.dv + n0 * geom.Dv, geom.Dv);
    if (packed != nullptr) {
      release_brgemm();  // after MKL's GEMM
      brgemm_over_keys<I, T>(rows, geom.Dv, width, tile.dout, tile.dout_ld, packed->values_t(n0), G, ld);
    } else {
      gemm_io<I, T>(false, true, rows, width, geom.Dv, T(1), tile.dout, tile.dout_ld, keys.v + n0 * in.vs[2],
                    in.vs[2], T(0), G, ld);
    }
    for (int64_t a = 0; a < rows; ++a) {
      score_grad_row(G + a * ld, P + a * ld, drop.on ? ws.keep.data() + a * ld : nullptr, ws.runs[a], width,
                     ws.out_dot[a], geom.has_v ? ws.value_rows.data() + a * wc : nullptr,
                     geom.has_qa() ? ws.key_rows_grad.data() + a * wc : nullptr, win, last);
      round_row(G + a * ld, a, ld, width, ws.block16);  // dS (bin_pos_term below reads G only)
    }
    if (geom.has_q)
      bin_pos_term(G, ld, ws.runs.data(), rows, n0, width, ws.pos_grad.data(), ws.pos_grad_lo.data(),
                   ws.pos_grad_hi.data(), ws.pos.rows);
    // dq += scale dS @ k;  dk += scale dS.T @ q
    const I* dS = operand<I>(G, ws.block16);
    if (packed != nullptr) {  // scaled below
      brgemm_over_columns<I, T>(rows, geom.D, width, ws.block16.data(), ld,
                                [&](int64_t c0) { return packed->key_rows(c0, n0); }, ws.dq_rows.data());
    } else if (keys.direct) {  // float32 brgemm on k as it lies, scaled below
      brgemm_rows<I, T>(rows, geom.D, width, G, ld, keys.k + n0 * in.ks[2], in.ks[2], ws.dq_rows.data(), geom.D, true);
    } else {
      gemm_io<I, T>(false, false, rows, geom.D, width, scale, dS, ld, keys.k + n0 * in.ks[2], in.ks[2], T(1),
                    tile.dq + m0 * geom.D, geom.D);
    }
    gemm_io<I, T>(true, false, width, geom.D, rows, scale, dS, ld, q, in.qs[2], T(1), keys.dk + n0 * geom.D, geom.D);
    if (packed != nullptr) release_brgemm();
  }
  if (packed != nullptr || keys.direct)
    for (int64_t x = 0; x < rows * geom.D; ++x) tile.dq[m0 * geom.D + x] += scale * ws.dq_rows[x];
  tile_table_grads(geom, in, h, rows, win, scale, ws.key_rows_grad.data(), qf, ldq, ws.value_weights.data(), dof, ldo,
                   tile.dq_pos + m0 * geom.D, grads);
}

// The position-to-content term's gradients from a query head's bins of dS over the segment's keys (dKA and its edge
// columns): dk += scale dKA @ a^Q;  d a^Q += scale dKA.T @ k, chunk by chunk of keys, in each chunk's window.
template <typename I, typename T>
void pos_term_grads(const SeqCall<I, T>& call, int64_t h, const SegmentKeys<I, T>& keys, T scale, int64_t ld,
                    BackwardWorkspace<I, T>& ws, T* d_rel_q) {
  const Geometry& geom = call.geom;
  const Views<I, T>& in = call.in;
  const int64_t nk = keys.hi - keys.lo, hq = geom.rel_q_head(h), last = 2 * geom.kk, R = geom.R;
  int64_t ldk;
  const T* kf = rows_as<T>(keys.k + keys.lo * in.ks[2], nk, geom.D, in.ks[2], ws.pos.keys, ldk);
  T* dka = ws.pos_grad.data();
  for (int64_t c = 0, x0 = 0; x0 < nk; ++c, x0 += kPosChunk) {
    const Window& win = ws.pos.windows[c];
    const int64_t x1 = std::min(nk, x0 + kPosChunk), top = last - win.first;
    for (int64_t x = x0; x < x1; ++x) {
      if (win.first == 0) dka[x * ld] += ws.pos_grad_lo[x];
      if (top < win.cols) dka[x * ld + top] += ws.pos_grad_hi[x];
    }
    const T* rel_q = in.rel_q + (hq * R + win.first) * geom.D;
    gemm<T>(false, false, x1 - x0, geom.D, win.rows, scale, dka + x0 * ld, ld, rel_q, geom.D, T(1),
            keys.dk + (keys.lo + x0) * geom.D, geom.D);
    gemm<T>(true, false, win.rows, geom.D, x1 - x0, scale, dka + x0 * ld, ld, kf + x0 * ldk, ldk, T(1),
            d_rel_q + (hq * R + win.first) * geom.D, geom.D);
  }
}

// A backward task: the segment's keys of key/value head hkv against its group's query heads in order (so dk and dv
// are summed over them in a fixed order), each head's tiles in turn; per head, the KA rows of the segment's keys
// (where they depend on the head) and its position-to-content gradients.
template <typename I, typename T>
void backward_segment(const SeqCall<I, T>& call, const Batch& batch, int64_t hkv, int64_t split,
                      const SegmentKeys<I, T>& keys, const Dropout& drop, T scale, int64_t ka_ld,
                      const BackwardIO<I, T>& io, BackwardWorkspace<I, T>& ws, const TableGrads<T>& grads) {
  const Geometry& geom = call.geom;
  const Seq& seq = call.seq;
  if (geom.has_q) key_windows(geom, call.in.padded_rows, keys.lo, keys.hi, ws.pos.windows);
  for (int64_t h = hkv * geom.group; h < (hkv + 1) * geom.group; ++h) {
    const int64_t bh = seq.b * geom.H + h, first_row = bh * batch.rows_q + seq.q0;  // of out, lse
    const int64_t slab_row = (split * geom.B * geom.H + bh) * batch.rows_q + seq.q0;  // of dq, dq_pos
    T* dq = io.dq + slab_row * geom.D;
    T* dq_pos = io.dq_pos == nullptr ? dq : io.dq_pos + slab_row * geom.D;
    const uint32_t drop_key = drop.on ? drop.key(seq.id, h) : 0;
    if (geom.has_q && (geom.Hq != 1 || h == hkv * geom.group)) ws.pos.form(call, h, keys.lo, keys.hi, ka_ld, scale);
    if (geom.has_q) {
      std::fill(ws.pos_grad.begin(), ws.pos_grad.end(), T(0));
      std::fill(ws.pos_grad_lo.begin(), ws.pos_grad_lo.end(), T(0));
      std::fill(ws.pos_grad_hi.begin(), ws.pos_grad_hi.end(), T(0));
    }
    for (int64_t m0 = 0; m0 < geom.N; m0 += ws.tile_q) {
      const int64_t rows = std::min(ws.tile_q, geom.N - m0);
      if (std::min(kv_end(geom, m0, rows), keys.hi) <= keys.lo) continue;  // the tile meets none of the keys
      const TileRows<I, T> tile{io.dout + seq.b * io.dout_strides[0] + h * io.dout_strides[1] +
                                    (seq.q0 + m0) * io.dout_strides[2],
                                io.dout_strides[2], io.out + (first_row + m0) * geom.Dv, io.lse + first_row + m0, dq,
                                dq_pos};
      backward_tile(call, h, m0, keys, tile, drop, drop_key, scale, ws, grads);
    }
    if (geom.has_q) pos_term_grads(call, h, keys, scale, ka_ld, ws, grads.rel_q);
  }
}

// The backward: each thread runs its tasks (backward_schedule) with its own buffers and table gradients; a task reads
// its sequence (seq_call) and owns its keys' dk and dv rows; with more than one segment per head, each writes its
// share of dq into its own slab (summed afterwards in segment order, so the result does not depend on the threads).
template <typename I, typename T>
void backward_impl(const Geometry& geom, const Views<I, T>& in, const Batch& batch, const Dropout& drop, T scale,
                   int64_t tile_q, int64_t tile_k, int64_t splits, bool brgemm, const BackwardIO<I, T>& io) {
  const PackedKV<I> packed = brgemm && is_16_bit<I> ? pack_keys_values(geom, in, batch, true) : PackedKV<I>{};
  const bool direct = brgemm && std::is_same_v<I, float> && in.ks[2] == geom.D;  // as the forward's: k's rows dense
  const KeySegments segs{splits, tile_k};
  const int64_t seg_keys = std::min(geom.M, segs.keys(geom.M));  // the most keys of a task (the longest sequence)
  const int64_t table_cols = window_cap(geom, in.padded_rows, tile_q, seg_keys);  // columns of a tile's table rows
  const int64_t ka_ld = geom.has_q ? key_table_ld(geom, in.padded_rows, sizeof(T)) : 0;  // KA's and its bins' stride
  const auto bounds = backward_schedule(geom, batch, tile_q, segs, table_cols);
  for_parts(bounds, [&](int64_t part, int64_t begin, int64_t end) {
    const TableGrads<T> grads = part_table_grads(geom, io, part);
    BackwardWorkspace<I, T> ws(geom, tile_q, tile_k, seg_keys, table_cols, ka_ld, drop.on, packed.on || direct);
    for (int64_t t = begin; t < end; ++t) {
      const BackwardTask task = backward_task(t, geom.Hkv, splits);
      const SeqCall<I, T> call = seq_call(geom, in, batch.seqs[task.seq]);
      const int64_t lo = segs.lo(call.geom.M, task.split), hi = segs.hi(call.geom.M, task.split);
      if (call.geom.N == 0 || hi <= lo) continue;  // no query, or no key: no gradient
      const int64_t first_key = (call.seq.b * geom.Hkv + task.hkv) * batch.rows_k + call.seq.k0;  // of dk, dv
      const PackedHead<I> head = packed.on ? packed.head(task.seq, task.hkv) : PackedHead<I>{};
      const SegmentKeys<I, T> keys{call.in.kh(call.seq.b, task.hkv), call.in.vh(call.seq.b, task.hkv),
                                   io.dk + first_key * geom.D, io.dv + first_key * geom.Dv, lo, hi,
                                   packed.on ? &head : nullptr, direct};
      backward_segment(call, batch, task.hkv, task.split, keys, drop, scale, ka_ld, io, ws, grads);
    }
    if (packed.on || direct) release_brgemm();
  });
}

// ------------------------------------------------------------------------------------------ entry points

// t with unit-stride rows at least a row apart, as the GEMMs' leading dimensions must be: a copy only where the
// caller's are not (an expand()ed row, stride 0, read as a broadcast key or a memory token).
at::Tensor rows_contiguous(const at::Tensor& t) {
  return t.stride(-1) == 1 && t.stride(-2) >= std::max<int64_t>(1, t.size(-1)) ? t : t.contiguous();
}

bool is_16_bit_type(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// float32 for 16-bit q (the type of its tables, mask and statistics), else q's own.
at::ScalarType compute_type(const at::Tensor& q) {
  return is_16_bit_type(q.scalar_type()) ? at::kFloat : q.scalar_type();
}

Geometry geometry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tk,
                  const at::Tensor& tv, const at::Tensor& tq, const at::Tensor& tb, int64_t kk, bool causal,
                  int64_t off) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "relattn native: q, k, v must be 4-D");
  const at::ScalarType dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || is_16_bit_type(dt),
              "relattn native: float32, float64, bfloat16 or float16 only, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, "relattn native: dtypes differ");
  TORCH_CHECK(!is_16_bit_type(dt) || has_gemm16(dt), "relattn native: this libtorch exports no ", dt,
              " GEMM with float32 output (pass float32 tensors)");
  TORCH_CHECK(q.device().is_cpu(), "relattn native: CPU tensors only");
  const int64_t H = q.size(1), Hkv = k.size(1);
  TORCH_CHECK(Hkv > 0 && v.size(1) == Hkv && H % Hkv == 0 && k.size(0) == q.size(0) && v.size(0) == q.size(0) &&
                  k.size(3) == q.size(3) && v.size(2) == k.size(2),
              "relattn native: k, v must be (B, Hkv, M, D), (B, Hkv, M, Dv) with H % Hkv == 0; got q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  Geometry g{q.size(0), H, q.size(2), k.size(2), q.size(3), v.size(3), 1, 1, 2 * kk + 1, kk, off, Hkv, H / Hkv,
             causal, tk.defined(), tv.defined()};
  // A table is (1 or H, 2K+1, d), or (2K+1, d): shared by all heads, as (1, 2K+1, d) (a decoding step's plan passes
  // the user's table as it is).
  for (const auto* t : {&tk, &tv, &tq}) {
    if (t->defined()) {
      TORCH_CHECK((t->dim() == 3 || t->dim() == 2) && t->size(-2) == g.R && t->is_contiguous() &&
                      t->scalar_type() == compute_type(q) && (t->dim() == 2 || t->size(0) == 1 || t->size(0) == g.H) &&
                      t->size(-1) == (t == &tv ? g.Dv : g.D),
                  "relattn native: tables must be contiguous (1 or H, 2K+1, d) or (2K+1, d) of q's dtype (float32 for "
                  "16-bit q)");
    }
  }
  const auto heads = [](const at::Tensor& t) { return t.defined() && t.dim() == 3 ? t.size(0) : int64_t{1}; };
  g.Hk = heads(tk);
  g.Hv = heads(tv);
  g.has_q = tq.defined();
  g.Hq = heads(tq);
  if (tb.defined()) {  // (1 or H, 2K+1) or (2K+1,)
    TORCH_CHECK((tb.dim() == 2 || tb.dim() == 1) && tb.size(-1) == g.R && tb.is_contiguous() &&
                    tb.scalar_type() == compute_type(q) && (tb.dim() == 1 || tb.size(0) == 1 || tb.size(0) == g.H),
                "relattn native: rel_bias must be contiguous (1 or H, 2K+1) or (2K+1,) of q's dtype (float32 for 16-bit "
                "q)");
    g.has_b = true;
    g.Hb = tb.dim() == 2 ? tb.size(0) : 1;
  }
  return g;
}

// The position queries (q_pos, the queries the key table reads), checked against q: its shape and dtype, rows
// contiguous; undefined when none is given (q is read instead).
at::Tensor checked_position_queries(const std::optional<at::Tensor>& q_pos, const at::Tensor& q) {
  if (!q_pos.has_value()) return at::Tensor();
  TORCH_CHECK(q_pos->sizes() == q.sizes() && q_pos->scalar_type() == q.scalar_type(),
              "relattn native: q_pos must have q's shape and dtype; got ", q_pos->sizes(), " ",
              q_pos->scalar_type(), " for q ", q.sizes(), " ", q.scalar_type());
  return rows_contiguous(*q_pos);
}

// Tiles no larger than the problem: the same tiles and blocks, but a decoding step (N = 1) no longer allocates and
// zeroes (tile_q, tile_k) score buffers per thread.
void clamp_tiles(const Geometry& g, int64_t& tile_q, int64_t& tile_k) {
  tile_q = std::max<int64_t>(1, std::min(tile_q, g.N));
  tile_k = std::max<int64_t>(1, std::min(tile_k, g.M));
}

at::Tensor opt(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

// A table as the kernel reads it: contiguous (a copy only where the caller's is not), or undefined.
at::Tensor table(const std::optional<at::Tensor>& t) { return t.has_value() ? t->contiguous() : at::Tensor(); }

// An additive mask of q's compute dtype, 4-D and broadcastable to (B, H, N, M), keys contiguous or broadcast.
at::Tensor checked_mask(at::Tensor mask, const at::Tensor& q, const at::Tensor& k) {
  if (!mask.defined()) return mask;
  TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == compute_type(q),
              "relattn native: the mask must be 4-D and of q's dtype (float32 for 16-bit q)");
  const int64_t want[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
  for (int d = 0; d < 4; ++d)
    TORCH_CHECK(mask.size(d) == 1 || mask.size(d) == want[d], "relattn native: mask dim ", d, " is ",
                mask.size(d), ", not 1 or ", want[d]);
  return mask.size(3) > 1 && mask.stride(3) != 1 ? mask.contiguous() : mask;
}

// The dropout of a call: off for dropout_p 0, else from its seed, an int64 CPU tensor (seed) or (seed, b0, i0, j0).
Dropout dropout_of(const std::optional<at::Tensor>& seed, double p) {
  Dropout d;
  if (p == 0.0) return d;
  TORCH_CHECK(p > 0.0 && p < 1.0, "relattn native: dropout_p must be in [0, 1); got ", p);
  TORCH_CHECK(seed.has_value() && seed->scalar_type() == at::kLong && seed->device().is_cpu() &&
                  (seed->numel() == 1 || seed->numel() == 4),
              "relattn native: dropout needs an int64 CPU seed of 1 or 4 entries (seed, b0, i0, j0)");
  const at::Tensor v = seed->reshape(-1).contiguous();
  const int64_t* e = v.data_ptr<int64_t>();
  d.on = true;
  d.seed = static_cast<uint32_t>(e[0]);
  if (v.numel() == 4) d.b0 = e[1], d.i0 = e[2], d.j0 = e[3];
  d.thresh = static_cast<uint32_t>(std::floor(p * 4294967296.0));
  d.inv = 1.0 / (1.0 - p);
  return d;
}

// fn.template operator()<I, T>() for q's storage type I and compute type T.
template <typename F>
void dispatch_types(at::ScalarType dt, F&& fn) {
  switch (dt) {
    case at::kFloat: return fn.template operator()<float, float>();
    case at::kDouble: return fn.template operator()<double, double>();
    case at::kBFloat16: return fn.template operator()<at::BFloat16, float>();
    case at::kHalf: return fn.template operator()<at::Half, float>();
    default: TORCH_CHECK(false, "relattn native: unsupported dtype ", dt);
  }
}

// A dense call's sequences: one per batch entry.
Batch dense_batch(const Geometry& g) {
  Batch batch{{}, g.N, g.M};
  for (int64_t b = 0; b < g.B; ++b) batch.seqs.push_back({b, 0, 0, g.N, g.M, g.off, b});
  return batch;
}

// The cumulative lengths `name` as int64 values, checked: 1-D integers on the CPU, 0 first, never decreasing, `rows`
// last.
std::vector<int64_t> checked_cu_seqlens(const at::Tensor& cu, const char* name, int64_t rows) {
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1 && (cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong) &&
                  cu.device().is_cpu(),
              "relattn native: ", name, " must be a 1-D int32 or int64 CPU tensor of S + 1 entries; got ",
              cu.scalar_type(), " ", cu.sizes(), " on ", cu.device());
  const at::Tensor c = cu.to(at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  std::vector<int64_t> out(p, p + c.numel());
  TORCH_CHECK(out.front() == 0 && out.back() == rows, "relattn native: ", name, " must start at 0 and end at ", rows,
              "; got ", out.front(), " .. ", out.back());
  for (size_t s = 1; s < out.size(); ++s)
    TORCH_CHECK(out[s] >= out[s - 1], "relattn native: ", name, " must never decrease; got ", out[s - 1], " then ",
                out[s], " at entry ", s);
  return out;
}

// A packed call's sequences (q (1, H, T, D), k (1, Hkv, T_k, D)): sequence s holds query rows cu_q[s] .. cu_q[s+1]
// - 1 and key rows cu_k[s] .. cu_k[s+1] - 1, its queries at the end of its keys (off = m_s - n_s + query_offset).
// Sets g's N and M to the longest lengths.
Batch packed_batch(Geometry& g, const at::Tensor& cu_q, const at::Tensor& cu_k) {
  TORCH_CHECK(g.B == 1, "relattn native: a packed call's q, k, v are (1, H, T, D); got a batch of ", g.B);
  const std::vector<int64_t> cq = checked_cu_seqlens(cu_q, "cu_seqlens_q", g.N);
  const std::vector<int64_t> ck = checked_cu_seqlens(cu_k, "cu_seqlens_k", g.M);
  TORCH_CHECK(cq.size() == ck.size(), "relattn native: cu_seqlens_q and cu_seqlens_k must have as many entries; got ",
              cq.size(), " and ", ck.size());
  Batch batch{{}, g.N, g.M};
  int64_t longest_q = 0, longest_k = 0;
  for (size_t s = 0; s + 1 < cq.size(); ++s) {
    const int64_t n = cq[s + 1] - cq[s], m = ck[s + 1] - ck[s];
    batch.seqs.push_back({0, cq[s], ck[s], n, m, m - n + g.off, static_cast<int64_t>(s)});
    longest_q = std::max(longest_q, n);
    longest_k = std::max(longest_k, m);
  }
  g.N = longest_q;
  g.M = longest_k;
  return batch;
}

// Whether a call that asked for brgemm (the CPU's choice) runs it: a dtype torch's brgemm takes here; for 16-bit
// inputs head dims that are multiples of 16 (the packed blocks' widths, and pairs of rows pack together); and enough
// queries per key/value head to repay packing its keys and values (packing a 64-key block costs about a 32-row GEMM;
// float32 packs nothing, but a decoding step keeps MKL's GEMMs, as it was measured).
bool uses_brgemm(const Geometry& g, at::ScalarType dt) {
  const bool dims = dt == at::kFloat || (g.D % 16 == 0 && g.Dv % 16 == 0);  // float32 packs nothing
  return g.N * g.group >= 64 && dims && has_brgemm(dt);
}

std::tuple<at::Tensor, at::Tensor> forward_call(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                                const std::optional<at::Tensor>& rel_k,
                                                const std::optional<at::Tensor>& rel_v,
                                                const std::optional<at::Tensor>& mask_,
                                                const std::optional<at::Tensor>& rel_q,
                                                const std::optional<at::Tensor>& q_pos,
                                                const std::optional<at::Tensor>& rel_bias, int64_t kk, bool is_causal,
                                                double scale, int64_t query_offset, int64_t tile_q, int64_t tile_k,
                                                const at::Tensor* cu_q, const at::Tensor* cu_k, const Dropout& drop,
                                                bool brgemm) {
  at::Tensor q = rows_contiguous(q_), k = rows_contiguous(k_), v = rows_contiguous(v_);
  at::Tensor tk = table(rel_k), tv = table(rel_v), tq = table(rel_q), mask = checked_mask(opt(mask_), q, k);
  at::Tensor tb = table(rel_bias);
  at::Tensor qp = checked_position_queries(q_pos, q);
  Geometry g = geometry(q, k, v, tk, tv, tq, tb, kk, is_causal, query_offset);
  const Batch batch = cu_q == nullptr ? dense_batch(g) : packed_batch(g, *cu_q, *cu_k);
  clamp_tiles(g, tile_q, tile_k);
  brgemm = brgemm && uses_brgemm(g, q.scalar_type());
  if (brgemm && is_16_bit_type(q.scalar_type()))
    tile_k = (tile_k + kPackCols - 1) / kPackCols * kPackCols;  // blocks start at packed blocks
  at::Tensor out = at::empty({g.B, g.H, batch.rows_q, g.Dv}, q.options());
  at::Tensor lse = at::empty({g.B, g.H, batch.rows_q}, q.options().dtype(compute_type(q)));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  const Padded pad = padded_tables(tk, tv, tq, g, tile_q);
  dispatch_types(q.scalar_type(), [&]<typename I, typename T>() {
    forward_impl<I, T>(g, views<I, T>(q, k, v, tk, tv, mask, tq, qp, pad, tb), batch, drop, static_cast<T>(scale),
                       tile_q, tile_k, brgemm, out.data_ptr<I>(), lse.data_ptr<T>());
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> shaw_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const std::optional<at::Tensor>& rel_k,
                                            const std::optional<at::Tensor>& rel_v,
                                            const std::optional<at::Tensor>& mask,
                                            const std::optional<at::Tensor>& rel_q,
                                            const std::optional<at::Tensor>& q_pos,
                                            const std::optional<at::Tensor>& rel_bias, int64_t kk, bool is_causal,
                                            double scale, int64_t query_offset, int64_t tile_q, int64_t tile_k,
                                            const std::optional<at::Tensor>& seed, double dropout_p, bool brgemm) {
  return forward_call(q, k, v, rel_k, rel_v, mask, rel_q, q_pos, rel_bias, kk, is_causal, scale, query_offset, tile_q,
                      tile_k, nullptr, nullptr, dropout_of(seed, dropout_p), brgemm);
}

std::tuple<at::Tensor, at::Tensor> shaw_varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const std::optional<at::Tensor>& rel_k,
                                                   const std::optional<at::Tensor>& rel_v,
                                                   const std::optional<at::Tensor>& rel_q,
                                                   const std::optional<at::Tensor>& q_pos,
                                                   const std::optional<at::Tensor>& rel_bias, const at::Tensor& cu_q,
                                                   const at::Tensor& cu_k, int64_t kk, bool is_causal, double scale,
                                                   int64_t query_offset, int64_t tile_q, int64_t tile_k,
                                                   const std::optional<at::Tensor>& seed, double dropout_p,
                                                   bool brgemm) {
  return forward_call(q, k, v, rel_k, rel_v, std::nullopt, rel_q, q_pos, rel_bias, kk, is_causal, scale, query_offset,
                      tile_q, tile_k, &cu_q, &cu_k, dropout_of(seed, dropout_p), brgemm);
}

using Grads =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Gradients in the compute type (float32 for 16-bit inputs); dk, dv (B, Hkv, rows_k, D|Dv); the seventh, d q_pos (the
// key table's share of the position queries' gradient, apart from dq's content share), empty without q_pos; the
// eighth, d rel_bias in rel_bias's shape, empty without it.
Grads backward_call(const at::Tensor& grad_out_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                    const std::optional<at::Tensor>& rel_k, const std::optional<at::Tensor>& rel_v,
                    const std::optional<at::Tensor>& mask_, const std::optional<at::Tensor>& rel_q,
                    const std::optional<at::Tensor>& q_pos, const std::optional<at::Tensor>& rel_bias,
                    const at::Tensor& out_, const at::Tensor& lse_, int64_t kk, bool is_causal, double scale,
                    int64_t query_offset, int64_t tile_q, int64_t tile_k, int64_t kv_splits, const at::Tensor* cu_q,
                    const at::Tensor* cu_k, const Dropout& drop, bool brgemm) {
  at::Tensor q = rows_contiguous(q_), k = rows_contiguous(k_), v = rows_contiguous(v_);
  at::Tensor grad_out = rows_contiguous(grad_out_), out = out_.contiguous(), lse = lse_.contiguous();
  at::Tensor tk = opt(rel_k), tv = opt(rel_v), tq = opt(rel_q), mask = checked_mask(opt(mask_), q, k);
  at::Tensor tb = table(rel_bias);
  at::Tensor qp = checked_position_queries(q_pos, q);
  Geometry g = geometry(q, k, v, tk, tv, tq, tb, kk, is_causal, query_offset);
  const Batch batch = cu_q == nullptr ? dense_batch(g) : packed_batch(g, *cu_q, *cu_k);
  TORCH_CHECK(grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  lse.scalar_type() == compute_type(q),
              "relattn native: grad_out and out must have q's dtype, lse its compute dtype");
  TORCH_CHECK(grad_out.sizes() == out.sizes() && out.dim() == 4 && out.size(0) == g.B && out.size(1) == g.H &&
                  out.size(2) == batch.rows_q && out.size(3) == g.Dv && lse.sizes() == out.sizes().slice(0, 3),
              "relattn native: grad_out and out must be (B, H, N, Dv) and lse (B, H, N) for q ", q.sizes(), "; got ",
              grad_out.sizes(), ", ", out.sizes(), ", ", lse.sizes());
  clamp_tiles(g, tile_q, tile_k);
  brgemm = brgemm && uses_brgemm(g, q.scalar_type());
  if (brgemm && is_16_bit_type(q.scalar_type()))
    tile_k = (tile_k + kPackCols - 1) / kPackCols * kPackCols;  // blocks and segments start at packed blocks
  const int64_t threads = at::get_num_threads(), blocks = (g.M + tile_k - 1) / tile_k;
  // Key segments per head: 1 when the heads spread evenly over the threads or there are two per thread, else
  // enough for two tasks per thread (fewer idle threads at the end); kv_splits > 0 forces the number.
  const int64_t nseq = static_cast<int64_t>(batch.seqs.size());
  const int64_t heads = std::max<int64_t>(1, nseq * g.Hkv);
  const bool even = heads % threads == 0 || heads >= 2 * threads;
  const int64_t wanted = kv_splits > 0 ? kv_splits : (even ? 1 : (2 * threads + heads - 1) / heads);
  const int64_t splits = std::max<int64_t>(1, std::min(blocks, wanted));
  const auto opts = q.options().dtype(compute_type(q));
  at::Tensor dq = at::zeros({splits, g.B, g.H, batch.rows_q, g.D}, opts);
  at::Tensor dqp = qp.defined() ? at::zeros({splits, g.B, g.H, batch.rows_q, g.D}, opts) : at::empty({0}, opts);
  at::Tensor dk = at::zeros({g.B, g.Hkv, batch.rows_k, g.D}, opts);
  at::Tensor dv = at::zeros({g.B, g.Hkv, batch.rows_k, g.Dv}, opts);
  // Table gradients: one copy per thread, summed in order afterwards; a single copy where each head's rows have one
  // writer (per-head tables, one sequence, one key segment: the task of a key/value head writes only its group's
  // heads), which saves (threads - 1) tables (Transformer-XL's per-head (2N - 1)-row tables).
  const bool single = nseq == 1 && splits == 1;
  const bool own[4] = {single && g.Hk == g.H, single && g.Hv == g.H, single && g.Hq == g.H, single && g.Hb == g.H};
  at::Tensor drk = g.has_k ? at::zeros({own[0] ? 1 : threads, g.Hk, g.R, g.D}, opts) : at::empty({0}, opts);
  at::Tensor drv = g.has_v ? at::zeros({own[1] ? 1 : threads, g.Hv, g.R, g.Dv}, opts) : at::empty({0}, opts);
  at::Tensor drq = g.has_q ? at::zeros({own[2] ? 1 : threads, g.Hq, g.R, g.D}, opts) : at::empty({0}, opts);
  at::Tensor drb = g.has_b ? at::zeros({own[3] ? 1 : threads, g.Hb, g.R}, opts) : at::empty({0}, opts);
  if (g.N > 0 && g.M > 0) {
    const Padded pad = padded_tables(tk, tv, tq, g, tile_q);
    dispatch_types(q.scalar_type(), [&]<typename I, typename T>() {
      const BackwardIO<I, T> io{grad_out.data_ptr<I>(), {grad_out.stride(0), grad_out.stride(1), grad_out.stride(2)},
                                out.data_ptr<I>(), lse.data_ptr<T>(), dq.data_ptr<T>(),
                                qp.defined() ? dqp.data_ptr<T>() : nullptr, dk.data_ptr<T>(), dv.data_ptr<T>(),
                                g.has_k ? drk.data_ptr<T>() : nullptr, g.has_v ? drv.data_ptr<T>() : nullptr,
                                g.has_q ? drq.data_ptr<T>() : nullptr, g.has_b ? drb.data_ptr<T>() : nullptr,
                                {own[0], own[1], own[2], own[3]}};
      backward_impl<I, T>(g, views<I, T>(q, k, v, tk, tv, mask, tq, qp, pad, tb), batch, drop, static_cast<T>(scale),
                          tile_q, tile_k, splits, brgemm, io);
    });
  }
  const auto slabs = [&](const at::Tensor& t) { return splits == 1 ? t[0] : t.sum(0); };
  const auto copies = [](const at::Tensor& t) { return t.size(0) == 1 ? t[0] : t.sum(0); };
  return {slabs(dq), dk, dv, g.has_k ? copies(drk) : drk, g.has_v ? copies(drv) : drv, g.has_q ? copies(drq) : drq,
          qp.defined() ? slabs(dqp) : dqp, g.has_b ? copies(drb).reshape(tb.sizes()) : drb};
}

Grads shaw_bwd(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const std::optional<at::Tensor>& rel_k, const std::optional<at::Tensor>& rel_v,
               const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& rel_q,
               const std::optional<at::Tensor>& q_pos, const std::optional<at::Tensor>& rel_bias, const at::Tensor& out,
               const at::Tensor& lse, int64_t kk, bool is_causal, double scale, int64_t query_offset, int64_t tile_q,
               int64_t tile_k, int64_t kv_splits, const std::optional<at::Tensor>& seed, double dropout_p,
               bool brgemm) {
  return backward_call(grad_out, q, k, v, rel_k, rel_v, mask, rel_q, q_pos, rel_bias, out, lse, kk, is_causal, scale,
                       query_offset, tile_q, tile_k, kv_splits, nullptr, nullptr, dropout_of(seed, dropout_p), brgemm);
}

Grads shaw_varlen_bwd(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& rel_k, const std::optional<at::Tensor>& rel_v,
                      const std::optional<at::Tensor>& rel_q, const std::optional<at::Tensor>& q_pos,
                      const std::optional<at::Tensor>& rel_bias, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t kk, bool is_causal, double scale,
                      int64_t query_offset, int64_t tile_q, int64_t tile_k, int64_t kv_splits,
                      const std::optional<at::Tensor>& seed, double dropout_p, bool brgemm) {
  return backward_call(grad_out, q, k, v, rel_k, rel_v, std::nullopt, rel_q, q_pos, rel_bias, out, lse, kk, is_causal,
                       scale, query_offset, tile_q, tile_k, kv_splits, &cu_q, &cu_k, dropout_of(seed, dropout_p),
                       brgemm);
}

}  // namespace

TORCH_LIBRARY(relattn_native, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, Tensor? rel_k, Tensor? rel_v, Tensor? mask, Tensor? rel_q, "
        "Tensor? q_pos, Tensor? rel_bias, int K, bool is_causal, float scale, int query_offset, int tile_q, int tile_k, "
        "Tensor? seed=None, float dropout_p=0.0, bool brgemm=False) -> (Tensor, Tensor)");
  m.def("bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? rel_k, Tensor? rel_v, Tensor? mask, "
        "Tensor? rel_q, Tensor? q_pos, Tensor? rel_bias, Tensor out, Tensor lse, int K, bool is_causal, float scale, "
        "int query_offset, int tile_q, int tile_k, int kv_splits, Tensor? seed=None, float dropout_p=0.0, "
        "bool brgemm=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor? rel_k, Tensor? rel_v, Tensor? rel_q, Tensor? q_pos, "
        "Tensor? rel_bias, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int K, bool is_causal, float scale, "
        "int query_offset, int tile_q, int tile_k, Tensor? seed=None, float dropout_p=0.0, bool brgemm=False) -> "
        "(Tensor, Tensor)");
  m.def("varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? rel_k, Tensor? rel_v, Tensor? rel_q, "
        "Tensor? q_pos, Tensor? rel_bias, Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int K, "
        "bool is_causal, float scale, int query_offset, int tile_q, int tile_k, int kv_splits, Tensor? seed=None, "
        "float dropout_p=0.0, bool brgemm=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("has_gemm16(ScalarType dtype) -> bool", [](at::ScalarType dtype) { return has_gemm16(dtype); });
  m.def("has_brgemm(ScalarType dtype) -> bool", [](at::ScalarType dtype) { return has_brgemm(dtype); });
}

TORCH_LIBRARY_IMPL(relattn_native, CPU, m) {
  m.impl("fwd", &shaw_fwd);
  m.impl("bwd", &shaw_bwd);
  m.impl("varlen_fwd", &shaw_varlen_fwd);
  m.impl("varlen_bwd", &shaw_varlen_bwd);
}

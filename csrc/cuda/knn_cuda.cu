// Exact k-nearest neighbours on CUDA.
//
// Screening. For each (query tile × gallery chunk) a GEMM writes the centred product into a
// 16 MiB tile that stays in L2: in bfloat16 with float32 accumulation and output for the
// float32, float16 and bfloat16 inputs (tensor cores, whatever allow_tf32 says), in float64
// for float64. Its expanded d̃² = |a|² + |b|² − 2ã·b̃ is within E = C·(|a|² + |b|²) + T of the
// exact d² (screen_error below), so it decides which entries may matter, never the result.
//
// Selection. One block per (query row, chunk) holds the row's k best (exact d², j) so far in
// shared memory, sorted, and reads its tile row once. An entry is a candidate when d̃² − E
// can reach the k-th best (the bar); its d² is then recomputed directly, Σ(a − b)² over the
// uncentred rows (one warp per candidate, coalesced), and it enters the buffer if it beats
// the bar in the total order (d² ascending, NaN after every number, ties to the lower index).
// A bitonic sort merges the buffer back to k when it fills, and at the chunk's end. Every
// entry is tested against an exact bar, so the k kept are complete by construction: there is
// no second pass, and no host synchronisation.
//
// Before the first k are held (the first chunk), the bar is an upper bound on the k-th d²
// from the bounds d̃² + E of the chunk (bound_of_kth): k entries are known to lie below it, so
// only those within 2E of it are recomputed instead of the whole chunk. A row without k
// finite bounds (a NaN query row, or norms past the type's range) takes every entry of the
// first chunk. Leave-one-out skips j == i by index.
//
// Past kMaxQueue the buffer no longer fits in shared memory: knn_sorted keeps the k best
// with a stable segmented sort per tile instead (slower, the same results).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cuda/std/limits>
#include <limits>
#include <type_traits>
#include <utility>

#include "cdist.h"
#include "cuda/launch.h"
#include "knn.h"

namespace torchkit::knn {
namespace {

using at::Tensor;

constexpr int kThreads = 256;  // one block per query row; entries per round
constexpr int kWarps = kThreads / 32;
constexpr int64_t kChunk = 4096;                   // gallery columns per tile
constexpr int kPerThread = kChunk / kThreads;      // a tile row's entries per thread
constexpr int64_t kTileBytes = int64_t(16) << 20;  // the screening tile: stays in L2
constexpr int64_t kMaxQueue = 2048 - kThreads;     // the largest k the shared buffer holds
static_assert(kMaxQueue <= 8 * kThreads, "bound_of_kth ranks at most 8 per thread");
constexpr int64_t kSortedTileElements = int64_t(1) << 21;  // the sorted path's candidates
constexpr int64_t kSortedChunk = 8192;

// The screening error: a bound on |d̃² − d²| for d̃² = |a|² + |b|² − 2·g̃, where g̃ is the
// screening GEMM's product of the centred rows and d² what the direct recompute gives from
// the uncentred ones. With u the unit roundoff of the GEMM's operands (bfloat16: 2⁻⁸; none for
// float64) and ε that of acc_t:
//  - the operands' rounding and the accumulation: a rounded operand moves by a relative
//    u/(1 + u) at most and a product of two by less than 2u, so |g̃ − a·b| is at most
//    (2u + γ_M(1 + u)²)·|a||b|, and 2|a||b| ≤ |a|² + |b|²;
//  - the centring (each centred coordinate is rounded once: |d_c² − d²| ≤ 6ε(|a|² + |b|²)),
//    the norms (γ_M each), the expansion's own three roundings and the recompute's (γ_M·d²,
//    d² ≤ 2(|a|² + |b|²)): (3M + 12)ε(|a|² + |b|²) together;
//  - products of coordinates below the smallest normal number, which the GEMM may flush:
//    at most M·min·(2 + |a|² + |b|²).
// C·(|a|² + |b|²) + T with C = 2·((u + u²/4 + γ_M)(1 + γ_M) + (3M + 12)ε + M·min) and
// T = 4M·min: the operands' 2u once, the rest of the sum twice.
template <typename acc_t>
struct ScreenError {
  acc_t C, T;
};
template <typename acc_t>
ScreenError<acc_t> screen_error(int64_t M, bool bf16) {
  using L = std::numeric_limits<acc_t>;
  const double u = bf16 ? 0x1p-8 : 0.0, eps = double(L::epsilon()) / 2, tiny = double(L::min());
  const double gamma = double(M) * eps / (1 - double(M) * eps);
  const double C =
      2 * ((u + u * u / 4 + gamma) * (1 + gamma) + (3 * double(M) + 12) * eps + double(M) * tiny);
  return {static_cast<acc_t>(C), static_cast<acc_t>(4 * double(M) * tiny)};
}

// The screening GEMM's operands for batch element b: bfloat16 copies of the centred rows
// where acc_t is float32 (P × M and R × M, small beside the tiles), the rows themselves in
// float64.
template <typename acc_t>
constexpr bool kScreenBf16 = std::is_same_v<acc_t, float>;

template <typename acc_t>
std::pair<Tensor, Tensor> screening_operands(const cdist::Problem& p, const cdist::Centred& c,
                                             int64_t b) {
  const Tensor xa = kScreenBf16<acc_t> ? c.x1[b].to(at::kBFloat16) : c.x1[b];
  const Tensor xb = p.self ? xa : kScreenBf16<acc_t> ? c.x2[b].to(at::kBFloat16) : c.x2[b];
  return {xa, xb};
}

// tile = a·bᵀ in the tile's type (float32 output from bfloat16 operands).
void screen(Tensor& tile, const Tensor& a, const Tensor& b) {
  if (a.size(1) == 0) {
    tile.zero_();
  } else if (a.scalar_type() == tile.scalar_type()) {
    at::mm_out(tile, a, b.t());
  } else {
    at::mm_out(tile, a, b.t(), tile.scalar_type());
  }
}

// The total order of candidates: d² ascending, NaN after every number, then the index.
template <typename acc_t>
__device__ __forceinline__ bool before(acc_t da, int64_t ja, acc_t db, int64_t jb) {
  const bool nan_a = da != da, nan_b = db != db;
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && da != db) return da < db;
  return ja < jb;
}

// Order-preserving integer keys of floating values, NaN above +∞.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t bits = __float_as_uint(v);
  return v != v ? 0xffffffffu : (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}
__device__ __forceinline__ uint64_t order_key(double v) {
  const uint64_t bits = static_cast<uint64_t>(__double_as_longlong(v));
  constexpr uint64_t sign = uint64_t(1) << 63;
  return v != v ? ~uint64_t(0) : (bits & sign) ? ~bits : bits | sign;
}

// An upper bound on the k-th smallest of the block's values, kPerThread per thread (NaN
// above every number), from which k of them are known to be at most it: each thread's m-th
// smallest, m = ⌈k / kThreads⌉ (at most kMaxRank), and the ⌈k / m⌉-th smallest of those
// (ranked by counting, no atomics). Every thread returns it.
constexpr int kMaxRank = 8;
template <typename acc_t>
__device__ acc_t bound_of_kth(const acc_t (&v)[kPerThread], int64_t k, acc_t* s_mth, acc_t* s_out) {
  const int m = int((k + kThreads - 1) / kThreads);
  acc_t low[kMaxRank];  // the thread's kMaxRank smallest, ascending (NaN as the largest)
#pragma unroll
  for (int q = 0; q < kMaxRank; ++q) low[q] = ::cuda::std::numeric_limits<acc_t>::quiet_NaN();
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    acc_t x = v[t];
#pragma unroll
    for (int q = 0; q < kMaxRank; ++q) {  // insert: the larger moves on
      if (order_key(x) < order_key(low[q])) {
        const acc_t y = low[q];
        low[q] = x;
        x = y;
      }
    }
  }
  acc_t mine = low[0];
#pragma unroll
  for (int q = 1; q < kMaxRank; ++q) {
    if (q == m - 1) mine = low[q];
  }
  s_mth[threadIdx.x] = mine;
  __syncthreads();
  const int64_t rank = (k + m - 1) / m - 1;  // 0-based
  const auto key = order_key(mine);
  int below = 0;
  for (int t = 0; t < kThreads; ++t) {
    const auto other = order_key(s_mth[t]);
    below += other < key || (other == key && t < int(threadIdx.x));
  }
  if (below == rank) *s_out = mine;
  __syncthreads();
  return *s_out;
}

// Sorts the block's n entries (a power of two) of d, j in shared memory by `before`.
template <typename acc_t>
__device__ void bitonic_sort(acc_t* d, int64_t* j, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
        const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        if (before(d[hi], j[hi], d[lo], j[lo]) == ascending) {
          const acc_t td = d[lo];
          d[lo] = d[hi];
          d[hi] = td;
          const int64_t tj = j[lo];
          j[lo] = j[hi];
          j[hi] = tj;
        }
      }
      __syncthreads();
    }
  }
}

template <typename acc_t, typename scalar_t>
struct SelectArgs {
  const acc_t* g;  // the tile: row r, column l at g[r * gstride + l]
  int64_t gstride;
  const acc_t *n1, *n2, *raw1, *raw2;  // norms of the centred rows; uncentred rows
  int64_t i0, j0, w, M, k;
  bool self, first, last, squared;
  ScreenError<acc_t> error;
  acc_t* best_d;  // (rows, k): each row's k best so far, sorted
  int64_t* best_j;
  scalar_t* out_d;  // (rows, k) at the tile's first row, written on the last chunk
  int64_t* out_j;
};

template <typename acc_t, typename scalar_t>
__global__ void __launch_bounds__(kThreads, 4)
    select_kernel(SelectArgs<acc_t, scalar_t> a, int cap) {
  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* buf_d = reinterpret_cast<acc_t*>(smem);
  int64_t* buf_j = reinterpret_cast<int64_t*>(buf_d + cap);
  __shared__ int list[kChunk];
  __shared__ acc_t s_mth[kThreads];
  __shared__ acc_t s_bound;
  __shared__ int s_count, s_list;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t r = blockIdx.x, i = a.i0 + r, k = a.k;
  const int64_t self = a.self ? i - a.j0 : -1;  // the row itself, as a column of the tile
  const acc_t* grow = a.g + r * a.gstride;
  const acc_t* nb = a.n2 + a.j0;
  const acc_t* query = a.raw1 + i * a.M;
  const acc_t na = a.n1[i];
  const acc_t nan = ::cuda::std::numeric_limits<acc_t>::quiet_NaN();
  const acc_t inf = ::cuda::std::numeric_limits<acc_t>::infinity();

  // The row's k best so far; none before the first chunk.
  int held = a.first ? 0 : int(k);
  for (int t = tid; t < held; t += kThreads) {
    buf_d[t] = a.best_d[r * k + t];
    buf_j[t] = a.best_j[r * k + t];
  }
  if (tid == 0) {
    s_count = held;
    s_list = 0;
  }

  // This thread's entries, l = tid + t·kThreads: the screened d̃² − E (NaN for none).
  acc_t lo[kPerThread];
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    const int64_t l = tid + int64_t(t) * kThreads;
    lo[t] = nan;
    if (l < a.w && l != self) {
      const acc_t norm = nb[l];
      lo[t] = acc_t(norm - acc_t(2) * grow[l] + na) - (a.error.C * (na + norm) + a.error.T);
    }
  }
  // The bar: the k-th best held; in the first chunk, an upper bound on the k-th d² from the
  // bounds d̃² + E (k entries lie below it). A row without k finite bounds (a NaN query row,
  // norms past the type's range) takes every entry until k are held.
  acc_t limit = inf;
  bool take_all = false;
  if (a.first) {
    acc_t hi[kPerThread];
#pragma unroll
    for (int t = 0; t < kPerThread; ++t) {
      const int64_t l = tid + int64_t(t) * kThreads;
      hi[t] = l < a.w && l != self
                  ? acc_t(lo[t] + acc_t(2) * (a.error.C * (na + nb[l]) + a.error.T))
                  : nan;
    }
    const acc_t upper = bound_of_kth(hi, k, s_mth, &s_bound);
    if (upper < inf) {
      limit = upper;
    } else {
      take_all = true;
    }
  }
  __syncthreads();
  if (held == k && buf_d[k - 1] < limit) limit = buf_d[k - 1];

  // The candidates: what the bar cannot rule out. NaN rows are exactly NaN: they never beat k
  // held entries, nor enter beside k numbers known to exist. !(lo > limit): NaN bounds are
  // candidates.
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    const int64_t l = tid + int64_t(t) * kThreads;
    if (l < a.w && l != self && (take_all || (na == na && nb[l] == nb[l] && !(lo[t] > limit)))) {
      list[atomicAdd(&s_list, 1)] = int(l);
    }
  }
  __syncthreads();

  // Their d², directly, kThreads at a time (one warp each, lanes over the coordinates in a
  // fixed order), into the buffer where they beat the bar; merged back to k when the next
  // batch might not fit, and at the end.
  const int n = s_list;
  for (int base = 0; base < n; base += kThreads) {
    const bool open = held < k;
    for (int c = base + warp; c < min(n, base + kThreads); c += kWarps) {
      const int64_t j = a.j0 + list[c];
      const acc_t* b = a.raw2 + j * a.M;
      acc_t s = 0;
      for (int64_t q = lane; q < a.M; q += 32) {
        const acc_t diff = query[q] - b[q];
        s += diff * diff;
      }
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0 && (open || before(s, j, buf_d[k - 1], buf_j[k - 1]))) {
        const int slot = atomicAdd(&s_count, 1);
        buf_d[slot] = s;
        buf_j[slot] = j;
      }
    }
    __syncthreads();
    const int count = s_count;
    __syncthreads();  // read by every thread before the next batch appends
    if (count > held && (count > cap - kThreads || base + kThreads >= n)) {
      int size = 2;
      while (size < count) size <<= 1;
      for (int t = count + tid; t < size; t += kThreads) {
        buf_d[t] = nan;
        buf_j[t] = ::cuda::std::numeric_limits<int64_t>::max();
      }
      __syncthreads();
      bitonic_sort(buf_d, buf_j, size);
      held = int(std::min<int64_t>(count, k));
      if (tid == 0) s_count = held;
      __syncthreads();
    }
  }

  if (!a.last) {
    for (int t = tid; t < k; t += kThreads) {
      a.best_d[r * k + t] = buf_d[t];
      a.best_j[r * k + t] = buf_j[t];
    }
    return;
  }
  for (int t = tid; t < k; t += kThreads) {
    const acc_t d = buf_d[t];
    a.out_d[r * k + t] = static_cast<scalar_t>(a.squared ? d : ::sqrt(d));
    a.out_j[r * k + t] = buf_j[t];
  }
}

template <typename scalar_t>
void knn_queue(const cdist::Problem& p, const cdist::Centred& c, int64_t b, int64_t k, Tensor& dist,
               Tensor& index) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunk = std::min<int64_t>(p.R, kChunk);
  const int64_t rows = std::clamp<int64_t>(kTileBytes / int64_t(sizeof(acc_t)) / kChunk, 1, p.P);
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto [xa, xb] = screening_operands<acc_t>(p, c, b);
  const Tensor n1 = c.n1[b], n2 = c.n2[b];
  const auto opts = c.x1.options();
  Tensor tile = at::empty({rows, chunk}, opts);
  Tensor best_d = at::empty({rows, k}, opts);
  Tensor best_j = at::empty({rows, k}, opts.dtype(at::kLong));
  int cap = 2;
  while (cap < k + kThreads) cap <<= 1;
  const size_t smem = size_t(cap) * (sizeof(acc_t) + sizeof(int64_t));
  // Past 48 KiB with the static arrays (float64 at the largest k) a kernel must opt in.
  C10_CUDA_CHECK(cudaFuncSetAttribute(select_kernel<acc_t, scalar_t>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  SelectArgs<acc_t, scalar_t> args{};
  args.n1 = n1.const_data_ptr<acc_t>();
  args.n2 = n2.const_data_ptr<acc_t>();
  args.raw1 = c.raw1[b].const_data_ptr<acc_t>();
  args.raw2 = c.raw2[b].const_data_ptr<acc_t>();
  args.M = p.M;
  args.k = k;
  args.self = p.self;
  args.squared = p.squared;
  args.error = screen_error<acc_t>(p.M, kScreenBf16<acc_t>);
  args.best_d = best_d.data_ptr<acc_t>();
  args.best_j = best_j.data_ptr<int64_t>();
  for (int64_t i0 = 0; i0 < p.P; i0 += rows) {
    const int64_t n = std::min(rows, p.P - i0);
    for (int64_t j0 = 0; j0 < p.R; j0 += chunk) {
      const int64_t w = std::min(chunk, p.R - j0);
      Tensor t = tile.narrow(0, 0, n).narrow(1, 0, w);
      screen(t, xa.narrow(0, i0, n), xb.narrow(0, j0, w));
      args.g = t.const_data_ptr<acc_t>();
      args.gstride = t.stride(0);
      args.i0 = i0;
      args.j0 = j0;
      args.w = w;
      args.first = j0 == 0;
      args.last = j0 + w == p.R;
      args.out_d = dist[b].narrow(0, i0, n).data_ptr<scalar_t>();
      args.out_j = index[b].narrow(0, i0, n).data_ptr<int64_t>();
      select_kernel<acc_t, scalar_t><<<n, kThreads, smem, stream>>>(args, cap);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

// The sorted path (k > kMaxQueue). cand[r, held + l] for l < w: the candidate of query row
// i0 + r and gallery row j0 + l: its d², directly, where the screen says it may beat the bar,
// else NaN, which can never be selected once k numbers are held. The first `held` columns
// are the row's best so far, sorted; its k-th, cand[r, k − 1], is the bar (exact; NaN while
// fewer than k numbers are held: then every entry is a candidate). cand and cand_j are views
// of the whole workspace: rows `cstride` apart, not held + w.
template <typename acc_t>
__global__ void candidates_kernel(const acc_t* __restrict__ g, int64_t gstride,
                                  const acc_t* __restrict__ n1, const acc_t* __restrict__ n2,
                                  const acc_t* __restrict__ raw1, const acc_t* __restrict__ raw2,
                                  int64_t i0, int64_t j0, int64_t n, int64_t w, int64_t M,
                                  int64_t held, int64_t k, bool self, ScreenError<acc_t> error,
                                  acc_t* __restrict__ cand, int64_t* __restrict__ cand_j,
                                  int64_t cstride) {
  const acc_t nan = ::cuda::std::numeric_limits<acc_t>::quiet_NaN();
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n * w;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / w, l = idx % w;
    const int64_t i = i0 + r, j = j0 + l;
    const acc_t na = n1[i], nb = n2[j];
    const acc_t lo =
        acc_t(na + nb - acc_t(2) * g[r * gstride + l]) - (error.C * (na + nb) + error.T);
    const acc_t bar = held > 0 ? cand[r * cstride + k - 1] : nan;
    acc_t value = nan;
    const bool open = !(bar == bar) || bar == ::cuda::std::numeric_limits<acc_t>::infinity();
    if (!(self && i == j) && (open || !(lo > bar))) {
      const acc_t* a = raw1 + i * M;
      const acc_t* b = raw2 + j * M;
      acc_t s = 0;
      for (int64_t q = 0; q < M; ++q) s += (a[q] - b[q]) * (a[q] - b[q]);
      value = s;
    }
    cand[r * cstride + held + l] = value;
    cand_j[r * cstride + held + l] = j;
  }
}

template <typename scalar_t>
void knn_sorted(const cdist::Problem& p, const cdist::Centred& c, int64_t b, int64_t k,
                Tensor& dist, Tensor& index) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t kept = p.self ? k + 1 : k;  // leave-one-out: the row itself is dropped at the end
  // The first chunk must hold `kept` candidates: a k beyond kSortedChunk widens the chunks
  // (and narrows the tile).
  const int64_t chunk = std::min<int64_t>(p.R, std::max<int64_t>(kSortedChunk, kept));
  const int64_t rows = std::clamp<int64_t>(kSortedTileElements / (kept + chunk), 1, p.P);
  const auto opts = c.x1.options();
  const auto error = screen_error<acc_t>(p.M, kScreenBf16<acc_t>);
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto [xa, xb] = screening_operands<acc_t>(p, c, b);
  const Tensor raw1 = c.raw1[b], raw2 = c.raw2[b], n1 = c.n1[b], n2 = c.n2[b];
  Tensor tile = at::empty({rows, chunk}, opts);
  Tensor cand = at::empty({rows, kept + chunk}, opts);
  Tensor cand_j = at::empty({rows, kept + chunk}, opts.dtype(at::kLong));
  for (int64_t i0 = 0; i0 < p.P; i0 += rows) {
    const int64_t n = std::min(rows, p.P - i0);
    // The best so far: none before the first chunk, which is at least `kept` wide (kept <= R).
    Tensor best, best_j;
    for (int64_t j0 = 0; j0 < p.R; j0 += chunk) {
      const int64_t w = std::min(chunk, p.R - j0);
      const int64_t held = j0 == 0 ? 0 : kept;
      Tensor t = tile.narrow(0, 0, n).narrow(1, 0, w);
      screen(t, xa.narrow(0, i0, n), xb.narrow(0, j0, w));
      Tensor cd = cand.narrow(0, 0, n).narrow(1, 0, held + w);
      Tensor cj = cand_j.narrow(0, 0, n).narrow(1, 0, held + w);
      if (held > 0) {
        cd.narrow(1, 0, held).copy_(best);
        cj.narrow(1, 0, held).copy_(best_j);
      }
      candidates_kernel<acc_t><<<cuda::grid_size(n * w, kThreads), kThreads, 0, stream>>>(
          t.const_data_ptr<acc_t>(), t.stride(0), n1.const_data_ptr<acc_t>(),
          n2.const_data_ptr<acc_t>(), raw1.const_data_ptr<acc_t>(), raw2.const_data_ptr<acc_t>(),
          i0, j0, n, w, p.M, held, k, p.self, error, cd.data_ptr<acc_t>(), cj.data_ptr<int64_t>(),
          cd.stride(0));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      // Stable: ties keep their order, which is by index (the best so far come from earlier
      // chunks, and are sorted); NaN sorts last. The row itself (leave-one-out) is NaN.
      // (at::sort with all four arguments: Tensor::sort(true, 1) would be sort(dim = 1,
      // descending = true).)
      const auto [values, order] = at::sort(cd, /*stable=*/true, /*dim=*/1, /*descending=*/false);
      best = values.narrow(1, 0, kept).clone();
      best_j = cj.gather(1, order.narrow(1, 0, kept));
    }
    if (p.self) {  // drop the row itself (NaN, wherever it sorted), keep the order of the rest
      const Tensor own = best_j == at::arange(i0, i0 + n, best_j.options()).unsqueeze(1);
      const Tensor keep =
          std::get<1>(at::sort(own.to(at::kByte), /*stable=*/true, /*dim=*/1, /*descending=*/false))
              .narrow(1, 0, k);
      best = best.gather(1, keep);
      best_j = best_j.gather(1, keep);
    }
    Tensor d = p.squared ? best : best.sqrt();
    dist[b].narrow(0, i0, n).copy_(d);
    index[b].narrow(0, i0, n).copy_(best_j);
  }
}

std::tuple<Tensor, Tensor> knn_cuda(const Tensor& query, const std::optional<Tensor>& gallery,
                                    const c10::Scalar& k_arg, const c10::Scalar& squared) {
  const Problem p = check_inputs(query, gallery, k_arg, squared);
  const int64_t k = p.k;
  const c10::cuda::CUDAGuard guard(query.device());
  Tensor dist = at::empty({p.B, p.P, k}, query.options());
  Tensor index = at::empty({p.B, p.P, k}, query.options().dtype(at::kLong));
  if (p.B * p.P > 0) {
    const cdist::Centred c = cdist::centre(p, query, gallery, cdist::kCentringAten);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "knn_cuda", [&] {
      for (int64_t b = 0; b < p.B; ++b) {
        if (k <= kMaxQueue) {
          knn_queue<scalar_t>(p, c, b, k, dist, index);
        } else {
          knn_sorted<scalar_t>(p, c, b, k, dist, index);
        }
      }
    });
  }
  std::vector<int64_t> shape = p.batch;
  shape.push_back(p.P);
  shape.push_back(k);
  return {dist.view(shape), index.view(shape)};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CUDA, m) { m.impl("knn", &knn_cuda); }

}  // namespace torchkit::knn

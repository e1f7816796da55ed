// Exact k-nearest neighbours on CUDA: for each (query tile × gallery chunk), cuBLAS writes the
// centred product, one kernel turns it into candidates next to the rows' current best, and a
// stable segmented sort keeps each row's k best. The kernel recomputes directly, Σ(a − b)²,
// every entry that may beat the row's current k-th best (within the expansion's margin,
// cancelled, or NaN) and marks the others NaN, which can never be selected once k numbers
// are held; so the kept values are exact and the stable sort orders them by (d², index).
// Leave-one-out keeps k + 1 (the row itself as NaN, after every number) and drops the row
// itself at the end. Workspace: one tile of candidates, never P × R. No host synchronisation.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cuda/std/limits>

#include "cdist.h"
#include "cuda/launch.h"
#include "knn.h"

namespace torchkit::knn {
namespace {

using at::Tensor;

constexpr int kThreads = 256;
constexpr int64_t kTileElements = int64_t(1) << 21;  // candidates per tile (24 MiB with indices)
constexpr int64_t kChunk = 8192;                     // gallery rows per tile

// cand[r, held + l] for l < w: the candidate of query row i0 + r and gallery row j0 + l. The
// first `held` columns are the row's best so far, sorted; its k-th, cand[r, k − 1], is the
// bar (exact; NaN while fewer than k numbers are held: then every entry is a candidate).
// cand and cand_j are views of the whole workspace: rows `cstride` apart, not held + w.
template <typename acc_t>
__global__ void candidates_kernel(const acc_t* __restrict__ g, int64_t gstride,
                                  const acc_t* __restrict__ n1, const acc_t* __restrict__ n2,
                                  const acc_t* __restrict__ raw1, const acc_t* __restrict__ raw2,
                                  int64_t i0, int64_t j0, int64_t n, int64_t w, int64_t M,
                                  int64_t held, int64_t k, bool self, acc_t margin,
                                  acc_t* __restrict__ cand, int64_t* __restrict__ cand_j,
                                  int64_t cstride) {
  const acc_t nan = ::cuda::std::numeric_limits<acc_t>::quiet_NaN();
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n * w;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / w, l = idx % w;
    const int64_t i = i0 + r, j = j0 + l;
    const acc_t na = n1[i], nb = n2[j];
    const acc_t d2 = na + nb - acc_t(2) * g[r * gstride + l];
    const acc_t bar = held > 0 ? cand[r * cstride + k - 1] : nan;
    acc_t value = nan;
    const bool open = !(bar == bar) || bar == ::cuda::std::numeric_limits<acc_t>::infinity();
    if (!(self && i == j) &&
        (open || d2 < bar * margin || d2 * acc_t(cdist::kRefineRatio) < na + nb || d2 != d2)) {
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
void knn_batch(const cdist::Problem& p, const cdist::Centred& c, int64_t b, int64_t k, Tensor& dist,
               Tensor& index) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t kept = p.self ? k + 1 : k;  // leave-one-out: the row itself is dropped at the end
  // The first chunk must hold `kept` candidates: a k beyond kChunk widens the chunks (and
  // narrows the tile).
  const int64_t chunk = std::min<int64_t>(p.R, std::max<int64_t>(kChunk, kept));
  const int64_t rows = std::clamp<int64_t>(kTileElements / (kept + chunk), 1, p.P);
  const auto opts = c.x1.options();
  const acc_t margin = static_cast<acc_t>(expansion_margin<acc_t>(p.M));
  auto stream = at::cuda::getCurrentCUDAStream();
  const Tensor xa = c.x1[b], xb = c.x2[b], raw1 = c.raw1[b], raw2 = c.raw2[b];
  const Tensor n1 = c.n1[b], n2 = c.n2[b];
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
      at::mm_out(t, xa.narrow(0, i0, n), xb.narrow(0, j0, w).t());
      Tensor cd = cand.narrow(0, 0, n).narrow(1, 0, held + w);
      Tensor cj = cand_j.narrow(0, 0, n).narrow(1, 0, held + w);
      if (held > 0) {
        cd.narrow(1, 0, held).copy_(best);
        cj.narrow(1, 0, held).copy_(best_j);
      }
      candidates_kernel<acc_t><<<cuda::grid_size(n * w, kThreads), kThreads, 0, stream>>>(
          t.const_data_ptr<acc_t>(), t.stride(0), n1.const_data_ptr<acc_t>(),
          n2.const_data_ptr<acc_t>(), raw1.const_data_ptr<acc_t>(), raw2.const_data_ptr<acc_t>(),
          i0, j0, n, w, p.M, held, k, p.self, margin, cd.data_ptr<acc_t>(), cj.data_ptr<int64_t>(),
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
                                    int64_t k, bool squared) {
  const cdist::Problem p = check_inputs(query, gallery, k, squared);
  const c10::cuda::CUDAGuard guard(query.device());
  Tensor dist = at::empty({p.B, p.P, k}, query.options());
  Tensor index = at::empty({p.B, p.P, k}, query.options().dtype(at::kLong));
  if (p.B * p.P > 0) {
    const cdist::Centred c = cdist::centre(p, query, gallery, cdist::kCentringAten);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "knn_cuda", [&] {
      for (int64_t b = 0; b < p.B; ++b) knn_batch<scalar_t>(p, c, b, k, dist, index);
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

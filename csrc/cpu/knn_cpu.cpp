// Exact k-nearest neighbours on the CPU.
//
// For each tile of query rows and each chunk of gallery rows, BLAS (multi-threaded) writes
// the centred product into a cache-sized buffer; then the threads, one query row each, turn
// it into expanded d² and keep the row's k best (d², j) in a max-heap whose top is the bar a
// new candidate must beat. Most entries fail the bar in a vectorised compare and cost
// nothing more; the few that may pass are recomputed directly, Σ(a − b)², and compared
// exactly, so the heap (and the output) holds exact values, ordered exactly. The heaps live in the
// outputs' workspace (P × k per batch), the buffer is kProductTileBytes: never P × R. Each row is
// processed by one thread in gallery order, so the result is the same on any number of threads.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "blas.h"
#include "cdist.h"
#include "cpu/distance.h"
#include "knn.h"

namespace torchkit::knn {
namespace {

using at::Tensor;
using at::vec::Vectorized;

constexpr int64_t kProductTileBytes = 8 << 20;  // the GEMM's output tile: stays in the L3 cache
constexpr int64_t kChunk = 4096;                // gallery rows per tile
constexpr int64_t kSymmetricBlock = 1024;       // leave-one-out: square tiles of 4 MiB

// An exact d² (Σ(a − b)², directly) as m·2^E in the inputs' units, m in [1/2, 1): the square
// of a float64 distance can leave float64's range both ways (1e-200 squared underflows,
// 1e200 squared overflows), and so can its square in a scaled batch element's units
// (cdist::Centred), so no one floating type holds every d² the heap orders. 0, ∞ and NaN
// take exponents below and above every finite one (with m = 0), so that the order of d² (NaN
// after every number) is the order of (E, m). Built and read with bit operations: the heap
// and the filter's bar use them once per candidate taken, which at large k is often.
struct Square {
  int E;
  double m;
};
constexpr int kZero = std::numeric_limits<int>::min();
constexpr int kInfinite = std::numeric_limits<int>::max() - 1;
constexpr int kNaN = std::numeric_limits<int>::max();
constexpr uint64_t kFraction = (uint64_t(1) << 52) - 1;

// v·2^E for v >= 0 or NaN.
Square square(double v, int E) {
  if (!(v > 0)) return {v == 0 ? kZero : kNaN, 0.0};
  if (std::isinf(v)) return {kInfinite, 0.0};
  uint64_t bits = c10::bit_cast<uint64_t>(v);
  int biased = static_cast<int>(bits >> 52);
  if (biased == 0) {  // subnormal: made normal, exactly
    bits = c10::bit_cast<uint64_t>(v * 0x1p64);
    biased = static_cast<int>(bits >> 52) - 64;
  }
  return {E + biased - 1022, c10::bit_cast<double>((bits & kFraction) | (uint64_t(1022) << 52))};
}

// s·2^shift as a double, rounded once (under- and overflow to 0 and ∞).
double value(const Square& s, int shift) {
  if (s.E == kZero) return 0.0;
  if (s.E == kInfinite) return std::numeric_limits<double>::infinity();
  if (s.E == kNaN) return std::numeric_limits<double>::quiet_NaN();
  const int biased = s.E + shift + 1022;
  if (biased > 0 && biased < 0x7ff) {
    return c10::bit_cast<double>((c10::bit_cast<uint64_t>(s.m) & kFraction) |
                                 (uint64_t(biased) << 52));
  }
  return std::ldexp(s.m, s.E + shift);
}

template <typename acc_t>
Square exact_d2(const acc_t* a, const acc_t* b, int64_t M) {
  const auto [sum, E] = cpu::direct_sq_exact(a, b, M);
  return square(static_cast<double>(sum), E);
}

struct Candidate {
  Square d2;
  int64_t j;
};

// The total order of candidates: d² ascending, NaN after every number, then the index. A
// type, not a function, so that the heap and sort algorithms inline it.
struct Before {
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.d2.E != b.d2.E) return a.d2.E < b.d2.E;
    if (a.d2.m != b.d2.m) return a.d2.m < b.d2.m;
    return a.j < b.j;
  }
};
constexpr Before before;

// The k best candidates of one query row so far, a max-heap by `before` (the worst on top).
struct RowHeap {
  Candidate* items;
  int64_t size, k;

  // Whether c entered (and so the bar may have moved).
  bool offer(const Candidate& c) {
    if (size < k) {
      items[size++] = c;
      std::push_heap(items, items + size, before);
      return true;
    }
    if (!before(c, items[0])) return false;
    int64_t i = 0;  // c replaces the worst: sifted down from the top
    for (int64_t child = 1; child < size; child = 2 * i + 1) {
      if (child + 1 < size && before(items[child], items[child + 1])) ++child;
      if (!before(c, items[child])) break;
      items[i] = items[child];
      i = child;
    }
    items[i] = c;
    return true;
  }

  // Whether every candidate must be offered: the heap is not full, or its worst is NaN
  // (then any number beats it). Otherwise a candidate needs d² below the top's to enter
  // (later columns lose ties).
  bool open() const { return size < k || items[0].d2.E == kNaN; }

  // Whether nothing can enter any more: the k best are all at distance 0, and later columns
  // lose ties. Duplicated rows reach it: their expansions cancel, so without it every
  // duplicate would be recomputed directly and offered, at several times the cost of a row
  // of distinct points.
  bool closed() const { return size == k && items[0].d2.E == kZero; }
};

// repeated[j]: gallery row j equals row j − 1 bit for bit, and so has its d² to every query.
// Where row j − 1 stayed out of a heap (filtered, or offered and refused: it was no better
// than the heap's worst, and the worst only improves), row j, a later column, stays out too
// and is not recomputed: a run of duplicated rows costs one direct sum per heap, not one per
// row (queries against a gallery of identical rows would otherwise recompute every entry,
// every one a tie within the filter's margin).
template <typename acc_t>
std::vector<uint8_t> repeated_rows(const acc_t* x, int64_t R, int64_t M) {
  std::vector<uint8_t> repeated(R, 0);
  for (int64_t j = 1; j < R; ++j)
    repeated[j] = std::memcmp(x + j * M, x + (j - 1) * M, M * sizeof(acc_t)) == 0;
  return repeated;
}

// Offers row i's candidates from one GEMM row g (columns j0 … j0 + n of the gallery). The
// heap holds directly computed d² only; the expansion is a filter: an entry is a candidate
// if its expanded d² = na + nb − 2g is below the heap's worst within the margin, or below
// (na + nb) / kRefineRatio (cancelled: not to be trusted), or NaN, or na + nb is below
// cpu::tiny_norms (underflow may have struck). With t = nb − 2g that is
// t < max(bar − na, (na + nb) / kRefineRatio − na) or nb < tiny − na, two fused
// multiply-adds, a max and two compares per 8 entries, the bar being re-read only after an
// entry got in.
template <typename acc_t>
void scan_row(RowHeap& heap, const acc_t* g, acc_t na, const acc_t* nb, const acc_t* a,
              const acc_t* xb, const uint8_t* repeated, int64_t j0, int64_t n, int64_t M,
              int64_t self, acc_t margin, int e, acc_t tiny) {
  using V = Vectorized<acc_t>;
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  const acc_t inv_ratio = acc_t(1) / acc_t(cdist::kRefineRatio);
  const V vinv(inv_ratio), vc(na * inv_ratio - na), minus_two(-2), vsmall(tiny - na);
  int64_t entered = -1;  // the last column that entered the heap in this call
  auto offer = [&](int64_t l) {
    const int64_t j = j0 + l;
    // j − 1 stayed out (not for being the query itself, whose repeat is at distance 0).
    const bool stays_out = l > 0 && repeated[j] && j - 1 != self && entered != j - 1;
    if (j == self || stays_out || !heap.offer({exact_d2(a, xb + j * M, M), j})) return false;
    entered = j;
    return true;
  };
  // t must be below this (or NaN) for the entry to be looked at. In the GEMM's units: where the
  // top's d² underflows there, an entry that could beat it has cancelled or tiny norms, and
  // the other two tests take it.
  auto bar = [&]() {
    return heap.open() ? kInf : static_cast<acc_t>(value(heap.items[0].d2, -2 * e) * margin - na);
  };
  if (heap.closed()) return;
  acc_t limit = bar();
  V vlimit(limit);
  auto candidate = [&](acc_t t, acc_t nbj) {
    return heap.open() || t < std::max(limit, nbj * inv_ratio + (na * inv_ratio - na)) || t != t ||
           nbj < tiny - na;
  };
  int64_t l = 0;
  acc_t lanes[V::size()];
  for (; l + V::size() <= n; l += V::size()) {
    const V vnb = V::loadu(nb + j0 + l);
    const V t = at::vec::fmadd(minus_two, V::loadu(g + l), vnb);
    const V threshold = at::vec::maximum(vlimit, at::vec::fmadd(vnb, vinv, vc));
    if (limit != kInf &&
        ((t < threshold) | (t != t) | (vnb < vsmall)).zero_mask() == (1 << V::size()) - 1) {
      continue;
    }
    t.store(lanes);
    for (int64_t q = 0; q < V::size(); ++q) {
      if (!candidate(lanes[q], nb[j0 + l + q]) || !offer(l + q)) continue;
      if (heap.closed()) return;
      limit = bar();
      vlimit = V(limit);
    }
  }
  for (; l < n; ++l) {
    if (!candidate(nb[j0 + l] - acc_t(2) * g[l], nb[j0 + l]) || !offer(l)) continue;
    if (heap.closed()) return;
    limit = bar();
  }
}

// The transposed scan for leave-one-out: the GEMM tile of rows I × columns J also holds
// the candidates of query rows J among gallery rows I (d is symmetric), so each pair of
// blocks is multiplied once. Columns c0 … c1 of the tile (query rows j0 + c, each with its
// own heap) are scanned 8 at a time down the tile's n rows (gallery rows i0 + r), the
// vector holding one bar per column.
template <typename acc_t>
void scan_columns(Candidate* heaps, int64_t* sizes, int64_t k, const acc_t* g, int64_t gs,
                  const acc_t* na, const acc_t* nb, const acc_t* xa, const acc_t* xb,
                  const uint8_t* repeated, int64_t i0, int64_t n, int64_t j0, int64_t c0,
                  int64_t c1, int64_t M, acc_t margin, int e, acc_t tiny) {
  using V = Vectorized<acc_t>;
  using Bits = std::conditional_t<sizeof(acc_t) == 4, uint32_t, uint64_t>;
  constexpr int64_t W = V::size();
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  const acc_t inv_ratio = acc_t(1) / acc_t(cdist::kRefineRatio);
  const V vinv(inv_ratio), minus_two(-2);
  for (int64_t c = c0; c < c1; c += W) {
    const int64_t lanes = std::min<int64_t>(W, c1 - c);
    RowHeap heap[W];
    acc_t limit[W], own_norm[W], t[W], live[W];  // live: all bits set for a lane still open
    int64_t entered[W];                          // as scan_row's, per lane
    std::fill(entered, entered + W, int64_t(-1));
    auto bar = [&](int64_t q) {  // as scan_row's, in terms of t = na − 2g for column q
      return heap[q].open()
                 ? kInf
                 : static_cast<acc_t>(value(heap[q].items[0].d2, -2 * e) * margin - nb[j0 + c + q]);
    };
    const acc_t all_bits = c10::bit_cast<acc_t>(~c10::bit_cast<Bits>(acc_t(0)));
    for (int64_t q = 0; q < W; ++q) {
      const bool in_range = q < lanes;
      heap[q] = {heaps + (in_range ? (c + q) * k : 0), in_range ? sizes[c + q] : k, k};
      own_norm[q] = in_range ? nb[j0 + c + q] : acc_t(0);
      limit[q] = in_range ? bar(q) : -kInf;
      // A lane past the tile or closed never takes anything.
      live[q] = in_range && !heap[q].closed() ? all_bits : acc_t(0);
    }
    const V vown = V::loadu(own_norm), voffset = vown * vinv - vown;
    V vlimit = V::loadu(limit), vlive = V::loadu(live);
    for (int64_t r = 0; r < n; ++r) {
      const acc_t nr = na[i0 + r];
      const V vt = at::vec::fmadd(minus_two, V::loadu(g + r * gs + c, lanes), V(nr));
      const V threshold = at::vec::maximum(vlimit, at::vec::fmadd(V(nr), vinv, voffset));
      const V take = ((vt < threshold) | (vt != vt) | (vown < V(tiny - nr))) & vlive;
      if (take.zero_mask() == (1 << W) - 1) continue;
      vt.store(t);
      for (int64_t q = 0; q < lanes; ++q) {
        const bool candidate =
            live[q] != acc_t(0) &&
            (heap[q].open() ||
             t[q] < std::max(limit[q], nr * inv_ratio + own_norm[q] * inv_ratio - own_norm[q]) ||
             t[q] != t[q] || own_norm[q] < tiny - nr);
        const bool stays_out = r > 0 && repeated[i0 + r] && entered[q] != i0 + r - 1;
        if (!candidate || stays_out ||
            !heap[q].offer({exact_d2(xb + (j0 + c + q) * M, xa + (i0 + r) * M, M), i0 + r})) {
          continue;
        }
        entered[q] = i0 + r;
        limit[q] = bar(q);
        if (heap[q].closed()) live[q] = acc_t(0);
        vlimit = V::loadu(limit);
        vlive = V::loadu(live);
      }
    }
    for (int64_t q = 0; q < lanes; ++q) sizes[c + q] = heap[q].size;
  }
}

// The survivors of rows [begin, end), in order, into the outputs at row offset `out_row`.
template <typename scalar_t>
void write_rows(Candidate* heaps, int64_t begin, int64_t end, int64_t k, int64_t out_row,
                bool squared, scalar_t* out_d, int64_t* out_j) {
  for (int64_t r = begin; r < end; ++r) {
    Candidate* best = heaps + r * k;
    std::sort(best, best + k, before);
    const int64_t o = (out_row + r) * k;
    for (int64_t q = 0; q < k; ++q) {
      const Square& s = best[q].d2;
      double d = value(s, 0);
      if (!squared && std::isnormal(d)) {
        d = std::sqrt(d);
      } else if (!squared && s.E != kZero && s.E != kInfinite && s.E != kNaN) {
        // d² past float64's normal range
        const int odd = s.E & 1;  // the root halves an even exponent
        d = std::ldexp(std::sqrt(odd ? 2 * s.m : s.m), (s.E - odd) / 2);
      }
      out_d[o + q] = static_cast<scalar_t>(d);
      out_j[o + q] = best[q].j;
    }
  }
}

// Leave-one-out: blocks of kSymmetricBlock rows; each pair of blocks (I <= J) is multiplied
// once and scanned both ways (half the GEMM of the two-set path). Every row keeps a heap
// for the whole call (P × k candidates): the k smallest under a total order do not depend
// on the order they were offered in, so the result equals the two-set path's.
template <typename scalar_t>
void knn_self_kernel(const cdist::Problem& p, const cdist::Centred& c, int64_t k, Tensor& dist,
                     Tensor& index) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t S = kSymmetricBlock, W = Vectorized<acc_t>::size();
  const int64_t blocks = (p.P + S - 1) / S;
  Tensor tile = at::empty({std::min(S, p.P), std::min(S, p.P)}, c.x1.options());
  std::vector<Candidate> heaps(p.P * k);
  std::vector<int64_t> sizes(p.P);
  const acc_t margin = static_cast<acc_t>(expansion_margin<acc_t>(p.M));
  const acc_t tiny = cpu::tiny_norms<acc_t>(p.M);
  for (int64_t b = 0; b < p.B; ++b) {
    const int e = c.exponent(b);
    const acc_t* x = c.raw1[b].const_data_ptr<acc_t>();
    const acc_t* norms = c.n1[b].const_data_ptr<acc_t>();
    const std::vector<uint8_t> repeated = repeated_rows(x, p.P, p.M);
    std::fill(sizes.begin(), sizes.end(), 0);
    for (int64_t bi = 0; bi < blocks; ++bi) {
      const int64_t i0 = bi * S, n = std::min(S, p.P - i0);
      for (int64_t bj = bi; bj < blocks; ++bj) {
        const int64_t j0 = bj * S, w = std::min(S, p.P - j0);
        Tensor t = tile.narrow(0, 0, n).narrow(1, 0, w);
        blas::mm_out(t, c.x1[b].narrow(0, i0, n), c.x1[b].narrow(0, j0, w).t());
        const acc_t* g = t.const_data_ptr<acc_t>();
        const int64_t gs = t.stride(0);
        at::parallel_for(0, n, cpu::rows_per_task(w), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const int64_t i = i0 + r;
            RowHeap heap{heaps.data() + i * k, sizes[i], k};
            scan_row<acc_t>(heap, g + r * gs, norms[i], norms, x + i * p.M, x, repeated.data(), j0,
                            w, p.M, i, margin, e, tiny);
            sizes[i] = heap.size;
          }
        });
        if (bj == bi) continue;  // the diagonal block's rows scanned it whole
        at::parallel_for(0, (w + W - 1) / W, 1, [&](int64_t begin, int64_t end) {
          scan_columns<acc_t>(heaps.data() + j0 * k, sizes.data() + j0, k, g, gs, norms, norms, x,
                              x, repeated.data(), i0, n, j0, begin * W, std::min(w, end * W), p.M,
                              margin, e, tiny);
        });
      }
    }
    at::parallel_for(0, p.P, 64, [&](int64_t begin, int64_t end) {
      write_rows<scalar_t>(heaps.data(), begin, end, k, b * p.P, p.squared,
                           dist.data_ptr<scalar_t>(), index.data_ptr<int64_t>());
    });
  }
}

template <typename scalar_t>
void knn_kernel(const cdist::Problem& p, const cdist::Centred& c, int64_t k, Tensor& dist,
                Tensor& index) {
  using acc_t = at::opmath_type<scalar_t>;
  if (p.self) return knn_self_kernel<scalar_t>(p, c, k, dist, index);
  const int64_t chunk = std::min<int64_t>(kChunk, std::max<int64_t>(p.R, 1));
  const int64_t rows =
      std::clamp<int64_t>(kProductTileBytes / (chunk * int64_t(sizeof(acc_t))), 16, 4096);
  Tensor tile = at::empty({std::min(rows, p.P), chunk}, c.x1.options());
  std::vector<Candidate> heaps(std::min(rows, p.P) * k);
  std::vector<int64_t> sizes(std::min(rows, p.P));
  const acc_t margin = static_cast<acc_t>(expansion_margin<acc_t>(p.M));
  const acc_t tiny = cpu::tiny_norms<acc_t>(p.M);
  scalar_t* out_d = dist.data_ptr<scalar_t>();
  int64_t* out_j = index.data_ptr<int64_t>();
  for (int64_t b = 0; b < p.B; ++b) {
    const int e = c.exponent(b);
    const acc_t* xa = c.raw1[b].const_data_ptr<acc_t>();
    const acc_t* xb = c.raw2[b].const_data_ptr<acc_t>();
    const acc_t* na = c.n1[b].const_data_ptr<acc_t>();
    const acc_t* nb = c.n2[b].const_data_ptr<acc_t>();
    const std::vector<uint8_t> repeated = repeated_rows(xb, p.R, p.M);
    for (int64_t i0 = 0; i0 < p.P; i0 += rows) {
      const int64_t n = std::min(rows, p.P - i0);
      std::fill(sizes.begin(), sizes.end(), 0);
      for (int64_t j0 = 0; j0 < p.R; j0 += chunk) {
        const int64_t w = std::min(chunk, p.R - j0);
        Tensor t = tile.narrow(0, 0, n).narrow(1, 0, w);
        blas::mm_out(t, c.x1[b].narrow(0, i0, n), c.x2[b].narrow(0, j0, w).t());
        const acc_t* g = t.const_data_ptr<acc_t>();
        const int64_t gs = t.stride(0);
        at::parallel_for(0, n, cpu::rows_per_task(w), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const int64_t i = i0 + r;
            RowHeap heap{heaps.data() + r * k, sizes[r], k};
            scan_row<acc_t>(heap, g + r * gs, na[i], nb, xa + i * p.M, xb, repeated.data(), j0, w,
                            p.M, p.self ? i : -1, margin, e, tiny);
            sizes[r] = heap.size;
          }
        });
      }
      at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        write_rows<scalar_t>(heaps.data(), begin, end, k, b * p.P + i0, p.squared, out_d, out_j);
      });
    }
  }
}

std::tuple<Tensor, Tensor> knn_cpu(const Tensor& query, const std::optional<Tensor>& gallery,
                                   const c10::Scalar& k_arg, const c10::Scalar& squared) {
  const Problem p = check_inputs(query, gallery, k_arg, squared);
  const int64_t k = p.k;
  Tensor dist = at::empty({p.B, p.P, k}, query.options());
  Tensor index = at::empty({p.B, p.P, k}, query.options().dtype(at::kLong));
  if (p.B * p.P > 0) {
    const cdist::Centred c = cdist::centre(p, query, gallery, cpu::kCentring);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "knn_cpu",
                                    [&] { knn_kernel<scalar_t>(p, c, k, dist, index); });
  }
  std::vector<int64_t> shape = p.batch;
  shape.push_back(p.P);
  shape.push_back(k);
  return {dist.view(shape), index.view(shape)};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) { m.impl("knn", &knn_cpu); }

}  // namespace torchkit::knn

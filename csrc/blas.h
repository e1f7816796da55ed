// ATen's matrix products as the CPU kernels need them: in IEEE float32 whatever PyTorch's
// fp32-matmul setting says, and sequential on the calling thread where a kernel asks.
//
// IEEE float32. torch.set_float32_matmul_precision("medium") (or
// torch.backends.mkldnn.matmul.fp32_precision = "bf16") lets ATen's CPU matmuls round float32
// operands to bfloat16 through oneDNN wherever the CPU has bfloat16 instructions (AVX512-BF16,
// AMX), and "high" to TF32 where it has AMX-FP16. Measured on an AMX CPU under "medium":
// cdist's distances moved by 8.5e-3, covariance pooling's output by 8.6e-3, SupCon's loss by
// 5.9e-4. The CPU kernels' accuracy bounds (knn's screening, the pair losses' float64 miners,
// the documented tolerances) assume IEEE products, and docs/ops.md promises them: the setting
// is the CUDA precision contract, not the CPU's. So for float32 operands on the CPU, while
// the setting is reduced, the products below call BLAS's sgemm_ directly (torch's CPU library
// exports the one it links in: MKL's in the x86 wheels), which never rounds its operands; where
// no sgemm_ is found, or a size passes BLAS's 32-bit integers, they are computed in float64.
// Under the default setting, and for other devices and dtypes, each is ATen's own call.
//
// Sequential. MKL splits a GEMM's work by its number of threads, and with it the order of some
// sums: a product computed on 1 thread and on 2 or 3 can differ in the last bits (measured with
// torch 2.14's MKL 2024.2: 5×3 by 3×256 float32 on 2 threads). Inside a parallel region of
// several threads MKL runs sequentially; a task that runs alone (one block of rows, or one
// thread's team) would let it use every thread, so that the result depended on the count.
// While a blas::Sequential lives, the calling thread's MKL calls are sequential
// (mkl_set_num_threads_local; elsewhere there is nothing to do and the guard does nothing). Its
// C entry point is MKL_Set_Num_Threads_Local (mkl_service.h's macro): the lower-case symbol is
// the Fortran one, which takes a pointer.
#pragma once

#include <ATen/ATen.h>
#include <torch/version.h>

#if defined(__linux__) || defined(__APPLE__)
#include <dlfcn.h>
#endif

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace torchkit::blas {

namespace detail {

// A symbol of torch's CPU library (already loaded: RTLD_NOLOAD), or nullptr.
inline void* torch_cpu_symbol(const char* name) {
#if defined(__linux__) || defined(__APPLE__)
  for (const char* library : {"libtorch_cpu.so", "libtorch_cpu.dylib"}) {
    if (void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD)) {
      void* found = dlsym(handle, name);
      dlclose(handle);  // (the library stays: torch holds it)
      if (found != nullptr) return found;
    }
  }
#endif
  return nullptr;
}

// The Fortran BLAS entry point (32-bit integers, column-major).
using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                       const float*, const int*, const float*, const int*, const float*, float*,
                       const int*);

inline Sgemm sgemm() {
  static const auto fn = reinterpret_cast<Sgemm>(torch_cpu_symbol("sgemm_"));
  return fn;
}

// How BLAS reads a row-major r×c operand as its column-major transpose: 'N' where its rows are
// contiguous, 'T' where its columns are, with the leading dimension; nothing otherwise.
struct Layout {
  char trans;
  int64_t ld;
};

inline std::optional<Layout> operand_layout(const at::Tensor& t) {
  const int64_t r = t.size(0), c = t.size(1);
  const int64_t s0 = t.stride(0), s1 = t.stride(1);
  if ((c == 1 || s1 == 1) && (r == 1 || s0 >= std::max<int64_t>(1, c)))
    return Layout{'N', r == 1 ? std::max<int64_t>(1, c) : s0};
  if ((r == 1 || s0 == 1) && (c == 1 || s1 >= std::max<int64_t>(1, r)))
    return Layout{'T', c == 1 ? std::max<int64_t>(1, r) : s1};
  return std::nullopt;
}

inline bool fits_int(int64_t v) { return v <= std::numeric_limits<int>::max(); }

// c = beta·c + alpha·(a @ b) for 2-D float32 CPU tensors, products and sums in IEEE float32
// (float64 where sgemm_ cannot take them); c's contents are not read when beta = 0.
inline void ieee_gemm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, double beta,
                      double alpha) {
  const int64_t m = c.size(0), n = c.size(1), k = a.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // no products (and no operand BLAS could take: its strides are arbitrary)
    beta == 0.0 ? c.zero_() : c.mul_(beta);
    return;
  }
  const Sgemm fn = sgemm();
  if (fn == nullptr || !fits_int(m) || !fits_int(n) || !fits_int(k)) {
    const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
    c.copy_(beta == 0.0 ? at::mm(a64, b64).mul_(alpha)
                        : at::addmm(c.to(at::kDouble), a64, b64, beta, alpha));
    return;
  }
  const auto la = detail::operand_layout(a), lb = detail::operand_layout(b);
  if (!la || !fits_int(la->ld)) return detail::ieee_gemm(c, a.contiguous(), b, beta, alpha);
  if (!lb || !fits_int(lb->ld)) return detail::ieee_gemm(c, a, b.contiguous(), beta, alpha);
  const auto lc = detail::operand_layout(c);
  if (!lc || lc->trans != 'N' || !fits_int(lc->ld)) {  // into a row-major copy, then back
    const at::Tensor t = beta == 0.0 ? at::empty({m, n}, c.options()) : c.contiguous();
    detail::ieee_gemm(t, a, b, beta, alpha);
    c.copy_(t);
    return;
  }
  // Row-major c = a·b is column-major cᵀ = bᵀ·aᵀ.
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int lda = static_cast<int>(lb->ld), ldb = static_cast<int>(la->ld);
  const int ldc = static_cast<int>(lc->ld);
  const float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
  fn(&lb->trans, &la->trans, &M, &N, &K, &fa, b.const_data_ptr<float>(), &lda,
     a.const_data_ptr<float>(), &ldb, &fb, c.data_ptr<float>(), &ldc);
}

}  // namespace detail

// Whether PyTorch's fp32-matmul setting now lets its CPU matmuls take reduced-precision
// products (bfloat16 or TF32) of float32 operands. torch 2.8 has only the one global setting;
// 2.9 keys it by backend and op as strings, 2.10 as enums.
inline bool float32_reduced() {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 9
  return at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST;
#elif TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 9
  const std::string p = at::globalContext().float32Precision("mkldnn", "matmul");
  return p == "bf16" || p == "tf32";
#else
  const at::Float32Precision p =
      at::globalContext().float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL);
  return p == at::Float32Precision::BF16 || p == at::Float32Precision::TF32;
#endif
}

// Whether a product into `out` must bypass ATen to stay IEEE.
inline bool bypass(const at::Tensor& out) {
  return out.is_cpu() && out.scalar_type() == at::kFloat && float32_reduced();
}

// ATen's calls of the same names and meaning (no broadcasting of self), IEEE on the CPU. Call
// them qualified (blas::), here too: unqualified, argument-dependent lookup finds at::'s.

// out = a @ b
inline void mm_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (bypass(out)) return detail::ieee_gemm(out, a, b, 0.0, 1.0);
  at::Tensor o = out;
  at::mm_out(o, a, b);
}

// out = beta·self + alpha·(a @ b); self is not read when beta = 0 (it may be out itself).
inline void addmm_out(const at::Tensor& out, const at::Tensor& self, const at::Tensor& a,
                      const at::Tensor& b, double beta, double alpha) {
  if (bypass(out)) {
    if (beta != 0.0 && !self.is_same(out)) out.copy_(self);
    return detail::ieee_gemm(out, a, b, beta, alpha);
  }
  at::Tensor o = out;
  at::addmm_out(o, self, a, b, beta, alpha);
}

// self = beta·self + alpha·(a @ b)
inline void addmm_(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                   double beta = 1.0, double alpha = 1.0) {
  if (bypass(self)) return detail::ieee_gemm(self, a, b, beta, alpha);
  self.addmm_(a, b, beta, alpha);
}

// self[i] = beta·self[i] + alpha·(a[i] @ b[i]), every i
inline const at::Tensor& baddbmm_(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                                  double beta = 1.0, double alpha = 1.0) {
  if (bypass(self)) {
    for (int64_t i = 0; i < self.size(0); ++i) detail::ieee_gemm(self[i], a[i], b[i], beta, alpha);
    return self;
  }
  return self.baddbmm_(a, b, beta, alpha);
}

// out[i] = a[i] @ b[i]
inline void bmm_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (bypass(out)) {
    for (int64_t i = 0; i < out.size(0); ++i) detail::ieee_gemm(out[i], a[i], b[i], 0.0, 1.0);
    return;
  }
  at::Tensor o = out;
  at::bmm_out(o, a, b);
}

inline at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) {
  if (!bypass(a)) return at::bmm(a, b);
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  blas::bmm_out(out, a, b);
  return out;
}

inline at::Tensor baddbmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                          double beta = 1.0, double alpha = 1.0) {
  if (!bypass(self)) return at::baddbmm(self, a, b, beta, alpha);
  at::Tensor out = self.clone(at::MemoryFormat::Contiguous);
  return blas::baddbmm_(out, a, b, beta, alpha);
}

class Sequential {
 public:
  Sequential() {
    if (const Fn set = set_local()) {
      previous_ = set(1);
      active_ = true;
    }
  }
  ~Sequential() {
    if (active_) set_local()(previous_);  // (0: back to MKL's global setting)
  }
  Sequential(const Sequential&) = delete;
  Sequential& operator=(const Sequential&) = delete;

 private:
  using Fn = int (*)(int);
  static Fn set_local() {
    static const auto fn =
        reinterpret_cast<Fn>(detail::torch_cpu_symbol("MKL_Set_Num_Threads_Local"));
    return fn;
  }
  int previous_ = 0;
  bool active_ = false;
};

}  // namespace torchkit::blas

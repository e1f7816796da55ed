// Sequential BLAS on the calling thread, so that a kernel's products round the same whatever
// the number of threads.
//
// MKL splits a GEMM's work by its number of threads, and with it the order of some sums: a
// product computed on 1 thread and on 2 or 3 can differ in the last bits (measured with
// torch 2.14's MKL 2024.2: 5×3 by 3×256 float32 on 2 threads). Inside a parallel region of
// several threads MKL runs sequentially; a task that runs alone (one block of rows, or one
// thread's team) would let it use every thread, so that the result depended on the count.
// While a SequentialBlas lives, the calling thread's MKL calls are sequential
// (mkl_set_num_threads_local, which torch's CPU library exports where torch was built with
// MKL; elsewhere there is nothing to do and the guard does nothing). Its C entry point is
// MKL_Set_Num_Threads_Local (mkl_service.h's macro): the lower-case symbol is the Fortran one,
// which takes a pointer.
#pragma once

#if defined(__linux__) || defined(__APPLE__)
#include <dlfcn.h>
#endif

namespace torchkit::cpu {

class SequentialBlas {
 public:
  SequentialBlas() {
    if (const Fn set = set_local()) {
      previous_ = set(1);
      active_ = true;
    }
  }
  ~SequentialBlas() {
    if (active_) set_local()(previous_);  // (0: back to MKL's global setting)
  }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;

 private:
  using Fn = int (*)(int);
  static Fn set_local() {
    static const Fn fn = [] {
      Fn found = nullptr;
#if defined(__linux__) || defined(__APPLE__)
      // Where MKL lives: linked into torch's CPU library (already loaded: RTLD_NOLOAD).
      for (const char* library : {"libtorch_cpu.so", "libtorch_cpu.dylib"}) {
        if (void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD)) {
          found = reinterpret_cast<Fn>(dlsym(handle, "MKL_Set_Num_Threads_Local"));
          dlclose(handle);  // (the library stays: torch holds it)
          if (found != nullptr) break;
        }
      }
#endif
      return found;
    }();
    return fn;
  }
  int previous_ = 0;
  bool active_ = false;
};

}  // namespace torchkit::cpu

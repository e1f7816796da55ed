// Library-wide declarations shared by torchkit.cpp and the backend translation units.
#pragma once

#include <cstdint>

namespace torchkit {

// CUDART_VERSION of the CUDA build (e.g. 13020), -1 in a CPU-only build. Constant-initialised
// here, then set by a static initialiser in csrc/cuda/torchkit_cuda.cu when that file is linked.
extern int64_t cuda_version_built;
// The nvcc that compiled the CUDA kernels ("" in a CPU-only build); set the same way.
extern const char* cuda_compiler_built;

}  // namespace torchkit

// Announces the CUDA build to the library-wide ops in csrc/torchkit.cpp. Linking this
// file is what turns torchkit::_cuda_version() from -1 into the CUDA runtime version.
#include <cuda_runtime_api.h>

#include "torchkit.h"

#define TK_STR2(x) #x
#define TK_STR(x) TK_STR2(x)

namespace torchkit {
namespace {

struct AnnounceCudaBuild {
  AnnounceCudaBuild() {
    cuda_version_built = CUDART_VERSION;
    cuda_compiler_built = "nvcc " TK_STR(__CUDACC_VER_MAJOR__) "." TK_STR(
        __CUDACC_VER_MINOR__) "." TK_STR(__CUDACC_VER_BUILD__);
  }
};
const AnnounceCudaBuild announce_cuda_build;

}  // namespace
}  // namespace torchkit

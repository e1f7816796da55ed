// The extension's entry point and the library-wide ops.
//
// `import torchkit._C` loads this shared object, which runs every TORCH_LIBRARY_FRAGMENT
// and TORCH_LIBRARY_IMPL static registration in csrc/. The module itself is empty: the
// ops are reached through torch.ops.torchkit, so no pybind11 (and a limited-API build).
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "torchkit.h"

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace torchkit {

int64_t cuda_version_built = -1;
const char* cuda_compiler_built = "";

namespace {

// These ops take no tensor, so the dispatcher has no backend to choose by: they are
// catch-all kernels, and the CUDA translation unit reports itself through the globals above.
int64_t cuda_version() { return cuda_version_built; }

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

#if defined(__clang__)
constexpr const char* kCompiler = "clang " __clang_version__;
#else
constexpr const char* kCompiler = "gcc " __VERSION__;
#endif

// A JSON object; torchkit.build_info() parses it.
std::string build_info() {
  return std::string("{") + "\"torch\": " + quoted(TORCHKIT_BUILD_TORCH) +
         ", \"cuda\": " + std::to_string(cuda_version_built) +
         ", \"architectures\": " + quoted(TORCHKIT_BUILD_ARCHS) +
         ", \"compiler\": " + quoted(kCompiler) +
         ", \"cuda_compiler\": " + quoted(cuda_compiler_built) + "}";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkit, m) {
  m.def("_cuda_version() -> int", &cuda_version);
  m.def("_build_info() -> str", &build_info);
}

}  // namespace torchkit

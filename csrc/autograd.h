// What the ops' C++ autograd formulas (each op's Autograd kernel) share.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>

#include <optional>

namespace torchkit {

// The typed handle of an op (e.g. "torchkit::cdist"); callers keep it in a static.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Held while a formula calls its backward op: below autograd, unless a graph of the gradient
// is asked for (create_graph=True); then the backward op's own formula is recorded, which
// refuses a double backward by name.
class BackwardOpGuard {
 public:
  BackwardOpGuard() {
    if (!at::GradMode::is_enabled()) below_.emplace();
  }

 private:
  std::optional<at::AutoDispatchBelowADInplaceOrView> below_;
};

}  // namespace torchkit

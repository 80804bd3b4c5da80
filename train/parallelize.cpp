#include "train/parallelize.h"

namespace kiln {

namespace {

// A Locate over one of the strategy's unit placements (params or grads).
Locate unit_locator(const Strategy& strategy, Tensor (Strategy::*unit_tensor)(int) const) {
  return [&strategy, unit_tensor](const ParamInfo& info) {
    const Tensor unit = (strategy.*unit_tensor)(info.unit);
    if (!unit.defined()) return Tensor{};
    const int64_t unit_begin = strategy.units()[static_cast<size_t>(info.unit)].first;
    return unit.slice(info.offset - unit_begin, info.shape);
  };
}

}  // namespace

void parallelize(Model& model, Strategy& strategy, UnitHooks& hooks) {
  auto bind = [&model, &strategy] {
    model.bind_weights(unit_locator(strategy, &Strategy::unit_params));
    model.bind_grads(unit_locator(strategy, &Strategy::unit_grads));
  };
  bind();
  strategy.on_placement_changed = bind;
  hooks.before_forward = [&strategy](int unit) { strategy.before_forward(unit); };
  hooks.before_backward = [&strategy](int unit) { strategy.before_backward(unit); };
  hooks.after_backward = [&strategy](int unit) { strategy.after_backward(unit); };
  model.set_hooks(&hooks);
}

}  // namespace kiln

#include "model/layers/linear.h"

namespace kiln {

void Linear::declare(LayoutBuilder& b, const std::string& name, int64_t in_features,
                     int64_t out_features, bool with_bias) {
  in = in_features;
  out = out_features;
  weight = b.add(name + ".weight", {out, in}, true);
  bias = with_bias ? b.add(name + ".bias", {out}, false) : -1;
}

}  // namespace kiln

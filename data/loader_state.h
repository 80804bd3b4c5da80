// The loader's position in its data (data/loader.h), as a checkpoint saves it: what a resumed
// run needs to serve the very batches the uninterrupted run would have, on any world size.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

// One source of a mixture (data.sources). The weight is kept so that a run resumed with other
// weights can tell, and the schedule restarts from the new weights instead of first paying back
// what the old ones owed.
struct SourcePosition {
  std::string name;
  double weight = 0;   // the weight its windows were drawn with
  uint64_t epoch = 0;  // its next window is window `cursor` of its epoch `epoch`
  uint64_t cursor = 0;
  uint64_t drawn = 0;  // windows drawn since the weights were set: the schedule's whole state
  uint64_t total = 0;  // windows drawn in the run, all ranks together
  bool operator==(const SourcePosition& o) const {
    return name == o.name && weight == o.weight && epoch == o.epoch && cursor == o.cursor &&
           drawn == o.drawn && total == o.total;
  }
};

// Position of a batch in the stream: `cursor` is a window index within epoch `epoch`. For a
// mixture, `cursor` counts the windows drawn in all, `epoch` stays 0, and `sources` holds each
// source's own position.
struct LoaderState {
  LoaderState() = default;
  LoaderState(uint64_t epoch_, uint64_t cursor_, std::vector<SourcePosition> sources_ = {})
      : epoch(epoch_), cursor(cursor_), sources(std::move(sources_)) {}

  uint64_t epoch = 0;
  uint64_t cursor = 0;
  std::vector<SourcePosition> sources;
  bool operator==(const LoaderState& o) const {
    return epoch == o.epoch && cursor == o.cursor && sources == o.sources;
  }
  bool operator!=(const LoaderState& o) const { return !(*this == o); }
};

}  // namespace kiln

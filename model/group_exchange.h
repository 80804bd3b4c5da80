// The two exchanges a model layer makes within a group of ranks that split its work (tensor
// parallelism's, context parallelism's): the layer knows these, never the communicator or the
// ranks' mesh (dist/device_mesh.h). train/parallelize.cpp fills them from the group's
// communicator.
#pragma once

#include <cstdint>
#include <functional>

#include "kernels/backend.h"

namespace kiln {

struct GroupExchange {
  int ranks = 1, rank = 0;
  // all_gather(all, mine): all = every rank's `mine`, one after another in rank order;
  // reduce_scatter(mine, all): mine = the sum over ranks of their `all`'s rank-th part. Each
  // finished when it returns.
  std::function<void(Tensor all, Tensor mine)> all_gather;
  std::function<void(Tensor mine, Tensor all)> reduce_scatter;
  // The same exchanges started only, so that they run beside the compute issued after them:
  // their buffers may be read or written once wait_until(a mark() taken after them) returns.
  // Unset where the group cannot overlap (then the layer uses the finished forms).
  std::function<void(Tensor all, Tensor mine)> start_all_gather;
  std::function<void(Tensor mine, Tensor all)> start_reduce_scatter;
  std::function<uint64_t()> mark;
  std::function<void(uint64_t)> wait_until;

  bool on() const { return ranks > 1; }
  bool overlaps() const { return start_all_gather && start_reduce_scatter && mark && wait_until; }
};

}  // namespace kiln

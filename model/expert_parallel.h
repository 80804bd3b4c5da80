// dist.expert_parallel as the model sees it, applied to the MoE layers from outside the model:
// the `ranks` ranks of a group hold the experts in equal runs (rank q: experts q*E/ranks ...),
// and each computes its experts for the tokens of every rank in the group, which travel through
// the group's Communicator (all_to_all and all_to_all_v, each finished when it returns). The
// forward exchanges the rows per expert first and reads them on the host (one copy, a stream
// sync on the GPU, which the grouped GEMMs need anyway), then sends exactly the rows each rank
// needs, there and back; the backward reuses those sizes. The model knows only these two
// exchanges, never the communicator or the device mesh (dist/device_mesh.h).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/backend.h"

namespace kiln {

struct ExpertParallel {
  int ranks = 1, rank = 0;
  std::function<void(Tensor out, Tensor in)> all_to_all;
  std::function<void(Tensor out, const std::vector<int64_t>& recv_rows, Tensor in,
                     const std::vector<int64_t>& send_rows)>
      all_to_all_v;
};

// Whether MoE blocks spread over `expert_parallel` ranks keep their group offsets on the device
// on backend k (no stream sync, and a CUDA graph can capture them): where k's grouped GEMMs read
// device offsets, and without expert parallelism, whose exchange reads its counts on the host.
inline bool moe_sizes_on_device(const Backend& k, int expert_parallel) {
  return expert_parallel == 1 && k.grouped_reads_device_offsets();
}

}  // namespace kiln

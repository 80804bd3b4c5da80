// What hf_model.h's implementation files share (hf/*.cpp): the JSON files a model directory
// holds, read with errors naming them, and export_hf's two halves.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hf/hf_adapter.h"
#include "hf/hf_model.h"

namespace kiln {

// The JSON at `path`; InputError naming it where it cannot be read or is malformed.
nlohmann::json read_json(const std::string& path);

// The weights of `cfg` as `family`'s into DIR as opts.dtype, in shards of at most
// opts.max_shard_bytes (model.safetensors, or model-0000i-of-0000n.safetensors and
// model.safetensors.index.json); returns the files written.
std::vector<std::string> write_hf_weights(const std::string& dir, const ModelConfig& cfg,
                                          const HfAdapter& family, const ParamLayout& layout,
                                          const float* params, const HfExportOptions& opts);
// DIR/config.json for `cfg` as `family`'s.
void write_hf_config(const std::string& dir, const ModelConfig& cfg, const HfAdapter& family,
                     const HfExportOptions& opts);

}  // namespace kiln

// The weights through the weight map (hf_model.h: for each kiln tensor, which HF tensors make it
// up, at which rows and whether transposed; each family's adapter gives its own, hf/hf_adapter.h),
// both ways: a directory's safetensors files read into kiln's flat layout, and kiln's parameters
// written as HF's tensors.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "base/error.h"
#include "hf/hf_adapter.h"
#include "hf/hf_files.h"
#include "hf/hf_model.h"
#include "hf/safetensors.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string join_shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

// The opened safetensors files of a directory and which file holds each tensor.
struct HfFiles {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<const SafetensorsFile*, const SafeTensorInfo*>> by_name;
};

HfFiles open_hf_files(const std::string& dir) {
  HfFiles out;
  const std::string index = dir + "/model.safetensors.index.json";
  const std::string single = dir + "/model.safetensors";
  std::map<std::string, std::string> weight_map;  // tensor -> file, from the index
  std::vector<std::string> names;
  if (fs::exists(single)) {
    names.push_back("model.safetensors");
  } else if (fs::exists(index)) {
    const json j = read_json(index);
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw InputError(index + ": no weight_map object");
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it->is_string())
        throw InputError(index + ": weight_map['" + it.key() + "'] is not a file name");
      const std::string file = it->get<std::string>();
      if (file.find('/') != std::string::npos)
        throw InputError(index + ": weight_map['" + it.key() + "'] names '" + file +
                         "' outside the directory");
      weight_map[it.key()] = file;
      if (std::find(names.begin(), names.end(), file) == names.end()) names.push_back(file);
    }
  } else {
    throw InputError(dir +
                     ": no model.safetensors or model.safetensors.index.json (only "
                     "safetensors weights are read, not pytorch_model.bin)");
  }
  for (const std::string& name : names) {
    out.files.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(dir + "/" + name)));
    const SafetensorsFile& f = *out.files.back();
    for (const SafeTensorInfo& t : f.tensors()) {
      auto [it, fresh] = out.by_name.emplace(t.name, std::make_pair(&f, &t));
      if (!fresh)
        throw InputError(f.path() + ": tensor '" + t.name + "' is also in " +
                         it->second.first->path());
    }
  }
  for (const auto& [tensor, file] : weight_map) {
    auto it = out.by_name.find(tensor);
    if (it == out.by_name.end() || fs::path(it->second.first->path()).filename() != file)
      throw InputError(index + ": tensor '" + tensor + "' is not in " + dir + "/" + file);
  }
  return out;
}

// A kiln tensor's rows as the weight map counts them: its last dimension wide (an expert
// tensor [E, R, W] is E*R rows of W), one value for a vector.
int64_t row_width(const ParamInfo& p) {
  return p.shape.ndim >= 2 ? p.shape[p.shape.ndim - 1] : 1;
}

}  // namespace

std::string hf_model_type(const ModelConfig& c) {
  return hf_adapter_for(c).model_type();
}

std::vector<HfTensorMap> hf_weight_map(const ModelConfig& c, const std::string& prefix) {
  return hf_adapter_for(c).weight_map(c, prefix);
}

std::vector<float> load_hf_weights(const std::string& dir, const ModelConfig& cfg,
                                   const ParamLayout& layout) {
  const HfFiles files = open_hf_files(dir);
  const HfAdapter& family = hf_adapter_for(cfg);
  // The prefix the files' names carry (GPT2LMHeadModel.save_pretrained's "transformer.", none in
  // the original GPT-2 files): the first of the family's whose first tensor is there.
  const std::vector<std::string> prefixes = family.weight_prefixes();
  std::string prefix = prefixes.back();
  for (const std::string& p : prefixes)
    if (files.by_name.count(family.weight_map(cfg, p).front().pieces.front().name)) {
      prefix = p;
      break;
    }
  const std::vector<HfTensorMap> map = family.weight_map(cfg, prefix);
  // transformers may save a tied head too: the untied model's head, the embedding again.
  std::string tied_head;
  if (cfg.tie_embeddings) {
    ModelConfig untied = cfg;
    untied.tie_embeddings = false;
    for (const HfTensorMap& m : family.weight_map(untied, prefix))
      if (m.kiln_name == "lm_head") tied_head = m.pieces.front().name;
  }
  std::vector<float> params(static_cast<size_t>(layout.total), 0.0f);
  std::set<std::string> used;
  std::vector<float> buf;
  for (const HfTensorMap& m : map) {
    const ParamInfo& p = layout.find(m.kiln_name);
    const int64_t cols = row_width(p);
    for (const HfPiece& piece : m.pieces) {
      auto it = files.by_name.find(piece.name);
      if (it == files.by_name.end())
        throw InputError(dir + ": tensor '" + piece.name + "' (kiln's " + m.kiln_name +
                         ") is missing from the safetensors files");
      const auto [file, info] = it->second;
      if (info->shape != piece.shape)
        throw InputError(file->path() + ": tensor '" + piece.name + "' has shape " +
                         info->shape_str() + ", config.json's sizes give " +
                         join_shape(piece.shape));
      buf.resize(static_cast<size_t>(info->numel()));
      file->read_f32(*info, buf.data());
      const int64_t bad =
          std::count_if(buf.begin(), buf.end(), [](float v) { return !std::isfinite(v); });
      if (bad > 0)
        throw InputError(file->path() + ": tensor '" + piece.name + "' holds " +
                         std::to_string(bad) + " NaN or infinite values of " +
                         std::to_string(buf.size()) + " (a weight must be finite)");
      float* dst = params.data() + p.offset + piece.row * cols;
      if (piece.transpose) {  // [in, out] -> rows of out, each `in` wide
        const int64_t in = piece.shape[0], out = piece.shape[1];
        for (int64_t o = 0; o < out; ++o)
          for (int64_t i = 0; i < in; ++i) dst[o * in + i] = buf[static_cast<size_t>(i * out + o)];
      } else {
        std::copy(buf.begin(), buf.end(), dst);
      }
      used.insert(piece.name);
    }
  }
  for (const auto& [name, where] : files.by_name) {
    if (used.count(name) || family.is_buffer(name) || name == tied_head) continue;
    throw InputError(where.first->path() + ": unexpected tensor '" + name + "' (not part of a " +
                     family.model_type() + " model of config.json's sizes)");
  }
  return params;
}

std::vector<std::string> write_hf_weights(const std::string& dir, const ModelConfig& cfg,
                                          const HfAdapter& family, const ParamLayout& layout,
                                          const float* params, const HfExportOptions& opts) {
  // The tensors in HF's shapes: rows of the flat buffer where they are rows, else transposed.
  struct Out {
    SafeTensorWrite t;
    std::vector<float> owned;
  };
  std::vector<Out> outs;
  for (const HfTensorMap& m : family.weight_map(cfg, family.weight_prefixes().front())) {
    const ParamInfo& p = layout.find(m.kiln_name);
    const int64_t cols = row_width(p);
    for (const HfPiece& piece : m.pieces) {
      Out o;
      o.t.name = piece.name;
      o.t.shape = piece.shape;
      const float* src = params + p.offset + piece.row * cols;
      if (piece.transpose) {
        const int64_t in = piece.shape[0], out = piece.shape[1];
        o.owned.resize(static_cast<size_t>(in * out));
        for (int64_t i = 0; i < in; ++i)
          for (int64_t r = 0; r < out; ++r)
            o.owned[static_cast<size_t>(i * out + r)] = src[r * in + i];
      } else {
        o.t.data = src;
      }
      outs.push_back(std::move(o));
    }
  }
  for (Out& o : outs)
    if (!o.owned.empty()) o.t.data = o.owned.data();

  // Greedy shards of at most max_shard_bytes (a larger tensor gets one to itself).
  const int64_t elem = opts.dtype == "bf16" ? 2 : 4;
  std::vector<std::vector<SafeTensorWrite>> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (const Out& o : outs) {
    int64_t bytes = elem;
    for (int64_t d : o.t.shape) bytes *= d;
    if (shard_bytes > 0 && shard_bytes + bytes > opts.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(o.t);
    shard_bytes += bytes;
    total += bytes;
  }
  const std::string st_dtype = opts.dtype == "bf16" ? "BF16" : "F32";
  std::vector<std::string> written;
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    if (shards.size() == 1)
      std::snprintf(name, sizeof name, "model.safetensors");
    else
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    write_safetensors(dir + "/" + name, shards[s], st_dtype, {{"format", "pt"}});
    written.push_back(name);
    for (const SafeTensorWrite& t : shards[s]) weight_map[t.name] = name;
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2) << "\n";
    written.push_back("model.safetensors.index.json");
  }
  return written;
}

}  // namespace kiln

// The weight map (hf_model.h: for each kiln tensor, which HF tensors make it up, at which rows
// and whether transposed) and the weights through it, both ways: a directory's safetensors
// files read into kiln's flat layout, and kiln's parameters written as HF's tensors.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "base/error.h"
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

// Tensors a checkpoint may carry that are not parameters: GPT-2's causal-mask buffers, old
// LLaMA's RoPE frequencies.
bool is_buffer(const std::string& name) {
  auto ends_with = [&](const char* s) {
    const size_t n = std::strlen(s);
    return name.size() >= n && name.compare(name.size() - n, n, s) == 0;
  };
  return ends_with(".attn.bias") || ends_with(".attn.masked_bias") ||
         ends_with("rotary_emb.inv_freq");
}

// A kiln tensor's rows as the weight map counts them: its last dimension wide (an expert
// tensor [E, R, W] is E*R rows of W), one value for a vector.
int64_t row_width(const ParamInfo& p) {
  return p.shape.ndim >= 2 ? p.shape[p.shape.ndim - 1] : 1;
}

// The HF MoE model_type of a kiln MoE model whose blocks are otherwise `dense`'s (llama or
// qwen3): Qwen3-MoE (QK-norm) or Mixtral (LLaMA attention, every block routed, renormalized);
// InputError naming what neither has.
std::string hf_moe_model_type(const ModelConfig& c, const std::string& dense) {
  const MoeConfig& e = c.moe;
  auto refuse = [](const std::string& why) {
    throw InputError(
        "no Hugging Face MoE architecture (Qwen3MoeForCausalLM, "
        "MixtralForCausalLM) has this model's experts: " +
        why);
  };
  if (e.score != MoeScore::softmax) refuse("moe.score=sigmoid (both route by softmax)");
  if (e.n_shared_experts > 0) refuse("moe.n_shared_experts > 0 (neither has a shared expert)");
  if (e.balance == MoeBalance::bias)
    refuse(
        "moe.balance=bias (the routing bias it learned has no place in either; retrain with "
        "aux_loss or none)");
  if (dense == "qwen3") return "qwen3_moe";
  if (e.every != 1) refuse("moe.every > 1 without QK-norm (Mixtral routes every block)");
  if (!e.renormalize) refuse("moe.renormalize=false (Mixtral renormalizes the top-k weights)");
  return "mixtral";
}

// Block l's MoE tensors: the router, then expert e's gate and up stacked into kiln's fc
// [E, 2F, C] (rows e*2F and e*2F+F) and its down into proj [E, C, F] (rows e*C).
void add_moe_block(std::vector<HfTensorMap>& map, const ModelConfig& c, const std::string& type,
                   const std::string& k, const std::string& h) {
  const int64_t E = c.moe.n_experts, F = c.moe.expert_ffn_dim, C = c.n_embd;
  const bool qwen = type == "qwen3_moe";
  const std::string block = h + (qwen ? "mlp." : "block_sparse_moe.");
  map.push_back({k + "moe.router.weight", {{block + "gate.weight", {E, C}, 0, false}}});
  HfTensorMap fc{k + "moe.experts.fc.weight", {}}, proj{k + "moe.experts.proj.weight", {}};
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = block + "experts." + std::to_string(e) + ".";
    fc.pieces.push_back({x + (qwen ? "gate_proj" : "w1") + ".weight", {F, C}, e * 2 * F, false});
    fc.pieces.push_back({x + (qwen ? "up_proj" : "w3") + ".weight", {F, C}, e * 2 * F + F, false});
    proj.pieces.push_back({x + (qwen ? "down_proj" : "w2") + ".weight", {C, F}, e * C, false});
  }
  map.push_back(std::move(fc));
  map.push_back(std::move(proj));
}

}  // namespace

std::string hf_model_type(const ModelConfig& c) {
  const AttentionDims a = c.attention();
  if (c.norm == NormKind::layernorm && c.positions == PositionKind::learned &&
      c.mlp == MlpKind::gelu && c.bias && !c.qk_norm && a.n_kv_head == a.n_head &&
      a.head_dim * a.n_head == c.n_embd && c.moe.n_experts == 0)
    return "gpt2";
  if (c.norm == NormKind::rmsnorm && c.positions == PositionKind::rope &&
      c.mlp == MlpKind::swiglu && !c.bias && !c.qkv_bias) {
    const std::string dense = c.qk_norm ? "qwen3" : "llama";
    return c.moe.n_experts > 0 ? hf_moe_model_type(c, dense) : dense;
  }
  throw InputError(std::string("no Hugging Face architecture has this model's layers (norm ") +
                   norm_name(c.norm) + ", positions " + position_name(c.positions) + ", mlp " +
                   mlp_name(c.mlp) + ", bias " + (c.bias ? "true" : "false") + ", qkv_bias " +
                   (c.qkv_bias ? "true" : "false") + ", qk_norm " + (c.qk_norm ? "true" : "false") +
                   "); GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM and their MoE kin "
                   "(Qwen3MoeForCausalLM, MixtralForCausalLM) are exported");
}

std::vector<HfTensorMap> hf_weight_map(const ModelConfig& c, const std::string& prefix) {
  const std::string type = hf_model_type(c);
  const AttentionDims a = c.attention();
  const int64_t C = c.n_embd, F = c.ffn_dim, V = c.vocab_size;
  const int64_t q = a.q_dim(), kv = static_cast<int64_t>(a.n_kv_head) * a.head_dim;
  std::vector<HfTensorMap> map;
  auto one = [&](const std::string& kiln, const std::string& hf, std::vector<int64_t> shape,
                 bool transpose = false) {
    map.push_back({kiln, {{hf, std::move(shape), 0, transpose}}});
  };
  if (type == "gpt2") {
    const std::string& p = prefix;
    one("wte", p + "wte.weight", {V, C});
    one("wpe", p + "wpe.weight", {c.seq_len, C});
    for (int l = 0; l < c.n_layer; ++l) {
      const std::string k = "h." + std::to_string(l) + ".", h = p + k;
      one(k + "ln1.weight", h + "ln_1.weight", {C});
      one(k + "ln1.bias", h + "ln_1.bias", {C});
      one(k + "attn.qkv.weight", h + "attn.c_attn.weight", {C, 3 * C}, true);
      one(k + "attn.qkv.bias", h + "attn.c_attn.bias", {3 * C});
      one(k + "attn.proj.weight", h + "attn.c_proj.weight", {C, C}, true);
      one(k + "attn.proj.bias", h + "attn.c_proj.bias", {C});
      one(k + "ln2.weight", h + "ln_2.weight", {C});
      one(k + "ln2.bias", h + "ln_2.bias", {C});
      one(k + "mlp.fc.weight", h + "mlp.c_fc.weight", {C, F}, true);
      one(k + "mlp.fc.bias", h + "mlp.c_fc.bias", {F});
      one(k + "mlp.proj.weight", h + "mlp.c_proj.weight", {F, C}, true);
      one(k + "mlp.proj.bias", h + "mlp.c_proj.bias", {C});
    }
    one("lnf.weight", p + "ln_f.weight", {C});
    one("lnf.bias", p + "ln_f.bias", {C});
  } else {
    one("wte", "model.embed_tokens.weight", {V, C});
    for (int l = 0; l < c.n_layer; ++l) {
      const std::string k = "h." + std::to_string(l) + ".";
      const std::string h = "model.layers." + std::to_string(l) + ".";
      one(k + "ln1.weight", h + "input_layernorm.weight", {C});
      map.push_back({k + "attn.qkv.weight",
                     {{h + "self_attn.q_proj.weight", {q, C}, 0, false},
                      {h + "self_attn.k_proj.weight", {kv, C}, q, false},
                      {h + "self_attn.v_proj.weight", {kv, C}, q + kv, false}}});
      if (c.qk_norm) {
        one(k + "attn.q_norm.weight", h + "self_attn.q_norm.weight", {a.head_dim});
        one(k + "attn.k_norm.weight", h + "self_attn.k_norm.weight", {a.head_dim});
      }
      one(k + "attn.proj.weight", h + "self_attn.o_proj.weight", {C, q});
      one(k + "ln2.weight", h + "post_attention_layernorm.weight", {C});
      if (c.is_moe_block(l)) {
        add_moe_block(map, c, type, k, h);
        continue;
      }
      map.push_back({k + "mlp.fc.weight",
                     {{h + "mlp.gate_proj.weight", {F, C}, 0, false},
                      {h + "mlp.up_proj.weight", {F, C}, F, false}}});
      one(k + "mlp.proj.weight", h + "mlp.down_proj.weight", {C, F});
    }
    one("lnf.weight", "model.norm.weight", {C});
  }
  if (!c.tie_embeddings) one("lm_head", "lm_head.weight", {V, C});
  return map;
}

std::vector<float> load_hf_weights(const std::string& dir, const ModelConfig& cfg,
                                   const ParamLayout& layout) {
  const HfFiles files = open_hf_files(dir);
  const std::string type = hf_model_type(cfg);
  // GPT2LMHeadModel.save_pretrained prefixes "transformer."; the original GPT-2 files do not.
  const std::string prefix =
      type == "gpt2" && files.by_name.count("transformer.wte.weight") ? "transformer." : "";
  std::vector<float> params(static_cast<size_t>(layout.total), 0.0f);
  std::set<std::string> used;
  std::vector<float> buf;
  for (const HfTensorMap& m : hf_weight_map(cfg, prefix)) {
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
    if (used.count(name) || is_buffer(name)) continue;
    // transformers may save a tied head too: it is the embedding again.
    if (cfg.tie_embeddings && name == "lm_head.weight") continue;
    throw InputError(where.first->path() + ": unexpected tensor '" + name + "' (not part of a " +
                     type + " model of config.json's sizes)");
  }
  return params;
}

std::vector<std::string> write_hf_weights(const std::string& dir, const ModelConfig& cfg,
                                          const std::string& type, const ParamLayout& layout,
                                          const float* params, const HfExportOptions& opts) {
  // The tensors in HF's shapes: rows of the flat buffer where they are rows, else transposed.
  struct Out {
    SafeTensorWrite t;
    std::vector<float> owned;
  };
  std::vector<Out> outs;
  for (const HfTensorMap& m : hf_weight_map(cfg, type == "gpt2" ? "transformer." : "")) {
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

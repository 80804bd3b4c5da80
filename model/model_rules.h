// The model keys' rules (model/model_rules.cpp): the spellings of the MoE enum keys, the sizes a
// config leaves 0 for kiln to derive, and the shape rules between keys. The one design choice: a
// rule names the key at fault as the config spells it ("model.n_kv_head"), so the config (with
// the file and line that set it), make_model and a Hugging Face config.json (with its path)
// report a broken rule in the same words, and each rule is written once.
#pragma once

#include <string>
#include <vector>

#include "model/model.h"

namespace kiln {

// Each enum's spellings as the config writes them, indexed by value (the layer choices' are
// model/arch.h's; enum_name() gives one).
const std::vector<std::string>& enum_names(MoeScore);
const std::vector<std::string>& enum_names(MoeBalance);
// model.rope_scaling's spellings: "none" (RopeScaling::type "") and the types
// kernels/rope_freq.h implements.
const std::vector<std::string>& rope_scaling_names();

// A rule between model keys that `cfg` breaks: the key at fault as the config names it
// ("model.n_kv_head", "moe.top_k") and what is wrong ("must divide model.n_head (12), got 5").
// Empty `key`: none.
struct ModelKeyError {
  std::string key;
  std::string what;
  explicit operator bool() const { return !key.empty(); }
};

// The sizes a config leaves 0 for kiln to derive, from the other keys: n_kv_head (n_head),
// ffn_dim (4 * n_embd for gelu; 8/3 * n_embd rounded up to 256 for swiglu, LLaMA's rule),
// padded_vocab_size (vocab_size rounded up to 128) and a MoE model's expert_ffn_dim (ffn_dim).
// An error where one cannot be derived (ffn_dim past int).
ModelKeyError resolve_model_sizes(ModelConfig& cfg);

// The shape rules between model keys (heads divide the width, RoPE's head width even, the
// padded vocabulary at least the vocabulary, top_k within the experts, ...), the first broken:
// the one place they are written. Config validation reports it with the file and line that set
// the key, make_model (check_model_config, model/model.h) as std::invalid_argument, the Hugging
// Face import with config.json's path. Sizes must be resolved (resolve_model_sizes).
ModelKeyError model_config_error(const ModelConfig& cfg);

}  // namespace kiln

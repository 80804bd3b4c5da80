// Architectures as configuration: each row of the table is the layer choices that make a model
// family out of the one decoder (model/decoder.h). `model.arch` picks a row; every choice is
// also a config key of its own that overrides the row. Adding an architecture whose layers
// exist is one row here plus a config file (docs/models.md). The layer choices' enums are here
// with their spellings, which the config's keys and the docs use.
#pragma once

#include <string>
#include <vector>

namespace kiln {

struct ModelConfig;  // model/model.h

enum class NormKind { layernorm, rmsnorm };
enum class PositionKind { learned, rope };
enum class MlpKind { gelu, swiglu };

// Each enum's spellings as the config writes them, indexed by value (enum_names(MoeScore) and
// enum_names(MoeBalance) are model/model_rules.h's).
const std::vector<std::string>& enum_names(NormKind);
const std::vector<std::string>& enum_names(PositionKind);
const std::vector<std::string>& enum_names(MlpKind);
template <class Enum>
const std::string& enum_name(Enum e) {
  return enum_names(e)[static_cast<size_t>(e)];
}

const char* norm_name(NormKind k);
const char* position_name(PositionKind k);
const char* mlp_name(MlpKind k);

struct ArchDefaults {
  const char* name;
  NormKind norm;
  double norm_eps;
  PositionKind positions;
  double rope_theta;
  MlpKind mlp;
  bool bias;            // on the linear layers
  bool qkv_bias;        // on the qkv projection alone (Qwen2-style); implied by bias
  bool qk_norm;         // RMSNorm of each query and key head (Qwen3)
  bool tie_embeddings;  // LM head shares the token embedding
};

// nullptr for an unknown name.
const ArchDefaults* find_arch(const std::string& name);
std::vector<std::string> arch_names();

// The row's layer choices (arch, norm, eps, positions, RoPE base, MLP, biases, QK-norm, tied
// head) written over `m`'s, its sizes left as they are: the defaults a config's own keys then
// override. False, and `m` untouched, for an unknown name.
bool apply_arch(const std::string& name, ModelConfig& m);
// The same over ModelConfig's defaults: where a model built outside the config (a test, a
// Hugging Face config.json) starts, so the rows are stated once. Throws std::invalid_argument
// for an unknown name.
ModelConfig arch_config(const std::string& name);

// ModelConfig keeps eps and the RoPE base as floats; written back into a config or config.json
// they are the short decimal they were given as (1e-06, not 9.99999997e-07).
double float_as_written(float v);

}  // namespace kiln

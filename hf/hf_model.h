// Hugging Face model directories <-> kiln parameters, for the families registered in
// hf/hf_adapter.h (GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM and
// MixtralForCausalLM built in, one adapter file each). A directory holds config.json and
// model.safetensors, or shards named by model.safetensors.index.json. The one design choice: a
// single table per model (hf_weight_map, from its family's adapter) says, for each kiln tensor,
// which HF tensors make it up, at which rows and whether transposed; import and export both walk
// that table, so they cannot disagree. The embedding (and an untied head) has vocab_size rows in
// HF, padded_vocab_size in kiln: the padding rows are zero on import and dropped on export.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/model.h"

namespace kiln {

// "hf:DIR" -> DIR; nullopt for anything else.
std::optional<std::string> hf_dir_of(const std::string& spec);

// DIR/config.json -> ModelConfig, read by the adapter of its model_type. seq_len is GPT-2's
// n_positions (the rows of wpe) or max_position_embeddings; padded_vocab_size is vocab_size
// rounded up to 128. InputError naming the file and key for a missing key, an unsupported
// model_type or an option kiln does not implement (rope scaling other than Llama 3.1's, sliding
// windows, biases LLaMA-style models do not have in kiln).
ModelConfig read_hf_config(const std::string& dir);

// The keys on which the run's model config and an HF directory's disagree, one line each
// ("model.n_layer: 12 in the config, 24 in DIR/config.json"); empty when they agree. seq_len
// counts only where it sizes a tensor (learned positions); padded_vocab_size never does.
std::vector<std::string> hf_config_mismatches(const ModelConfig& run, const ModelConfig& hf,
                                              const std::string& dir);

// One HF tensor that makes up part of a kiln tensor: `rows` rows of it from `row` on, or all of
// it transposed (Conv1D). Shapes are HF's.
struct HfPiece {
  std::string name;
  std::vector<int64_t> shape;
  int64_t row = 0;
  bool transpose = false;
};
struct HfTensorMap {
  std::string kiln_name;
  std::vector<HfPiece> pieces;
};
// The HF model_type kiln exports `cfg` as (gpt2, llama, qwen3, qwen3_moe, mixtral or a
// registered family's), from its layer choices; InputError when no HF architecture has them.
std::string hf_model_type(const ModelConfig& cfg);
// Every kiln tensor of `cfg`'s model and its HF pieces, in HF's order (its family's adapter's
// map). `prefix` is GPT-2's "transformer." (present in files saved from GPT2LMHeadModel, absent
// in the original release); other families' names carry none.
std::vector<HfTensorMap> hf_weight_map(const ModelConfig& cfg, const std::string& prefix = "");

// DIR's weights into a host f32 buffer laid out as `layout` (the model of `cfg`). InputError
// naming the file and tensor for a missing, misshapen or unexpected tensor.
std::vector<float> load_hf_weights(const std::string& dir, const ModelConfig& cfg,
                                   const ParamLayout& layout);

// The model's begin/end-of-sequence token ids, as config.json gives them: none (null), one
// (a number) or several (a list, as LLaMA-3's instruct models have).
struct HfSpecialTokens {
  std::vector<int64_t> bos, eos;
};

// The tokenizer files transformers keeps beside a model (tokenizer.json, tokenizer_config.json,
// special_tokens_map.json, vocab.json, merges.txt, tokenizer.model, added_tokens.json) that DIR
// holds, by name.
std::vector<std::string> hf_tokenizer_files(const std::string& dir);

// DIR's bos/eos ids: config.json's bos_token_id / eos_token_id where it gives them, else the
// tokens tokenizer_config.json (or special_tokens_map.json) names, looked up in tokenizer.json.
// Empty where DIR does not say. InputError naming the file for a malformed one, or an id that
// is not below `vocab_size` (a tokenizer that does not fit the model).
HfSpecialTokens read_hf_special_tokens(const std::string& dir, int vocab_size);

struct HfExportOptions {
  std::string dtype = "bf16";                       // bf16 | f32
  int64_t max_shard_bytes = 5'000'000'000;  // above this (5GB, save_pretrained's), shards + index
  HfSpecialTokens special_tokens;           // config.json's bos/eos_token_id (null when empty)
  // A RoPE model's declared context (max_position_embeddings) when it is longer than the run's
  // seq_len: the model it came from could read that much, and training shorter does not change
  // it. 0: seq_len. (GPT-2's is the rows of wpe, always seq_len.)
  int max_position = 0;
};

// Writes DIR/config.json and the weights (model.safetensors, or model-0000i-of-0000n.safetensors
// and model.safetensors.index.json) so that transformers.AutoModelForCausalLM loads them.
// Earlier model*.safetensors files in DIR are removed first. Returns the files written.
std::vector<std::string> export_hf(const std::string& dir, const ModelConfig& cfg,
                                   const ParamLayout& layout, const float* params,
                                   const HfExportOptions& opts);

}  // namespace kiln

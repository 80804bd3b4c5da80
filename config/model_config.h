// The config's model sections <-> ModelConfig, in one place: model_config() builds the model a
// run trains from the model and moe sections (and, for a run, the precision and fp8 sections
// on its backend); model_section() and moe_section() are its inverse, for a config written
// around a model that came from elsewhere (init.from=hf:DIR, convert); apply_arch_row() puts
// model.arch's row into the section through that inverse. A key added to the
// model's sections is mapped here, both ways, and nowhere else; so is train.recompute, the one
// model choice outside them.
#pragma once

#include <string>

#include "config/config.h"
#include "model/model.h"

namespace kiln {

// A dense model from the model section alone.
ModelConfig model_config(const ModelSection& model);
// With the moe section's MoE blocks.
ModelConfig model_config(const ModelSection& model, const MoeSection& moe);
// The run's model: the sections above with the precision section applied on `backend`, the
// residual stream's dtype and FP8 where the backend can run it (Hopper and newer run the FP8
// GEMMs, the CPU emulates them, for tests; an older GPU says why and runs bf16). `log`: say so.
ModelConfig model_config(const Config& config, const Backend& backend, bool log);

// train.recompute, train.recompute_full_blocks and train.recompute_kept_blocks for a model of
// n_layer blocks: which activations backward computes again.
RecomputePlan recompute_plan(const TrainSection& train, int n_layer);

// model.arch's row (model/arch.cpp) in the model section: the row's layer choices (norm and eps,
// positions and RoPE base, MLP, biases, QK-norm, tied head) written over `m`'s, as the defaults
// the file's and the overrides' own keys then override; the sizes are left as they are. False,
// and `m` untouched, for an unknown name (the schema names it).
bool apply_arch_row(const std::string& arch, ModelSection& m);

// The config section that gives `m` (the inverse of model_config()).
ModelSection model_section(const ModelConfig& m);
// The moe section of `e` (every key at its default for a dense model).
MoeSection moe_section(const MoeConfig& e);

}  // namespace kiln

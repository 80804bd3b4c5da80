// Models from elsewhere: a run's first weights (init.from) and the weights the tools (convert,
// eval) read. A source is `hf:DIR` (a Hugging Face model directory, hf/hf_model.h), a kiln
// checkpoint directory, or a run directory (its newest checkpoint). Only weights come across:
// a run initialized this way starts at step 0 with fresh optimizer state and its own data order.
#pragma once

#include <string>
#include <vector>

#include "config/config.h"
#include "model/model.h"

namespace kiln {

// A model and its f32 weights, laid out as make_model(config)'s layout.
struct LoadedModel {
  ModelConfig config;
  std::vector<float> params;
  std::string source;  // the checkpoint directory, or hf:DIR
  // The run's resolved config (kiln checkpoints); for hf:DIR, defaults around the model
  // (set_model, config/config.h).
  Config run_config;
  // moe.balance=bias: the checkpoint's balancing bias (Model::moe_bias), which routing uses.
  std::vector<float> moe_bias;
};

// Loads `spec` (hf:DIR, a checkpoint or a run directory). InputError naming what is wrong.
LoadedModel load_model(const std::string& spec);

// init.from: the weights of `spec` laid out as `layout`, the model of `run`. Refuses (InputError,
// listing every key that differs) a source whose model differs from the run's.
std::vector<float> load_init_weights(const std::string& spec, const ModelConfig& run,
                                     const ParamLayout& layout);

}  // namespace kiln

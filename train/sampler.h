// Sampling from a trained model: autoregressive decoding with temperature and top-k. There is no
// KV cache: each new token runs the full forward over the window (the model is causal, so
// positions past the current one do not affect it). Fine for demos and spot checks, not serving.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "model/model.h"

namespace kiln {

struct SamplingOptions {
  int max_new_tokens = 128;
  float temperature = 1.0f;  // 0: greedy
  int top_k = 0;             // 0: whole vocabulary
};

// `weights`: the flat parameter buffer in the backend's working dtype. Returns prompt +
// generated tokens. moe_bias: a MoE run's balancing bias (Model::moe_bias), which routing uses.
std::vector<int> generate(Backend& backend, const ModelConfig& cfg, Tensor weights,
                          std::vector<int> prompt, const SamplingOptions& opts,
                          std::mt19937_64& rng, Tensor moe_bias = {});

}  // namespace kiln

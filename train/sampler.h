// Sampling from a trained model: autoregressive decoding with temperature and top-k, with a KV
// cache (Model::decode) so that each new token costs one position's forward. The cache holds
// at most model.seq_len positions (there are no positions past it): when it is full, the oldest
// half of the context is dropped and the cache is rebuilt from the rest by one forward, so past
// seq_len a token sees between seq_len/2 and seq_len tokens of context. Without the cache
// (kv_cache false) every token runs the full forward over the last seq_len tokens: the same
// tokens while the text fits in seq_len (bit for bit on the CPU), slower by about seq_len times.
// For demos and spot checks, not serving.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "config/config.h"
#include "model/model.h"

namespace kiln {

struct SamplingOptions {
  int max_new_tokens = 128;
  float temperature = 1.0f;  // 0: greedy
  int top_k = 0;             // 0: whole vocabulary
  bool kv_cache = true;
};

// `weights`: where the model's parameters are, as the trainer reads them (flat_params of the
// working copy and the master, model/model.h). Returns prompt + generated tokens. moe_bias: a
// MoE run's balancing bias (Model::moe_bias), which routing uses.
std::vector<int> generate(Backend& backend, const ModelConfig& cfg, const Locate& weights,
                          std::vector<int> prompt, const SamplingOptions& opts,
                          std::mt19937_64& rng, Tensor moe_bias = {});

// train.sample_every's sample at step `step`: `tokens` tokens after a newline, at temperature
// 0.8 and top-k 40, logged as text. Only the byte tokenizer decodes here: a model of a larger
// vocabulary logs nothing.
void log_sample(Backend& backend, const ModelConfig& cfg, const Locate& weights, Tensor moe_bias,
                int tokens, std::mt19937_64& rng, int step);
// Whether finishing `step` (1-based) logs train.sample_every's sample.
bool sample_due(const TrainSection& train, int step);
// At the start of a run whose rank 0 holds only part of the model (fsdp; `sharded`: tensor or
// expert parallelism), so samples none: where train.sample_every asks for samples, says so once,
// and how to sample the run's checkpoints instead.
void warn_no_samples(const TrainSection& train, bool sharded);

// How many of the newest tokens the context of the next token holds when the one before it
// had `context` (0: none yet) and the text has `length` tokens, for a model of seq_len T: one
// more while the cache has room, T - T/2 when it was full (the dropped half), and without a
// cache always min(length, T).
int next_context(int context, int64_t length, int T, bool kv_cache);

}  // namespace kiln

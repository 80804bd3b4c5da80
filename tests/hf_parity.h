// kiln's numbers for a Hugging Face model directory, to compare with transformers' (written by
// tests/fixtures/hf/make_hf_fixtures.py): the mean next-token loss on a batch of token rows
// (inputs are a row's first T ids, targets its last T) and the greedy continuation of a prompt.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kernels/arena.h"
#include "state/init_from.h"
#include "train/sampler.h"

namespace kiln::testing {

struct KilnScore {
  double loss = NAN;
  std::vector<int> greedy;  // prompt + new tokens
};

inline KilnScore kiln_score(Backend& backend, const std::string& hf_dir,
                            const std::vector<std::vector<int>>& rows,
                            const std::vector<int>& prompt, int new_tokens) {
  const LoadedModel m = load_model("hf:" + hf_dir);
  const int B = static_cast<int>(rows.size()), T = static_cast<int>(rows[0].size()) - 1;
  std::unique_ptr<Model> model = make_model(m.config, backend);
  Arena arena(backend, "hf_parity");
  Tensor weights, master, tokens, targets;
  const int64_t n = model->layout().total;
  arena.plan(&weights, "weights", {n}, backend.activation_dtype());
  arena.plan(&master, "master", {n}, DType::f32);
  arena.plan(&tokens, "tokens", {B, T}, DType::i32);
  arena.plan(&targets, "targets", {B, T}, DType::i32);
  model->plan_activations(arena, B, T, Recompute::none);
  arena.allocate();
  backend.copy_from_host(master, m.params.data());
  backend.copy(weights, master);
  model->bind_weights(flat_params(weights));
  std::vector<int32_t> in, tgt;
  for (const auto& r : rows) {
    in.insert(in.end(), r.begin(), r.end() - 1);
    tgt.insert(tgt.end(), r.begin() + 1, r.end());
  }
  backend.copy_from_host(tokens, in.data());
  backend.copy_from_host(targets, tgt.data());
  model->forward(tokens, targets, DocumentMask{}, 0.0f, false);
  std::vector<float> losses(in.size());
  backend.copy_to_host(losses.data(), model->losses());
  KilnScore out;
  double sum = 0;
  for (float l : losses) sum += l;
  out.loss = sum / static_cast<double>(losses.size());
  SamplingOptions greedy;
  greedy.max_new_tokens = new_tokens;
  greedy.temperature = 0.0f;
  std::mt19937_64 rng(0);
  out.greedy = generate(backend, m.config, flat_params(weights), prompt, greedy, rng);
  return out;
}

inline nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// What tests/fixtures/hf/make_hf_fixtures.py recorded in DIR for one architecture: transformers'
// numbers (expected.json: loss, swapped_loss, prompt, greedy) and the token batch (tokens.json).
struct HfExpected {
  nlohmann::json numbers;
  std::vector<std::vector<int>> rows;
  std::vector<int> prompt;
  int new_tokens = 0;  // greedy tokens after the prompt
};

inline HfExpected read_hf_expected(const std::string& dir, const std::string& arch) {
  HfExpected e;
  e.numbers = read_json_file(dir + "/expected.json")["models"][arch];
  e.rows = read_json_file(dir + "/tokens.json")[arch].get<std::vector<std::vector<int>>>();
  e.prompt = e.numbers["prompt"].get<std::vector<int>>();
  e.new_tokens = static_cast<int>(e.numbers["greedy"].size() - e.prompt.size());
  return e;
}

// kiln's loss within `rel` of transformers', on a batch where a wrong mapping would show (two
// swapped tensors move transformers' loss by more than 1%); with `greedy`, the same tokens too.
inline void expect_matches_transformers(const KilnScore& kiln, const HfExpected& e, double rel,
                                        bool greedy, const std::string& what) {
  const double hf = e.numbers["loss"].get<double>();
  EXPECT_NEAR(kiln.loss, hf, rel * hf) << what;
  // The batch must tell a wrong mapping from rounding: a swapped tensor moves the loss by far
  // more than the tolerance.
  EXPECT_GT(std::abs(e.numbers["swapped_loss"].get<double>() - hf),
            std::max(1e-2, 10 * rel) * hf)
      << what;
  if (greedy) {
    EXPECT_EQ(kiln.greedy, e.numbers["greedy"].get<std::vector<int>>()) << what;
  }
}

}  // namespace kiln::testing

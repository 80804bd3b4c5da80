#include "train/evaluation.h"

namespace kiln {

Evaluation::Evaluation(const Config& cfg, const DeviceMesh& mesh, Backend& backend,
                       Model& model, StepInputs& inputs, const Tensor& loss_sum, Nvtx& nvtx,
                       std::function<void(Tensor)> sum_over_ranks)
    : cfg_(cfg),
      token_ranks_(mesh.gradient_ranks()),
      rows_(model.config().seq_len / mesh.context),
      backend_(backend),
      model_(model),
      inputs_(inputs),
      loss_sum_(loss_sum),
      nvtx_(nvtx),
      sum_over_ranks_(std::move(sum_over_ranks)) {
  if (cfg.train.eval_every == 0) return;
  const int B = cfg.train.batch_size, T = model.config().seq_len, R = mesh.batch_rank(),
            W = mesh.batch_ranks(), V = model.config().vocab_size;
  const int sep = cfg.data.document_mask ? cfg.data.document_separator : -1;
  if (cfg.data.sources.empty()) {
    if (!cfg.data.val.empty())
      loaders_.push_back(
          {"", 1, open_data("data.val", cfg.data.val, B, T, R, W, V, false, 0, false, sep)});
    return;
  }
  for (const DataSource& s : cfg.data.sources)
    if (!s.val.empty())
      loaders_.push_back({s.name, s.weight,
                          open_data(("data.sources " + s.name + " val").c_str(), s.val, B, T, R, W,
                                    V, false, 0, false, sep)});
}

void Evaluation::run(StepMetrics& sm) {
  std::vector<double> losses, weights;
  for (ValLoader& v : loaders_) {
    const double loss = mean_loss(*v.loader);
    if (v.source.empty()) {
      sm.val_loss = loss;
      return;
    }
    sm.source_val_loss.emplace_back(v.source, loss);
    losses.push_back(loss);
    weights.push_back(v.weight);
  }
  const std::vector<double> shares = mixture_shares(weights);
  double mean = 0;
  for (size_t i = 0; i < losses.size(); ++i) mean += shares[i] * losses[i];
  sm.val_loss = mean;
}

double Evaluation::mean_loss(DataLoader& loader) {
  Backend& k = backend_;
  loader.reset();
  for (int i = 0; i < cfg_.train.eval_steps; ++i) {
    inputs_.copy_batch(loader.next());
    model_.forward(inputs_.tokens(0), inputs_.targets(0), inputs_.documents(0), 0.0f, false);
    nvtx_.close_unit();  // no backward follows to close the last unit's forward
    k.reduce_sum(loss_sum_, model_.losses(), i > 0);
  }
  sum_over_ranks_(loss_sum_);
  const double n =
      static_cast<double>(cfg_.train.batch_size) * rows_ * cfg_.train.eval_steps * token_ranks_;
  float host[1];
  k.copy_to_host(host, loss_sum_);
  return host[0] / n;
}

}  // namespace kiln

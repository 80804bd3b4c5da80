#include "model/decoder.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kiln {

Locate flat_params(Tensor flat, Tensor f32) {
  return [flat, f32](const ParamInfo& info) {
    return (info.f32_read && f32.defined() ? f32 : flat).slice(info.offset, info.shape);
  };
}

std::unique_ptr<Model> make_model(const ModelConfig& cfg, Backend& backend) {
  return std::make_unique<Decoder>(cfg, backend);
}

Decoder::Decoder(const ModelConfig& cfg, Backend& backend)
    : cfg_(cfg), backend_(backend), fp8_(backend, cfg.fp8_options, weights_) {
  check_model_config(cfg);
  const int64_t C = cfg.n_embd;
  LayoutBuilder b;
  embed_.declare(b, cfg.padded_vocab_size, C, cfg.seq_len, cfg.positions == PositionKind::learned);
  b.close_unit();
  blocks_.resize(static_cast<size_t>(cfg.n_layer));
  for (int l = 0; l < cfg.n_layer; ++l) {
    Block& blk = blocks_[static_cast<size_t>(l)];
    const std::string p = "h." + std::to_string(l) + ".";
    blk.ln1 = blk.ln2 = Norm{cfg.norm, cfg.norm_eps};
    blk.attn.dims = cfg.attention();
    blk.attn.rope = cfg.positions == PositionKind::rope;
    blk.attn.rope_params = {cfg.rope_theta, cfg.rope_scaling};
    blk.attn.qk_norm = cfg.qk_norm;
    blk.attn.norm_eps = cfg.norm_eps;
    blk.mlp.kind = cfg.mlp;
    blk.mlp.ffn_dim = cfg.ffn_dim;
    blk.ln1.declare(b, p + "ln1", C);
    blk.attn.declare(b, p + "attn", C, cfg.qkv_bias || cfg.bias, cfg.bias);
    blk.ln2.declare(b, p + "ln2", C);
    blk.is_moe = cfg.is_moe_block(l);
    if (blk.is_moe) {
      moe_blocks_.push_back(l);
      const MoeConfig& m = cfg.moe;
      blk.moe.routing = {m.n_experts,   m.top_k,         m.score,
                         m.renormalize, m.aux_loss_coef, m.z_loss_coef};
      blk.moe.kind = cfg.mlp;
      blk.moe.expert_ffn_dim = m.expert_ffn_dim;
      blk.moe.declare(b, p + "moe", C, m.n_shared_experts);
    } else {
      blk.mlp.declare(b, p + "mlp", C, cfg.bias);
    }
    b.close_unit();
  }
  lnf_ = Norm{cfg.norm, cfg.norm_eps};
  lnf_.declare(b, "lnf", C);
  lm_head_ = cfg.tie_embeddings ? embed_.wte
                                 : b.add("lm_head", {cfg.padded_vocab_size, C}, true, 0,
                                         TensorSplit{0, {}});
  b.close_unit();
  layout_ = b.finish();
  layout_.last_unit_reads_first = cfg.tie_embeddings;
  // Without learned positions unit 0 is the token table alone.
  if (embed_.wpe < 0) layout_.first_unit_rows = cfg.padded_vocab_size;

  // GPT-2's init (and torchtitan's LLaMA one): N(0, 0.02) for matrices, the residual
  // projections scaled by 1/sqrt(2 * n_layer), norm gains 1, biases 0.
  init_.assign(layout_.tensors.size(), Init::normal);
  auto set = [&](int index, Init how) {
    if (index >= 0) init_[static_cast<size_t>(index)] = how;
  };
  auto norm_init = [&](const Norm& n) {
    set(n.weight, Init::ones);
    set(n.bias, Init::zeros);
  };
  set(embed_.wte, Init::embedding);
  for (const Block& blk : blocks_) {
    norm_init(blk.ln1);
    norm_init(blk.ln2);
    set(blk.attn.qkv.bias, Init::zeros);
    set(blk.attn.q_norm, Init::ones);
    set(blk.attn.k_norm, Init::ones);
    set(blk.attn.proj.weight, Init::residual_normal);
    set(blk.attn.proj.bias, Init::zeros);
    set(blk.mlp.fc.bias, Init::zeros);
    set(blk.mlp.proj.weight, Init::residual_normal);
    set(blk.mlp.proj.bias, Init::zeros);
    set(blk.moe.proj, Init::residual_normal);
    set(blk.moe.shared.proj.weight, Init::residual_normal);
  }
  norm_init(lnf_);
  set(lm_head_, Init::embedding);

  if (cfg.fp8) {
    const bool edges = cfg.fp8_options.bf16_edges;
    for (int l = 0; l < cfg.n_layer; ++l) {
      if (edges && (l == 0 || l == cfg.n_layer - 1)) continue;
      Block& blk = blocks_[static_cast<size_t>(l)];
      const std::string p = "h." + std::to_string(l) + ".";
      std::vector<std::pair<Linear*, const char*>> linears = {{&blk.attn.qkv, "attn.qkv"},
                                                              {&blk.attn.proj, "attn.proj"}};
      // A MoE block's router and routed experts stay bf16 (the grouped GEMM has no FP8 form);
      // its shared expert is a dense MLP and runs in FP8 like one.
      if (!blk.is_moe)
        linears.insert(linears.end(), {{&blk.mlp.fc, "mlp.fc"}, {&blk.mlp.proj, "mlp.proj"}});
      else if (blk.moe.has_shared)
        linears.insert(linears.end(), {{&blk.moe.shared.fc, "moe.shared.fc"},
                                       {&blk.moe.shared.proj, "moe.shared.proj"}});
      for (auto [lin, name] : linears) fp8_.add(*lin, p + name);
    }
  }
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Element j of a tensor whose draws are keyed by `key`: a standard normal (Box-Muller over the
// two 32-bit halves of one counter-based draw). Each element is a function of (key, j) alone,
// so a tensor is drawn in parallel, identically for any thread count, and any part of it can
// be drawn without the rest.
float normal_at(uint64_t key, int64_t j) {
  const uint64_t r = splitmix64(key ^ splitmix64(static_cast<uint64_t>(j)));
  const double u1 = (static_cast<double>(r >> 32) + 1.0) / 4294967296.0;  // (0, 1]
  const double u2 = static_cast<double>(r & 0xffffffffu) / 4294967296.0;  // [0, 1)
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace

void Decoder::init_range(uint64_t seed, int64_t begin, int64_t end, float* out) const {
  // Padding between tensors (layout alignment) stays zero.
  std::fill(out, out + (end - begin), 0.0f);
  const float residual_std = 0.02f / std::sqrt(2.0f * static_cast<float>(cfg_.n_layer));
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const ParamInfo& t = layout_.tensors[i];
    // The part of tensor i inside [begin, end), as element indices into the tensor.
    const int64_t lo = std::max<int64_t>(begin, t.offset) - t.offset;
    const int64_t hi = std::min<int64_t>(end, t.offset + t.numel()) - t.offset;
    if (lo >= hi) continue;
    float* p = out + (t.offset + lo - begin);  // element lo of the tensor
    switch (init_[i]) {
      case Init::ones:
        std::fill(p, p + (hi - lo), 1.0f);
        break;
      case Init::zeros:
        break;
      case Init::normal:
      case Init::residual_normal:
      case Init::embedding: {
        // Keyed by the seed and the tensor's index: one tensor's draws never depend on another's.
        const uint64_t key = splitmix64(seed ^ splitmix64(0x5eed0000ull + i));
        const float sigma = init_[i] == Init::residual_normal ? residual_std : 0.02f;
        // Padded vocab rows are never looked up or predicted: they stay zero.
        const int64_t drawn =
            init_[i] == Init::embedding
                ? std::min<int64_t>(hi, static_cast<int64_t>(cfg_.vocab_size) * cfg_.n_embd)
                : hi;
#pragma omp parallel for schedule(static) if (drawn - lo > (1 << 16))
        for (int64_t j = lo; j < drawn; ++j) p[j - lo] = sigma * normal_at(key, j);
        break;
      }
    }
  }
}

// 6 FLOPs per token per matmul parameter (2 forward, 4 backward), the LM head included, plus
// attention's two T x T matmuls: 2 * 2 * T * (NH * hs) per layer forward, halved for the causal
// mask, times 3 for forward and backward = 6 * T * NH * hs. GQA shrinks only the qkv weight.
double Decoder::flops_per_token(int T) const {
  const AttentionDims a = cfg_.attention();
  const double C = cfg_.n_embd, F = cfg_.ffn_dim;
  const double mats = cfg_.mlp == MlpKind::swiglu ? 3.0 : 2.0;
  const double attention =
      C * static_cast<double>(a.qkv_dim()) + static_cast<double>(a.q_dim()) * C;
  const double per_block = attention + mats * C * F;
  // A MoE block counts its active parameters: the router, k experts and the shared ones.
  const MoeConfig& m = cfg_.moe;
  const double n_moe = static_cast<double>(moe_blocks_.size());
  const double moe_block =
      attention + C * m.n_experts + (m.top_k + m.n_shared_experts) * mats * C * m.expert_ffn_dim;
  const double n_matmul = (cfg_.n_layer - n_moe) * per_block + n_moe * moe_block +
                          static_cast<double>(cfg_.padded_vocab_size) * C;
  return 6.0 * n_matmul +
         6.0 * cfg_.n_layer * static_cast<double>(T) * static_cast<double>(a.q_dim());
}

void Decoder::bind(const Locate& locate, Params& out) const {
  out.resize(layout_.tensors.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = locate(layout_.tensors[i]);
}

const char* recompute_name(Recompute r) {
  return r == Recompute::none        ? "none"
         : r == Recompute::light     ? "light"
         : r == Recompute::selective ? "selective"
                                     : "full";
}

namespace {

// A MoE block's buffers beside its output and the shared expert's (Moe::Acts).
constexpr Tensor Moe::Acts::*kMoeActs[] = {
    &Moe::Acts::logits, &Moe::Acts::scores,     &Moe::Acts::topk_idx, &Moe::Acts::topk_w,
    &Moe::Acts::counts, &Moe::Acts::offsets,    &Moe::Acts::slot_row, &Moe::Acts::row_token,
    &Moe::Acts::xp,     &Moe::Acts::pre,        &Moe::Acts::act,      &Moe::Acts::yp,
    &Moe::Acts::xl,     &Moe::Acts::ep_offsets, &Moe::Acts::ep_counts};

// A block activation's place inside BlockActs-like structs, to tell fields apart by identity.
template <class S>
size_t field_offset(const S& s, const Tensor* t) {
  return static_cast<size_t>(reinterpret_cast<const char*>(t) - reinterpret_cast<const char*>(&s));
}

}  // namespace

DType Decoder::residual_dtype() const {
  return cfg_.residual_fp32 ? DType::f32 : backend_.activation_dtype();
}

// Block l's activations are planned per block where `recompute` keeps them, else once in
// acts.shared. What each mode keeps is what its backward reads and cannot cheaply recompute:
//  selective: the block's input, the norms' statistics, q/k/v (after QK-norm and RoPE) and the
//             QK-norm input, the residual after attention, and the fc GEMM's output (and GELU's,
//             fused into that GEMM). Recomputed: norm outputs, the attention core, SwiGLU.
//  light:     as selective, and the attention core's output and log-sum-exp (B*T*NH*hs a block
//             more): recomputed are the norm outputs and SwiGLU, each a pass over memory.
//  full:      the block's input alone; backward runs the block's forward again from it.
// Each block has its own mode (RecomputePlan: the first blocks full, the rest another); the
// shared set holds what the mode that keeps least leaves out, and every recomputing block
// reuses it in turn.
void Decoder::plan(const Planner& planner, Acts& acts, int B, int T,
                   const RecomputePlan& recompute) const {
  const int64_t C = cfg_.n_embd, Vp = cfg_.padded_vocab_size;
  // The residual stream's rows: the rank's tokens under tensor parallelism.
  const int64_t Bs = stream_b(B, T), Ts = stream_t(B, T);
  const DType act = backend_.activation_dtype(), res = residual_dtype();
  acts.blocks.assign(blocks_.size(), {});
  const BlockActs& probe = acts.shared;
  // The fields a block under `mode` keeps (none: every one).
  auto kept_under = [&](Recompute mode) {
    std::vector<size_t> kept;
    auto keep = [&](const Tensor& t) { kept.push_back(field_offset(probe, &t)); };
    keep(probe.residual_in);
    if (mode == Recompute::selective || mode == Recompute::light) {
      if (mode == Recompute::light) {
        keep(probe.attn.y);
        keep(probe.attn.lse);
      }
      for (const Tensor* t :
           {&probe.ln1.mean, &probe.ln1.rstd, &probe.attn.qkv_raw, &probe.attn.qk_rstd,
            &probe.attn.qkv, &probe.residual_mid, &probe.ln2.mean, &probe.ln2.rstd, &probe.mlp.pre})
        keep(*t);
      if (cfg_.mlp == MlpKind::gelu) keep(probe.mlp.act);
      // A MoE block keeps all it computed but its output: routing, permutation and the experts'
      // activations are what its backward reads, and recomputing them is most of its forward.
      for (Tensor Moe::Acts::*f : kMoeActs) keep(probe.moe.*f);
      keep(probe.moe.shared.pre);
      keep(probe.moe.shared.act);
    }
    return kept;
  };
  // The shared set holds what the block that keeps least leaves out: the modes nest.
  Recompute shared_mode = Recompute::none;
  for (size_t l = 0; l < blocks_.size(); ++l)
    shared_mode = std::max(shared_mode, recompute.at(static_cast<int>(l)));
  // Plans block l's fields (l >= 0) that are kept, or the shared set's (l < 0) that are not.
  auto plan_block = [&](int l, BlockActs& a) {
    const bool shared = l < 0;
    const std::string p = shared ? "shared." : "h." + std::to_string(l) + ".";
    const Recompute mode = shared ? shared_mode : recompute.at(l);
    const std::vector<size_t> kept = kept_under(mode);
    const Planner pick = [&](Tensor* slot, const std::string& name, Shape shape, DType dtype) {
      const size_t at = field_offset(a, slot);
      const bool is_kept =
          mode == Recompute::none || std::find(kept.begin(), kept.end(), at) != kept.end();
      if (is_kept != shared) planner(slot, name, shape, dtype);
    };
    // Attention and the norms have the same shapes in every block; the shared set holds a
    // dense block's MLP and a MoE block's buffers where the model has both kinds.
    const Block& blk = blocks_[shared ? 0 : static_cast<size_t>(l)];
    if (l != 0) pick(&a.residual_in, p + "residual_in", {Bs, Ts, C}, res);
    blk.ln1.plan(pick, p + "ln1", a.ln1, Bs, Ts, C, act);
    blk.attn.plan(pick, p, a.attn, B, T, act);
    pick(&a.residual_mid, p + "residual_mid", {Bs, Ts, C}, res);
    blk.ln2.plan(pick, p + "ln2", a.ln2, Bs, Ts, C, act);
    const bool any_dense = moe_blocks_.size() < blocks_.size();
    if (shared ? any_dense : !blk.is_moe)
      blocks_.front().mlp.plan(pick, p, a.mlp, B, T, act);  // block 0 is dense if any is
    // A MoE block routes the rank's tokens.
    if (shared ? !moe_blocks_.empty() : blk.is_moe)
      blocks_[static_cast<size_t>(moe_blocks_.front())].moe.plan(pick, p, a.moe, Bs, Ts, act);
  };
  planner(&acts.encoded, "encoded", {Bs, Ts, C}, res);
  for (size_t l = 0; l < blocks_.size(); ++l) plan_block(static_cast<int>(l), acts.blocks[l]);
  if (shared_mode != Recompute::none) plan_block(-1, acts.shared);
  planner(&acts.residual_out, "residual_out", {Bs, Ts, C}, res);
  lnf_.plan(planner, "lnf", acts.lnf, Bs, Ts, C, act);
  planner(&acts.logits, "logits", {B, T, Vp / tp_.ranks}, act);
  planner(&acts.losses, "losses", {B * T}, DType::f32);
  planner(&acts.dresidual, "d.residual", {Bs, Ts, C}, res);
  if (res != act) planner(&acts.dbranch, "d.branch", {Bs, Ts, C}, act);
  planner(&acts.dln, "d.ln", {Bs, Ts, C}, act);
  blocks_.front().attn.plan_scratch(planner, acts.attn, B, T, act);
  if (tp_.on()) {
    // Shared by every block's attention and MLP, and by the LM head (its gathered input).
    planner(&acts.attn.gathered, "tp.gathered", {B, T, C}, act);
    planner(&acts.attn.partial, "tp.partial", {B, T, C}, act);
    planner(&acts.tp_every, "tp.every", {B, T, C}, res);
    planner(&acts.ce_stats, "ce.stats", {B * T, kCrossEntropyStats}, DType::f32);
    planner(&acts.ce_stats_all, "ce.stats_all", {tp_.ranks, B * T, kCrossEntropyStats},
            DType::f32);
  }
  // Block 0 is dense unless every block is MoE (moe.every 1).
  if (!blocks_.front().is_moe) blocks_.front().mlp.plan_scratch(planner, acts.mlp, B, T, act);
  if (!moe_blocks_.empty()) {
    const Moe& moe = blocks_[static_cast<size_t>(moe_blocks_.front())].moe;
    moe.plan_scratch(planner, acts.moe, Bs, Ts, act);
    const int64_t n = static_cast<int64_t>(moe_blocks_.size()), E = moe.n_experts();
    planner(&acts.moe_stats, "moe.stats", {n * (E + kMoeStats)}, DType::f32);
    if (cfg_.moe.balance == MoeBalance::bias)
      planner(&acts.moe_bias, "moe.bias", {n * E}, DType::f32);
  }
  planner(&acts.dlnf, "d.lnf", {Bs, Ts, C}, act);
}

void Decoder::plan_activations(Arena& arena, int B, int T, const RecomputePlan& recompute) {
  if (T > cfg_.seq_len)
    throw std::invalid_argument("sequence length " + std::to_string(T) + " exceeds model.seq_len");
  if (tp_.on() && (int64_t{B} * T) % tp_.ranks != 0)
    throw std::invalid_argument("a micro-batch of " + std::to_string(int64_t{B} * T) +
                                " tokens does not split over " + std::to_string(tp_.ranks) +
                                " tensor-parallel ranks (sequence parallelism): make "
                                "train.batch_size x model.seq_len a multiple of it");
  if (recompute.full_blocks < 0 || recompute.full_blocks > cfg_.n_layer)
    throw std::invalid_argument("train.recompute_full_blocks " +
                                std::to_string(recompute.full_blocks) + " is outside [0, " +
                                std::to_string(cfg_.n_layer) + "] (model.n_layer)");
  if (recompute.kept_from < recompute.full_blocks)
    throw std::invalid_argument("train.recompute_kept_blocks: block " +
                                std::to_string(recompute.kept_from) +
                                " on keep every activation, but the first " +
                                std::to_string(recompute.full_blocks) + " recompute fully");
  B_ = B;
  T_ = T;
  recompute_ = recompute;
  const Planner planner = [&arena](Tensor* slot, const std::string& name, Shape shape,
                                   DType dtype) { arena.plan(slot, name, shape, dtype); };
  plan(planner, acts_, B, T, recompute);
  fp8_.plan(planner, B, T);
}

int64_t Decoder::activation_bytes(int B, int T, const RecomputePlan& recompute) const {
  int64_t bytes = 0;
  Acts scratch;
  plan([&bytes](Tensor*, const std::string&, Shape shape,
                DType dtype) { bytes += shape.numel() * static_cast<int64_t>(dtype_size(dtype)); },
       scratch, B, T, recompute);
  return bytes + fp8_.planned_bytes(B, T);
}

Decoder::BlockActs Decoder::block_acts(const Acts& set, const RecomputePlan& recompute,
                                       int l) const {
  BlockActs a = set.blocks[static_cast<size_t>(l)];
  if (blocks_[static_cast<size_t>(l)].is_moe) {
    const int64_t i = std::find(moe_blocks_.begin(), moe_blocks_.end(), l) - moe_blocks_.begin();
    const int64_t E = cfg_.moe.n_experts;
    a.moe.stats = acts_.moe_stats.slice(i * (E + kMoeStats), {E + kMoeStats});
    if (acts_.moe_bias.defined()) a.moe.bias = acts_.moe_bias.slice(i * E, {E});
  }
  if (recompute.at(l) == Recompute::none) return a;
  const BlockActs& s = set.shared;
  auto merge = [](Tensor& t, const Tensor& shared) {
    if (!t.defined()) t = shared;
  };
  merge(a.ln1.out, s.ln1.out);
  merge(a.ln1.mean, s.ln1.mean);
  merge(a.ln1.rstd, s.ln1.rstd);
  merge(a.attn.qkv_raw, s.attn.qkv_raw);
  merge(a.attn.qk_rstd, s.attn.qk_rstd);
  merge(a.attn.qkv, s.attn.qkv);
  merge(a.attn.y, s.attn.y);
  merge(a.attn.lse, s.attn.lse);
  merge(a.attn.out, s.attn.out);
  merge(a.residual_mid, s.residual_mid);
  merge(a.ln2.out, s.ln2.out);
  merge(a.ln2.mean, s.ln2.mean);
  merge(a.ln2.rstd, s.ln2.rstd);
  merge(a.mlp.pre, s.mlp.pre);
  merge(a.mlp.act, s.mlp.act);
  merge(a.mlp.out, s.mlp.out);
  for (Tensor Moe::Acts::*f : kMoeActs) merge(a.moe.*f, s.moe.*f);
  merge(a.moe.shared.pre, s.moe.shared.pre);
  merge(a.moe.shared.act, s.moe.shared.act);
  merge(a.moe.out, s.moe.out);
  return a;
}

void Decoder::recompute_block(int l, const BlockActs& a, const DocumentMask& docs) {
  Backend& k = backend_;
  const Params& w = weights_;
  const Block& blk = blocks_[static_cast<size_t>(l)];
  const Recompute mode = recompute_.at(l);
  // The norm runs on the stored sum rather than fused with the add: the same value on the CPU.
  blk.ln1.forward(k, w, a.ln1, block_input(acts_, l));
  if (mode == Recompute::selective || mode == Recompute::light) {
    if (mode == Recompute::selective) blk.attn.core(k, a.attn, docs, acts_.attn);
    blk.ln2.forward(k, w, a.ln2, a.residual_mid);
    if (!blk.is_moe) blk.mlp.recompute_act(k, a.mlp);  // a MoE block kept its activations
  } else {
    blk.attn.forward(k, w, a.attn, a.ln1.out, docs, acts_.attn);
    blk.ln2.residual_forward(k, w, a.ln2, a.residual_mid, block_input(acts_, l), a.attn.out);
    // The routing comes out as in forward (same input, same bias); its statistics were
    // counted there.
    if (blk.is_moe)
      blk.moe.forward(k, w, a.moe, acts_.moe, a.ln2.out, /*with_stats=*/false);
    else
      blk.mlp.forward(k, w, a.mlp, mlp_scratch(acts_), a.ln2.out, /*project=*/false);
  }
}

Tensor Decoder::block_input(const Acts& set, int l) const {
  return l == 0 ? set.encoded : set.blocks[static_cast<size_t>(l)].residual_in;
}

void Decoder::set_expert_parallel(const ExpertParallel& ep) {
  if (B_ > 0) throw std::logic_error("set_expert_parallel: after the activations were planned");
  if (ep.ranks < 1 || ep.rank < 0 || ep.rank >= ep.ranks ||
      (ep.ranks > 1 && (!ep.all_to_all || !ep.all_to_all_v)))
    throw std::invalid_argument("set_expert_parallel: rank " + std::to_string(ep.rank) + " of " +
                                std::to_string(ep.ranks) +
                                " (and all_to_all, all_to_all_v past 1 rank)");
  if (ep.ranks > 1 && (moe_blocks_.empty() || cfg_.moe.n_experts % ep.ranks != 0))
    throw std::invalid_argument("expert parallelism over " + std::to_string(ep.ranks) +
                                " ranks needs MoE blocks whose experts it divides (" +
                                std::to_string(cfg_.moe.n_experts) + ")");
  for (const int l : moe_blocks_) blocks_[static_cast<size_t>(l)].moe.ep = ep;
}

void Decoder::set_tensor_parallel(const TensorParallel& tp) {
  if (B_ > 0) throw std::logic_error("set_tensor_parallel: after the activations were planned");
  if (tp.ranks < 1 || tp.rank < 0 || tp.rank >= tp.ranks ||
      (tp.on() && (!tp.all_gather || !tp.reduce_scatter)))
    throw std::invalid_argument("set_tensor_parallel: rank " + std::to_string(tp.rank) + " of " +
                                std::to_string(tp.ranks) +
                                " (and all_gather, reduce_scatter past 1 rank)");
  if (!tp.on()) return;
  // Each layer checks its own sizes first, so that nothing is changed where one refuses.
  const AttentionDims a = cfg_.attention();
  if (a.n_head % tp.ranks != 0 || a.n_kv_head % tp.ranks != 0)
    throw std::invalid_argument(
        std::to_string(a.n_head) + " query heads and " + std::to_string(a.n_kv_head) +
        " key-value heads must each split over " + std::to_string(tp.ranks) +
        " ranks (model.n_head, model.n_kv_head)");
  if (moe_blocks_.size() < blocks_.size() && cfg_.ffn_dim % tp.ranks != 0)
    throw std::invalid_argument("model.ffn_dim " + std::to_string(cfg_.ffn_dim) +
                                " must split over " + std::to_string(tp.ranks) + " ranks");
  embed_.set_tensor_parallel(tp, cfg_.padded_vocab_size);
  for (Block& blk : blocks_) {
    blk.attn.set_tensor_parallel(tp);
    if (!blk.is_moe) blk.mlp.set_tensor_parallel(tp);
  }
  tp_ = tp;
}

void Decoder::set_context_parallel(const ContextParallel& cp) {
  if (B_ > 0) throw std::logic_error("set_context_parallel: after the activations were planned");
  if (cp.ranks < 1 || cp.rank < 0 || cp.rank >= cp.ranks ||
      (cp.on() && (!cp.all_gather || !cp.reduce_scatter)))
    throw std::invalid_argument("set_context_parallel: rank " + std::to_string(cp.rank) + " of " +
                                std::to_string(cp.ranks) +
                                " (and all_gather, reduce_scatter past 1 rank)");
  if (cp.on() && cfg_.positions != PositionKind::rope)
    throw std::invalid_argument(
        "context parallelism needs rotary positions (model.positions: rope): a rank's rows are "
        "not the first of the sequence");
  for (Block& blk : blocks_) blk.attn.cp = cp;
}

std::string Decoder::graph_unavailable() const {
  if (moe_blocks_.empty()) return "";
  const int ranks = blocks_[static_cast<size_t>(moe_blocks_[0])].moe.ep.ranks;
  if (moe_sizes_on_device(backend_, ranks)) return "";
  return std::string(
             "the MoE blocks' grouped GEMMs read their group sizes on the host at every "
             "call (") +
         (ranks > 1
              ? "dist.expert_parallel"
              : "no sm_90a grouped GEMM runs here: the cuda backend's startup line says why") +
         "), which a graph cannot replay";
}

void Decoder::moe_update_bias() {
  if (!acts_.moe_bias.defined()) return;
  const int64_t E = cfg_.moe.n_experts;
  for (size_t i = 0; i < moe_blocks_.size(); ++i)
    backend_.moe_bias_update(acts_.moe_bias.slice(static_cast<int64_t>(i) * E, {E}),
                             acts_.moe_stats.slice(static_cast<int64_t>(i) * (E + kMoeStats), {E}),
                             cfg_.moe.bias_update_rate);
}

void Decoder::forward(Tensor tokens, Tensor targets, const DocumentMask& docs, float dloss_scale,
                      bool with_backward) {
  Backend& k = backend_;
  // Learned positions (wpe) are not restarted per document: rotary ones are.
  if (docs.positions.defined() && cfg_.positions != PositionKind::rope)
    throw std::invalid_argument(
        "Decoder::forward: per-document positions need rotary positions (model.positions: rope)");
  if (blocks_.front().attn.cp.on() && !docs.positions.defined())
    throw std::invalid_argument(
        "Decoder::forward: under context parallelism each row's position in the sequence is an "
        "input (DocumentMask::positions)");
  const Params& w = weights_;
  // Evaluation and sampling must not move the scales training uses.
  const bool keep_window = !with_backward && fp8_.on();
  if (keep_window) fp8_.keep_window();

  // The aux and z losses are means over this micro-batch's tokens; the step's objective weighs
  // each micro-batch's as dloss_scale weighs its tokens' losses.
  // Under tp each rank's aux and z losses are over its tokens, and the ranks' gradients of the
  // router (which every rank holds) are summed: each weighs 1/ranks.
  moe_loss_scale_ = dloss_scale * static_cast<float>(B_) * static_cast<float>(T_) /
                    static_cast<float>(tp_.ranks);
  hook(&UnitHooks::before_forward, 0);
  embed_.forward(k, w, acts_.encoded, tokens, 0, acts_.tp_every);
  forward_blocks(acts_, recompute_, with_backward, -1, docs);
  const Tensor logits = acts_.logits.view({B_ * T_, acts_.logits.dim(-1)});
  if (!tp_.on()) {
    k.softmax_cross_entropy(acts_.losses, logits, targets, cfg_.vocab_size, dloss_scale,
                            with_backward);
  } else {
    // The vocabulary-parallel cross-entropy: each rank's statistics of its slice, every rank's
    // gathered, combined into every token's loss and this slice's dlogits.
    k.softmax_cross_entropy_stats(acts_.ce_stats, logits, targets, head_first(),
                                  cfg_.vocab_size);
    tp_.all_gather(acts_.ce_stats_all, acts_.ce_stats);
    k.softmax_cross_entropy_combine(acts_.losses, logits, acts_.ce_stats_all, targets,
                                    head_first(), cfg_.vocab_size, dloss_scale, with_backward);
  }
  if (keep_window) fp8_.restore_window();
}

Tensor Decoder::losses() const {
  if (!tp_.on()) return acts_.losses;
  const int64_t n = acts_.losses.numel() / tp_.ranks;
  return acts_.losses.slice(tp_.rank * n, {n});
}

void Decoder::forward_blocks(const Acts& set, const RecomputePlan& recompute, bool with_stats,
                             int decode_pos, const DocumentMask& docs) {
  Backend& k = backend_;
  const Params& w = weights_;
  const int L = cfg_.n_layer;
  for (int l = 0; l < L; ++l) {
    hook(&UnitHooks::before_forward, l + 1);
    const Block& blk = blocks_[static_cast<size_t>(l)];
    const BlockActs a = block_acts(set, recompute, l);
    if (l == 0) {
      blk.ln1.forward(k, w, a.ln1, set.encoded);
    } else {
      const BlockActs prev = block_acts(set, recompute, l - 1);
      blk.ln1.residual_forward(k, w, a.ln1, a.residual_in, prev.residual_mid, ffn_out(l - 1, prev));
    }
    if (decode_pos < 0)
      blk.attn.forward(k, w, a.attn, a.ln1.out, docs, set.attn);
    else
      blk.attn.decode(k, w, a.attn, a.ln1.out, acts_.blocks[static_cast<size_t>(l)].attn.qkv,
                      decode_pos);
    blk.ln2.residual_forward(k, w, a.ln2, a.residual_mid, block_input(set, l), a.attn.out);
    if (blk.is_moe)
      blk.moe.forward(k, w, a.moe, set.moe, a.ln2.out, with_stats);
    else
      blk.mlp.forward(k, w, a.mlp, mlp_scratch(set), a.ln2.out);
  }
  hook(&UnitHooks::before_forward, L + 1);
  const BlockActs last = block_acts(set, recompute, L - 1);
  lnf_.residual_forward(k, w, set.lnf, set.residual_out, last.residual_mid, ffn_out(L - 1, last));
  // Under tp every token's final norm, gathered, times this rank's rows of the head; the
  // gathered tokens stay for the head's backward.
  if (!tp_.on()) {
    k.matmul_forward(set.logits, set.lnf.out, param(w, lm_head_), Tensor{}, Tensor{});
    return;
  }
  tp_.gather_tokens(set.attn.gathered, set.lnf.out, [&](int64_t first, int64_t n) {
    k.matmul_forward(set.logits.rows(first, n), set.attn.gathered.rows(first, n),
                     param(w, lm_head_), Tensor{}, Tensor{});
  });
}

void Decoder::plan_decode(Arena& arena) {
  if (B_ != 1 || !recompute_.keeps_all())
    throw std::logic_error(
        "plan_decode: after plan_activations(arena, 1, T, Recompute::none), whose per-block q, "
        "k and v are the cache");
  if (fp8_.on())
    throw std::logic_error("plan_decode: an FP8 model decodes with its bf16 weights (fp8 off)");
  if (tp_.on()) throw std::logic_error("plan_decode: a tensor-parallel rank holds part of the model");
  plan([&arena](Tensor* slot, const std::string& name, Shape shape,
                DType dtype) { arena.plan(slot, "decode." + name, shape, dtype); },
       decode_, 1, 1, Recompute::none);
}

Tensor Decoder::decode(Tensor token, int pos) {
  if (!decode_.logits.defined()) throw std::logic_error("decode: plan_decode first");
  if (pos < 0 || pos >= T_)
    throw std::invalid_argument("decode: position " + std::to_string(pos) +
                                " is outside the cache's [0, " + std::to_string(T_) + ")");
  hook(&UnitHooks::before_forward, 0);
  embed_.forward(backend_, weights_, decode_.encoded, token, pos);
  forward_blocks(decode_, Recompute::none, /*with_stats=*/false, pos, DocumentMask{});
  return decode_.logits;
}

bool Decoder::grads_fresh(int unit) const {
  return hooks_ && hooks_->grads_fresh && hooks_->grads_fresh(unit);
}

void Decoder::zero_unit_grads(int unit) {
  for (size_t i = 0; i < layout_.tensors.size(); ++i)
    if (layout_.tensors[i].unit == unit && grads_[i].defined()) backend_.fill_zero(grads_[i]);
}

void Decoder::backward(Tensor tokens, const DocumentMask& docs) {
  Backend& k = backend_;
  const Params &w = weights_, &g = grads_;
  const int L = cfg_.n_layer;

  hook(&UnitHooks::before_backward, L + 1);
  // A tied head's gradient lands in unit 0's (wte).
  const int head_unit = layout_.tensors[static_cast<size_t>(lm_head_)].unit;
  // logits now hold dlogits (written in place by softmax_cross_entropy).
  if (!tp_.on()) {
    k.matmul_backward(acts_.dlnf, param(g, lm_head_), Tensor{}, acts_.logits, acts_.lnf.out,
                      param(w, lm_head_), Tensor{}, !grads_fresh(head_unit));
  } else {
    // The forward's gathered final norm is still in place; every token's gradient of it, a
    // partial sum over this rank's vocabulary, summed into this rank's tokens.
    k.matmul_backward(acts_.attn.partial, param(g, lm_head_), Tensor{}, acts_.logits,
                      acts_.attn.gathered, param(w, lm_head_), Tensor{}, !grads_fresh(head_unit));
    tp_.scatter_tokens(acts_.dlnf, acts_.attn.partial);
  }
  k.fill_zero(acts_.dresidual);
  // dbranch: each norm's backward leaves dresidual's activation copy for the branch below it.
  const Tensor dbranch = this->dbranch(), copy = acts_.dbranch;
  lnf_.backward(k, w, g, acts_.dresidual, acts_.dlnf, acts_.residual_out, acts_.lnf,
                !grads_fresh(L + 1), copy);
  // With untied embeddings the head is in the last unit; tied, wte's grad lands in unit 0's.
  hook(&UnitHooks::after_backward, L + 1);

  for (int l = L - 1; l >= 0; --l) {
    hook(&UnitHooks::before_backward, l + 1);
    const Block& blk = blocks_[static_cast<size_t>(l)];
    const BlockActs a = acts(l);
    const Recompute mode = recompute_.at(l);
    if (mode != Recompute::none) recompute_block(l, a, docs);
    // A MoE block's experts accumulate (an expert no token reached adds nothing): cleared here.
    const bool fresh = grads_fresh(l + 1);
    if (fresh && blk.is_moe) zero_unit_grads(l + 1);
    const bool accumulate = !fresh || blk.is_moe;
    // dresidual: gradient w.r.t. the block's output == w.r.t. residual_mid through the skip.
    if (blk.is_moe)
      blk.moe.backward(k, w, g, acts_.moe, acts_.dln, dbranch, a.ln2.out, a.moe, moe_loss_scale_);
    else
      blk.mlp.backward(k, w, g, mlp_scratch(acts_), acts_.dln, dbranch, a.ln2.out, a.mlp, accumulate);
    blk.ln2.backward(k, w, g, acts_.dresidual, acts_.dln, a.residual_mid, a.ln2, accumulate, copy);
    // Recomputation ran the block's attention forward just now: its keys are gathered.
    blk.attn.backward(k, w, g, acts_.attn, acts_.dln, dbranch, a.ln1.out, a.attn, docs, accumulate,
                      mode == Recompute::selective || mode == Recompute::full);
    // Block 0's ln1 feeds the embedding, which reads dresidual itself: no copy.
    blk.ln1.backward(k, w, g, acts_.dresidual, acts_.dln, block_input(acts_, l), a.ln1, accumulate,
                     l > 0 ? copy : Tensor{});
    hook(&UnitHooks::after_backward, l + 1);
  }
  hook(&UnitHooks::before_backward, 0);
  const bool taken = embed_.wpe < 0 && hooks_ && hooks_->embedding_backward &&
                     hooks_->embedding_backward(acts_.dresidual, tokens);
  if (!taken) embed_.backward(k, g, acts_.dresidual, tokens, acts_.tp_every);
  hook(&UnitHooks::after_backward, 0);
}

}  // namespace kiln

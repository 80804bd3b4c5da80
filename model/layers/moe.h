// Mixture-of-Experts feed-forward layer: a router picks each token's k experts of n_experts,
// the token's rows go through those experts' MLPs, and the outputs are summed with the routing
// weights; an optional shared expert (DeepSeek, Qwen-MoE) sees every token.
//
//   logits = x @ router^T                        [N,E]      (Linear, no bias)
//   scores, top-k, weights = route(logits)       moe_router_forward (+ balancing statistics)
//   xp = permute(x)                              [N*k,C]    rows grouped by expert, dropless
//   yp = proj_e(act(fc_e(xp)))                   grouped GEMMs over the groups
//   out = sum_j w_j * yp[row(n,j)] (+ shared(x)) moe_unpermute
//
// Dropless: no capacity factor, every token reaches its k experts, so a skewed routing costs
// time (one large group) and never tokens. The group sizes stay on the device (the grouped
// GEMM reads them there). Balancing: the Switch aux loss and the z-loss enter the gradient in
// moe_router_backward; DeepSeek-V3's bias is state the trainer updates once per step from the
// step's counts (Decoder::moe_update_bias). Parameters: router [E,C], experts' fc [E,2F|F,C]
// and proj [E,C,F], indexed by the global expert number, and the shared expert as an Mlp.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "model/arch.h"
#include "model/expert_parallel.h"
#include "model/layers/layer.h"
#include "model/layers/linear.h"
#include "model/layers/mlp.h"
#include "model/param_layout.h"

namespace kiln {

struct Moe {
  MoeRouting routing;
  MlpKind kind = MlpKind::swiglu;  // each expert's MLP
  int64_t expert_ffn_dim = 0;
  bool has_shared = false;
  Linear router;
  int fc = -1, proj = -1;  // [E, 2F (swiglu) | F (gelu), C], [E, C, F]
  Mlp shared;              // ffn_dim = n_shared_experts * expert_ffn_dim; out is Acts::out
  ExpertParallel ep;       // set before planning: the buffers' shapes depend on it

  struct Acts {
    Tensor logits;               // [N,E]
    Tensor scores;               // f32[N,E]
    Tensor topk_idx, topk_w;     // i32[N,k], f32[N,k]
    Tensor counts;               // f32[E], this batch's rows per expert
    Tensor offsets;              // i32[E+1]
    Tensor slot_row, row_token;  // i32[N*k]
    Tensor xp, pre, act, yp;     // [M,C], [R,2F|F], [R,F], [M,C]; R = M (or P*M: below)
    // Expert parallelism over P ranks: the rows this rank's El experts received from every
    // rank, grouped by expert (xl [R,C], R = P*M: every rank may send it all its rows;
    // ep_offsets i32[El+1]), and the rows per expert this rank sent (ep_counts[0], i32[E])
    // and each rank sent it per local expert (ep_counts[1], i32[P*El]: one copy to the host
    // reads both); the experts' pre and act have xl's rows.
    Tensor xl, ep_offsets, ep_counts;
    Mlp::Acts shared;            // pre and act; shared.out is out
    Tensor out;                  // [B,T,C]
    // The layer's state, slices of the decoder's (not activations): statistics summed over a
    // step (f32[E + kMoeStats], Backend's MoeStat) and the balancing bias (f32[E] or absent).
    Tensor stats, bias;
  };
  struct Scratch {
    Tensor dlogits, dtopk_w, dyp, dact, dpre, dxp, dx;
    // Expert parallelism, forward and backward: the rows received or sent back, packed by rank
    // ([P*M,C]), the experts' rows in or out ([P*M,C]) and the local offsets.
    Tensor ep_recv, ep_rows, ep_offsets;
    Mlp::Scratch shared;
  };

  int64_t n_experts() const { return routing.n_experts; }
  int64_t local_experts() const { return n_experts() / ep.ranks; }
  void declare(LayoutBuilder& b, const std::string& name, int64_t C, int n_shared);
  void plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
            DType act) const;
  void plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T, DType act) const;
  // with_stats: add this batch's routing statistics to a.stats (training, not evaluation).
  void forward(Backend& k, const Params& w, const Acts& a, const Scratch& s, Tensor inp,
               bool with_stats) const;
  // dinp = gradient w.r.t. inp (overwritten). loss_scale: the weight of this batch's aux and
  // z losses in the step's objective (1 / grad_accum: each is a mean over the batch's tokens).
  void backward(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                Tensor dout, Tensor inp, const Acts& a, float loss_scale) const;

 private:
  // This rank's experts' slice of an expert tensor ([E,...] -> [El,...]).
  Tensor local(const Params& p, int index) const;
  // rows (grouped by `offsets`) through this rank's experts' MLPs into out.
  void experts_forward(Backend& k, const Params& w, const Acts& a, Tensor rows, Tensor offsets,
                       Tensor out) const;
  // Their backward: dout rows -> drows (may be dout's buffer); the experts' grads +=.
  void experts_backward(Backend& k, const Params& w, const Params& g, const Scratch& s,
                        const Acts& a, Tensor rows, Tensor offsets, Tensor dout,
                        Tensor drows) const;
  // The offsets as a host tensor, for the grouped GEMMs (which take them in host memory): a
  // device tensor is copied to host_offsets_ (a stream sync); a host one is returned as it is.
  // The forward's copy (forward_offsets_) serves the backward of the same micro-batch, whose
  // offsets are the same: the backward needs no copy and no sync.
  Tensor on_host(Backend& k, Tensor offsets) const;
  mutable std::vector<int32_t> host_offsets_;
  mutable Tensor forward_offsets_;
  // Expert parallelism: exchanges the rows per expert and reads them on the host (the forward's
  // one sync), setting the sizes below for this micro-batch's forward and backward.
  void exchange_counts(Backend& k, const Acts& a) const;
  Tensor received_counts(const Acts& a) const;  // i32[P,El], a view of a.ep_counts
  // The rows sent to and received from each rank, and the local experts' offsets in xl; the
  // counts' host copy (kept, so that no layer allocates in the step).
  mutable std::vector<int64_t> ep_send_rows_, ep_recv_rows_;
  mutable std::vector<int32_t> ep_local_offsets_, ep_host_counts_;
};

}  // namespace kiln

// The feed-forward layer: GELU (GPT-2: fc -> gelu -> proj, the GELU fused into the fc GEMM's
// epilogue and gelu' into the proj GEMM's backward) or SwiGLU (LLaMA/Qwen3: one fc GEMM
// computes gate and up as [N,2F], silu(gate) * up, then proj; three F x C matrices). Under
// tensor parallelism (model/tensor_parallel.h) fc is column-parallel (each rank F/ranks of the
// hidden units: of gate and of up alike) and proj row-parallel; the layer takes and returns the
// rank's tokens, gathering them before fc and summing proj's partial outputs into them after.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "model/arch.h"
#include "model/layers/layer.h"
#include "model/layers/linear.h"
#include "model/param_layout.h"
#include "model/tensor_parallel.h"

namespace kiln {

struct Mlp {
  MlpKind kind = MlpKind::gelu;
  int64_t ffn_dim = 0;
  Linear fc, proj;  // fc: C -> F (gelu) or C -> 2F (swiglu: gate rows, then up rows)
  TensorParallel tp;  // set before planning (set_tensor_parallel)

  struct Acts {
    Tensor pre;  // fc's output: [B,T,F] before GELU, or [B,T,2F] gate|up
    Tensor act;  // [B,T,F], proj's input
    Tensor out;  // [B,T,C]; the rank's tokens under tp
  };
  struct Scratch {
    Tensor dpre, dact;  // dact: SwiGLU only
    Tensor gathered, partial;  // tensor parallelism's, as Attention::Scratch's (shared)
  };

  // `split`: its matrices split under tensor parallelism (a MoE block's shared expert, on the
  // rank's tokens like the routed ones, does not).
  void declare(LayoutBuilder& b, const std::string& name, int64_t C, bool bias, bool split = true);
  // The rank's hidden units; std::invalid_argument where they do not split.
  void set_tensor_parallel(const TensorParallel& t);
  void plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
            DType act) const;
  void plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T, DType act) const;
  // project=false stops before proj (recomputation needs act, not out).
  void forward(Backend& k, const Params& w, const Acts& a, const Scratch& s, Tensor inp,
               bool project = true) const;
  // Activation recomputation: SwiGLU's product again from the kept fc output. (GELU's output
  // comes out of the fc GEMM's epilogue, so selective recomputation keeps it.)
  void recompute_act(Backend& k, const Acts& a) const {
    if (kind == MlpKind::swiglu) k.swiglu_forward(a.act, a.pre);
  }
  // dinp = gradient w.r.t. inp (overwritten); the grads are added to, or overwritten where not
  // `accumulate`.
  void backward(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                Tensor dout, Tensor inp, const Acts& a, bool accumulate) const;

 private:
  // The backward over every token this rank computes; `fc_input`, where given, supplies fc's
  // input once proj's backward no longer reads dout (tp: every token's, gathered beside it).
  void backward_local(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                      Tensor dout, Tensor inp, const Acts& a, bool accumulate,
                      const std::function<Tensor()>& fc_input = {}) const;
};

}  // namespace kiln

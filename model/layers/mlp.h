// The feed-forward layer: GELU (GPT-2: fc -> gelu -> proj, the GELU fused into the fc GEMM's
// epilogue and gelu' into the proj GEMM's backward) or SwiGLU (LLaMA/Qwen3: one fc GEMM
// computes gate and up as [N,2F], silu(gate) * up, then proj; three F x C matrices).
#pragma once

#include <string>

#include "model/arch.h"
#include "model/layers/layer.h"
#include "model/layers/linear.h"
#include "model/param_layout.h"

namespace kiln {

struct Mlp {
  MlpKind kind = MlpKind::gelu;
  int64_t ffn_dim = 0;
  Linear fc, proj;  // fc: C -> F (gelu) or C -> 2F (swiglu: gate rows, then up rows)

  struct Acts {
    Tensor pre;  // fc's output: [B,T,F] before GELU, or [B,T,2F] gate|up
    Tensor act;  // [B,T,F], proj's input
    Tensor out;  // [B,T,C]
  };
  struct Scratch {
    Tensor dpre, dact;  // dact: SwiGLU only
  };

  void declare(LayoutBuilder& b, const std::string& name, int64_t C, bool bias);
  void plan(const Planner& planner, const std::string& name, Acts& a, int64_t B, int64_t T,
            DType act) const;
  void plan_scratch(const Planner& planner, Scratch& s, int64_t B, int64_t T, DType act) const;
  // project=false stops before proj (recomputation needs act, not out).
  void forward(Backend& k, const Params& w, const Acts& a, Tensor inp, bool project = true) const;
  // Activation recomputation: SwiGLU's product again from the kept fc output. (GELU's output
  // comes out of the fc GEMM's epilogue, so selective recomputation keeps it.)
  void recompute_act(Backend& k, const Acts& a) const {
    if (kind == MlpKind::swiglu) k.swiglu_forward(a.act, a.pre);
  }
  // dinp = gradient w.r.t. inp (overwritten); the grads are added to, or overwritten where not
  // `accumulate`.
  void backward(Backend& k, const Params& w, const Params& g, const Scratch& s, Tensor dinp,
                Tensor dout, Tensor inp, const Acts& a, bool accumulate) const;
};

}  // namespace kiln

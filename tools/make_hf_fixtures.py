#!/usr/bin/env python3
"""Tiny random GPT-2, LLaMA, Qwen3, Qwen3-MoE and Mixtral models saved by transformers, with transformers' own loss
and greedy generation on a token batch, for kiln's parity tests.

    python3 tools/make_hf_fixtures.py OUTDIR            # writes the fixtures
    python3 tools/make_hf_fixtures.py OUTDIR --only qwen3_moe,mixtral   # adds or redoes these
    python3 tools/make_hf_fixtures.py --score HF_DIR TOKENS_JSON   # one model's numbers, as JSON

Needs torch, transformers and safetensors (the GPU host has them; CI does not, which is why the
output is committed under tests/fixtures/hf/). Everything runs on the CPU in float32 and is
seeded, so a rerun writes the same numbers.

OUTDIR gets one folder per architecture (config.json + model.safetensors, bf16: a few hundred
KB in all) and expected.json: per architecture, the mean next-token loss on the batch in
tokens.json, the greedy continuation of a prompt, and the loss after one deliberately swapped
tensor (to show the batch notices a wrong mapping by far more than the test's tolerance).

The batch is sampled from each model itself at temperature 0.5 (sharpened logits), with weights
drawn wider than usual (initializer_range 0.3) so the models have strong preferences: a random
model on random tokens gives ln(vocab) whatever its weights, and would catch nothing.
"""
import argparse
import json
import os
import sys

VOCAB = 320  # not a multiple of 128: kiln pads it to 384, and the padding must not show
BATCH, SEQ, NEW_TOKENS = 4, 64, 32


def configs():
    from transformers import GPT2Config, LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, initializer_range=0.3, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    return {
        "gpt2": GPT2Config(n_layer=2, n_head=4, n_embd=64, n_inner=128, n_positions=128,
                           activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, tie_word_embeddings=True, **common),
        "llama": LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             hidden_size=64, intermediate_size=96, max_position_embeddings=128,
                             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                             attention_bias=False, mlp_bias=False, **common),
        # head_dim 32 != hidden_size / heads (16), as in the real Qwen3 models
        "qwen3": Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, hidden_size=64, intermediate_size=96,
                             max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1e6,
                             tie_word_embeddings=True, use_sliding_window=False, **common),
        # MoE in every other block (decoder_sparse_step 2): block 0 dense, block 1 routed, and an
        # untied head; top-2 of 4 experts, renormalized.
        "qwen3_moe": Qwen3MoeConfig(num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, hidden_size=64,
                                    intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                                    num_experts_per_tok=2, norm_topk_prob=True,
                                    decoder_sparse_step=2, max_position_embeddings=128,
                                    rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                                    use_sliding_window=False, **common),
        # Every block routed (top-2 of 4), Mistral attention.
        "mixtral": MixtralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 hidden_size=64, intermediate_size=48, num_local_experts=4,
                                 num_experts_per_tok=2, max_position_embeddings=128,
                                 rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
                                 **common),
    }


def mean_loss(model, tokens):
    import torch

    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()


def greedy(model, prompt):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0].tolist()


def load(path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.eval()


def swapped_loss(model, arch, tokens):
    """The loss with two of a layer's tensors exchanged: GPT-2's q and k columns of c_attn,
    LLaMA's and Qwen3's gate_proj and up_proj (the order kiln's fused SwiGLU weight depends on),
    and the MoE models' gate and up halves in every expert of the last layer (in expert 0 alone
    the loss moved by 4-5%, too little beside the CUDA test's 1% bf16 tolerance)."""
    import torch

    with torch.no_grad():
        if arch in ("qwen3_moe", "mixtral"):
            w = model.model.layers[-1].mlp.experts.gate_up_proj  # [E, 2F, C]: gate, then up
            f = w.shape[1] // 2
            gate, up = w[:, :f].clone(), w[:, f:].clone()
            w[:, :f], w[:, f:] = up, gate
        elif arch == "gpt2":
            w = model.transformer.h[0].attn.c_attn.weight
            c = w.shape[0]
            q, k = w[:, :c].clone(), w[:, c:2 * c].clone()
            w[:, :c], w[:, c:2 * c] = k, q
        else:
            up, gate = model.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.gate_proj.weight
            a, b = up.clone(), gate.clone()
            up.copy_(b)
            gate.copy_(a)
        return mean_loss(model, tokens)


def make(outdir, only=None):
    """Writes every architecture's fixture, or (only) those named, keeping the others' files
    and numbers as they are; each model's entry records the versions that made it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    os.makedirs(outdir, exist_ok=True)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "batch": BATCH, "seq_len": SEQ, "new_tokens": NEW_TOKENS}
    expected, batches = {}, {}
    if only:
        with open(os.path.join(outdir, "expected.json")) as f:
            kept = json.load(f)
        with open(os.path.join(outdir, "tokens.json")) as f:
            batches = json.load(f)
        for arch, entry in kept["models"].items():
            entry.setdefault("made_with", kept["made_with"])
            expected[arch] = entry
        unknown = set(only) - set(configs())
        if unknown:
            sys.exit(f"make_hf_fixtures: --only names unknown architectures {sorted(unknown)}")
    for i, (arch, config) in enumerate(configs().items()):
        if only and arch not in only:
            continue
        torch.manual_seed(1234 + i)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():  # bf16 values, so the bf16 file holds exactly the model scored
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        path = os.path.join(outdir, arch)
        model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
        model = load(path)

        generator = torch.Generator().manual_seed(99 + i)
        tokens = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
        with torch.no_grad():
            for _ in range(SEQ):
                logits = model(input_ids=tokens).logits[:, -1, :].float() / 0.5
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
                tokens = torch.cat([tokens, nxt], dim=1)
        prompt = tokens[0, :8].tolist()
        expected[arch] = {
            "loss": mean_loss(model, tokens),
            "uniform_loss": float(torch.log(torch.tensor(float(VOCAB)))),
            "prompt": prompt,
            "greedy": greedy(model, prompt),
            "swapped_loss": swapped_loss(load(path), arch, tokens),
            "made_with": meta,
        }
        batches[arch] = tokens.tolist()
        print(f"{arch}: loss {expected[arch]['loss']:.6f} (swapped tensor: "
              f"{expected[arch]['swapped_loss']:.4f}, uniform {expected[arch]['uniform_loss']:.4f})")
    with open(os.path.join(outdir, "tokens.json"), "w") as f:
        json.dump(batches, f)
    with open(os.path.join(outdir, "expected.json"), "w") as f:
        json.dump({"models": expected}, f, indent=1)
    print(f"wrote {outdir}: copy it to tests/fixtures/hf/ in the kiln tree")


def score(path, tokens_json):
    """transformers' loss on a batch ([[ids]]) and greedy continuation of its first 8 ids."""
    import torch

    with open(tokens_json) as f:
        tokens = torch.tensor(json.load(f))
    model = load(path)
    prompt = tokens[0, :8].tolist()
    print(json.dumps({"loss": mean_loss(model, tokens), "prompt": prompt,
                      "greedy": greedy(model, prompt)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", nargs="?")
    parser.add_argument("--score", nargs=2, metavar=("HF_DIR", "TOKENS_JSON"))
    parser.add_argument("--only", help="comma-separated architectures to add or redo in OUTDIR")
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"make_hf_fixtures: needs torch and transformers ({e})", file=sys.stderr)
        sys.exit(3)
    if args.score:
        score(*args.score)
    elif args.outdir:
        make(args.outdir, args.only.split(",") if args.only else None)
    else:
        parser.error("give OUTDIR or --score HF_DIR TOKENS_JSON")


if __name__ == "__main__":
    main()

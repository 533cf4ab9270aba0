#!/usr/bin/env python3
"""Small random checkpoints written by Hugging Face transformers itself
(`<Arch>ForCausalLM(<Arch>Config(...)).save_pretrained`), for the tests that hold Touchstone's
checkpoint reading to transformers' own float64 forward (`hf_f64.py`). A development/test peer,
never a runtime dependency.

- gemma3: six layers (five windowed, window 4, then one global), GQA 4:2, heads of 32, tied
  embeddings, norm weights drawn around 0 as a trained Gemma's are (the model multiplies by 1 + w).
- gemma2: four layers alternating windowed (window 4) and global, otherwise as gemma3, with the
  soft-caps of the attention scores and the logits lowered to 5 and 3 so that tanh bends a share
  of them, as Gemma 2's 50 and 30 do on a trained model's large values, and a query scale of
  1/sqrt(24), not 1/sqrt(head_dim), as Gemma 2 27B's.
- gpt-oss: four layers alternating windowed (window 4) and global, GQA 4:2 with query heads wider
  than the model (4 x 32 over 64), eight experts of 48 with two chosen per token, YaRN RoPE with
  its correction range untruncated (as GPT-OSS's configs say), attention sinks; gate/up biases of
  sd 4, so that the clamped SwiGLU clamps a share of its inputs as on a trained model's outliers.
- mamba2: three Mamba-2 layers (no FFN), 64 wide, eight heads of 16 in two groups, a state of 16,
  a convolution of 4, chunks of 8 (transformers runs a prompt through the chunked scan, the
  oracle through the recurrent one); A between -1 and -16, time steps around softplus(-2), D
  near 1, so that the state decays at a different rate in every head.
- granite-hybrid: Granite 4.0-H's structure (`GraniteMoeHybridForCausalLM`, dense): four layers,
  Mamba-2 (as mamba2's) and attention (GQA 4:2, no RoPE: `position_embedding_type` nope)
  alternating, each followed by a SwiGLU FFN; Granite's multipliers set apart from 1 (embeddings
  x 6, attention scale 1/8 for heads of 16, each residual branch x 0.5, logits / 3);
  `num_experts_per_tok` 0 as a dense model's (llama.cpp's loader requires it). Its config.json
  names the layer types as the published checkpoints do (`mamba`, `attention`), which
  transformers reads and llama.cpp's converter needs.
- qwen3-next: Qwen3-Next's structure (`Qwen3NextForCausalLM`): four layers, gated DeltaNet and
  gated full attention alternating, every layer's FFN a MoE (four experts of 32, two chosen, the
  shares renormalized) beside a shared expert (48 wide) gated by a sigmoid. DeltaNet: two key
  heads of 16 serving four value heads of 16 (each key head two value heads), a convolution of 4
  (transformers' chunked form runs in chunks of 64); A between -1 and -16, `dt_bias` around -2
  as mamba2's. Attention: GQA 4:2, heads of 32 with a quarter of each rotated (8 dimensions), an
  output gate; the (1 + w) norms drawn around 0.

- deepseek-v3: DeepSeek V3's structure (`DeepseekV3ForCausalLM`): three layers, the first dense
  (`first_k_dense_replace` 1; all three with `--dense`), the others eight routed experts of 32 in
  four groups, two groups kept, two experts chosen by sigmoid scores plus a correction bias
  (drawn, sd 0.1), renormalized and scaled by 2.5, beside one shared expert. Latent attention:
  four heads, the query compressed to 32 (`q_lora_rank`; 0
  with `--no-q-lora`: one query projection), the key/value latent 24 wide, each query head 16
  unrotated + 8 rotated dimensions in adjacent pairs (`rope_interleave`), values of 12; YaRN
  RoPE (factor 4 over an original context of 32, `mscale` and `mscale_all_dim` 1 as DeepSeek
  V3's: the score scale grows by (1 + 0.1 ln 4)^2; the GGUF form holds only that case); SwiGLU
  FFNs 96 wide.

With `--tokenizer`, the checkpoint also gets a tokenizer of its vocabulary (512 tokens instead
of 300), trained on
a few fixed sentences, in the form its family ships, so that llama.cpp's converter
(`hf_to_gguf.py`) can write it to GGUF: gemma2/gemma3 a SentencePiece BPE `tokenizer.model`
(byte fallback; pad 0, eos 1, bos 2, unk 3 as Gemma's), gpt-oss a byte-level BPE
`tokenizer.json` split by GPT-OSS's own (o200k) pattern.

With `--mxfp4` (gpt-oss), the experts are stored as OpenAI publishes them: MXFP4 blocks
(`*_blocks` `[experts, out, in / 32, 16]`, two E2M1 codes a byte, the low nibble first) and
power-of-two scales (`*_scales`, E8M0), with `quantization_config` saying so in config.json;
each block's scale is the smallest power of two that brings its largest magnitude within 6, each
code the nearest E2M1 value; the experts are 64 wide instead of 48 (whole blocks).

Usage: make_checkpoint.py {gemma2,gemma3,gpt-oss,mamba2,granite-hybrid,qwen3-next,deepseek-v3} OUT_DIR [--seed N] [--tokenizer] [--mxfp4] [--no-q-lora] [--dense]
       [--shape WIDTHxLAYERS] [--layer-types alternate|mamba|attention]

(`--layer-types mamba` makes every qwen3-next layer a gated DeltaNet.)
"""
import argparse
import io
import json
import pathlib

import torch


def gemma(t, two, vocab):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=256, sliding_window=4, rms_norm_eps=1e-6, tie_word_embeddings=True)
    if two:
        # A query scale apart from 1/sqrt(head_dim), as Gemma 2 27B's (n_embd / n_head).
        model = t.Gemma2ForCausalLM(t.Gemma2Config(num_hidden_layers=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                                   query_pre_attn_scalar=24, **common))
    else:
        model = t.Gemma3ForCausalLM(t.Gemma3TextConfig(num_hidden_layers=6, rope_theta=1e6, rope_local_base_freq=10000.0,
                                                       query_pre_attn_scalar=32, **common))
    model = model.to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, (1.0 if two else 0.5) / p.shape[-1] ** 0.5)
    return model


def gpt_oss(t, vocab, ffn):
    rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 32, "rope_theta": 150000.0}
    cfg = t.GptOssConfig(vocab_size=vocab, hidden_size=64, intermediate_size=ffn, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=4, num_local_experts=8,
                         num_experts_per_tok=2, rope_parameters=rope, layer_types=["sliding_attention", "full_attention"] * 2,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = t.GptOssForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("gate_up_proj_bias"):
                p.normal_(0.0, 4.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("gate_up_proj") or name.endswith("down_proj"):
                p.normal_(0.0, 0.5 / p.shape[-2] ** 0.5)  # x @ W: the input dimension is the second to last
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return model


TEXT = """The capital of France is Paris, and the capital of Italy is Rome.
A small model reads a prompt one token at a time and writes the next one.
Numbers such as 12, 345 and 6789 are split into digits or groups of digits.
She said: "It's late; we'll go tomorrow." They didn't answer.
Engines round their products in different orders, so their numbers differ a little.
The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.
Water boils at 100 degrees Celsius at sea level and freezes at 0.
Every layer adds its attention and its feed-forward output to the residual stream.
"""

# GPT-OSS's pre-tokenizer split (the o200k pattern of its tokenizer.json).
O200K = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])


def sentencepiece_tokenizer(out, vocab):
    """A SentencePiece BPE model of `vocab` pieces (Gemma's special ids), as tokenizer.model."""
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT.splitlines()), model_writer=model, vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, pad_id=0, eos_id=1,
                                   bos_id=2, unk_id=3, add_dummy_prefix=False, num_threads=1, minloglevel=2)
    (pathlib.Path(out) / "tokenizer.model").write_bytes(model.getvalue())


def byte_level_tokenizer(out, vocab):
    """A byte-level BPE tokenizer of `vocab` tokens split by GPT-OSS's pattern, as tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = ["<|startoftext|>", "<|endoftext|>", "<|return|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[0], eos_token=special[2]).save_pretrained(out)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4(w):
    """`w` `[experts, in, out]` (GPT-OSS's `x @ W`) as MXFP4 blocks and scales of its rows `[experts, out, in]`."""
    rows = w.transpose(1, 2).contiguous()
    e, r, n = rows.shape
    x = rows.reshape(e, r, n // 32, 32).double()
    amax = x.abs().amax(-1)
    exp = torch.ceil(torch.log2(torch.clamp(amax, min=2.0 ** -126) / 6.0)).to(torch.int32)
    y = x / torch.pow(2.0, exp.double()).unsqueeze(-1)
    lut = torch.tensor(E2M1, dtype=torch.float64)
    codes = (y.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def store_experts_mxfp4(out, n_layers):
    """Rewrite the saved checkpoint's expert matrices as MXFP4 blocks and scales."""
    from safetensors.torch import load_file, save_file
    path = pathlib.Path(out) / "model.safetensors"
    tensors = load_file(path)
    for layer in range(n_layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4(tensors.pop(name))
    save_file(tensors, path, metadata={"format": "pt"})
    cfg_path = pathlib.Path(out) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    cfg_path.write_text(json.dumps(cfg, indent=2))


def ssm_shape(shape):
    """The Mamba-2 dimensions of a `WIDTHxLAYERS` shape (None: the test's 64 x 3 or 4): heads of 64,
    one group and a state of 128 as Mamba-2 130M's, else the test's eight heads of 16 in two
    groups and a state of 16."""
    if shape is None:
        return dict(hidden=64, layers=None, heads=8, head_dim=16, groups=2, state=16)
    width, layers = (int(v) for v in shape.split("x"))
    return dict(hidden=width, layers=layers, heads=2 * width // 64, head_dim=64, groups=1, state=128)


def mamba2(t, vocab, shape=None):
    d = ssm_shape(shape)
    cfg = t.Mamba2Config(vocab_size=vocab, hidden_size=d["hidden"], num_hidden_layers=d["layers"] or 3, num_heads=d["heads"],
                         head_dim=d["head_dim"], expand=2, state_size=d["state"], n_groups=d["groups"], conv_kernel=4, chunk_size=8,
                         layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, tie_word_embeddings=False, residual_in_fp32=True)
    return ssm_init(t.Mamba2ForCausalLM(cfg).to(torch.float32))


def ssm_init(model, norm_mean=lambda name: 1.0):
    """Mamba-2 mixers' parameters drawn as `mamba2` draws them (a gated DeltaNet's alike); norm
    weights around `norm_mean(name)`; the rest 0.5 / sqrt(fan-in)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(0.0, 2.77)  # A = -exp(A_log) in [-16, -1]
            elif name.endswith("dt_bias"):
                p.normal_(-2.0, 0.5)
            elif name.endswith(".D"):
                p.normal_(1.0, 0.1)
            elif "norm" in name:
                p.normal_(norm_mean(name), 0.1)
            elif name.endswith("conv1d.bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return model


def granite_hybrid(t, vocab, shape=None, layer_types="alternate"):
    d = ssm_shape(shape)
    n = d["layers"] or 4
    types = {"alternate": ["mamba", "attention"] * (n // 2) + ["mamba"] * (n % 2), "mamba": ["mamba"] * n, "attention": ["attention"] * n}[layer_types]
    heads = max(4, d["hidden"] // 64)
    cfg = t.GraniteMoeHybridConfig(vocab_size=vocab, hidden_size=d["hidden"], intermediate_size=2 * d["hidden"], shared_intermediate_size=2 * d["hidden"],
                                   num_local_experts=0, num_experts_per_tok=0, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=heads // 2 if shape is None else heads // 3,
                                   layer_types=types, mamba_n_heads=d["heads"], mamba_d_head=d["head_dim"], mamba_n_groups=d["groups"],
                                   mamba_d_state=d["state"], mamba_d_conv=4, mamba_expand=2,
                                   mamba_chunk_size=8, position_embedding_type="nope", embedding_multiplier=6.0, attention_multiplier=0.125,
                                   residual_multiplier=0.5, logits_scaling=3.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return ssm_init(t.GraniteMoeHybridForCausalLM(cfg).to(torch.float32))


def qwen3_next(t, vocab, shape=None, layer_types="alternate"):
    """The test's model, or (`shape` WIDTHxLAYERS, for benchmarks) heads of 128 as Qwen3-Next's
    DeltaNet layers have: width / 256 key heads serving twice as many value heads, width / 128
    attention heads over 2 key/value heads, eight experts of width / 2 (two chosen) and a shared
    one as wide."""
    if shape is None:
        d = dict(hidden=64, layers=4, heads=4, kv=2, head_dim=32, k_heads=2, v_heads=4, lin_dim=16, experts=4, expert_ffn=32, shared_ffn=48, ffn=96)
    else:
        width, layers = (int(v) for v in shape.split("x"))
        d = dict(hidden=width, layers=layers, heads=width // 128, kv=2, head_dim=128, k_heads=width // 256, v_heads=width // 128, lin_dim=128,
                 experts=8, expert_ffn=width // 2, shared_ffn=width // 2, ffn=width)
    n = d["layers"]
    types = {"alternate": ["linear_attention", "full_attention"] * (n // 2) + ["linear_attention"] * (n % 2),
             "linear": ["linear_attention"] * n, "full": ["full_attention"] * n}[layer_types]
    cfg = t.Qwen3NextConfig(vocab_size=vocab, hidden_size=d["hidden"], intermediate_size=d["ffn"], num_hidden_layers=n, num_attention_heads=d["heads"],
                            num_key_value_heads=d["kv"], head_dim=d["head_dim"], partial_rotary_factor=0.25, rope_theta=10000.0,
                            layer_types=types, full_attention_interval=2,
                            linear_conv_kernel_dim=4, linear_key_head_dim=d["lin_dim"], linear_value_head_dim=d["lin_dim"], linear_num_key_heads=d["k_heads"],
                            linear_num_value_heads=d["v_heads"], num_experts=d["experts"], num_experts_per_tok=2, moe_intermediate_size=d["expert_ffn"],
                            shared_expert_intermediate_size=d["shared_ffn"], decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[],
                            rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096)
    # The (1 + w) norms drawn around 0; the DeltaNet's output norm multiplies by w.
    return ssm_init(t.Qwen3NextForCausalLM(cfg).to(torch.float32), lambda name: 1.0 if name.endswith("linear_attn.norm.weight") else 0.0)


def deepseek_v3(t, vocab, q_lora=True, dense=False, shape=None):
    """The test's model, or (`shape` WIDTHxLAYERS, for benchmarks) DeepSeek V3's own head and
    latent widths (128 + 64 per query head, a latent of 512, values of 128) on width / 128 heads,
    the query compressed to width / 2, every layer dense (FFN twice the width)."""
    d = dict(hidden=64, layers=3, heads=4, q_lora=32, kv_lora=24, nope=16, rope=8, v=12, ffn=96)
    if shape is not None:
        width, layers = (int(v) for v in shape.split("x"))
        d = dict(hidden=width, layers=layers, heads=width // 128, q_lora=width // 2, kv_lora=512, nope=128, rope=64, v=128, ffn=2 * width)
        dense = True
    cfg = t.DeepseekV3Config(vocab_size=vocab, hidden_size=d["hidden"], intermediate_size=d["ffn"], moe_intermediate_size=32, num_hidden_layers=d["layers"],
                             num_attention_heads=d["heads"], num_key_value_heads=d["heads"], q_lora_rank=d["q_lora"] if q_lora else None, kv_lora_rank=d["kv_lora"],
                             qk_nope_head_dim=d["nope"], qk_rope_head_dim=d["rope"], v_head_dim=d["v"], first_k_dense_replace=d["layers"] if dense else 1, n_routed_experts=8,
                             num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                             rope_interleave=True, max_position_embeddings=128,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                             rms_norm_eps=1e-6, tie_word_embeddings=False, num_mtp_layers=0)
    model = ssm_init(t.DeepseekV3ForCausalLM(cfg).to(torch.float32))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)  # transformers initializes it to zeros; a trained model's is not
    return model


def scoring_func_sigmoid(out):
    """config.json's `scoring_func` as DeepSeek V3's own config.json says it (transformers'
    config drops it; llama.cpp's converter reads it, else takes DeepSeek V2's softmax)."""
    path = pathlib.Path(out) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["scoring_func"] = "sigmoid"
    path.write_text(json.dumps(cfg, indent=2))


def legacy_layer_types(out):
    """config.json's layer types as the published Granite 4.0-H checkpoints name them."""
    path = pathlib.Path(out) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["layer_types"] = [{"linear_attention": "mamba", "full_attention": "attention"}.get(x, x) for x in cfg["layer_types"]]
    path.write_text(json.dumps(cfg, indent=2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch", choices=["gemma2", "gemma3", "gpt-oss", "mamba2", "granite-hybrid", "qwen3-next", "deepseek-v3"])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", action="store_true", help="also write a tokenizer of the vocabulary")
    ap.add_argument("--no-q-lora", action="store_true", help="deepseek-v3: one query projection, no query compression")
    ap.add_argument("--dense", action="store_true", help="deepseek-v3: every layer dense (first_k_dense_replace = 3)")
    ap.add_argument("--mxfp4", action="store_true", help="gpt-oss: store the experts as MXFP4 blocks")
    ap.add_argument("--shape", help="mamba2, granite-hybrid, qwen3-next, deepseek-v3: WIDTHxLAYERS (e.g. 768x24), benchmark-sized heads (mamba2: heads of 64 and a state of 128; qwen3-next: heads of 128; deepseek-v3: DeepSeek V3's head and latent widths, dense)")
    ap.add_argument("--layer-types", choices=["alternate", "mamba", "attention"], default="alternate",
                    help="granite-hybrid, qwen3-next: recurrent (Mamba-2, gated DeltaNet) and attention layers alternating (default), or every layer one kind")
    a = ap.parse_args()
    import transformers as t
    torch.manual_seed(a.seed)
    # A tokenizer needs its 256 bytes, the text's characters and enough merges that tokens span
    # what one split cuts and another does not.
    vocab = 512 if a.tokenizer else 300
    # MXFP4 blocks are 32 wide: experts of 64 then, not 48.
    if a.arch == "gpt-oss":
        model = gpt_oss(t, vocab, 64 if a.mxfp4 else 48)
    elif a.arch == "mamba2":
        model = mamba2(t, vocab, a.shape)
    elif a.arch == "granite-hybrid":
        model = granite_hybrid(t, vocab, a.shape, a.layer_types)
    elif a.arch == "qwen3-next":
        model = qwen3_next(t, vocab, a.shape, {"mamba": "linear", "attention": "full"}.get(a.layer_types, a.layer_types))
    elif a.arch == "deepseek-v3":
        model = deepseek_v3(t, vocab, not a.no_q_lora, a.dense, a.shape)
    else:
        model = gemma(t, a.arch == "gemma2", vocab)
    model.save_pretrained(a.out, safe_serialization=True)
    if a.arch == "granite-hybrid":
        legacy_layer_types(a.out)
    if a.arch == "deepseek-v3":
        scoring_func_sigmoid(a.out)
    if a.mxfp4:
        store_experts_mxfp4(a.out, model.config.num_hidden_layers)
    if a.tokenizer:
        (byte_level_tokenizer if a.arch in ("gpt-oss", "qwen3-next", "deepseek-v3") else sentencepiece_tokenizer)(a.out, model.config.vocab_size)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""An independent f64 reference from Hugging Face transformers: a checkpoint directory run by
`AutoModelForCausalLM` (eager attention) with every weight and every op in float64.

Some models force parts of the forward pass to float32 whatever the weights' dtype (Gemma 2's,
Gemma 3's and GPT-OSS's RMSNorm compute `x.float()`, GPT-OSS's rotary embedding its angles); those modules
are patched here to compute in the input's dtype, and
the script refuses to run if any floating tensor of the forward pass is not float64 (a forward
hook on every module checks its inputs and outputs). A development/test peer: never a runtime
dependency of Touchstone.

Usage: hf_f64.py CHECKPOINT_DIR --prompt-ids 1,2,3 [--greedy N] --out ref.json
Writes {"logits": [[...], ...] (every position), "greedy": [...], "hidden": [...]}: `hidden` is
transformers' `hidden_states`, one [position][width] array per entry: the embedding as the first
layer takes it, each layer's output, the last one after the final norm.
"""
import argparse
import json
import sys

import torch


def f64_norms():
    """Patch RMSNorm modules that upcast to float32 so they compute in their input's dtype."""
    patched = []

    def gemma_norm(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y * (1.0 + self.weight.to(x.dtype))
    for module, cls in [("gemma2", "Gemma2RMSNorm"), ("gemma3", "Gemma3RMSNorm")]:
        try:
            mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[cls])
            getattr(mod, cls).forward = gemma_norm
            patched.append(cls)
        except (ImportError, AttributeError):
            pass
    try:
        from transformers.models.gpt_oss import modeling_gpt_oss as oss

        def forward_oss(self, x):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight.to(x.dtype) * y
        oss.GptOssRMSNorm.forward = forward_oss
        patched.append("GptOssRMSNorm")

        def rotary_oss(self, x, position_ids):
            # The angles in float64 (transformers forms them in float32).
            freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(torch.float64)
            return (freqs.cos() * self.attention_scaling).to(x.dtype), (freqs.sin() * self.attention_scaling).to(x.dtype)
        oss.GptOssRotaryEmbedding.forward = rotary_oss
        patched.append("GptOssRotaryEmbedding")
    except ImportError:
        pass
    return patched


# Families whose transformers code casts to float32 inside the forward pass in many places (the
# state-space scan, its norms, the residual, the logits): for them every cast of a float64
# tensor to float32 is made a float64 one, so the whole pass runs in float64.
F32_CASTING = {"mamba2", "granitemoehybrid", "qwen3_next", "deepseek_v3"}


def keep_float64():
    """Make `.float()`, `.to(torch.float32)`, `.type(torch.float32)` and a float32 softmax of a
    float64 tensor keep float64."""
    orig_float, orig_to, orig_softmax, orig_type = torch.Tensor.float, torch.Tensor.to, torch.nn.functional.softmax, torch.Tensor.type

    def type_(self, *args, **kwargs):
        if self.dtype == torch.float64 and args and args[0] is torch.float32:
            return self
        return orig_type(self, *args, **kwargs)
    torch.Tensor.type = type_

    def softmax(x, *args, dtype=None, **kwargs):
        if x.dtype == torch.float64 and dtype is torch.float32:
            dtype = torch.float64
        return orig_softmax(x, *args, dtype=dtype, **kwargs)
    torch.nn.functional.softmax = softmax

    def to_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else orig_float(self, *args, **kwargs)

    def to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if x is torch.float32 else x for x in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return orig_to(self, *args, **kwargs)
    torch.Tensor.float, torch.Tensor.to = to_float, to


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--greedy", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM
    f64_norms()
    torch.set_default_dtype(torch.float64)
    # Eager attention and experts: the fused kernels do not take float64.
    kw = {}
    config = json.load(open(f"{a.checkpoint}/config.json"))
    if config.get("model_type") in F32_CASTING:
        keep_float64()
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "mxfp4":
        # MXFP4 experts dequantized by transformers itself, into the float64 parameters (exact:
        # every E2M1 code times a power of two is a float64).
        from transformers import Mxfp4Config
        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager", **kw)
    # Modules a family keeps in float32 whatever the dtype (DeepSeek V3's router and its
    # correction bias) widened too: exact, the stored values being float32 at most.
    model = model.to(torch.float64)
    model.eval()
    bad = []

    def check(module, inputs, output):
        for t in list(inputs) + (list(output) if isinstance(output, (tuple, list)) else [output]):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                bad.append(f"{type(module).__name__}: {t.dtype}")
    hooks = [m.register_forward_hook(check) for m in model.modules()]
    ids = [int(t) for t in a.prompt_ids.split(",")]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        logits = out.logits[0]
        hidden = [h[0].tolist() for h in out.hidden_states]
        for h in hooks:
            h.remove()
        if bad:
            sys.exit(f"not every op ran in float64: {sorted(set(bad))[:5]}")
        seq, greedy = list(ids), []
        for _ in range(a.greedy):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            greedy.append(nxt)
            seq.append(nxt)
    json.dump({"logits": logits.tolist(), "greedy": greedy, "hidden": hidden}, open(a.out, "w"))


if __name__ == "__main__":
    main()

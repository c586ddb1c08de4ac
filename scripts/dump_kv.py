#!/usr/bin/env python3
"""Dump a Hugging Face model's attention inputs per layer for `kvq eval`.

One forward pass over a prompt; for every attention layer L the file gets

    q.L  [tokens, num_q_heads,  head_dim]  f16
    k.L  [tokens, num_kv_heads, head_dim]  f16
    v.L  [tokens, num_kv_heads, head_dim]  f16

exactly as the model's attention kernel receives them: queries and keys *after* RoPE (and
after any q/k norm), keys and values before GQA repetition, i.e. what a KV cache stores.
They are captured by registering a pass-through attention function with transformers'
AttentionInterface (transformers >= 4.51), so the model code itself is not patched and the
model's output is unchanged (the function calls the stock SDPA attention).

    pip install torch transformers safetensors
    python3 scripts/dump_kv.py meta-llama/Llama-3.2-1B --tokens 1024 --out llama_kv.safetensors
    kvq eval llama_kv.safetensors     # or: cargo run --release --features cli -- eval ...

    # No download: a randomly initialised 2-layer Llama, for testing the script itself.
    python3 scripts/dump_kv.py --random-tiny --out tiny_kv.safetensors

The prompt is --text, else --text-file, else a built-in paragraph, repeated until --tokens
tokens (random token ids with --random-tiny). File metadata records the model, the prompt's
length and the dtype the model ran in (bf16 activations are rounded to f16 on the way out;
|x| > 65504 saturates, which kvq's sanitization would do too).
"""

import argparse
import sys

DEFAULT_TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged key-value cache stores each "
    "sequence's keys and values in fixed-size blocks of a shared pool, as virtual memory "
    "stores pages; a block table maps a sequence's positions to its blocks. Quantizing the "
    "cache to eight or four bits halves or quarters the memory a long context needs, and the "
    "time a decode step spends reading it, at some cost in accuracy that depends on how the "
    "scales are chosen and on the outlier channels real keys carry. "
)

ATTN_NAME = "kvq_dump"


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Dump post-RoPE q/k/v per layer (q.L, k.L, v.L; f16 [tokens, heads, "
        "head_dim]) of a Hugging Face causal LM for `kvq eval`."
    )
    p.add_argument("model", nargs="?", help="model id on the Hub or a local directory")
    p.add_argument("--random-tiny", action="store_true",
                   help="a randomly initialised tiny Llama (2 layers, 8 query / 2 KV heads of "
                        "64), nothing downloaded: for testing this script")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--tokens", type=int, default=512, help="prompt length in tokens (512)")
    p.add_argument("--text", help="prompt text (repeated up to --tokens)")
    p.add_argument("--text-file", help="file with the prompt text (repeated up to --tokens)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16",
                   help="dtype the model runs in (bfloat16)")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random-tiny (0)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="pass trust_remote_code=True to transformers")
    args = p.parse_args(argv)
    if args.random_tiny == bool(args.model):
        p.error("give a model id / path, or --random-tiny (not both)")
    if args.tokens < 2:
        p.error("--tokens must be at least 2")
    return args


def main(argv):
    args = parse_args(argv)
    try:
        import torch
        import transformers
        from safetensors.torch import save_file
        from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError as e:
        sys.exit(f"dump_kv.py: {e}; needs torch, safetensors and transformers >= 4.51 "
                 "(pip install torch transformers safetensors)")

    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"

    captured = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        """Record what the kernel sees (batch 0), then attend as SDPA would."""
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            layer = len(captured)
        if layer in captured:
            raise RuntimeError(f"layer {layer} attended twice in one forward pass")
        # [batch, heads, tokens, head_dim] -> [tokens, heads, head_dim], f16 on the host.
        captured[layer] = tuple(
            t[0].transpose(0, 1).to(torch.float16).contiguous().cpu()
            for t in (query, key, value)
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(ATTN_NAME, capture)
    try:
        # transformers >= 4.53 builds masks per attention function: give ours SDPA's (sliding
        # windows included). Older versions build the SDPA mask for any implementation.
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    except ImportError:
        pass

    if args.random_tiny:
        from transformers import LlamaConfig

        torch.manual_seed(args.seed)
        config = LlamaConfig(
            vocab_size=1024,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=max(2048, args.tokens),
            rope_theta=10000.0,
        )
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=ATTN_NAME, **{dtype_kw: dtype}
        )
        ids = torch.randint(0, config.vocab_size, (1, args.tokens))
        name = f"random-tiny-llama (seed {args.seed})"
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            args.model,
            attn_implementation=ATTN_NAME,
            trust_remote_code=args.trust_remote_code,
            **{dtype_kw: dtype},
        )
        if args.text is not None:
            text = args.text
        elif args.text_file is not None:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read()
        else:
            text = DEFAULT_TEXT
        if not text.strip():
            sys.exit("dump_kv.py: the prompt text is empty")
        ids = tok(text, return_tensors="pt").input_ids
        while ids.shape[1] < args.tokens:
            ids = torch.cat([ids, tok(" " + text, return_tensors="pt",
                                      add_special_tokens=False).input_ids], dim=1)
        ids = ids[:, : args.tokens]
        name = args.model

    model.to(device).eval()
    with torch.no_grad():
        model(input_ids=ids.to(device), use_cache=False)

    if not captured:
        sys.exit(f"dump_kv.py: no attention layer of {name} went through the attention "
                 "interface (the model's attention does not dispatch through "
                 "transformers' AttentionInterface)")
    tensors = {}
    for layer, (q, k, v) in sorted(captured.items()):
        if q.shape[0] != ids.shape[1] or k.shape != v.shape or q.shape[2] != k.shape[2]:
            sys.exit(f"dump_kv.py: layer {layer}: unexpected shapes q {tuple(q.shape)}, "
                     f"k {tuple(k.shape)}, v {tuple(v.shape)}")
        tensors[f"q.{layer}"], tensors[f"k.{layer}"], tensors[f"v.{layer}"] = q, k, v
    metadata = {
        "kvq.dump.model": name,
        "kvq.dump.tokens": str(ids.shape[1]),
        "kvq.dump.dtype": args.dtype,
        "kvq.dump.rope": "applied (post-RoPE q and k)",
        "kvq.dump.transformers": transformers.__version__,
    }
    save_file(tensors, args.out, metadata=metadata)
    q, k, _ = captured[min(captured)]
    print(f"{args.out}: {len(captured)} layers of {ids.shape[1]} tokens, "
          f"{q.shape[1]} query / {k.shape[1]} kv heads of head_dim {q.shape[2]} ({name})")


if __name__ == "__main__":
    main(sys.argv[1:])

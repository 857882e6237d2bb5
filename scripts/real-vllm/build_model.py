#!/usr/bin/env python3
r"""Build a seeded random-weight Llama model + byte-level BPE tokenizer for a local real vLLM.

No download of any kind: the weights are random (seeded), the tokenizer is trained on the
interpreter's own standard-library sources. Output text is garbage by design; use
``"ignore_eos": true`` with ``max_tokens`` to get exact output lengths.

Runs inside the real-vLLM venv (needs torch, transformers, tokenizers):

    ~/.cache/marsproxy/real-vllm/venv/bin/python scripts/real-vllm/build_model.py \
        --size tiny --out ~/.cache/marsproxy/real-vllm/models/tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

SIZES = {
    # head_dim 64 everywhere: works with the CPU attention backend.
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=384,
        vocab_size=2048,
    ),
    "medium": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1536,
        vocab_size=2048,
    ),
}

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

# ChatML-like; every message, then an open assistant turn when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def training_files(limit_bytes: int) -> list[str]:
    """Deterministic list of stdlib .py files, up to ``limit_bytes`` in total."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    total = 0
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib).parts
        if rel and rel[0] in ("site-packages", "test", "idlelib", "lib2to3"):
            continue
        try:
            size = p.stat().st_size
        except OSError:
            continue
        files.append(str(p))
        total += size
        if total >= limit_bytes:
            break
    if not files:
        sys.exit(f"no training text found under {stdlib}")
    return files


def build_tokenizer(out: Path, vocab_size: int, limit_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = training_files(limit_bytes)
    tok.train(files, trainer)
    # The model's vocab is fixed; make every id decodable by filling any gap with extra tokens.
    n = tok.get_vocab_size()
    if n < vocab_size:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - n)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast, len(files)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--train-bytes",
        type=int,
        default=8_000_000,
        help="how much stdlib source text to train the tokenizer on",
    )
    args = ap.parse_args()

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    marker = out / ".built"
    if marker.exists():
        marker.unlink()

    spec = SIZES[args.size]
    tokenizer, n_files = build_tokenizer(out, spec["vocab_size"], args.train_bytes)
    t_tok = time.time() - t0

    config = LlamaConfig(
        **spec,
        max_position_embeddings=args.max_model_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    # vLLM on CPU runs this model in bfloat16 (dtype "auto"); saving bf16 weights avoids a cast
    # (and a warning per tensor) at every load, and halves the file.
    config.dtype = "bfloat16"
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)  # float32 init (seeded), then cast
    model = model.to(torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(str(out))

    info = {
        "size": args.size,
        "seed": args.seed,
        "params": n_params,
        "config": spec,
        "max_position_embeddings": args.max_model_len,
        "tokenizer_vocab": len(tokenizer),
        "tokenizer_training_files": n_files,
        "special_tokens": {
            "bos": [tokenizer.bos_token, tokenizer.bos_token_id],
            "eos": [tokenizer.eos_token, tokenizer.eos_token_id],
            "pad": [tokenizer.pad_token, tokenizer.pad_token_id],
        },
        "torch": torch.__version__,
        "build_seconds": round(time.time() - t0, 2),
        "tokenizer_seconds": round(t_tok, 2),
    }
    (out / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    marker.write_text("ok\n")
    print(
        f"    {args.size}: {n_params / 1e6:.2f} M params, vocab {len(tokenizer)}, "
        f"tokenizer {t_tok:.1f} s on {n_files} stdlib files, "
        f"total {time.time() - t0:.1f} s -> {out}"
    )
    # Quick sanity check of the chat template.
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    if hasattr(ids, "keys"):  # newer transformers may return a BatchEncoding
        ids = ids["input_ids"]
    print(f"    chat template ok: {len(ids)} tokens for a one-word user turn")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()

"""Write a tiny Hugging Face chat model folder offline, for the quick-start's chat leg (examples/quickstart_chat.sh).

A randomly initialised 2-layer `Qwen2ForCausalLM` (GQA, QKV bias) over the 5,000-token GPT-2-style vocabulary in
tests/fixtures/openwebtext-1000 plus the ChatML tokens `<|im_start|>` and `<|im_end|>`, with a ChatML
`chat_template` (an assistant turn ends with `<|im_end|>`), saved with `save_pretrained` (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja).

    python examples/make_tiny_hf_chat_model.py OUTPUT_DIR
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers

VOCAB = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "openwebtext-1000"
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make(out: Path, seed: int = 1234) -> None:
    """Write the tokenizer and the model to `out` (a new or empty folder)."""
    vocab = json.loads((VOCAB / "gpt2-tiny-vocab.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in (VOCAB / "gpt2-tiny-merges.txt").read_text(encoding="utf-8").splitlines()
              if line and not line.startswith("#")]
    tokenizer = transformers.GPT2TokenizerFast(vocab=vocab, merges=merges, eos_token="<|endoftext|>",
                                               bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    make(parser.parse_args().output_dir)
    print(f"tiny Hugging Face chat model written to {parser.parse_args().output_dir}")


if __name__ == "__main__":
    main()

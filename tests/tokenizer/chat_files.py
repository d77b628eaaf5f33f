"""A tiny Hugging Face tokenizer folder with chat special tokens and a ChatML chat_template, built offline from the
shipped GPT-2 test vocabulary (tests/fixtures/openwebtext-1000): for the chat-format, SFT and chat-route tests."""
from __future__ import annotations

import shutil
from pathlib import Path

import transformers

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Megatron's named formats use these; <SPECIAL_233> is nemotron's pad and <unk> nemotron-nano-v2's.
SPECIAL = ["<|im_start|>", "<|im_end|>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_14>",
           "<SPECIAL_15>", "<SPECIAL_233>", "<unk>"]


def write_chat_tokenizer(folder: Path, fixtures: Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json (with CHATML as chat_template) into `folder`; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    owt = Path(fixtures) / "openwebtext-1000"
    shutil.copyfile(owt / "gpt2-tiny-vocab.json", folder / "vocab.json")
    shutil.copyfile(owt / "gpt2-tiny-merges.txt", folder / "merges.txt")
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(folder))
    (folder / "vocab.json").unlink()
    (folder / "merges.txt").unlink()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(folder))
    return folder

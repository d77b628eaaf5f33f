"""megatron/tokenizer/chat_format.py: conversations to token ids and assistant targets, through the tokenizer's own
chat_template ("hf") and Megatron-LM's named prompt formats; generation prompts; end-of-turn ids; bad conversations."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pytest

from megatron.checkpoint.conversion.hf_tokenizer_export import export_tokenizer
from megatron.errors import ArgumentError
from megatron.run_configs.saved_args import SavedRunArgs
from megatron.tokenizer.chat_format import (
    IGNORE_INDEX,
    ChatFormat,
    ConversationError,
    chat_format_for,
    check_prompt_format,
)
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HuggingFaceTokenizer
from tests.tokenizer.chat_files import write_chat_tokenizer

transformers = pytest.importorskip("transformers")
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"},
        {"role": "assistant", "content": "Six, no: five."}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory, shared_data: Path):
    folder = write_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"), shared_data)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _targets_text(tok, fmt: ChatFormat, conv=CONV) -> str:
    tokens, mask = fmt.render(conv)
    return tok.decode([t for t, m in zip(tokens, mask) if m])


def test_hf_template_targets_are_the_assistant_replies_with_their_end_of_turn(tok):
    fmt = ChatFormat(tok, "hf")
    tokens, mask = fmt.render(CONV)
    assert tokens == tok.apply_chat_template(CONV, tokenize=True, return_dict=False)
    assert _targets_text(tok, fmt) == "Four.<|im_end|>\nSix, no: five.<|im_end|>\n"
    # the non-target tokens are exactly the rest of the text
    assert tok.decode([t for t, m in zip(tokens, mask) if not m]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_start|>user\nAnd three?<|im_end|>\n<|im_start|>assistant\n")
    assert fmt.end_of_turn_ids == [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]


def test_generation_prompt_ends_with_the_assistant_header(tok):
    fmt = ChatFormat(tok, "hf")
    ids = fmt.generation_prompt(CONV[:2])
    assert ids == tok.apply_chat_template(CONV[:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids).endswith("two plus two?<|im_end|>\n<|im_start|>assistant\n")


def test_nemotron_h_aligned_megatron_default(tok):
    fmt = ChatFormat(tok, "nemotron-h-aligned")
    tokens, target = fmt.tokenize_conversation(CONV, return_target=True, add_generation_prompt=False)
    assert tok.decode(tokens) == ("<SPECIAL_10>System\nBe brief.\n<SPECIAL_11>User\nWhat is two plus two?\n"
                                  "<SPECIAL_11>Assistant\nFour.\n<SPECIAL_11>User\nAnd three?\n"
                                  "<SPECIAL_11>Assistant\nSix, no: five.\n")
    assert tok.decode(target[target != IGNORE_INDEX]) == "Four.\nSix, no: five.\n"
    assert fmt.pad == tok.convert_tokens_to_ids("<SPECIAL_233>")
    assert fmt.end_of_turn_ids == [tok.eos_token_id]


def test_prefix_length_formats_mask_the_assistant_header_tokens(tok):
    fmt = ChatFormat(tok, "nemotron-nano-v2")
    tokens, target = fmt.tokenize_conversation(CONV, return_target=True, add_generation_prompt=False)
    header = tok.encode("<SPECIAL_11>Assistant\n")
    ids = tokens.tolist()
    first = next(i for i in range(len(ids)) if ids[i:i + len(header)] == header)  # the first assistant header
    assert target[first:first + 3].tolist() == [IGNORE_INDEX] * 3 and target[first + 3] == tokens[first + 3]
    assert fmt.end_of_turn_ids == [tok.convert_tokens_to_ids("<SPECIAL_12>"), tok.eos_token_id]
    assert np.array_equal(tokens, tok.apply_chat_template(CONV, tokenize=True, return_dict=False,
                                                          chat_template=fmt.template))


def test_mistral_drops_the_system_turn_and_keeps_one_bos(tok):
    fmt = ChatFormat(tok, "mistral")
    tokens, mask = fmt.render(CONV)
    assert tok.decode(tokens).startswith("<|endoftext|>[INST] What is two plus two?[/INST] Four.<|endoftext|>")
    assert _targets_text(tok, fmt) == " Four.<|endoftext|> Six, no: five.<|endoftext|>"


@pytest.mark.parametrize("conv, words", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], "message 1 (assistant) is empty"),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}], "message 1 has role 'bot'"),
    ([{"content": "hi"}], "message 0 must be an object with 'role' and 'content'"),
    ([], "non-empty list"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}], "must follow a user message"),
])
def test_bad_conversations_are_one_line(tok, conv, words):
    with pytest.raises(ConversationError, match=re.escape(words)) as err:
        ChatFormat(tok, "nemotron-h-aligned").render(conv)
    assert "\n" not in str(err.value)


def test_refused_and_unknown_formats_are_one_line(tok):
    with pytest.raises(ArgumentError, match="nvlm-yi-34b: a vision-language format"):
        check_prompt_format("nvlm-yi-34b")
    with pytest.raises(ArgumentError, match="not one of Megatron's prompt formats; choose one of nemotron-h-aligned"):
        ChatFormat(tok, "vicuna")
    tok_no_template = transformers.AutoTokenizer.from_pretrained(tok.name_or_path)
    tok_no_template.chat_template = None
    with pytest.raises(ArgumentError, match="the tokenizer has no chat_template"):
        ChatFormat(tok_no_template, "hf")


def test_a_tokenizer_without_chat_support_is_one_line(shared_data):
    owt = shared_data / "openwebtext-1000"
    gpt2 = GPT2BPETokenizer(str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt"))
    with pytest.raises(ArgumentError, match="chat formats need a Hugging Face tokenizer .* not GPT2BPETokenizer"):
        chat_format_for(gpt2, "hf")


def test_from_our_huggingface_tokenizer_wrapper(tok):
    ours = HuggingFaceTokenizer(tok.name_or_path)
    fmt = chat_format_for(ours, "hf")
    assert fmt.render(CONV) == ChatFormat(tok, "hf").render(CONV)
    assert fmt.eod == ours.eod


def test_hf_export_of_an_sft_tokenizer_carries_its_prompt_format_as_chat_template(tok, tmp_path):
    args = argparse.Namespace(tokenizer_type="SFTTokenizer", tokenizer_model=tok.name_or_path,
                              sft_tokenizer_prompt_format="nemotron-h-aligned")
    record = SavedRunArgs.from_args(args).tokenizer_dict()
    assert record["sft_tokenizer_prompt_format"] == "nemotron-h-aligned"
    export_tokenizer(record, str(tmp_path))
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    fmt = ChatFormat(tok, "nemotron-h-aligned")
    assert exported.chat_template == fmt.template
    assert ChatFormat(exported, "hf").generation_prompt(CONV[:2]) == fmt.generation_prompt(CONV[:2])

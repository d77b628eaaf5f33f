"""`pretrain_gpt.py --sft` (issue #39): a tiny HF Llama converted with ``convert.py --loader hf`` is finetuned with
--finetune on the shipped chat sample (examples/data/chat_sample.jsonl, the tokenizer's chat_template); the first
iteration's loss equals HF LlamaForCausalLM's with labels=-100 on the non-assistant tokens, run on each packed
conversation separately (1e-6); a resume from iteration 2 repeats iterations 3-4 bit for bit; the HF export carries
the tokenizer's chat_template."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert, parse_args
from megatron.data.sft_dataset import SFTBuilder, check_sft_flags
from megatron.errors import ArgumentError
from megatron.tokenizer.chat_format import IGNORE_INDEX, ChatFormat
from tests.dist_utils import run_distributed
from tests.tokenizer.chat_files import CHATML, write_chat_tokenizer
from tests.training._workers import checkpoint_at, run_pretrain

transformers = pytest.importorskip("transformers")
SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "chat_sample.jsonl"
SEQ = 96


def _hf_llama(folder: Path, shared_data: Path) -> None:
    write_chat_tokenizer(folder, shared_data)
    config = transformers.LlamaConfig(vocab_size=5120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                                      eos_token_id=4999, pad_token_id=None)  # 5120: no vocabulary padding
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))


def _hf_loss(model, sample: dict) -> float:
    """Megatron's micro-batch loss of one packed row from HF: each conversation (cu_seqlens span) run alone with
    labels -100 where the row's loss mask is 0; token losses summed over spans, divided by the mask's sum."""
    total, count = 0.0, 0
    cu = sample["cu_seqlens"].tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        ids = sample["tokens"][a:b]
        labels = torch.where(sample["loss_mask"][a:b - 1] > 0, sample["labels"][a:b - 1], IGNORE_INDEX)
        n = int((labels != IGNORE_INDEX).sum())
        if n:
            with torch.no_grad():
                loss = model(input_ids=ids[None], labels=torch.cat([torch.tensor([IGNORE_INDEX]), labels])[None]).loss
            total, count = total + float(loss.double()) * n, count + n
    assert count == int(sample["loss_mask"].sum())
    return total / count


def test_sft_finetunes_from_hf_matches_hf_loss_resumes_exactly_and_exports_the_template(shared_data: Path,
                                                                                         tmp_path: Path) -> None:
    hf_dir, meg, trained, back = (tmp_path / n for n in ("hf", "meg", "trained", "back"))
    _hf_llama(hf_dir, shared_data)
    convert(parse_args(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir", str(hf_dir),
                        "--save-dir", str(meg)]))
    flags = ["--sft", "--sft-tokenizer-prompt-format", "hf", "--data-path", str(SAMPLE), "--split", "100,0,0",
             "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
             "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--log-interval", "1",
             "--eval-iters", "0", "--num-workers", "0", "--seed", "7", "--save", str(trained),
             "--save-interval", "2", "--use-checkpoint-args", "--hidden-dropout", "0", "--attention-dropout", "0"]
    (first,) = run_distributed(run_pretrain, 1, args=([*flags, "--load", str(meg), "--finetune"],))
    assert first["error"] is None, first["error"]
    losses = first["result"]["train_losses"]

    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    dataset = SFTBuilder(ChatFormat(tok, "hf"), SEQ).build([8, 0, 0], [str(SAMPLE)], "100,0,0")[0]
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).float().eval()
    expected = (_hf_loss(hf, dataset[0]) + _hf_loss(hf, dataset[1])) / 2  # two micro-batches of one row
    assert losses[1]["lm loss"] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert len(dataset[0]["cu_seqlens"]) > 2  # the first row packs two conversations

    (resumed,) = run_distributed(run_pretrain, 1, args=([*flags, "--load", str(checkpoint_at(trained, 2, tmp_path)),
                                                         "--save", str(tmp_path / "again")],))
    assert resumed["error"] is None, resumed["error"]
    assert [resumed["result"]["train_losses"][i]["lm loss"] for i in (3, 4)] == [losses[i]["lm loss"] for i in (3, 4)]

    convert(parse_args(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir", str(trained),
                        "--save-dir", str(back)]))
    exported = transformers.AutoTokenizer.from_pretrained(str(back))
    assert exported.chat_template == CHATML
    conv = [{"role": "user", "content": "What is 2 plus 3?"}]
    assert ChatFormat(exported, "hf").generation_prompt(conv) == ChatFormat(tok, "hf").generation_prompt(conv)


def test_sft_refuses_flags_megatron_refuses() -> None:
    with pytest.raises(ArgumentError, match="--micro-batch-size must be 1"):
        check_sft_flags(2, False, False)
    with pytest.raises(ArgumentError, match="drop --reset-position-ids"):
        check_sft_flags(1, True, False)
    with pytest.raises(ArgumentError, match="drop --eod-mask-loss"):
        check_sft_flags(1, False, False, True)
    with pytest.raises(ArgumentError, match="GPTModelPipe"):
        check_sft_flags(1, False, False, False, deepspeed_pipeline=True)
    assert check_sft_flags(1, False, False, False) is None

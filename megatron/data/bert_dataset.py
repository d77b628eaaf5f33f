"""Megatron's BERT pretraining dataset on sentence-level `<prefix>_text_sentence.{bin,idx}` data.

Sample `idx` is built exactly as Megatron's `BertDataset` does, so the same files, split and seed give the same
samples token for token: row `(first, end, target)` of the samples mapping (dataset_utils.get_samples_mapping, with
targets `seq_length - 3`) selects sentences [first, end); one `np.random.RandomState((seed + idx) % 2**32)` then
draws, in this order: the A/B split point and the sentence-order swap (binary head only), the truncation sides,
and the masked-LM choices (whole-word n-grams up to 3 with p ~ 1/n, 80% [MASK] / 10% kept / 10% random id).
Output (int64 numpy): text, types, labels (-1 where not masked), is_random (1 = segments swapped), loss_mask,
padding_mask, truncated.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from megatron.data.dataset_builder import build_train_valid_test_splits, documents_view
from megatron.data.dataset_utils import (
    DatasetError,
    check_no_empty_sentences,
    check_sentence_pairs,
    create_masked_lm_predictions,
    create_tokens_and_tokentypes,
    get_a_and_b_segments,
    get_samples_mapping,
    tokenizer_special_ids,
    truncate_segments,
)

try:
    from torch.utils.data import Dataset as _TorchDataset
except ImportError:  # pragma: no cover
    _TorchDataset = object


class BertDataset(_TorchDataset):
    """One split of BERT samples; `indexed_dataset.doc_idx` lists the split's documents while this is built."""

    def __init__(self, name: str, indexed_dataset: Any, data_prefix: str, num_epochs: Optional[int],
                 max_num_samples: Optional[int], masked_lm_prob: float, max_seq_length: int, short_seq_prob: float,
                 seed: int, binary_head: bool, *, tokenizer: Any, data_cache_path: Optional[str] = None,
                 group: Any = None, synchronize: bool = True) -> None:
        check_masking_args(max_seq_length, 3, masked_lm_prob, short_seq_prob, seed)
        self.name = name
        self.seed = seed
        self.masked_lm_prob = masked_lm_prob
        self.max_seq_length = max_seq_length
        self.binary_head = binary_head
        self.indexed_dataset = indexed_dataset
        self.vocab_id_list = list(tokenizer.inv_vocab.keys())
        self.vocab_id_to_token_dict = tokenizer.inv_vocab
        self.cls_id, self.sep_id, self.mask_id, self.pad_id = tokenizer_special_ids(
            tokenizer, ("cls", "sep", "mask", "pad"), "BERT")
        if binary_head:
            check_sentence_pairs(indexed_dataset.doc_idx, data_prefix, name)
        check_no_empty_sentences(indexed_dataset, data_prefix, name)
        self.samples_mapping = get_samples_mapping(indexed_dataset, data_prefix, num_epochs, max_num_samples,
                                                   max_seq_length - 3,  # [CLS], [SEP], [SEP]
                                                   short_seq_prob, seed, name, binary_head,
                                                   data_cache_path=data_cache_path, group=group,
                                                   synchronize=synchronize)

    def __len__(self) -> int:
        return self.samples_mapping.shape[0]

    def __getitem__(self, idx: int) -> dict:
        start, end, target = (int(v) for v in self.samples_mapping[idx])
        sample = [self.indexed_dataset[i].tolist() for i in range(start, end)]
        # numpy's RandomState, not Python's random: randint's upper bound is exclusive
        np_rng = np.random.RandomState(seed=(self.seed + idx) % 2**32)
        return build_training_sample(sample, target, self.max_seq_length, self.vocab_id_list,
                                     self.vocab_id_to_token_dict, self.cls_id, self.sep_id, self.mask_id,
                                     self.pad_id, self.masked_lm_prob, np_rng, self.binary_head)


def check_masking_args(max_seq_length: int, added_tokens: int, masked_lm_prob: float, short_seq_prob: float,
                       seed: int) -> None:
    if max_seq_length - added_tokens < 2:
        raise DatasetError(f"--seq-length {max_seq_length} is too short: samples hold seq_length - {added_tokens} "
                           "tokens of text and need at least 2")
    if not 0.0 <= masked_lm_prob <= 1.0:
        raise DatasetError(f"--mask-prob must be in [0, 1], got {masked_lm_prob}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise DatasetError(f"--short-seq-prob must be in [0, 1], got {short_seq_prob}")
    if seed < 0:
        raise DatasetError(f"--seed must be non-negative for BERT/T5 data, got {seed}")


def build_training_sample(sample: Sequence[Sequence[int]], target_seq_length: int, max_seq_length: int,
                          vocab_id_list: Sequence[int], vocab_id_to_token_dict: dict, cls_id: int, sep_id: int,
                          mask_id: int, pad_id: int, masked_lm_prob: float, np_rng: np.random.RandomState,
                          binary_head: bool) -> dict:
    """One BERT sample from its sentences (Megatron's build_training_sample; see the module docstring)."""
    if binary_head:
        assert len(sample) > 1, "the binary head needs at least two sentences per sample"
    assert target_seq_length <= max_seq_length
    if binary_head:
        tokens_a, tokens_b, is_next_random = get_a_and_b_segments(sample, np_rng)
    else:
        tokens_a = [t for sentence in sample for t in sentence]
        tokens_b, is_next_random = [], False
    max_num_tokens = target_seq_length
    truncated = truncate_segments(tokens_a, tokens_b, len(tokens_a), len(tokens_b), max_num_tokens, np_rng)
    tokens, tokentypes = create_tokens_and_tokentypes(tokens_a, tokens_b, cls_id, sep_id)
    max_predictions_per_seq = masked_lm_prob * max_num_tokens
    tokens, masked_positions, masked_labels, _, _ = create_masked_lm_predictions(
        tokens, vocab_id_list, vocab_id_to_token_dict, masked_lm_prob, cls_id, sep_id, mask_id,
        max_predictions_per_seq, np_rng)
    text, types, labels, padding_mask, loss_mask = pad_and_convert_to_numpy(
        tokens, tokentypes, masked_positions, masked_labels, pad_id, max_seq_length)
    return {"text": text, "types": types, "labels": labels, "is_random": int(is_next_random),
            "loss_mask": loss_mask, "padding_mask": padding_mask, "truncated": int(truncated)}


def pad_and_convert_to_numpy(tokens: list, tokentypes: list, masked_positions: list, masked_labels: list,
                             pad_id: int, max_seq_length: int) -> tuple:
    """Pad text and types with pad_id to max_seq_length; labels -1 and loss_mask 0 except at masked positions."""
    num_tokens = len(tokens)
    padding_length = max_seq_length - num_tokens
    assert padding_length >= 0 and len(tokentypes) == num_tokens and len(masked_positions) == len(masked_labels)
    filler = [pad_id] * padding_length
    text = np.array(tokens + filler, dtype=np.int64)
    types = np.array(tokentypes + filler, dtype=np.int64)
    padding_mask = np.zeros(max_seq_length, dtype=np.int64)
    padding_mask[:num_tokens] = 1
    labels = np.full(max_seq_length, -1, dtype=np.int64)
    loss_mask = np.zeros(max_seq_length, dtype=np.int64)
    if masked_positions:
        labels[masked_positions] = masked_labels
        loss_mask[masked_positions] = 1
    return text, types, labels, padding_mask, loss_mask


def build_train_valid_test_datasets(data_prefix: Optional[Sequence[Any]], data_impl: str, splits_string: str,
                                    train_valid_test_num_samples: Sequence[int], max_seq_length: int,
                                    masked_lm_prob: float, short_seq_prob: float, seed: int, skip_warmup: bool,
                                    binary_head: bool = True, *, tokenizer: Any,
                                    data_cache_path: Optional[str] = None,
                                    train_data_prefix: Optional[Sequence[Any]] = None,
                                    valid_data_prefix: Optional[Sequence[Any]] = None,
                                    test_data_prefix: Optional[Sequence[Any]] = None,
                                    group: Any = None, synchronize: bool = True) -> tuple:
    """(train, valid, test) BertDatasets (or blends of them), each None when empty; `--split` over documents.

    A split asked for 0 samples is None (Megatron would refuse to build its mapping).
    """

    def build_split(name: str, prefix: str, indexed: Any, documents: tuple, num_samples: int, _splits: str):
        if num_samples == 0:
            return None
        with documents_view(indexed, documents):
            return BertDataset(name, indexed, prefix, None, num_samples, masked_lm_prob, max_seq_length,
                               short_seq_prob, seed, binary_head, tokenizer=tokenizer,
                               data_cache_path=data_cache_path, group=group, synchronize=synchronize)

    return build_train_valid_test_splits(data_prefix, data_impl, splits_string, train_valid_test_num_samples,
                                         skip_warmup, build_split, split_documents=True,
                                         train_data_prefix=train_data_prefix, valid_data_prefix=valid_data_prefix,
                                         test_data_prefix=test_data_prefix)

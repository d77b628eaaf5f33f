"""Megatron's T5 span-corruption dataset on sentence-level (or document-level) `.bin/.idx` data.

Sample `idx` as Megatron's `T5Dataset` builds it: row `(first, end, target)` of the samples mapping (targets
`seq_length - 2`, one sentence per sample allowed); the sentences are concatenated and cut to `target`; one
`np.random.RandomState(seed + idx)` picks whole-word spans of length min(Geometric(0.2), 10) covering ~`--mask-prob`
of the tokens; each span is replaced in the encoder input by one sentinel `<extra_id_i>` (from `--vocab-extra-ids`,
ascending ids, in order), and the decoder gets `dec_in = [bos] + sentinel/span pairs`, `dec_out = sentinel/span
pairs + [eos]`. Output (int64 numpy): text_enc, text_dec, labels (-1 on padding), loss_mask, truncated, and the
encoder, decoder (causal) and encoder-decoder attention masks (1 = attend).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from megatron.data.bert_dataset import check_masking_args
from megatron.data.dataset_builder import build_train_valid_test_splits, documents_view
from megatron.data.dataset_utils import (
    DatasetError,
    create_masked_lm_predictions,
    get_samples_mapping,
    tokenizer_special_ids,
)

try:
    from torch.utils.data import Dataset as _TorchDataset
except ImportError:  # pragma: no cover
    _TorchDataset = object


class T5Dataset(_TorchDataset):
    """One split of T5 samples; `indexed_dataset.doc_idx` lists the split's documents while this is built."""

    def __init__(self, name: str, indexed_dataset: Any, data_prefix: str, num_epochs: Optional[int],
                 max_num_samples: Optional[int], masked_lm_prob: float, max_seq_length: int,
                 max_seq_length_dec: int, short_seq_prob: float, seed: int, *, tokenizer: Any,
                 data_cache_path: Optional[str] = None, group: Any = None, synchronize: bool = True) -> None:
        check_masking_args(max_seq_length, 2, masked_lm_prob, short_seq_prob, seed)
        if max_seq_length_dec is None or max_seq_length_dec < 2:
            raise DatasetError(f"--decoder-seq-length must be at least 2 for T5, got {max_seq_length_dec}")
        self.name = name
        self.seed = seed
        self.masked_lm_prob = masked_lm_prob
        self.max_seq_length = max_seq_length
        self.max_seq_length_dec = max_seq_length_dec
        self.indexed_dataset = indexed_dataset
        self.sentinel_tokens = list(tokenizer.additional_special_tokens_ids or [])
        if not self.sentinel_tokens:
            raise DatasetError(f"the {getattr(tokenizer, 'name', 'chosen')} tokenizer has no sentinel tokens for T5's "
                               "span corruption; pass --vocab-extra-ids 100")
        self.vocab_id_list = list(tokenizer.inv_vocab.keys())
        self.vocab_id_to_token_dict = tokenizer.inv_vocab
        self.cls_id = _special_or_none(tokenizer, "cls")
        self.sep_id = _special_or_none(tokenizer, "sep")
        self.mask_id = _special_or_none(tokenizer, "mask")
        self.pad_id, self.bos_id, self.eos_id = tokenizer_special_ids(tokenizer, ("pad", "bos", "eos"), "T5")
        check_t5_documents(indexed_dataset, data_prefix, name)
        self.samples_mapping = get_samples_mapping(indexed_dataset, data_prefix, num_epochs, max_num_samples,
                                                   max_seq_length - 2,  # as Megatron (room for bos/eos)
                                                   short_seq_prob, seed, name, False,
                                                   data_cache_path=data_cache_path, group=group,
                                                   synchronize=synchronize)
        if self.samples_mapping.shape[0] == 0:
            raise DatasetError(f"{data_prefix} ({name} split): no T5 sample can be built from its "
                               f"{len(indexed_dataset.doc_idx) - 1} document(s); use more data or another --split")

    def __len__(self) -> int:
        return self.samples_mapping.shape[0]

    def __getitem__(self, idx: int) -> dict:
        start, end, target = (int(v) for v in self.samples_mapping[idx])
        sample = [self.indexed_dataset[i].tolist() for i in range(start, end)]
        np_rng = np.random.RandomState(seed=self.seed + idx)  # no % 2**32 here, as Megatron's T5
        try:
            return build_training_sample(sample, target, self.max_seq_length, self.max_seq_length_dec,
                                         self.vocab_id_list, self.vocab_id_to_token_dict, self.cls_id, self.sep_id,
                                         self.mask_id, self.pad_id, self.masked_lm_prob, np_rng, self.bos_id,
                                         self.eos_id, self.sentinel_tokens)
        except DatasetError as exc:
            raise DatasetError(f"{self.name} sample {idx}: {exc}") from None


def check_t5_documents(indexed_dataset: Any, data_prefix: str, name: str) -> None:
    """The split's documents must hold tokens: documents made only of zero-length sentences would become empty
    samples (all padding) that T5 trains on silently. All such: one-line DatasetError; some: one warning line."""
    doc_idx = np.asarray(indexed_dataset.doc_idx, dtype=np.int64)
    if len(doc_idx) < 2 or doc_idx[-1] <= doc_idx[0]:
        raise DatasetError(f"{data_prefix} ({name} split): no sentences in its documents: no T5 sample can be built; "
                           "use more data or another --split")
    sizes = np.asarray(indexed_dataset.sizes, dtype=np.int64)[doc_idx[0]:doc_idx[-1]]
    starts = doc_idx[:-1] - doc_idx[0]
    nonempty = doc_idx[1:] > doc_idx[:-1]  # documents without sentences are skipped by the mapping itself
    per_doc = np.add.reduceat(np.append(sizes, 0), starts)[nonempty]
    empty = int((per_doc == 0).sum())
    if empty == len(per_doc):
        raise DatasetError(f"{data_prefix} ({name} split): all {empty} document(s) hold only zero-length sentences: "
                           "no T5 sample can be built; check the --json-keys field used by preprocessing")
    if empty:
        print(f" > WARNING: {data_prefix} ({name} split): {empty} of {len(per_doc)} documents hold only "
              "zero-length sentences; their samples are empty", flush=True)


def _special_or_none(tokenizer: Any, attr: str) -> Optional[int]:
    """cls/sep/mask id, or None for tokenizers without one (T5 only needs them to skip them when masking)."""
    try:
        return getattr(tokenizer, attr)
    except (AttributeError, NotImplementedError):
        return None


def build_training_sample(sample: Sequence[Sequence[int]], target_seq_length: int, max_seq_length: int,
                          max_seq_length_dec: int, vocab_id_list: Sequence[int], vocab_id_to_token_dict: dict,
                          cls_id: Optional[int], sep_id: Optional[int], mask_id: Optional[int], pad_id: int,
                          masked_lm_prob: float, np_rng: np.random.RandomState, bos_id: int, eos_id: int,
                          sentinel_tokens: Sequence[int]) -> dict:
    """One T5 sample from its sentences (Megatron's t5_dataset.build_training_sample)."""
    assert target_seq_length <= max_seq_length
    tokens = [t for sentence in sample for t in sentence]
    max_num_tokens = target_seq_length
    truncated = len(tokens) > max_num_tokens
    tokens = tokens[:max_num_tokens]
    max_predictions_per_seq = masked_lm_prob * max_num_tokens
    tokens, masked_positions, masked_labels, _, masked_spans = create_masked_lm_predictions(
        tokens, vocab_id_list, vocab_id_to_token_dict, masked_lm_prob, cls_id, sep_id, mask_id,
        max_predictions_per_seq, np_rng, max_ngrams=10, geometric_dist=True, masking_style="t5")
    out = pad_and_convert_to_numpy(tokens, masked_positions, masked_labels, pad_id, max_seq_length,
                                   max_seq_length_dec, masked_spans, bos_id, eos_id, sentinel_tokens)
    text_enc, text_dec, labels, enc_mask, dec_mask, enc_dec_mask, loss_mask = out
    return {"text_enc": text_enc, "text_dec": text_dec, "labels": labels, "loss_mask": loss_mask,
            "truncated": int(truncated), "enc_mask": enc_mask, "dec_mask": dec_mask, "enc_dec_mask": enc_dec_mask}


def pad_and_convert_to_numpy(tokens: list, masked_positions: list, masked_labels: list, pad_id: int,
                             max_seq_length: int, max_seq_length_dec: int, masked_spans: list, bos_id: int,
                             eos_id: int, sentinel_tokens: Sequence[int]) -> tuple:
    """Encoder input with one sentinel per span, decoder input/output, padding and the three attention masks."""
    if len(masked_spans) > len(sentinel_tokens):
        raise DatasetError(f"{len(masked_spans)} masked spans but only {len(sentinel_tokens)} sentinel tokens; "
                           "raise --vocab-extra-ids (Megatron's T5 uses 100)")
    enc: list = []
    dec_in: list = [bos_id]
    dec_out: list = []
    start = 0
    for sentinel, span in zip(sentinel_tokens, masked_spans):
        dec_in.append(sentinel)
        dec_in.extend(span.label)
        dec_out.append(sentinel)
        dec_out.extend(span.label)
        enc.extend(tokens[start:span.index[0]])
        enc.append(sentinel)
        start = span.index[-1] + 1
    dec_out.append(eos_id)
    enc.extend(tokens[start:])

    num_tokens = len(enc)
    padding_length = max_seq_length - num_tokens
    assert padding_length >= 0 and len(masked_positions) == len(masked_labels)
    num_tokens_dec = len(dec_in)
    padding_length_dec = max_seq_length_dec - num_tokens_dec
    if padding_length_dec < 0:
        raise DatasetError(f"the decoder needs {num_tokens_dec} tokens for this sample's {len(masked_spans)} spans "
                           f"but --decoder-seq-length is {max_seq_length_dec}; raise --decoder-seq-length")
    text_enc = np.array(enc + [pad_id] * padding_length, dtype=np.int64)
    text_dec = np.array(dec_in + [pad_id] * padding_length_dec, dtype=np.int64)
    # Megatron tests `>= 1`, i.e. the same with pad id 0 (BERT and T5 vocabularies)
    enc_valid = (text_enc != pad_id).astype(np.int64)
    dec_valid = (text_dec != pad_id).astype(np.int64)
    enc_mask = np.outer(enc_valid, enc_valid)
    enc_dec_mask = np.outer(dec_valid, enc_valid)
    dec_mask = np.tril(np.outer(dec_valid, dec_valid))  # causal: position i sees j <= i
    labels = np.array(dec_out + [-1] * padding_length_dec, dtype=np.int64)
    loss_mask = np.array([1] * num_tokens_dec + [0] * padding_length_dec, dtype=np.int64)
    return text_enc, text_dec, labels, enc_mask, dec_mask, enc_dec_mask, loss_mask


def build_train_valid_test_datasets(data_prefix: Optional[Sequence[Any]], data_impl: str, splits_string: str,
                                    train_valid_test_num_samples: Sequence[int], max_seq_length: int,
                                    max_seq_length_dec: int, masked_lm_prob: float, short_seq_prob: float,
                                    seed: int, skip_warmup: bool, *, tokenizer: Any,
                                    data_cache_path: Optional[str] = None,
                                    train_data_prefix: Optional[Sequence[Any]] = None,
                                    valid_data_prefix: Optional[Sequence[Any]] = None,
                                    test_data_prefix: Optional[Sequence[Any]] = None,
                                    group: Any = None, synchronize: bool = True) -> tuple:
    """(train, valid, test) T5Datasets (or blends of them), each None when empty; `--split` over documents."""

    def build_split(name: str, prefix: str, indexed: Any, documents: tuple, num_samples: int, _splits: str):
        if num_samples == 0:
            return None
        with documents_view(indexed, documents):
            return T5Dataset(name, indexed, prefix, None, num_samples, masked_lm_prob, max_seq_length,
                             max_seq_length_dec, short_seq_prob, seed, tokenizer=tokenizer,
                             data_cache_path=data_cache_path, group=group, synchronize=synchronize)

    return build_train_valid_test_splits(data_prefix, data_impl, splits_string, train_valid_test_num_samples,
                                         skip_warmup, build_split, split_documents=True,
                                         train_data_prefix=train_data_prefix, valid_data_prefix=valid_data_prefix,
                                         test_data_prefix=test_data_prefix)

"""Slow, literal re-implementation of Megatron 23.06's BERT and T5 sample builders for the dataset tests.

Written from the documented algorithm (megatron-facts-wave2 §1.2 and §2.1) in Megatron's own shape: the n-gram
candidate lists are materialised and shuffled as nested lists, spans are joined with `sum(..., [])`, every random
draw is made in the documented order. The library's code shares none of it, so equal samples mean both follow the
same draws.
"""
from __future__ import annotations

import collections

import numpy as np

Masked = collections.namedtuple("Masked", ["index", "label"])


def masked_lm(tokens, vocab_ids, inv_vocab, prob, cls_id, sep_id, mask_id, max_predictions, rng, max_ngrams=3,
              geometric=False, style="bert"):
    cand = []
    for i, tok in enumerate(tokens):
        if tok == cls_id or tok == sep_id:
            continue
        if cand and inv_vocab[tok].startswith("##"):
            cand[-1].append(i)
        else:
            cand.append([i])
    output = list(tokens)
    if prob == 0:
        return output, [], [], []
    num_to_predict = min(max_predictions, max(1, int(round(len(tokens) * prob))))
    ngrams = np.arange(1, max_ngrams + 1, dtype=np.int64)
    pvals = 1.0 / np.arange(1, max_ngrams + 1)
    pvals /= pvals.sum(keepdims=True)
    ngram_indexes = [[cand[i:i + n] for n in ngrams] for i in range(len(cand))]
    rng.shuffle(ngram_indexes)
    lms, spans, covered = [], [], set()
    for entry in ngram_indexes:
        if len(lms) >= num_to_predict:
            break
        if not entry:
            continue
        k = len(entry)
        if not geometric:
            n = rng.choice(ngrams[:k], p=pvals[:k] / pvals[:k].sum(keepdims=True))
        else:
            n = min(rng.geometric(0.2), max_ngrams)
        index_set = sum(entry[n - 1], [])
        n -= 1
        while len(lms) + len(index_set) > num_to_predict:
            if n == 0:
                break
            index_set = sum(entry[n - 1], [])
            n -= 1
        if len(lms) + len(index_set) > num_to_predict:
            continue
        if any(i in covered for i in index_set):
            continue
        for i in index_set:
            covered.add(i)
            if style == "bert":
                if rng.random() < 0.8:
                    new = mask_id
                elif rng.random() < 0.5:
                    new = tokens[i]
                else:
                    new = vocab_ids[rng.randint(0, len(vocab_ids))]
            else:
                new = mask_id
            output[i] = new
            lms.append(Masked(i, tokens[i]))
        spans.append(Masked(index_set, [tokens[i] for i in index_set]))
    rng.shuffle(ngram_indexes)
    lms = sorted(lms, key=lambda m: m.index)
    spans = sorted(spans, key=lambda m: m.index[0])
    return output, [m.index for m in lms], [m.label for m in lms], spans


def bert_sample(sentences, target, max_seq_length, vocab_ids, inv_vocab, cls_id, sep_id, mask_id, pad_id, prob,
                seed, idx, binary_head):
    rng = np.random.RandomState((seed + idx) % 2**32)
    if binary_head:
        n = len(sentences)
        a_end = rng.randint(1, n) if n >= 3 else 1
        a = [t for s in sentences[:a_end] for t in s]
        b = [t for s in sentences[a_end:] for t in s]
        swapped = rng.random() < 0.5
        if swapped:
            a, b = b, a
    else:
        a, b, swapped = [t for s in sentences for t in s], [], False
    truncated = len(a) + len(b) > target
    while len(a) + len(b) > target:
        seg = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del seg[0]
        else:
            seg.pop()
    tokens = [cls_id] + a + [sep_id] + (b + [sep_id] if b else [])
    types = [0] * (len(a) + 2) + ([1] * (len(b) + 1) if b else [])
    tokens, positions, labels, _ = masked_lm(tokens, vocab_ids, inv_vocab, prob, cls_id, sep_id, mask_id,
                                             prob * target, rng)
    pad = max_seq_length - len(tokens)
    lab = [-1] * max_seq_length
    loss = [0] * max_seq_length
    for p, lbl in zip(positions, labels):
        lab[p] = lbl
        loss[p] = 1
    return {"text": tokens + [pad_id] * pad, "types": types + [pad_id] * pad, "labels": lab,
            "is_random": int(swapped), "loss_mask": loss, "padding_mask": [1] * len(tokens) + [0] * pad,
            "truncated": int(truncated)}


def t5_sample(sentences, target, max_seq_length, max_seq_length_dec, vocab_ids, inv_vocab, cls_id, sep_id, mask_id,
              pad_id, prob, seed, idx, bos_id, eos_id, sentinels):
    rng = np.random.RandomState(seed + idx)
    tokens = [t for s in sentences for t in s]
    truncated = len(tokens) > target
    tokens = tokens[:target]
    tokens, _, _, spans = masked_lm(tokens, vocab_ids, inv_vocab, prob, cls_id, sep_id, mask_id, prob * target,
                                    rng, max_ngrams=10, geometric=True, style="t5")
    queue = collections.deque(sentinels)
    enc, dec_in, dec_out, start = [], [bos_id], [], 0
    for span in spans:
        flag = queue.popleft()
        dec_in += [flag] + span.label
        dec_out += [flag] + span.label
        enc += tokens[start:span.index[0]] + [flag]
        start = span.index[-1] + 1
    dec_out.append(eos_id)
    enc += tokens[start:]
    enc_arr = np.array(enc + [pad_id] * (max_seq_length - len(enc)))
    dec_arr = np.array(dec_in + [pad_id] * (max_seq_length_dec - len(dec_in)))
    causal = np.arange(max_seq_length_dec)[None, :] <= np.arange(max_seq_length_dec)[:, None]
    return {"text_enc": enc_arr.tolist(), "text_dec": dec_arr.tolist(),
            "labels": dec_out + [-1] * (max_seq_length_dec - len(dec_in)),
            "loss_mask": [1] * len(dec_in) + [0] * (max_seq_length_dec - len(dec_in)),
            "truncated": int(truncated),
            "enc_mask": ((enc_arr[None, :] >= 1) * (enc_arr[:, None] >= 1)).astype(np.int64).tolist(),
            "dec_mask": ((dec_arr[None, :] >= 1) * (dec_arr[:, None] >= 1) * causal).astype(np.int64).tolist(),
            "enc_dec_mask": ((enc_arr[None, :] >= 1) * (dec_arr[:, None] >= 1)).astype(np.int64).tolist()}

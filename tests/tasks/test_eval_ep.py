"""Evaluation of an MoE model under expert parallelism (EP=2 = DP=2): the ranks of one expert group exchange tokens
in every MoE layer, so they must run the same batches (ParallelState.forward_only_shard); before, each DP rank took
its own share of the examples and the two ranks' MoE collectives no longer matched (a hang). The zero-shot loss and
the lm-eval adapter's log-likelihoods and generations equal the single-process ones."""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron.core.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.models.gpt.model import GPTModel
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from tasks.zeroshot_gpt.evaluate import evaluate
from tests.dist_utils import run_distributed
from tests.text_generation.helpers import tiny_config
from tests.text_generation.test_generate_sp_moe import MOE, _ep_slice

pytest.importorskip("lm_eval")
from tasks.eval_harness.adapter import MegatronLM  # noqa: E402

SEQ = 16
ARGS = argparse.Namespace(micro_batch_size=1, num_workers=0, reset_position_ids=False, reset_attention_mask=False,
                          eod_mask_loss=False, distributed_backend="gloo")


class Req:
    """The part of lm-eval's Instance the adapter reads."""

    def __init__(self, *args):
        self.args = args


def _model(**extra) -> GPTModel:
    model_parallel_manual_seed(99, 0)
    return GPTModel(tiny_config(**MOE, padded_vocab_size=5120, **extra), parallel_output=False).eval()


def _dataset() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"text": torch.randint(0, 5000, (SEQ + 1,), generator=gen), "pad_mask": torch.ones(SEQ, dtype=torch.long)}
            for _ in range(5)]  # 5 examples: 3 and 2 per rank if split over DP


def _evaluate_all(model: torch.nn.Module, tokenizer: GPT2BPETokenizer, state: ParallelState) -> dict:
    lm = MegatronLM(model, tokenizer, max_length=48, batch_size=1, progress=False, state=state)
    contexts = ["The meaning of life is", "Hello", "In 1999 the company said that it would"]
    requests = [(None, tokenizer.tokenize(c), tokenizer.tokenize(" and more")) for c in contexts]
    gen_requests = [Req(c, {"until": ["\n"], "max_gen_toks": 5, "do_sample": False}) for c in contexts]
    return {"loss": evaluate(_dataset(), model, "loss", ARGS, tokenizer.eod, state, progress=False),
            "loglikelihood": lm._loglikelihood_tokens(requests),
            "generate": lm.generate_until(gen_requests)}


def _ep2_body(rank: int, world_size: int, full_state: dict, tokenizer: GPT2BPETokenizer) -> dict:
    state = initialize_model_parallel(expert_model_parallel_size=2)
    try:
        model = _model(expert_model_parallel_size=2)
        model.load_state_dict(_ep_slice(full_state, state.ep_rank, 2))
        return _evaluate_all(model, tokenizer, state)
    finally:
        destroy_model_parallel()


def test_ep2_evaluation_equals_single_process(shared_data) -> None:
    owt = shared_data / "openwebtext-1000"
    tokenizer = GPT2BPETokenizer(str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt"))
    model = _model()
    reference = _evaluate_all(model, tokenizer, ParallelState.single())
    for result in run_distributed(_ep2_body, world_size=2, args=(model.state_dict(), tokenizer)):
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert result["generate"] == reference["generate"]
        for (lp, greedy), (ref_lp, ref_greedy) in zip(result["loglikelihood"], reference["loglikelihood"]):
            assert lp == pytest.approx(ref_lp, abs=1e-5) and greedy == ref_greedy


def test_forward_only_shard_keeps_expert_groups_together() -> None:
    """(index, count): DP ranks of one expert group (EP, or expert-TP spanning DP ranks) share an index."""
    assert ParallelState(dp_rank=3, dp_size=4).forward_only_shard() == (3, 4)
    assert [ParallelState(dp_rank=d, dp_size=4, ep_size=2).forward_only_shard() for d in range(4)] == [
        (0, 2), (0, 2), (1, 2), (1, 2)]
    # TP 2 with expert-TP 1 and EP 2: an expert group is 2 stage ranks = one TP group = one DP rank
    assert [ParallelState(tp_size=2, dp_rank=d, dp_size=2, ep_size=2, etp_size=1).forward_only_shard()
            for d in range(2)] == [(0, 2), (1, 2)]
    # TP 1 with expert-TP 2: the expert-TP group spans 2 DP ranks
    assert [ParallelState(dp_rank=d, dp_size=4, etp_size=2).forward_only_shard() for d in range(4)] == [
        (0, 2), (0, 2), (1, 2), (1, 2)]

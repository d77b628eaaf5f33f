"""Checkpoints of today's Megatron-LM against megatron-core 0.16.1 itself (tests/mcore_oracle.py).

One oracle run (2 gloo processes, tests/tools/mcore_oracle_checkpoints.py) builds a tiny GPT, a tiny Llama and a tiny
Mixtral-like MoE (4 experts, top-2, gated shared expert) in Megatron Core (local layer spec), saves per-rank `torch`
files (Core names) and `torch_dist` folders at TP1, TP2 and PP2 (MoE: TP1, PP2 and EP2), and loads our torch_dist output into its own models. Here: every one of them loads with `--load` into our model
at another layout and gives Megatron Core's logits (<= 1e-5); ours saved as torch_dist gives the same logits in
Megatron Core; BERT and T5 too (T5 also into our pipeline stages, and saved from our PP2 run); convert.py reads both (`--loader mcore`; BERT and T5 too, and `--saver mcore` writes them); damaged or missing shards are one line naming the file.
Training state: Megatron Core's GPT with its DDP and distributed optimizer (DP2) trains 6 steps and saves a torch_dist
checkpoint with the optimizer state (its fully_reshardable and its default dp_reshardable layout) and Megatron-LM's
RNG state after step 3; ours loads it (another layout: one process, the regular optimizer, no --no-load-rng) and
steps 4-6 give Megatron Core's losses (1e-5); dp_reshardable states saved at TP2/PP2 read as the fully_reshardable
ones; ours trained on the same batches and saved with
`--ckpt-format torch_dist --async-save` (optimizer state included; written in the background while our steps 4-6
run) resumes in Megatron Core with our losses.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.layers import ModelType
from megatron.models.gpt.model import GPTModel
from tests.mcore_oracle import ORACLE_CPU_PRELUDE, run_oracle

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 32, 4, 128, 16
BASE = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--auto-detect-ckpt-format"]
FLAGS = {"gpt": ["--no-bias-gelu-fusion"],
         "llama": ["--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64", "--disable-bias-linear",
                   "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
                   "--untie-embeddings-and-output-weights"]}
FLAGS["qwen3"] = [*FLAGS["llama"], "--qk-layernorm", "--kv-channels", "12", "--window-size", "3,0",
                  "--window-attn-skip-freq", "2"]
FLAGS["bert"] = ["--no-bias-gelu-fusion"]
FLAGS["t5"] = ["--no-bias-gelu-fusion"]
FLAGS["moe"] = [*FLAGS["llama"], "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
                "--moe-shared-expert-intermediate-size", "40", "--moe-shared-expert-gate", "--moe-aux-loss-coeff", "0"]
FLAGS["moe_mixed"] = [*FLAGS["moe"], "--moe-layer-freq", "[1,0]"]
FLAGS["mtp_moe"] = [*FLAGS["moe"], "--moe-layer-freq", "[0,1]", "--mtp-num-layers", "1"]
FLAGS["deepseek"] = ["--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64", "--disable-bias-linear",
                     "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                     "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "24", "--kv-lora-rank", "16",
                     "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--rope-type", "rope",
                     "--num-experts", "4", "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size", "32",
                     "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2",
                     "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                     "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                     "--moe-router-topk-scaling-factor", "2.5", "--moe-aux-loss-coeff", "0", "--mtp-num-layers", "1",
                     "--mtp-loss-scaling-factor", "0.3"]
# what the oracle saved per family (MoE: TP1, PP2 and EP2) and the layouts at which it loaded ours
SAVED = {"gpt": ("torch_tp2", "torch_pp2", "dist_tp1", "dist_tp2", "dist_pp2"),
         "llama": ("torch_tp2", "torch_pp2", "dist_tp1", "dist_tp2", "dist_pp2"),
         "qwen3": ("torch_tp2", "torch_pp2", "dist_tp1", "dist_tp2", "dist_pp2"),
         "moe": ("torch_tp1", "torch_pp2", "torch_ep2", "dist_tp1", "dist_pp2", "dist_ep2")}
OURS_IN_CORE = {"gpt": ("ours_logits_tp1.pt", "ours_logits_tp2.pt"), "llama": ("ours_logits_tp1.pt",
                "ours_logits_tp2.pt"), "qwen3": ("ours_logits_tp1.pt", "ours_logits_tp2.pt"), "moe": ("ours_logits_tp1.pt",), "moe_mixed": ("ours_logits_tp1.pt",)}
TOL = dict(rtol=1e-5, atol=1e-5)


def tokens():
    g = torch.Generator().manual_seed(7)  # the oracle script's tokens
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return ids, pos, mask


def run_args(family: str, load: Path, *extra: str):
    args = parse_args(args=[*BASE, *FLAGS[family], "--load", str(load), *extra])
    args.rank = 1  # quiet argument dump
    validate_args(args, {"model_family": family} if family == "t5" else {})  # T5 flags: pretrain_t5.py's defaults
    args.padded_vocab_size = VOCAB
    # recorded as pretrain_*.py's get_model records it (our enum; the torch_dist writer stores Megatron Core's, which
    # megatron-core's weights-only load of common.pt in the oracle needs)
    args.model_type = ModelType.encoder_and_decoder if family == "t5" else ModelType.encoder_or_decoder
    return args


def our_model(args, state=None, **kw) -> GPTModel:
    config = core_transformer_config_from_args(args)
    return GPTModel(config, pp_state=state, parallel_output=False, **kw)


def load_logits(family: str, load: Path, *extra: str) -> torch.Tensor:
    """Our TP1 model loaded from `load` (single process), its logits on the oracle's tokens."""
    from megatron.compat import load_checkpoint

    args = run_args(family, load, "--finetune", *extra)
    model = our_model(args)
    assert load_checkpoint([model], None, None, args) == 0
    with torch.no_grad():
        return model(*tokens())


def our_bert(args):
    from megatron.models.bert.model import BertModel

    return BertModel(core_transformer_config_from_args(args), num_tokentypes=2, add_binary_head=True,
                     parallel_output=False)


def bert_logits(model, grad: bool = False) -> tuple:
    """(LM logits, binary-head logits) on the oracle's BERT inputs (a padded sequence, two token types)."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 11:] = 0
    types = torch.zeros_like(ids)
    types[:, 8:] = 1
    with torch.set_grad_enabled(grad):
        return model(ids, mask, tokentype_ids=types)


def our_t5(args):
    from megatron.models.t5.model import T5Model

    return T5Model(core_transformer_config_from_args(args), parallel_output=False)


def t5_logits(model, grad: bool = False) -> torch.Tensor:
    """Logits on the oracle's T5 inputs (sample 1's encoder padded after 11 tokens; 12 decoder tokens)."""
    dseq = 12
    g = torch.Generator().manual_seed(13)
    enc, dec = torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, dseq), generator=g)
    keys = torch.ones(2, SEQ)
    keys[1, 11:] = 0
    masks = (keys[:, None, :].expand(2, SEQ, SEQ), torch.tril(torch.ones(dseq, dseq)).expand(2, dseq, dseq),
             keys[:, None, :].expand(2, dseq, SEQ))
    with torch.set_grad_enabled(grad):
        return model(enc, dec, *masks)


def _one_step(model, loss) -> object:
    """Our optimizer after one step on `loss()` (every parameter gets Adam moments)."""
    optimizer = our_optimizer(model)
    optimizer.zero_grad()
    loss().backward()
    optimizer.step()
    return optimizer


def _t5_pp2_resave(rank: int, world_size: int, load: str, save: str) -> None:
    """Our T5 at PP2 (--pipeline-model-parallel-split-rank 1: the encoder on stage 0, the decoder on stage 1) resumes
    from `load` (a torch_dist folder, its optimizer state cut to the stages) and saves with --ckpt-format torch_dist
    (optimizer state included) into `save`."""
    from megatron.compat import load_checkpoint, save_checkpoint
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron.models.t5.model import T5Model

    state = initialize_model_parallel(1, 2, pipeline_model_parallel_split_rank=1)
    try:
        args = run_args("t5", Path(load), "--no-load-rng", "--pipeline-model-parallel-size", "2",
                        "--pipeline-model-parallel-split-rank", "1", "--save", save, "--save-interval", "1",
                        "--ckpt-format", "torch_dist", "--no-save-rng")
        model = T5Model(core_transformer_config_from_args(args), pp_state=state, parallel_output=False)
        optimizer = our_optimizer(model)
        assert load_checkpoint([model], optimizer, None, args) == 3
        save_checkpoint(3, [model], optimizer, None, args)
    finally:
        destroy_model_parallel()


def t5_pipeline_logits(load: Path, pp: int, split: int) -> torch.Tensor:
    """Our T5 as `pp` pipeline stages split at `split` (ParallelState records in one process), each stage loaded
    from `load` by --load's code for Megatron Core layouts (formats.load_foreign) and run as the schedule runs them
    (an encoder stage's output into the next stage, [decoder hidden states, encoder output] after the split): the
    last stage's logits."""
    import dataclasses

    from megatron.checkpoint.args import architecture_from_args
    from megatron.checkpoint.formats import detect_format, load_foreign
    from megatron.core.parallel_state import ParallelState
    from megatron.models.t5.model import T5Model
    from megatron.run_configs.checkpoint import CheckpointSettings
    from megatron.training_state import TrainingState

    args = run_args("t5", load, "--finetune")
    config = dataclasses.replace(core_transformer_config_from_args(args), pipeline_model_parallel_size=pp)
    iter_dir = next(load.glob("iter_*"))
    out = None
    for rank in range(pp):
        state = ParallelState(pp_size=pp, pp_rank=rank, pipeline_split_rank=split, pp_ranks=list(range(pp)))
        stage = T5Model(config, pp_state=state, parallel_output=False)
        load_foreign([stage], CheckpointSettings.from_args(args), architecture_from_args(args), str(load),
                     str(iter_dir), detect_format(str(iter_dir)), False, state, TrainingState())
        if rank:
            stage.set_input_tensor(out)
        out = t5_logits(stage)
    return out


TRAIN_STEPS, SAVE_AT = 6, 3


def train_steps(model, optimizer, batches) -> list:
    """Our steps on full batches [4, SEQ + 1] (Megatron Core's DP2 run averages two halves: the same mean loss)."""
    pos = torch.arange(SEQ).unsqueeze(0).expand(4, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    losses = []
    for ids in batches:
        optimizer.zero_grad()
        loss = model(ids[:, :-1], pos, mask, labels=ids[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def our_optimizer(model):
    from megatron.optimizer import get_megatron_optimizer
    from megatron.optimizer.optimizer_config import OptimizerConfig

    return get_megatron_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0))


def _draws_and_tracker() -> dict:
    """One draw of the python, numpy and torch generators and the RNG tracker's streams (the generators left as
    they were)."""
    import random

    import numpy as np

    from megatron.core.tensor_parallel import get_rng_tracker

    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    out = {"draws": (random.random(), float(np.random.random_sample()), float(torch.rand(()))),
           "tracker": get_rng_tracker().get_states()}
    random.setstate(saved[0]), np.random.set_state(saved[1]), torch.set_rng_state(saved[2])
    return out


def save_ours_mtp(root: Path, family: str = "deepseek") -> str:
    """Our `family` model ("deepseek", or "mtp_moe") with random weights and expert biases saved with --ckpt-format
    torch_dist; its logits, its MTP depth's logits (the output layer on the MTP layer's hidden states) and its expert
    biases in `ours_<family>.pt`. Returns the iteration folder."""
    from megatron.compat import save_checkpoint
    from megatron.layers.mtp import output_logits

    save = root / "ours" / family
    args = run_args(family, root / "none", "--save", str(save), "--save-interval", "1", "--ckpt-format",
                    "torch_dist", "--no-save-optim", "--no-save-rng")
    torch.manual_seed(11)
    model = our_model(args)
    ids, pos, mask = tokens()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        biases = [b for name, b in model.named_buffers() if name.endswith("router.expert_bias")]
        for bias in biases:  # the MoE layer's and the MTP layer's: they change which experts are chosen
            bias.copy_(0.1 * torch.randn_like(bias))
        states = model.mtp(ids, pos, model.language_model(ids, pos, mask), mask, model.language_model.embedding)
        torch.save({"logits": model(ids, pos, mask), "expert_bias": [b.clone() for b in biases],
                    "mtp_logits": output_logits(model.output_weight(), None, False)(states[0]).transpose(0, 1)},
                   root / f"ours_{family}.pt")
    save_checkpoint(3, [model], None, None, args)
    return str(save / "iter_0000003")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    """The oracle's checkpoints and logits; it also loads ours (saved here first with --ckpt-format torch_dist), and
    our training checkpoint (3 steps on the oracle's batches, saved with the optimizer state; steps 4-6 recorded)."""
    from megatron.compat import maybe_finalize_async_save, save_checkpoint

    root = tmp_path_factory.mktemp("mcore")
    batches = torch.randint(0, VOCAB, (TRAIN_STEPS, 4, SEQ + 1), generator=torch.Generator().manual_seed(5))
    torch.save(batches, root / "batches.pt")
    save = root / "ours_train"
    # --async-save: written while steps 4-6 run (the synchronous save's bytes: tests/reliability/test_async_save.py)
    args = run_args("gpt", root / "none", "--save", str(save), "--save-interval", "1", "--ckpt-format", "torch_dist",
                    "--async-save", "--use-persistent-ckpt-worker")
    model_parallel_manual_seed(3, 0)  # the default generator and the RNG tracker's stream
    model = our_model(args)
    optimizer = our_optimizer(model)
    train_steps(model, optimizer, batches[:SAVE_AT])
    save_checkpoint(SAVE_AT, [model], optimizer, None, args)
    torch.save(_draws_and_tracker(), root / "ours_rng.pt")  # what the saved RNG state gives
    torch.save(train_steps(model, optimizer, batches[SAVE_AT:]), root / "ours_train_losses.pt")
    maybe_finalize_async_save(blocking=True)
    job = {"families": ["gpt", "llama", "qwen3", "moe"], "ours": {}, "train": True, "bert": True, "t5": True,
           "ours_train": str(save / f"iter_{SAVE_AT:07d}")}
    args = run_args("bert", root / "none", "--save", str(root / "ours" / "bert"), "--save-interval", "1",
                    "--ckpt-format", "torch_dist", "--no-save-rng")
    torch.manual_seed(11)
    bert = our_bert(args)
    optimizer = _one_step(bert, lambda: sum(x.pow(2).mean() for x in bert_logits(bert, grad=True)))
    torch.save(bert_logits(bert), root / "ours_bert_logits.pt")
    save_checkpoint(3, [bert], optimizer, None, args)  # with the optimizer state (Core reads it: ours_optim_tp2)
    job["ours"]["bert"] = str(root / "ours" / "bert" / "iter_0000003")
    args = run_args("t5", root / "none", "--save", str(root / "ours" / "t5"), "--save-interval", "1",
                    "--ckpt-format", "torch_dist", "--no-save-rng")
    torch.manual_seed(12)
    t5 = our_t5(args)
    with torch.no_grad():
        for p in t5.parameters():
            p.add_(0.1 * torch.randn_like(p))
    optimizer = _one_step(t5, lambda: t5_logits(t5, grad=True).pow(2).mean())
    torch.save(t5_logits(t5), root / "ours_t5_logits.pt")
    save_checkpoint(3, [t5], optimizer, None, args)
    job["ours"]["t5"] = str(root / "ours" / "t5" / "iter_0000003")
    from tests.dist_utils import run_distributed  # that folder loaded by our T5 at PP2 and saved there as torch_dist

    run_distributed(_t5_pp2_resave, world_size=2, args=(str(root / "ours" / "t5"), str(root / "ours" / "t5_pp2")))
    job["ours"]["t5_pp2"] = str(root / "ours" / "t5_pp2" / "iter_0000003")
    for family in [*job["families"], "moe_mixed"]:  # the last saved by us only (MoE and dense layers mixed)
        save = root / "ours" / family
        args = run_args(family, root / "none", "--save", str(save), "--save-interval", "1", "--ckpt-format", "torch_dist", "--no-save-optim",
                        "--no-save-rng")
        torch.manual_seed(11)
        model = our_model(args)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
            torch.save(model(*tokens()), root / f"ours_{family}_logits.pt")
        save_checkpoint(3, [model], None, None, args)
        job["ours"][family] = str(save / "iter_0000003")
    for family in ("deepseek", "mtp_moe"):
        job["ours"][family] = save_ours_mtp(root, family)
    (root / "job.json").write_text(json.dumps(job))
    script = ORACLE_CPU_PRELUDE + (Path(__file__).parent / "mcore_oracle_checkpoints.py").read_text()
    run_oracle(script, root, nproc=2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama", "qwen3", "moe"])
def test_core_checkpoints_load_at_tp1_with_core_logits(oracle, family):
    ref = torch.load(oracle / "out" / family / "logits.pt")
    for name in SAVED[family]:
        got = load_logits(family, oracle / "out" / family / name)
        torch.testing.assert_close(got, ref, **TOL, msg=f"{family} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama", "qwen3", "moe", "moe_mixed"])
def test_ours_as_torch_dist_gives_the_same_logits_in_megatron_core(oracle, family):
    ours = torch.load(oracle / f"ours_{family}_logits.pt")
    for name in OURS_IN_CORE[family]:
        torch.testing.assert_close(torch.load(oracle / "out" / family / name), ours, **TOL, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek", "mtp_moe"])
def test_ours_deepseek_as_torch_dist_in_megatron_core(oracle, family):
    """Our DeepSeek-family save (multi-latent attention with q-lora, a first dense layer, group-limited sigmoid
    routing with the expert bias and scaling, a shared expert, one MTP layer) loads strictly into Megatron Core's
    GPTModel with its MTP block (MLA local specs, a stand-in core attention): Core's logits and MTP-depth logits are
    ours (<= 1e-5) and its expert biases (the MoE layer's, the MTP layer's) are ours bit for bit. So does the MoE
    family's with a dense first layer and one MTP layer (plain attention, gated shared expert; no expert bias)."""
    ours, core = torch.load(oracle / f"ours_{family}.pt"), torch.load(oracle / "out" / family / "ours_in_core.pt")
    assert len(ours["expert_bias"]) == len(core["expert_bias"]) == (2 if family == "deepseek" else 0)
    assert all(torch.equal(a, b) and a.abs().min() > 0 for a, b in zip(ours["expert_bias"], core["expert_bias"]))
    for key in ("logits", "mtp_logits"):
        torch.testing.assert_close(core[key], ours[key], **TOL, msg=key)


def test_ours_deepseek_torch_dist_loads_back(tmp_path):
    """Our DeepSeek-family torch_dist save (per-layer names: a dense first layer, then MoE; the MTP depth's experts
    stacked as Core's) loads back into ours with our logits bit for bit."""
    path = Path(save_ours_mtp(tmp_path))
    assert torch.equal(load_logits("deepseek", path.parent), torch.load(tmp_path / "ours_deepseek.pt")["logits"])


@pytest.mark.slow
def test_core_bert_checkpoints_both_ways(oracle):
    """Megatron Core's BertModel saved as `torch` (per-rank files, Core names) and `torch_dist` at TP1 and TP2 loads
    into our BERT (--load, any layout) with Core's LM and binary-head logits; ours saved with --ckpt-format
    torch_dist gives our logits in Core's BertModel at TP1 and TP2 (<= 1e-5)."""
    from megatron.compat import load_checkpoint

    bert = oracle / "out" / "bert"
    ref = torch.load(bert / "logits.pt")
    for name in ("torch_tp1", "torch_tp2", "dist_tp1", "dist_tp2"):
        args = run_args("bert", bert / name, "--finetune")
        model = our_bert(args)
        assert load_checkpoint([model], None, None, args) == 0
        for got, want, what in zip(bert_logits(model), ref, ("lm", "binary")):
            torch.testing.assert_close(got, want, **TOL, msg=f"{name} {what}")
    ours = torch.load(oracle / "ours_bert_logits.pt")
    for tp in (1, 2):
        for got, want in zip(torch.load(bert / f"ours_logits_tp{tp}.pt"), ours):
            torch.testing.assert_close(got, want, **TOL, msg=f"ours in Core at TP{tp}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "t5"])
def test_ours_bert_t5_optimizer_state_goes_through_megatron_core(oracle, family):
    """Our BERT (T5) saved with --ckpt-format torch_dist after one step, its optimizer state in the fully_reshardable
    layout, loads into Megatron Core's DDP + distributed optimizer at TP2, which saves it again in that layout and in
    its default dp_reshardable one (bucket buffers, rebuilt here in Core's BERT / T5 parameter order): read here,
    every parameter's fp32 main param and Adam moments are ours bit for bit, and the step count with them; so are
    those of our T5 pipeline (PP2, split 1) resumed from our save and saved again."""
    from megatron.checkpoint.conversion.torch_dist import read_iteration_state
    from megatron.checkpoint.conversion.torch_dist_optim import optimizer_common

    common, _, _, ours = read_iteration_state(str(oracle / "ours" / family / "iter_0000003"))
    assert sorted(ours) == ["exp_avg", "exp_avg_sq", "param"] and optimizer_common(common, ours, family)["step"] == 1
    for kind in ("fully_reshardable", "dp_reshardable"):
        folder = oracle / "out" / family / f"ours_optim_tp2_{kind}" / f"iter_{SAVE_AT:07d}"
        common, _, _, core = read_iteration_state(str(folder))
        assert optimizer_common(common, core, kind)["step"] == 1
        assert sorted(core) == sorted(ours)
        for key, tensors in ours.items():
            assert sorted(core[key]) == sorted(tensors), (kind, key, set(core[key]) ^ set(tensors))
            for name, value in tensors.items():
                assert torch.equal(core[key][name], value), (kind, key, name)
    if family == "t5":  # our T5 pipeline (PP2, split 1) resumed from it with its optimizer and saved again
        _, _, _, again = read_iteration_state(str(oracle / "ours" / "t5_pp2" / "iter_0000003"))
        assert sorted(again) == sorted(ours)
        for key, tensors in ours.items():
            assert sorted(again[key]) == sorted(tensors) and all(torch.equal(again[key][n], t)
                                                                 for n, t in tensors.items()), key


@pytest.mark.slow
def test_core_t5_checkpoints_both_ways(oracle):
    """Megatron Core's T5Model (local specs: encoder, decoder with cross-attention, tied head with its bias) saved as
    `torch` (per-rank files, Core names) and `torch_dist` at TP1 and TP2 loads into our T5 (--load, one process)
    with Core's logits, and into our T5 pipeline (PP2 split 1, PP4 split 2); ours saved with --ckpt-format torch_dist
    gives our logits in Core's T5Model at TP1 and TP2, and so does ours saved by a PP2 run (<= 1e-5)."""
    from megatron.compat import load_checkpoint

    t5 = oracle / "out" / "t5"
    ref = torch.load(t5 / "logits.pt")
    for name in ("torch_tp1", "torch_tp2", "dist_tp1", "dist_tp2"):
        args = run_args("t5", t5 / name, "--finetune")
        model = our_t5(args)
        assert load_checkpoint([model], None, None, args) == 0
        torch.testing.assert_close(t5_logits(model), ref, **TOL, msg=name)
    ours = torch.load(oracle / "ours_t5_logits.pt")
    for tp in (1, 2):
        torch.testing.assert_close(torch.load(t5 / f"ours_logits_tp{tp}.pt"), ours, **TOL, msg=f"ours in Core TP{tp}")
    # under pipeline parallelism: Core's torch_dist folder in our PP2 (split 1) and its per-rank files (TP2) in our
    # PP4 (split 2: one layer a stage, the last stage's copy of the tied embeddings) give Core's logits; ours saved at
    # PP2 as torch_dist gives our logits in Core's T5Model (Megatron-LM 0.16 runs T5 without a pipeline only)
    for name, pp, split in (("dist_tp1", 2, 1), ("torch_tp2", 4, 2)):
        torch.testing.assert_close(t5_pipeline_logits(t5 / name, pp, split), ref, **TOL, msg=f"{name} PP{pp}")
    torch.testing.assert_close(torch.load(t5 / "ours_pp2_logits_tp1.pt"), ours, **TOL, msg="ours PP2 in Core")
    saved = {}
    for name in ("t5", "t5_pp2"):  # the PP2 save holds the very tensors of the PP1 one
        args = run_args("t5", oracle / "ours" / name, "--finetune")
        model = our_t5(args)
        load_checkpoint([model], None, None, args)
        saved[name] = model.state_dict()
    assert sorted(saved["t5"]) == sorted(saved["t5_pp2"])
    assert all(torch.equal(v, saved["t5_pp2"][k]) for k, v in saved["t5"].items())


def test_t5_pipeline_piece_refusals_are_one_line():
    """Cutting a full T5 state dict for a pipeline stage without a split rank, or with a stack that does not divide
    over its stages, is one line naming the flag."""
    from megatron.checkpoint.formats import CheckpointFormatError, rank_piece
    from megatron.core.parallel_state import ParallelState

    full = {f"language_model.{stack}.layers.{i}.mlp.dense_4h_to_h.bias": torch.zeros(2)
            for stack in ("encoder", "decoder") for i in range(3)}
    for split, match in ((None, r"needs --pipeline-model-parallel-split-rank in 1\.\.2"),
                         (1, "3 decoder layers do not split evenly over 2 decoder pipeline stage")):
        state = ParallelState(pp_size=3, pp_rank=0, pipeline_split_rank=split, pp_ranks=[0, 1, 2])
        with pytest.raises(CheckpointFormatError, match=match) as info:
            rank_piece(full, {}, None, 3, 0, state)
        assert "\n" not in str(info.value)


@pytest.mark.slow
def test_convert_loader_and_saver_mcore(oracle, tmp_path):
    from megatron.checkpoint.conversion.driver import main as convert

    for family, name in (("gpt", "torch_pp2"), ("llama", "dist_tp2")):
        ref = torch.load(oracle / "out" / family / "logits.pt")
        ours = tmp_path / f"{family}_ours"
        convert(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron", "--load-dir",
                 str(oracle / "out" / family / name), "--save-dir", str(ours), "--target-tensor-parallel-size", "1",
                 "--target-pipeline-parallel-size", "1"])
        torch.testing.assert_close(load_logits(family, ours), ref, **TOL, msg=f"{family} {name} -> megatron")
        back = tmp_path / f"{family}_back"
        summary = convert(["--model-type", "GPT", "--loader", "megatron", "--saver", "mcore", "--load-dir", str(ours),
                           "--save-dir", str(back)])
        assert summary["flags"].endswith("--auto-detect-ckpt-format")
        assert json.loads((back / "iter_0000010" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        torch.testing.assert_close(load_logits(family, back), ref, **TOL, msg=f"{family} -> mcore")


def _loaded(family: str, load: Path) -> torch.nn.Module:
    """Our BERT or T5 (TP1, one process) loaded from `load` with --finetune."""
    from megatron.compat import load_checkpoint

    args = run_args(family, load, "--finetune")
    model = our_bert(args) if family == "bert" else our_t5(args)
    load_checkpoint([model], None, None, args)
    return model


def _optimizer_state_through_mcore(src: Path, model_type: str, tmp_path: Path) -> None:
    """Our BERT / T5 torch_dist checkpoint with its optimizer state (one Adam step) converted --loader mcore
    --saver mcore, and --saver megatron at TP2 (T5: PP2 split 1) then back with --saver mcore: each folder holds the
    source's weights and model-space optimizer state (fp32 params, both moments) bit for bit, its step and param groups."""
    from megatron.checkpoint.conversion.driver import main as convert
    from megatron.checkpoint.conversion.torch_dist import read_iteration_state
    from megatron.checkpoint.conversion.torch_dist_optim import optimizer_common

    def read(folder: Path) -> tuple:
        common, _, weights, state = read_iteration_state(str(folder / "iter_0000003"))
        return weights, state, optimizer_common(common, state, str(folder))

    weights, state, opt_common = read(src)
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "param"] and opt_common["step"] == 1
    assert all(sorted(part) == sorted(weights) for part in state.values())  # every parameter's state
    split = ["--target-pipeline-parallel-size", "2", "--target-pipeline-model-parallel-split-rank", "1"] \
        if model_type == "T5" else []
    base = ["--model-type", model_type, "--loader", "mcore", "--load-dir", str(src)]
    convert([*base, "--saver", "mcore", "--save-dir", str(tmp_path / "opt_mcore")])
    convert([*base, "--saver", "megatron", "--save-dir", str(tmp_path / "opt_ours"), "--target-tensor-parallel-size",
             "2", *split])
    convert(["--model-type", model_type, "--loader", "megatron", "--saver", "mcore", "--load-dir",
             str(tmp_path / "opt_ours"), "--save-dir", str(tmp_path / "opt_back")])
    for name in ("opt_mcore", "opt_back"):
        got_weights, got, got_common = read(tmp_path / name)
        for want, have in [(weights, got_weights), *((state[k], got[k]) for k in state)]:
            assert sorted(have) == sorted(want) and all(torch.equal(v, have[n]) for n, v in want.items()), name
        assert sorted(got) == sorted(state) and got_common == opt_common, name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "t5"])
def test_convert_loader_and_saver_mcore_bert_t5(oracle, tmp_path, family):
    """convert.py --loader mcore reads Megatron Core's BERT / T5 `torch_dist` folder (TP2 / TP1) and per-rank `torch`
    files (TP2) into ours (T5's at PP2, split 1) with Core's logits; that -> --saver mcore -> ours gives the
    tensors of the first conversion bit for bit, and the torch_dist folder it wrote loads with --load to Core's
    logits (1e-5). Training state: our BERT / T5 torch_dist checkpoint keeps its optimizer state bit for bit through
    --loader mcore / --saver mcore (_optimizer_state_through_mcore)."""
    from megatron.checkpoint.conversion.driver import main as convert

    model_type, logits = ("BERT", bert_logits) if family == "bert" else ("T5", t5_logits)
    core = oracle / "out" / family
    ref = torch.load(core / "logits.pt")
    first = None
    for name in ("dist_tp2" if family == "bert" else "dist_tp1", "torch_tp2"):
        ours = tmp_path / f"{name}_ours"
        pp2 = ["--target-pipeline-parallel-size", "2", "--target-pipeline-model-parallel-split-rank", "1"] \
            if family == "t5" and name == "torch_tp2" else []
        summary = convert(["--model-type", model_type, "--loader", "mcore", "--saver", "megatron", "--load-dir",
                           str(core / name), "--save-dir", str(ours), "--target-tensor-parallel-size", "1", *pp2])
        assert ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 1" in summary["flags"]) == \
            bool(pp2)
        first = first or ours
        if not pp2:  # (ours at PP2: checked below, through the round trip)
            torch.testing.assert_close(logits(_loaded(family, ours)), ref, **TOL, msg=f"{family} {name} -> ours")
    back, again = tmp_path / "back", tmp_path / "again"
    convert(["--model-type", model_type, "--loader", "megatron", "--saver", "mcore", "--load-dir", str(ours),
             "--save-dir", str(back), "--no-save-optim"])
    assert json.loads((back / "iter_0000010" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    torch.testing.assert_close(logits(_loaded(family, back)), ref, **TOL, msg=f"{family} -> mcore")
    convert(["--model-type", model_type, "--loader", "mcore", "--saver", "megatron", "--load-dir", str(back),
             "--save-dir", str(again)])
    one, two = _loaded(family, first).state_dict(), _loaded(family, again).state_dict()
    assert sorted(one) == sorted(two) and all(torch.equal(v, two[k]) for k, v in one.items())
    _optimizer_state_through_mcore(oracle / "ours" / family, model_type, tmp_path)
    from megatron.checkpoint.conversion.interchange import ConversionError

    wrong = "T5" if family == "bert" else "BERT"
    with pytest.raises(ConversionError, match=f"holds a {model_type} .*--model-type {model_type}") as info:
        convert(["--model-type", wrong, "--loader", "mcore", "--saver", "megatron", "--load-dir",
                 str(core / "dist_tp1"), "--save-dir", str(tmp_path / "wrong")])
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_use_checkpoint_args_from_common_pt(oracle):
    from megatron.compat import load_args_from_checkpoint, load_checkpoint

    load = oracle / "out" / "llama" / "dist_pp2"
    args = parse_args(args=["--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                            "--load", str(load), "--use-checkpoint-args", "--finetune", "--auto-detect-ckpt-format",
                            "--hidden-dropout", "0", "--attention-dropout", "0"])
    load_args_from_checkpoint(args)
    args.rank = 1
    validate_args(args, {})
    assert (args.swiglu, args.normalization, args.num_query_groups, args.ffn_hidden_size) == (True, "RMSNorm", 2, 64)
    args.padded_vocab_size = VOCAB
    model = our_model(args)
    assert load_checkpoint([model], None, None, args) == 0
    with torch.no_grad():
        torch.testing.assert_close(model(*tokens()), torch.load(oracle / "out" / "llama" / "logits.pt"), **TOL)


@pytest.mark.slow
def test_format_flags_and_damaged_shards_are_one_line(oracle, tmp_path):
    from megatron.checkpoint.formats import CheckpointFormatError
    from megatron.compat import CheckpointError, load_checkpoint

    src = oracle / "out" / "gpt" / "dist_tp2"
    args = run_args("gpt", src, "--finetune")
    args.auto_detect_ckpt_format = False
    with pytest.raises(CheckpointFormatError, match="pass --auto-detect-ckpt-format") as info:
        load_checkpoint([our_model(args)], None, None, args)
    assert "\n" not in str(info.value)
    args = run_args("gpt", src)  # resuming: Megatron Core's RNG state is not read, and this folder has no optimizer
    with pytest.raises(CheckpointFormatError, match="has no RNG state this code reads; pass --no-load-rng"):
        load_checkpoint([our_model(args)], None, None, args)
    args = run_args("gpt", src, "--no-load-rng")
    model = our_model(args)
    with pytest.raises(CheckpointFormatError, match="holds no optimizer state: pass --no-load-optim") as info:
        load_checkpoint([model], our_optimizer(model), None, args)
    assert "\n" not in str(info.value)
    for source, field, value, match in (  # layouts and records not read: one line naming the flag
            ("train", "param_state_sharding_type", "dp_zero_gather_scatter", "dp_zero_gather_scatter layout"),
            ("train_dp", "tensor_model_parallel_size", 2, r"groups \[0\] .* TP x PP = 2 x 1")):
        bucket = tmp_path / field
        shutil.copytree(oracle / "out" / source, bucket)
        common = torch.load(bucket / "iter_0000003" / "common.pt", weights_only=False)
        if field in common["optimizer"]:
            common["optimizer"][field] = value
        else:
            setattr(common["args"], field, value)
        torch.save(common, bucket / "iter_0000003" / "common.pt")
        args = run_args("gpt", bucket, "--no-load-rng")
        model = our_model(args)
        with pytest.raises(CheckpointFormatError, match=f"{match}.*--dist-ckpt-optim-fully-reshardable") as info:
            load_checkpoint([model], our_optimizer(model), None, args)
        assert "\n" not in str(info.value)
    for damage in ("missing", "truncated", "flipped"):
        bad = tmp_path / damage
        shutil.copytree(src, bad)
        shard = bad / "iter_0000010" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        if damage == "missing":
            shard.unlink()
        elif damage == "truncated":
            shard.write_bytes(bytes(data[: len(data) // 2]))
        else:
            for i in range(64, len(data), 97):
                data[i] ^= 0xFF
            shard.write_bytes(bytes(data))
        with pytest.raises(Exception) as info:
            load_logits("gpt", bad)
        msg = str(info.value)
        assert "__1_0.distcp" in msg and "\n" not in msg, (damage, msg)
    # ours, saved with --ckpt-format torch_dist, is signed (manifest.json): a changed shard fails its check first
    signed = tmp_path / "signed"
    shutil.copytree(oracle / "ours" / "gpt", signed)
    shard = next((signed / "iter_0000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"no intact checkpoint in --load .*{shard.name} has checksum") as info:
        load_logits("gpt", signed)  # (its only iteration: nothing older to fall back to, as with legacy folders)
    assert "\n" not in str(info.value)


def _load_parallel(rank: int, world_size: int, jobs: list) -> list:
    """Each (checkpoint, tp, pp) loaded into our GPT at that layout: this rank's weights (and logits at PP1)."""
    from megatron.compat import load_checkpoint
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron.core.tensor_parallel import model_parallel_manual_seed

    results = []
    for load, tp, pp in jobs:
        state = initialize_model_parallel(tp, pp)
        model_parallel_manual_seed(1234, state.tp_rank)
        try:
            args = run_args("gpt", Path(load), "--finetune", "--tensor-model-parallel-size", str(tp),
                            "--pipeline-model-parallel-size", str(pp))
            model = our_model(args, state, pre_process=state.is_pipeline_first_stage(),
                              post_process=state.is_pipeline_last_stage())
            load_checkpoint([model], None, None, args)
            out = {"state": {k: v.clone() for k, v in model.state_dict().items()}}
            if pp == 1:
                with torch.no_grad():
                    out["logits"] = model(*tokens())
            results.append(out)
        finally:
            destroy_model_parallel()
    return results


@pytest.mark.slow
def test_core_checkpoints_load_at_our_tp2_and_pp2(oracle):
    from megatron.compat import load_checkpoint
    from tests.dist_utils import run_distributed

    gpt = oracle / "out" / "gpt"
    jobs = [(str(gpt / "torch_pp2"), 2, 1), (str(gpt / "dist_tp1"), 2, 1), (str(gpt / "dist_tp2"), 1, 2)]
    per_rank = run_distributed(_load_parallel, world_size=2, args=(jobs,))
    ref = torch.load(gpt / "logits.pt")
    for rank_results in per_rank:
        for job, res in zip(jobs[:2], rank_results[:2]):
            torch.testing.assert_close(res["logits"], ref, **TOL, msg=job[0])
    args = run_args("gpt", gpt / "dist_tp2", "--finetune")
    full = our_model(args)
    load_checkpoint([full], None, None, args)
    expected = full.state_dict()
    for stage, rank_results in enumerate(per_rank):
        for key, value in rank_results[2]["state"].items():
            if key == "word_embeddings.weight":  # the last stage's copy of the tied embeddings
                source = "language_model.embedding.word_embeddings.weight"
            else:
                source = key.replace(".layers.0.", f".layers.{stage}.")
            assert torch.equal(value, expected[source]), (stage, key)


@pytest.mark.slow
def test_megatron_core_distributed_optimizer_checkpoint_continues_its_curve_in_ours(oracle):
    """Megatron Core's DP2 distributed-optimizer torch_dist checkpoint (step 3; its fully_reshardable layout and its
    default dp_reshardable one, with Megatron-LM's RNG state), resumed here in one process with the regular optimizer
    and no extra flag: the python/numpy/torch generators continue from the saved states, and steps 4-6 give the
    losses of Megatron Core's run that never stopped."""
    from megatron.compat import load_checkpoint

    core = torch.load(oracle / "out" / "train_losses.pt")
    import random

    import numpy as np

    for folder in ("train", "train_dp"):  # --dist-ckpt-optim-fully-reshardable, and Megatron-LM's default layout
        args = run_args("gpt", oracle / "out" / folder)  # no --no-load-rng: Megatron-LM's RNG state is restored
        model = our_model(args)
        optimizer = our_optimizer(model)
        assert load_checkpoint([model], optimizer, None, args) == SAVE_AT
        draws = (random.random(), float(np.random.random_sample()), float(torch.rand(())))
        random.seed(41), np.random.seed(42), torch.manual_seed(43)  # the oracle's seeds just before its save
        assert draws == (random.random(), float(np.random.random_sample()), float(torch.rand(()))), folder
        ours = train_steps(model, optimizer, torch.load(oracle / "batches.pt")[SAVE_AT:])
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(core["losses"][SAVE_AT:]), rtol=1e-5, atol=0,
                                   msg=folder)
    # convert.py carries the same state: --loader mcore -> ours (TP1, distrib_optim.pt) -> --saver mcore -> --load
    from megatron.checkpoint.conversion.driver import main as convert

    ours_dir, back = oracle.parent / f"{oracle.name}_conv_ours", oracle.parent / f"{oracle.name}_conv_back"
    convert(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron", "--load-dir",
             str(oracle / "out" / "train"), "--save-dir", str(ours_dir)])
    assert (ours_dir / f"iter_{SAVE_AT:07d}" / "mp_rank_00" / "distrib_optim.pt").is_file()
    convert(["--model-type", "GPT", "--loader", "megatron", "--saver", "mcore", "--load-dir", str(ours_dir),
             "--save-dir", str(back)])
    args = run_args("gpt", back, "--no-load-rng")
    model = our_model(args)
    optimizer = our_optimizer(model)
    assert load_checkpoint([model], optimizer, None, args) == SAVE_AT
    again = train_steps(model, optimizer, torch.load(oracle / "batches.pt")[SAVE_AT:])
    torch.testing.assert_close(torch.tensor(again), torch.tensor(core["losses"][SAVE_AT:]), rtol=1e-5, atol=0)
    # without the optimizer state the continuation differs: the check above is not vacuous
    fresh = our_model(run_args("gpt", oracle / "out" / "train", "--finetune"))
    load_checkpoint([fresh], None, None, run_args("gpt", oracle / "out" / "train", "--finetune"))
    other = train_steps(fresh, our_optimizer(fresh), torch.load(oracle / "batches.pt")[SAVE_AT:])
    assert abs(other[-1] - core["losses"][-1]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["gpt_tp2", "gpt_pp2", "llama_tp2"])
def test_core_default_optimizer_layout_reads_as_its_reshardable_one(oracle, layout):
    """One Megatron Core distributed-optimizer state (random Adam moments) saved at TP2 or PP2 (tied embeddings split
    over the stages) in its default dp_reshardable layout (bucket buffers) and in fully_reshardable: read here, the
    two give the same model-space tensors, bit for bit."""
    from megatron.checkpoint.conversion.torch_dist import read_iteration_state
    from megatron.checkpoint.conversion.torch_dist_optim import optimizer_common

    root = oracle / "out" / "layouts"
    common, _, _, buckets = read_iteration_state(str(root / f"{layout}_dp_reshardable" / "iter_0000003"))
    _, _, _, model_space = read_iteration_state(str(root / f"{layout}_fully_reshardable" / "iter_0000003"))
    assert sorted(buckets) == sorted(model_space) == ["exp_avg", "exp_avg_sq", "param"]
    for key, tensors in model_space.items():
        assert sorted(buckets[key]) == sorted(tensors), key
        for name, value in tensors.items():
            assert torch.equal(buckets[key][name], value), (key, name)
    assert optimizer_common(common, buckets, layout)["state_keys"] == ["exp_avg", "exp_avg_sq"]


@pytest.mark.slow
def test_ours_torch_dist_optimizer_state_resumes_in_megatron_core(oracle):
    """Ours saved with --ckpt-format torch_dist (optimizer and RNG state included), loaded by Megatron Core's
    dist_checkpointing into its DDP + distributed optimizer (DP2) with Megatron-LM's `rng_state` ShardedObject as
    the template (as its load_checkpoint without --no-load-rng): its steps 4-6 give our losses, and the RNG state it
    restores (python, numpy, torch generators, the tracker's stream through convert_cuda_rng_state) is ours at the
    save."""
    ours = torch.load(oracle / "ours_train_losses.pt")
    result = torch.load(oracle / "out" / "train_losses.pt", weights_only=False)
    torch.testing.assert_close(torch.tensor(result["ours_resumed"]), torch.tensor(ours), rtol=1e-5, atol=0)
    saved, core = torch.load(oracle / "ours_rng.pt", weights_only=False), result["ours_rng"]
    assert core["draws"] == saved["draws"] and core["cuda_rng_state"] is None  # a CPU run has no CUDA generator
    assert sorted(core["tracker"]) == sorted(saved["tracker"]) == ["model-parallel-rng"]
    for name, state in saved["tracker"].items():  # Megatron Core's tracker: one generator-state tensor per stream
        assert torch.equal(core["tracker"][name], state["cpu"]), name


@pytest.mark.slow
def test_our_older_torch_dist_rng_entry_is_still_read(oracle, tmp_path):
    """Our torch_dist folders of before today kept the RNG state in common.pt (``rng_state_by_rank``): such a folder
    resumes with that state (it is read before the ShardedObjects), with the optimizer state and no extra flag."""
    import random

    import numpy as np

    from megatron.checkpoint.formats import RNG_KEY
    from megatron.compat import load_checkpoint, local_rng_state, restore_local_rng_state

    old = tmp_path / "old"
    shutil.copytree(oracle / "ours_train", old)
    path = old / f"iter_{SAVE_AT:07d}" / "common.pt"
    (old / f"iter_{SAVE_AT:07d}" / "manifest.json").unlink(missing_ok=True)  # signed before this edit
    common = torch.load(path, weights_only=False)
    saved = local_rng_state()
    random.seed(51), np.random.seed(52), torch.manual_seed(53)
    common[RNG_KEY] = {"tp": 1, "pp": 1, "ranks": {(0, 0): [local_rng_state()]}}
    want = _draws_and_tracker()["draws"]
    restore_local_rng_state(saved)
    torch.save(common, path)
    args = run_args("gpt", old)
    model = our_model(args)
    assert load_checkpoint([model], our_optimizer(model), None, args) == SAVE_AT
    assert _draws_and_tracker()["draws"] == want


def test_torch_dist_save_flags_refused_in_one_line(tmp_path):
    from megatron.errors import ArgumentError

    save = ["--save", str(tmp_path), "--save-interval", "1", "--ckpt-format", "torch_dist"]
    with pytest.raises(ArgumentError, match="--deepspeed") as info:
        run_args("gpt", tmp_path, *save, "--deepspeed")
    assert "\n" not in str(info.value)
    args = parse_args(args=[*BASE, *FLAGS["moe"], *save, "--expert-model-parallel-size", "2"])
    args.rank, args.world_size = 1, 2
    validate_args(args, {})  # written under expert parallelism (tests/training/test_torch_dist_resume.py)
    assert run_args("gpt", tmp_path, "--save", str(tmp_path), "--ckpt-format", "torch_dist").ckpt_format == \
        "torch_dist"  # the optimizer state is saved too (no --no-save-optim needed)
    assert run_args("gpt", tmp_path).ckpt_format == "torch"  # ours stays the default


def test_moe_expert_names_both_spellings_round_trip():
    """Core's per-expert local names and Transformer Engine's grouped names give the same stacked tensors of ours;
    ours written back (local spelling) reads again unchanged; a gap in the experts is one line."""
    from megatron.layers.mcore_names import UnsupportedCoreCheckpoint, core_to_ours, ours_to_core

    g = torch.Generator().manual_seed(0)
    fc1 = [torch.randn(12, 8, generator=g) for _ in range(3)]  # [F x2 (gate; up), h] per expert
    fc2 = [torch.randn(8, 6, generator=g) for _ in range(3)]
    router = torch.randn(3, 8, generator=g)
    local = {"decoder.layers.1.mlp.router.weight": router}
    grouped = dict(local)
    for e in range(3):
        local[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
        local[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
        grouped[f"decoder.layers.1.mlp.experts.linear_fc1.weight{e}"] = fc1[e]
        grouped[f"decoder.layers.1.mlp.experts.linear_fc2.weight{e}"] = fc2[e]
    ours = core_to_ours(local)
    prefix = "language_model.encoder.layers.1.mlp."
    assert torch.equal(ours[prefix + "experts.weight1"], torch.stack(fc1).transpose(1, 2))  # [E, h, F x2]
    assert torch.equal(ours[prefix + "experts.weight2"], torch.stack(fc2).transpose(1, 2))  # [E, F, h]
    assert torch.equal(ours[prefix + "router.weight"], router)
    for key, value in core_to_ours(grouped).items():
        assert torch.equal(value, ours[key]), key
    back = ours_to_core(ours)
    assert sorted(back) == sorted(local) and all(torch.equal(back[k], local[k]) for k in local)
    del local["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"]
    with pytest.raises(UnsupportedCoreCheckpoint, match=r"experts of .*weight2 are \[0, 2\]") as info:
        core_to_ours(local)
    assert "\n" not in str(info.value)


def _load_moe_at_ep2(rank: int, world_size: int, load: str) -> torch.Tensor:
    """Our MoE at DP2 x EP2 (2 experts per rank) loaded from `load`; this rank's logits on the oracle's tokens."""
    from megatron.compat import load_checkpoint
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel

    state = initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    try:
        args = run_args("moe", Path(load), "--finetune", "--expert-model-parallel-size", "2")
        model = our_model(args, state)
        load_checkpoint([model], None, None, args)
        assert model.state_dict()["language_model.encoder.layers.0.mlp.experts.weight1"].size(0) == 2
        with torch.no_grad():
            return model(*tokens())
    finally:
        destroy_model_parallel()


@pytest.mark.slow
def test_core_moe_torch_dist_loads_at_our_expert_parallel_ep2(oracle):
    """Megatron Core's MoE torch_dist folder (all 4 experts stacked) at our EP2: each rank takes its 2 experts and
    both give Core's logits."""
    from tests.dist_utils import run_distributed

    ref = torch.load(oracle / "out" / "moe" / "logits.pt")
    for logits in run_distributed(_load_moe_at_ep2, world_size=2, args=(str(oracle / "out" / "moe" / "dist_tp1"),)):
        torch.testing.assert_close(logits, ref, **TOL)

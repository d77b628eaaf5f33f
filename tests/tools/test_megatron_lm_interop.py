"""Megatron-LM interop of torch_dist checkpoints (issue #44, round 4).

1. A folder that `pretrain_gpt.py --ckpt-format torch_dist` writes loads with megatron-core 0.16.1's own read path
   (tests/mcore_oracle.py): `dist_checkpointing.load_common_state_dict` and `dist_checkpointing.load` unpickle
   ``common.pt`` weights-only with megatron-core's safe globals, so ``args.model_type`` must be its
   ``megatron.core.enums.ModelType`` (ours was megatron.model.enums.ModelType, unknown to Megatron-LM); the weights
   it loads into Core's GPTModel are ours. Older folders holding our enum still load here.
2. A Megatron Core checkpoint without ``args`` (Megatron-LM takes the architecture from its command line) loads with
   ``--load`` and the model flags; each tensor's shape is checked against the model the flags build, a mismatch is
   one line naming the tensor, the checkpoint's shape and the flag.
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.conversion.torch_dist import COMMON, core_args, read_iteration
from megatron.checkpoint.safe_load import safe_torch_load
from megatron.core.enums import ModelType as CoreModelType
from megatron.layers.enums import ModelType
from megatron.layers.mcore_names import ours_to_core
from tests.mcore_oracle import ORACLE_CPU_PRELUDE, run_oracle
from tests.reliability.helpers import MODEL, assert_one_line_error, build_corpus, run, train_argv

ITER_DIR = "iter_0000002"

# megatron-core 0.16.1 reads the folder as Megatron-LM's load_checkpoint does: common.pt first (its args), then the
# model's sharded state dict; the tiny GPT of tests/reliability/helpers.py (LayerNorm, GeLU, learned positions, tied)
_ORACLE = '''
import json, sys
import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mps
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

if __name__ == "__main__":
    job = json.load(open("job.json"))
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:" + str(job["port"]), rank=0,
                                         world_size=1)
    mps.initialize_model_parallel(1, 1)
    common = dist_checkpointing.load_common_state_dict(job["gpt"])
    args = common["args"]
    out = {"model_type": [type(args.model_type).__module__, type(args.model_type).__name__, args.model_type.name],
           "encoder_or_decoder": args.model_type is ModelType.encoder_or_decoder}
    for name in job.get("common_only", []):
        other = dist_checkpointing.load_common_state_dict(name)["args"].model_type
        out[name] = [type(other).__module__, other.name]
    cfg = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                            num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            pipeline_dtype=torch.float32)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, job["gpt"])
    model.load_state_dict(loaded["model"], strict=False)
    sd = model.state_dict()
    torch.save({k: sd[k] for k in job["tensors"]}, "core_tensors.pt")
    json.dump(out, open("out.json", "w"))
'''
_CORE_TO_OURS = {"embedding.word_embeddings.weight": "language_model.embedding.word_embeddings.weight",
                 "embedding.position_embeddings.weight": "language_model.embedding.position_embeddings.weight",
                 "decoder.layers.1.self_attention.linear_qkv.weight":
                     "language_model.encoder.layers.1.self_attention.query_key_value.weight",
                 "decoder.layers.0.mlp.linear_fc2.weight": "language_model.encoder.layers.0.mlp.dense_4h_to_h.weight",
                 "decoder.final_layernorm.weight": "language_model.encoder.final_layernorm.weight"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def trained(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny GPT trained 2 iterations by pretrain_gpt.py with --ckpt-format torch_dist."""
    work = tmp_path_factory.mktemp("mlinterop")
    data = build_corpus(shared_data, work / "data")
    proc = run("pretrain_gpt.py", *train_argv(data, "--save", str(work / "ckpt"), "--save-interval", "2",
                                              "--ckpt-format", "torch_dist"), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"data": data, "work": work, "ckpt": work / "ckpt"}


def test_pretrain_gpt_torch_dist_loads_with_megatron_core_read_path(trained, tmp_path):
    iter_dir = trained["ckpt"] / ITER_DIR
    old = tmp_path / "old" / ITER_DIR  # the same folder as our older saves wrote it: our own enum in args
    shutil.copytree(iter_dir, old)
    common = safe_torch_load(old / COMMON)
    common["args"].model_type = ModelType.encoder_or_decoder
    torch.save(common, old / COMMON)
    (tmp_path / "job.json").write_text(json.dumps({"gpt": str(iter_dir), "tensors": list(_CORE_TO_OURS),
                                                   "port": _free_port()}))
    run_oracle(ORACLE_CPU_PRELUDE + _ORACLE, tmp_path)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["model_type"] == ["megatron.core.enums", "ModelType", "encoder_or_decoder"]
    assert out["encoder_or_decoder"] is True
    core = torch.load(tmp_path / "core_tensors.pt")
    _, _, ours = read_iteration(str(iter_dir))
    for core_name, our_name in _CORE_TO_OURS.items():
        torch.testing.assert_close(core[core_name], ours[our_name], rtol=0, atol=0, msg=core_name)
    # our reader takes both: today's (Core's enum) and the older folder (ours)
    assert safe_torch_load(iter_dir / COMMON)["args"].model_type is CoreModelType.encoder_or_decoder
    assert safe_torch_load(old / COMMON)["args"].model_type is ModelType.encoder_or_decoder
    proc = run("pretrain_gpt.py", *train_argv(trained["data"], "--load", str(old.parent), "--finetune",
                                              "--ckpt-format", "torch_dist", "--train-iters", "3"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("ours, core", [(ModelType.encoder_or_decoder, CoreModelType.encoder_or_decoder),
                                        (ModelType.encoder_and_decoder, CoreModelType.encoder_or_decoder)])
def test_common_pt_model_type_is_megatron_cores(ours, core):
    """GPT/BERT (encoder_or_decoder) and T5 (encoder_and_decoder, a member megatron-core 0.16 no longer has) are all
    stored as Megatron Core 0.16's only member; the run's own args are left as they are."""
    args = argparse.Namespace(model_type=ours, num_layers=2)
    saved = core_args(args)
    assert saved.model_type is core and saved.num_layers == 2
    assert args.model_type is ours
    assert core_args(argparse.Namespace(num_layers=2)).num_layers == 2  # no model_type: unchanged


def test_safe_loader_takes_both_model_type_enums(tmp_path):
    """megatron.core.enums:ModelType (Megatron-LM's checkpoints, our new common.pt) and our old enum both load
    weights-only; Megatron Core's older T5 member too."""
    path = tmp_path / "args.pt"
    members = [CoreModelType.encoder_or_decoder, CoreModelType.encoder_and_decoder, ModelType.encoder_and_decoder]
    torch.save({"args": [argparse.Namespace(model_type=m) for m in members]}, path)
    assert [a.model_type for a in safe_torch_load(path)["args"]] == members


@pytest.fixture(scope="module")
def no_args(trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained folder as a Megatron Core checkpoint without args or architecture in common.pt."""
    root = tmp_path_factory.mktemp("noargs") / "ckpt"
    shutil.copytree(trained["ckpt"], root)
    common = safe_torch_load(root / ITER_DIR / COMMON)
    for key in ("args", "architecture"):
        common.pop(key)
    torch.save(common, root / ITER_DIR / COMMON)
    (root / ITER_DIR / "manifest.json").unlink(missing_ok=True)  # hand-edited: no manifest (loads unverified)
    return root


@pytest.fixture(scope="module")
def core_torch_no_args(trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained weights as Megatron-LM's --ckpt-format torch files with Megatron Core names and no args."""
    root = tmp_path_factory.mktemp("coretorch") / "ckpt"
    _, _, flat = read_iteration(str(trained["ckpt"] / ITER_DIR))
    (root / ITER_DIR / "mp_rank_00").mkdir(parents=True)
    torch.save({"model": ours_to_core(flat), "checkpoint_version": 3.0, "iteration": 2},
               root / ITER_DIR / "mp_rank_00" / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    return root


def test_core_checkpoints_without_args_load_with_the_flags(trained, no_args, core_torch_no_args, tmp_path):
    """--load (training and generation) takes the flags' architecture; the weights are the checkpoint's: the first
    loss and the greedy continuation equal those of the same weights loaded from the folder with args."""
    losses, texts = [], []
    (tmp_path / "prompts.txt").write_text("Hello world\n")
    for i, load in enumerate((no_args, core_torch_no_args, trained["ckpt"])):
        proc = run("pretrain_gpt.py", *train_argv(trained["data"], "--load", str(load), "--finetune",
                                                  "--auto-detect-ckpt-format", "--train-iters", "1"), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses.append([line.split("lm loss:")[1].split("|")[0].strip() for line in proc.stdout.splitlines()
                       if "lm loss:" in line])
        proc = run("tools/generate_samples_gpt.py", *MODEL, *trained["data"]["tokenizer"], "--load", str(load),
                   "--auto-detect-ckpt-format", "--sample-input-file", "prompts.txt", "--sample-output-file",
                   f"out{i}.json", "--out-seq-length", "6", "--greedy", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        texts.append(json.loads((tmp_path / f"out{i}.json").read_text().splitlines()[0])["tokens"])
    assert losses[0] and losses[0] == losses[1] == losses[2]
    assert len(texts[0]) == 6 and texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize("flags, fragments", [
    (("--ffn-hidden-size", "64"), ("dense_h_to_4h.weight has shape [128, 32]", "[64, 32]", "--ffn-hidden-size")),
    (("--num-layers", "3"), ("records no args", "holds 2 layers", "pass --num-layers 2")),
])
def test_core_torch_files_without_args_refuse_a_mismatch_in_one_line(trained, core_torch_no_args, tmp_path, flags,
                                                                      fragments):
    proc = run("pretrain_gpt.py", *train_argv(trained["data"], "--load", str(core_torch_no_args), "--finetune",
                                              "--auto-detect-ckpt-format", "--train-iters", "1", *flags),
               cwd=tmp_path)
    assert_one_line_error(proc, *fragments)


@pytest.mark.parametrize("flags, fragments", [
    (("--ffn-hidden-size", "64"), ("dense_h_to_4h.weight has shape [128, 32]", "[64, 32]", "--ffn-hidden-size")),
    (("--max-position-embeddings", "64"), ("position_embeddings.weight has shape [32, 32]", "[64, 32]",
                                           "--max-position-embeddings")),
    (("--num-attention-heads", "8", "--kv-channels", "8"), ("query_key_value.weight has shape [96, 32]",
                                                            "--num-attention-heads")),
    (("--make-vocab-size-divisible-by", "4096"), ("word_embeddings.weight has shape [5120, 32]", "[8192, 32]",
                                                  "--vocab-size")),
    (("--num-layers", "3"), ("records no args", "stack 2 layers", "pass --num-layers 2")),
])
def test_core_checkpoint_without_args_refuses_a_mismatch_in_one_line(trained, no_args, tmp_path, flags, fragments):
    proc = run("pretrain_gpt.py", *train_argv(trained["data"], "--load", str(no_args), "--finetune",
                                              "--ckpt-format", "torch_dist", "--train-iters", "1", *flags),
               cwd=tmp_path)
    assert_one_line_error(proc, *fragments)

"""Megatron's import paths that users' scripts use keep working after the moves into family folders
(megatron/models/<family>/) and into the checkpoint package (megatron/checkpoint/): each old name gives the very object
defined at its new place, so monkeypatching the old name patches what the code calls."""
from __future__ import annotations

import importlib

import pytest

# (old module, name, module where it is defined now)
PATHS = [
    ("megatron.model", "GPTModel", "megatron.models.gpt.model"),
    ("megatron.model.gpt_model", "GPTModel", "megatron.models.gpt.model"),
    ("megatron.model.gpt_model", "flatten_checkpoint_state_dict", "megatron.layers.checkpoint_keys"),
    ("megatron.model", "flatten_checkpoint_state_dict", "megatron.layers.checkpoint_keys"),
    ("megatron.model", "post_language_model_processing", "megatron.models.gpt.model"),
    ("megatron.model.gpt_model_pipe", "GPTModelPipe", "megatron.models.gpt.model_pipe"),
    ("megatron.model", "BertModel", "megatron.models.bert.model"),
    ("megatron.model.bert_model", "BertModel", "megatron.models.bert.model"),
    ("megatron.model.bert_model", "bert_extended_attention_mask", "megatron.models.bert.model"),
    ("megatron.model.classification", "Classification", "megatron.models.bert.classification"),
    ("megatron.model.multiple_choice", "MultipleChoice", "megatron.models.bert.multiple_choice"),
    ("megatron.model", "T5Model", "megatron.models.t5.model"),
    ("megatron.model.t5_model", "T5Model", "megatron.models.t5.model"),
    ("megatron.model.t5_model", "t5_stage_roles", "megatron.models.t5.model"),
    ("megatron.model", "ParallelTransformer", "megatron.layers.transformer"),
    ("megatron.model.transformer", "ParallelTransformer", "megatron.layers.transformer"),
    ("megatron.model.transformer", "ParallelTransformerLayer", "megatron.layers.transformer"),
    ("megatron.model", "Float16Module", "megatron.layers.module"),
    ("megatron.model", "ModelType", "megatron.layers.enums"),
    ("megatron.model", "LayerNorm", "megatron.layers.fused_layer_norm"),
    ("megatron.model.enums", "AttnMaskType", "megatron.layers.enums"),
    ("megatron.model.rotary", "RotaryEmbedding", "megatron.layers.rotary"),
    ("megatron.model.language_model", "parallel_lm_logits", "megatron.layers.language_model"),
    ("megatron.checkpointing", "save_checkpoint", "megatron.compat"),
    ("megatron.checkpointing", "load_checkpoint", "megatron.compat"),
    ("megatron.checkpointing", "load_args_from_checkpoint", "megatron.compat"),
    ("megatron.checkpointing", "check_checkpoint_args", "megatron.compat"),
    ("megatron.checkpointing", "CheckpointError", "megatron.checkpoint.paths"),
    ("megatron.checkpointing", "get_checkpoint_name", "megatron.checkpoint.paths"),
    ("megatron.checkpointing", "get_checkpoint_tracker_filename", "megatron.checkpoint.paths"),
    ("megatron.checkpointing", "read_metadata", "megatron.checkpoint.paths"),
    ("megatron.checkpointing", "get_rng_state", "megatron.checkpoint.rng"),
    ("megatron.checkpointing", "set_rng_state", "megatron.checkpoint.rng"),
    ("megatron.checkpoint.checkpointing", "save_checkpoint", "megatron.compat"),
    ("megatron.checkpoint.checkpointing", "read_checkpoint", "megatron.checkpoint.loading"),
    ("megatron.checkpoint.checkpointing", "write_checkpoint", "megatron.checkpoint.saving"),
    ("megatron.checkpoint_args", "compare_architecture", "megatron.checkpoint.args"),
    ("megatron.checkpoint_args", "ArchitectureMismatchError", "megatron.checkpoint.args"),
    ("megatron.checkpoint_formats", "CheckpointFormatError", "megatron.checkpoint.formats"),
    ("megatron.checkpoint_integrity", "write_manifest", "megatron.checkpoint.integrity"),
    ("megatron.safe_load", "safe_torch_load", "megatron.checkpoint.safe_load"),
    ("megatron.safe_load", "UnsafeCheckpointError", "megatron.checkpoint.safe_load"),
    ("megatron.atomic_io", "DiskFullError", "megatron.checkpoint.atomic_io"),
    ("megatron.flag_registry", "refuse_unimplemented", "megatron.settings.flag_registry"),
    ("megatron.config_flags", "CONFIG_FIELDS", "megatron.settings.config_flags"),
    ("megatron.required_flags", "check_required_flags", "megatron.settings.required_flags"),
    ("megatron.moe_arguments", "validate_moe_args", "megatron.settings.moe_checks"),
    ("megatron.cli_parser", "FlagParser", "megatron.settings.cli_parser"),
]


@pytest.mark.parametrize("old,name,new", PATHS, ids=[f"{o}.{n}" for o, n, _ in PATHS])
def test_old_path_gives_the_same_object(old, name, new):
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


def test_a_moved_module_is_the_same_module_under_both_names():
    from megatron import moved

    for old, new in moved.MOVED_MODULES.items():
        module = importlib.import_module(old)
        assert module is importlib.import_module(new)
        assert module.__spec__.name == new  # the alias does not rename the module
    from megatron.model import bert_model  # `from package import submodule` finds it too
    assert bert_model is importlib.import_module("megatron.models.bert.model")
    assert "BertModel" in dir(importlib.import_module("megatron.model"))
    from megatron import checkpoint_integrity, checkpointing, safe_load  # the checkpoint package's old names too
    assert checkpointing is importlib.import_module("megatron.compat")  # Megatron's args-taking wrappers
    assert checkpoint_integrity is importlib.import_module("megatron.checkpoint.integrity")
    assert safe_load is importlib.import_module("megatron.checkpoint.safe_load")
    from megatron.model import moved as old_moved
    assert old_moved is moved


def test_a_moved_package_keeps_every_submodule_under_its_old_prefix():
    """megatron.checkpoint_conversion moved whole to megatron.checkpoint.conversion: each submodule, however it is
    imported, is the one module object (never loaded twice through the package's __path__)."""
    import megatron.checkpoint.conversion.plugins as new_plugins
    import megatron.checkpoint_conversion.plugins as old_plugins
    from megatron.checkpoint_conversion import hf_format

    assert old_plugins is new_plugins
    assert hf_format is importlib.import_module("megatron.checkpoint.conversion.hf_format")
    assert importlib.import_module("megatron.checkpoint_conversion") is importlib.import_module(
        "megatron.checkpoint.conversion")
    assert importlib.import_module("megatron.checkpoint_conversion.torch_dist").__name__ == (
        "megatron.checkpoint.conversion.torch_dist")


def test_monkeypatching_an_old_checkpoint_path_patches_the_code_that_calls_it(monkeypatch, tmp_path):
    """megatron.checkpointing is megatron.compat: a user's script that patches a name there patches what Megatron's
    wrappers call (here load_checkpoint's `read_checkpoint`, with the records it built from the flags)."""
    import argparse

    import megatron.checkpointing as old
    from megatron import compat

    seen = []
    monkeypatch.setattr("megatron.checkpointing.read_checkpoint", lambda *a, **kw: seen.append(a[3]) or 7)
    args = argparse.Namespace(load=str(tmp_path), pretrained=str(tmp_path / "p"), finetune=True)
    assert compat.load_checkpoint(None, None, None, args, load_arg="pretrained") == 7
    assert (seen[0].load, seen[0].finetune) == (str(tmp_path / "p"), True)
    assert old.read_checkpoint is compat.read_checkpoint


def test_checkpoints_pickle_the_model_enums_by_megatrons_path(tmp_path):
    """args.model_type in a checkpoint names megatron.model.enums (the path Megatron's and our earlier files use),
    and the safe loader reads it back as the very member."""
    import io
    import pickletools
    import zipfile

    import torch

    from megatron.checkpoint.safe_load import safe_torch_load
    from megatron.layers.enums import AttnMaskType, ModelType

    path = tmp_path / "ckpt.pt"
    torch.save({"model_type": ModelType.encoder_and_decoder, "mask": AttnMaskType.causal}, path)
    with zipfile.ZipFile(path) as z:
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    globals_ = {arg for op, arg, _ in pickletools.genops(io.BytesIO(pickled)) if op.name == "GLOBAL"}
    assert globals_ >= {"megatron.model.enums ModelType", "megatron.model.enums AttnMaskType"}
    assert b"megatron.layers" not in pickled
    loaded = safe_torch_load(str(path))
    assert loaded["model_type"] is ModelType.encoder_and_decoder and loaded["mask"] is AttnMaskType.causal

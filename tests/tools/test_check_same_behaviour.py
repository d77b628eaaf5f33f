"""tools/check_same_behaviour.py's runs beyond one process (issue #36's proof): the BLOOM, Mixtral-EP2 and CP2 runs'
flags, the per-rank log records of a 2-process run (MoE aux losses logged, one checkpoint folder per expert rank), a
failed rank stopping its run, a byte difference explained (pickled class paths, text lines), and a compare running in
the record's own work folder (refusing another one), its lock apart from a flock(1) wrapper's."""
from __future__ import annotations

import argparse
import collections
import enum
import fcntl
import importlib.util
import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("check_same_behaviour", ROOT / "tools" / "check_same_behaviour.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DATA = {"gpt_vocab": "V", "gpt_merges": "M", "gpt_prefix": "P", "bert_vocab": "B", "bert_prefix": "Q",
        "ds_config": "/w/ds.json"}


def _flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def test_new_runs_flags_and_processes() -> None:
    tool = _tool()
    argv = {kind: tool._run_argv(kind, DATA) for kind in tool.RUNS}
    assert {kind: script for kind, (script, _) in argv.items()} == {
        "gpt": "pretrain_gpt.py", "llama": "pretrain_gpt.py", "bert": "pretrain_bert.py", "t5": "pretrain_t5.py",
        "gpt_deepspeed": "pretrain_gpt.py", "bloom": "pretrain_gpt.py", "mixtral_ep2": "pretrain_gpt.py",
        "gpt_cp2": "pretrain_gpt.py"}
    gpt = argv["gpt"][1]
    assert argv["gpt_deepspeed"][1] == gpt + ["--deepspeed", "--deepspeed_config", "/w/ds.json"]
    assert argv["gpt_cp2"][1] == gpt + ["--context-parallel-size", "2"]
    assert argv["llama"][1] == gpt + tool._LLAMA
    assert argv["mixtral_ep2"][1][:len(gpt) + len(tool._LLAMA)] == gpt + tool._LLAMA
    bloom = argv["bloom"][1]
    assert (_flag(bloom, "--position-embedding-type"), _flag(bloom, "--num-attention-heads")) == ("alibi", "6")
    assert "--embed-layernorm" in bloom and _flag(bloom, "--hidden-size") == "48"
    moe = argv["mixtral_ep2"][1]
    assert [_flag(moe, f) for f in ("--num-experts", "--moe-router-topk", "--expert-model-parallel-size",
                                    "--moe-z-loss-coeff")] == ["4", "2", "2", "0.001"]
    assert "--moe-layer-freq" not in moe  # every layer is a MoE layer, as in Mixtral
    for kind, (_, flags) in argv.items():  # the scheme: 6 iterations, validation and a checkpoint every 2
        assert [_flag(flags, f) for f in ("--train-iters", "--save-interval", "--eval-interval")] == ["6", "2", "2"]
        world = tool.PROCESSES.get(kind, 1)
        assert world == (2 if kind in ("mixtral_ep2", "gpt_cp2") else 1)


def test_compare_runs_in_the_records_work_folder(tmp_path: Path) -> None:
    tool = _tool()
    rec = tmp_path / "rec.json"
    rec.write_text(json.dumps({tool.META: {"workdir": "/tmp/csb-x", "runs": ["gpt"]}, "gpt": {}}))
    parser = argparse.ArgumentParser()

    def workdir(*argv: str) -> str:
        return tool._workdir_for(parser.parse_args(["--compare", str(rec), *argv]), parser)

    parser.add_argument("--compare")
    parser.add_argument("--record")
    parser.add_argument("--workdir")
    assert workdir() == workdir("--workdir", "/tmp/csb-x/") == "/tmp/csb-x"
    with pytest.raises(SystemExit):
        workdir("--workdir", str(tmp_path))
    rec.write_text(json.dumps({"gpt": {}}))  # a record of before the folder was kept: the default or --workdir
    assert workdir("--workdir", str(tmp_path)) == str(tmp_path)
    assert tool.compare({"gpt": {"log": ["a"], "log.rank1": ["b"], "checkpoints": {}}},
                        {"gpt": {"log": ["a"], "log.rank1": ["c"], "checkpoints": {}}})[0].startswith("gpt log.rank1")


@pytest.mark.slow
def test_a_failed_rank_stops_the_run(tmp_path: Path) -> None:
    tool = _tool()
    code = "import os, sys, time; r = int(os.environ['RANK']); print('rank', r, flush=True); " \
           "sys.exit(3) if r == 1 else time.sleep(120)"
    with pytest.raises(SystemExit, match="gpt_cp2: -c rank 1 exited 3:\nrank 1"):
        tool._launch("gpt_cp2", [sys.executable, "-c", code], str(tmp_path), str(tmp_path / "log"))
    assert (tmp_path / "log.rank0").read_text() == "rank 0\n"  # rank 0 was started, then stopped


@pytest.mark.slow
def test_two_process_run_is_recorded_per_rank(tmp_path: Path) -> None:
    tool = _tool()
    tool.DATA = str(ROOT / "tests" / "fixtures")
    work = str(tmp_path / "work")
    record = tool.record(work, ["mixtral_ep2"])["mixtral_ep2"]
    assert sorted(record) == ["checkpoints", "log", "log.rank1", "log_resumed", "log_resumed.rank1"]
    # the last rank prints the iteration lines (Megatron's print_rank_last), rank 0 the arguments and checkpoints
    lines = [line for line in record["log.rank1"] + record["log_resumed.rank1"] if line.startswith(" iteration ")]
    assert [line.split("/")[0].split()[-1] for line in lines] == ["1", "2", "3", "4", "5", "6"]
    assert all("load_balancing_loss: " in line and "z_loss: " in line and "<T>" in line for line in lines)
    assert "  expert_model_parallel_size ...................... 2" in record["log"]
    assert not any(line.startswith(" iteration ") for line in record["log"] + record["log_resumed"])
    files = record["checkpoints"]
    assert sorted(name for name in files if name.endswith(".pt")) == [
        f"ckpt_mixtral_ep2/iter_{it:07d}/mp_rank_00_{ep:03d}/model_optim_rng.pt" for it in (2, 4, 6) for ep in (0, 1)]
    assert all(len(files[name]["sha256"]) == 64 and files[name]["content"] for name in files if name.endswith(".pt"))
    assert os.path.isdir(os.path.join(work, "logs"))


def test_a_byte_difference_names_the_pickled_classes_and_text_lines(tmp_path: Path, monkeypatch) -> None:
    """A checkpoint whose values are equal but whose pickle names a class at another module path (a moved enum in
    args) differs in bytes: the compare says which class paths changed; a text file's changed lines are shown."""
    tool = _tool()
    kind = enum.Enum("ModelType", "encoder_or_decoder")
    digests = []
    for module in ("megatron.model.enums", "megatron.layers.enums"):
        kind.__module__ = module
        # pickle checks the class is found there; the real modules are put back after the test (deleting them would
        # make the next import build a second ModelType class that later pickles refuse)
        monkeypatch.setitem(sys.modules, module, argparse.Namespace(ModelType=kind))
        path = tmp_path / "model_optim_rng.pt"
        torch.save({"args": argparse.Namespace(model_type=kind.encoder_or_decoder), "w": torch.ones(2),
                    "o": collections.OrderedDict(a=1)}, path)
        digests.append(tool._file_digest(str(path), str(tmp_path)))
    old, new = digests
    assert "argparse.Namespace" in old["classes"] and "collections.OrderedDict" in old["classes"]
    assert old["content"] == new["content"] and old["sha256"] != new["sha256"]
    assert tool._file_difference(old, new) == [
        "    pickled classes: megatron.model.enums.ModelType -> megatron.layers.enums.ModelType"]
    assert tool._file_difference({"sha256": "a", "text": "x\ncrc: 1\n"}, {"sha256": "b", "text": "x\ncrc: 2\n"}) == [
        "    @@ -2 +2 @@", "    -crc: 1", "    +crc: 2"]


def test_a_check_under_a_flock_wrapper_does_not_wait_on_it(tmp_path: Path) -> None:
    """`flock WORK.lock python tools/check_same_behaviour.py ...` (a wrapper holding flock on the tool's lock file)
    must not block the tool inside it: its own lock is a POSIX record lock, apart from flock's."""
    tool = _tool()
    work = str(tmp_path / "work")
    entered = threading.Event()

    def check() -> None:
        with tool._exclusive(work):
            entered.set()

    with open(work + ".lock", "w") as wrapper:
        fcntl.flock(wrapper, fcntl.LOCK_EX)
        threading.Thread(target=check, daemon=True).start()
        assert entered.wait(10), "the check waited on the flock wrapper's lock"


def test_new_settings_at_their_defaults_are_allowed_only_when_asked() -> None:
    """--allow-new-settings: a flag the record does not know, at its default, in the argument dump, the checkpoint's
    args/architecture (so its bytes and manifest) is not a difference; at another value, or any other change, it is;
    without the option the compare is strict."""
    tool = _tool()
    defaults = {"new_flag": 0.5, "other": None, "lr": 1e-4}
    log_old = ["  lr ...... 0.0001", "iteration 1 | lm loss: 1.0"]
    pt_old = {"sha256": "a", "content": {".args.lr": "0.0001", ".model.w": "tensor x"}, "classes": []}
    manifest_old = {"text": '{"files": {"m.pt": {"crc32": "1", "size": 10}}}'}

    def digests(arg_line: str, args_value: str, weight: str = "tensor x") -> dict:
        pt = {"sha256": "b", "content": {".args.lr": "0.0001", ".args.new_flag": args_value,
                                         ".architecture.other": "None", ".model.w": weight}, "classes": []}
        manifest = {"text": '{"files": {"m.pt": {"crc32": "2", "size": 12}}}'}
        return {"gpt": {"log": [log_old[0], arg_line, log_old[1]],
                        "checkpoints": {"c/iter_1/m.pt": pt, "c/iter_1/manifest.json": manifest}}}

    old = {"gpt": {"log": log_old, "checkpoints": {"c/iter_1/m.pt": pt_old, "c/iter_1/manifest.json": manifest_old}}}
    at_default = digests("  new_flag ...... 0.5", "0.5")
    seen: set = set()
    assert tool.compare(old, at_default, defaults, seen) == [] and seen == {"new_flag", "other"}
    assert len(tool.compare(old, at_default)) == 3  # strict: the log, the file, its manifest
    changed = tool.compare(old, digests("  new_flag ...... 0.7", "0.7"), defaults)
    assert [p.split(":")[0] for p in changed] == ["gpt log", "gpt", "gpt"]
    weights = tool.compare(old, digests("  new_flag ...... 0.5", "0.5", weight="tensor y"), defaults)
    assert len(weights) == 2 and ".model.w: tensor x -> tensor y" in weights[0]  # the file and its manifest
    ds_old = {"gpt": {"checkpoints": {"g/global_step1/m.pt": pt_old,
                                      "g/global_step1/manifest.json": {"manifest": {"m.pt": 10}}}}}
    ds_new = {"gpt": {"checkpoints": {"g/global_step1/m.pt": digests("", "0.5")["gpt"]["checkpoints"]["c/iter_1/m.pt"],
                                      "g/global_step1/manifest.json": {"manifest": {"m.pt": 12}}}}}
    assert tool.compare(ds_old, ds_new, defaults) == []  # DeepSpeed's manifest: sizes only


def test_a_new_setting_with_a_48_character_name_is_dropped_at_its_default() -> None:
    """Megatron's argument dump pads names to 48 characters with dots: a 48-character name gets none."""
    tool = _tool()
    name = "inference_dynamic_batching_paused_buffer_size_gb"
    assert len(name) == 48
    old = {"gpt": {"log": ["  lr .............. 0.1"], "checkpoints": {}}}
    new = {"gpt": {"log": ["  lr .............. 0.1", f"  {name}  None"], "checkpoints": {}}}
    seen: set = set()
    assert tool.compare(old, new, {name: None, "lr": 0.1}, seen) == [] and seen == {name}
    assert tool.compare(old, {"gpt": {"log": new["gpt"]["log"][:1] + [f"  {name}  2.0"], "checkpoints": {}}},
                        {name: None}) != []

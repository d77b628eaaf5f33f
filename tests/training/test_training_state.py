"""TrainingState (megatron/training_state.py) and the behaviour-identity tool's comparison (no processes).

- The ``args`` a checkpoint stores, derived from the flags and the state, has Megatron's names, values and key order
  exactly as the loop used to leave them on ``args`` (fresh run, and a resumed one with consumed_valid_tokens);
  callables are dropped as before.
- Counters restore from a checkpoint's top-level keys, or from its saved ``args`` (old checkpoints), and write back
  onto ``args`` for callers that keep their run state there.
- tools/check_same_behaviour.py masks timings only, and reports a changed loss, log line or tensor.
- megatron/training.py never mentions DeepSpeed; both backends implement every method of the seam.
- LoopSettings (megatron/run_configs/run_settings.py) reads the loop's flags once, with Megatron's defaults for absent ones.
"""
from __future__ import annotations

import argparse
import importlib.util
import os

import torch

from megatron.training_state import TrainingState

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parsed() -> argparse.Namespace:
    return argparse.Namespace(lr=1e-3, consumed_train_samples=0, consumed_valid_samples=0, padded_vocab_size=128,
                              hook=lambda: None, params_dtype=torch.float32)


def test_megatron_args_match_the_old_loop_order_and_values() -> None:
    # What the loop used to write onto args (pretrain, get_model, the loop), in that order.
    old = _parsed()
    old.consumed_train_tokens = 0
    old.model_type = "encoder_or_decoder"
    old.iteration = 6
    old.do_train, old.do_valid, old.do_test = True, True, False
    old.curr_iteration = 5
    old.consumed_train_samples, old.consumed_valid_samples, old.consumed_train_tokens = 24, 16, 768
    expected = [(k, v) for k, v in vars(old).items() if k != "hook"]

    args = _parsed()
    args.model_type = "encoder_or_decoder"
    run = TrainingState(iteration=6, consumed_train_samples=24, consumed_valid_samples=16, consumed_train_tokens=768,
                        padded_vocab_size=128, curr_iteration=5, do_train=True, do_valid=True, do_test=False)
    assert list(vars(run.megatron_args(args)).items()) == expected
    assert args.consumed_train_samples == 0 and not hasattr(args, "iteration")  # the flags are not written

    run.consumed_valid_tokens = 0  # a loaded checkpoint provides it; Megatron's loop then has it after model_type
    keys = list(vars(run.megatron_args(args)))
    assert keys[keys.index("model_type") + 1:] == ["consumed_valid_tokens", "iteration", "do_train", "do_valid",
                                                   "do_test", "curr_iteration"]


def test_counters_restore_from_keys_or_old_args_and_write_back() -> None:
    run = TrainingState()
    run.restore_counters({"consumed_train_samples": 40, "consumed_valid_samples": 8, "consumed_train_tokens": 320,
                          "consumed_valid_tokens": 4}, None)
    assert (run.consumed_train_samples, run.consumed_valid_samples, run.consumed_train_tokens,
            run.consumed_valid_tokens) == (40, 8, 320, 4)
    old = TrainingState()
    old.restore_counters({}, argparse.Namespace(consumed_train_samples=12, consumed_valid_samples=3),
                         ("consumed_train_samples", "consumed_valid_samples"))
    assert (old.consumed_train_samples, old.consumed_valid_samples) == (12, 3)
    args = argparse.Namespace()
    run.write_counters(args)
    assert vars(args) == {"consumed_train_samples": 40, "consumed_valid_samples": 8, "consumed_train_tokens": 320,
                          "consumed_valid_tokens": 4}
    assert TrainingState.from_args(args).checkpoint_counters() == vars(args)
    assert TrainingState.from_args(argparse.Namespace()).checkpoint_counters() == dict.fromkeys(vars(args), 0)


def _tool():
    spec = importlib.util.spec_from_file_location("check_same_behaviour",
                                                  os.path.join(ROOT, "tools", "check_same_behaviour.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_behaviour_check_masks_timings_and_reports_changes() -> None:
    tool = _tool()
    line = (" iteration        5/       6 | consumed samples:           20 | elapsed time per iteration (s): 0.02 |"
            " lm loss: 8.481794E+00 | samples per second: 183.112 | TFLOPs: 0.01 |")
    masked = tool._normalise_line(line, "/w")
    assert "lm loss: 8.481794E+00" in masked and "0.02" not in masked and "183.112" not in masked
    assert tool._normalise_line("    save-checkpoint ......: (36.18, 36.18)", "/w").endswith("<T>")
    assert tool._normalise_line("saving checkpoint at iteration 6 to /w/ckpt", "/w").endswith("<WORK>/ckpt")

    digest: dict = {}
    tool._value_digest({"w": torch.ones(2, 3), "step": 3, "args": argparse.Namespace(save="/w/x")}, "/w", digest, "")
    base = {"gpt": {"log": [masked], "log_resumed": [], "checkpoints": {"f.pt": {"sha256": "a", "content": digest}}}}
    assert tool.compare(base, base) == []
    changed_loss = {"gpt": {**base["gpt"], "log": [masked.replace("8.481794", "8.481795")]}}
    assert "gpt log" in tool.compare(base, changed_loss)[0]
    other: dict = {}
    tool._value_digest({"w": torch.ones(2, 3) * 2, "step": 3, "args": argparse.Namespace(save="/w/x")}, "/w", other,
                       "")
    changed_tensor = {"gpt": {**base["gpt"], "checkpoints": {"f.pt": {"sha256": "b", "content": other}}}}
    assert ".w:" in tool.compare(base, changed_tensor)[0]


def test_the_loop_has_no_deepspeed_branches_and_both_backends_implement_the_seam() -> None:
    import inspect

    from megatron import training
    from megatron.backend import TrainingBackend, backend_for
    from megatron.backend.megatron import MegatronBackend
    from megatron.run_configs.deepspeed import DeepSpeedSettings

    code = inspect.getsource(training).split('"""', 2)[2]  # below the module docstring
    assert "deepspeed" not in code.lower()
    def configs(**flags: bool) -> argparse.Namespace:  # backend_for reads only the bundle's DeepSpeed record
        return argparse.Namespace(deepspeed=DeepSpeedSettings.from_args(argparse.Namespace(**flags)))

    assert type(backend_for(configs())) is MegatronBackend
    assert type(backend_for(configs(deepspeed=True))).__name__ == "DeepSpeedBackend"
    methods = {"setup", "load", "train_step", "evaluate", "save", "loss_scale", "params_norm"}
    assert methods <= TrainingBackend.__abstractmethods__
    from megatron.backend.deepspeed import PIPE_MODELS, DeepSpeedBackend

    for cls in (MegatronBackend, DeepSpeedBackend):
        assert not cls.__abstractmethods__, cls
    assert set(PIPE_MODELS) == {"gpt"}  # BERT/T5 keep their entry scripts' one-line refusals under DeepSpeed PP


def test_loop_settings_read_the_flags_with_megatron_defaults() -> None:
    from megatron.run_configs.run_settings import LoopSettings

    minimal = argparse.Namespace(train_iters=8, eval_interval=4, save=None, save_interval=None, load=None, fp16=False,
                                 loss_scale=None)
    loop = LoopSettings.from_args(minimal)  # a namespace without the optional flags gets Megatron's defaults
    assert (loop.exit_interval, loop.exit_duration_in_mins, loop.exit_signal_handler, loop.max_skipped_iterations,
            loop.loss_scale_floor) == (None, None, False, 10, None)
    fp16 = LoopSettings.from_args(argparse.Namespace(**{**vars(minimal), "fp16": True, "min_loss_scale": 2.0}))
    assert fp16.loss_scale_floor == 2.0
    fixed = LoopSettings.from_args(argparse.Namespace(**{**vars(minimal), "fp16": True, "loss_scale": 128.0}))
    assert fixed.loss_scale_floor == 128.0

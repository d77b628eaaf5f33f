"""--saver deepspeed: the stream as a DeepSpeed ``global_stepN`` checkpoint at the target TP
(``mp_rank_XX_model_states.pt``, or with --target-pipeline-parallel-size > 1 the pipeline engine's layer files),
written one tensor rank at a time (megatron/checkpoint/conversion/deepspeed_format.py). Weights and client state only:
train from it with --finetune or --no-load-optim --no-load-rng under any ZeRO stage. The built-in plugin, re-exported
under Megatron-LM's module name."""
from __future__ import annotations

from megatron.checkpoint.conversion.plugins import DeepSpeedSaver

add_arguments = DeepSpeedSaver.add_arguments
save_checkpoint = DeepSpeedSaver.save_checkpoint

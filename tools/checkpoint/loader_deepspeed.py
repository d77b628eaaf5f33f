"""--loader deepspeed: a DeepSpeed ``global_stepN`` folder (ZeRO 0-3, pipeline engine, any TP) streamed layer by
layer (megatron/checkpoint/conversion/deepspeed_format.py: rank files memory-mapped; a ZeRO-3 checkpoint is
consolidated one tensor rank at a time with DeepSpeed's zero_to_fp32). The built-in plugin, re-exported under
Megatron-LM's module name."""
from __future__ import annotations

from megatron.checkpoint.conversion.plugins import DeepSpeedLoader

add_arguments = DeepSpeedLoader.add_arguments
load_checkpoint = DeepSpeedLoader.load_checkpoint

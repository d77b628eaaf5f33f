"""Convert checkpoints between Megatron layouts (any TP / PP / virtual PP), Hugging Face and DeepSpeed.

    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver megatron \
        --load-dir IN --save-dir OUT --target-tensor-parallel-size 4 --target-pipeline-parallel-size 2

Megatron-LM's interface; the code lives in megatron/checkpoint/conversion (loaders/savers are plugins there).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.checkpoint.conversion.driver import main  # noqa: E402
from megatron.errors import exit_on_user_error  # noqa: E402

if __name__ == "__main__":
    exit_on_user_error(main)

"""preprocess_data.py for many cores: the input is cut into --workers partitions (byte ranges of whole lines) that
are tokenized in parallel into partial .bin/.idx files, then merged in order with indexed_dataset's merge_file_.

Same flags and byte-identical output as tools/preprocess_data.py (it shares megatron/data/preprocessing.py).
Partial files are named `{output}.partNNN-PID.{bin,idx}` and are always removed.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.preprocessing import main, run_partitioned  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(run_partitioned, description="Tokenize JSON lines into Megatron .bin/.idx files, one partition "
                                               "per worker, then merge"))

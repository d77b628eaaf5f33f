"""python -m tests.gpu._runner RUNS.json OUT.json: run pretrain_gpt.main(argv) for each argv of RUNS.json in this one
process (world size 1 from the environment; NCCL on CUDA) and write [{stdout, result, error}] to OUT.json."""
from __future__ import annotations

import json
import sys

from tests.ds._workers import run_pretrain_ds


def main() -> None:
    runs = json.loads(open(sys.argv[1]).read())
    import torch
    import torch.distributed as dist

    results = []
    for argv in runs:
        result = run_pretrain_ds(0, 1, argv)
        result["backend"] = dist.get_backend() if dist.is_initialized() else None
        result["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        results.append(result)
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, default=str)


if __name__ == "__main__":
    main()

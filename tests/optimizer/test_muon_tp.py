"""--muon-tp-mode on 2 gloo ranks: `duplicated` and `distributed` give each rank its piece of the serial
Newton-Schulz of the whole matrix (rows or columns split); `blockwise` (each shard alone) does not."""
from __future__ import annotations

from tests.dist_utils import run_distributed
from tests.optimizer._muon_tp_worker import shard_updates


def test_tp_modes_equal_the_serial_orthogonalisation() -> None:
    for diffs in run_distributed(shard_updates, 2):
        for dim in (0, 1):
            assert diffs[("duplicated", dim)] <= 1e-6, diffs
            assert diffs[("distributed", dim)] <= 1e-5, diffs
            assert diffs[("blockwise", dim)] > 1e-2, diffs

"""DeepSpeed integration (``--deepspeed``): config reconciliation, the ``mpu`` adapter, engine set-up and steps.

`megatron.ds.config` is pure Python (safe to import anywhere); `megatron.ds.mpu`, `megatron.ds.engine` and
`megatron.ds.pipe` import ``deepspeed`` lazily, inside the functions that need it, so ``import megatron.ds`` never
loads DeepSpeed.
"""

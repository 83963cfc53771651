"""Parallelism helpers applied by the models' ``parallelize`` functions (TP, AC, compile, FSDP).

See Also:
    :titan:`torchtitan.distributed`: TorchTitan's distributed helpers.
"""

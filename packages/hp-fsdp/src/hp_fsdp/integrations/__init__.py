"""Use hp-fsdp from HF Accelerate, the transformers Trainer and LlamaFactory.

Those clients call torch's ``fully_shard`` for you. :func:`use_hp_fsdp` (or
``HP_FSDP_BACKEND=hp``, read by :func:`install_from_env` when ``hp_fsdp`` is imported) rebinds
the FSDP2 names they look up in ``torch.distributed.fsdp`` to hp-fsdp's objects, for as long as it
is installed; :func:`restore_torch_fsdp` puts torch's back. Nothing on disk is patched, and no
other code path changes. ``python -m hp_fsdp.integrations [-m module | script] [args...]`` runs a
program (``torchrun`` accepts it too) with the switch installed.

See Also:
    :pt:`torch.distributed.fsdp.fully_shard`: the function the clients call, replaced.
"""

from hp_fsdp.integrations._switch import (
    CLIENT_MODULES,
    ENV_VAR,
    TORCH_FSDP_MODULE,
    ClientUse,
    HpFsdpSwitch,
    client_fsdp_uses,
    fsdp2_names,
    hp_fsdp_active,
    install_from_env,
    restore_torch_fsdp,
    use_hp_fsdp,
)

__all__ = [
    "CLIENT_MODULES",
    "ENV_VAR",
    "TORCH_FSDP_MODULE",
    "ClientUse",
    "HpFsdpSwitch",
    "client_fsdp_uses",
    "fsdp2_names",
    "hp_fsdp_active",
    "install_from_env",
    "restore_torch_fsdp",
    "use_hp_fsdp",
]

"""``reshard_after_forward``: the values ``fully_shard`` accepts, normalized.

See Also:
    :pt:`torch.distributed.fsdp.fully_shard`: the ``reshard_after_forward`` argument.
"""

from __future__ import annotations

import logging

__all__ = ["resolve_reshard_after_forward"]

_log = logging.getLogger("hp_fsdp")


def resolve_reshard_after_forward(value: bool | int, shard_size: int) -> bool | int:
    """Normalize ``reshard_after_forward``: a bool, or an int k with 1 < k < shard size.

    Args:
        value: the user's value (bools are checked before ints).
        shard_size: the size of the shard axis.

    Returns:
        ``True``/``False``, or the int ``k``.

    Raises:
        ValueError: for an int that does not divide the shard size, or another type.

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard`: the ``reshard_after_forward`` argument.
    """
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to (bool, None or an int), not {value!r}"
        )
    if value < 1 or value > shard_size or shard_size % value != 0:
        raise ValueError(
            "If passing reshard_after_forward as an int, it should be a factor of "
            f"{shard_size}, not {value} (a divisor of the shard size)"
        )
    if value == 1:
        _log.warning(
            "reshard_after_forward=1 (int) keeps parameters unsharded after forward, which is "
            "reshard_after_forward=False"
        )
        return False
    if value == shard_size:
        return True
    return value

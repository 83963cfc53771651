"""init_empty_weights / init_on_device / init_parameters against single-process construction."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.placement_types import _StridedShard

from hp_dtensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    init_empty_weights,
    init_on_device,
    init_parameters,
    register_init_fn,
)
from hp_dtensor.testing import distributed, fake_world, rank_seed

VOCAB, DIM = 13, 10  # neither divides by 2, 3 or 4 evenly everywhere


class Block(nn.Module):
    """A tiny transformer-ish block: tied embedding/head, norms, MLP, attention projections."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=1)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.rms = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 2 * dim + 1)
        self.down = nn.Linear(2 * dim + 1, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(tokens))
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DIM), dim=-1) @ v
        h = h + self.proj(att)
        h = h + self.down(torch.relu(self.up(self.rms(h))))
        return self.head(h)


class Rope(nn.Module):
    """A module whose buffer is computed in ``__init__`` and recomputed by ``reset_buffers``."""

    def __init__(self, dim: int = 8, seq: int = 6) -> None:
        super().__init__()
        self.dim, self.seq = dim, seq
        self.register_buffer("freqs", self._compute(), persistent=False)
        self.scale = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def _compute(self) -> torch.Tensor:
        inv = 1.0 / (10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))
        return torch.outer(torch.arange(self.seq).float(), inv)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale)

    def reset_buffers(self) -> None:
        self.freqs = self._compute()


class RopeNoProtocol(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.arange(4.0))


class RawParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))


class Custom(nn.Module):
    """Has no reset_parameters; its initializer is registered with ``register_init_fn``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(5))
        _init_custom(self)


def _init_custom(module: nn.Module) -> None:
    assert isinstance(module, Custom)
    nn.init.uniform_(module.gain, -2.0, 2.0)


register_init_fn(Custom, _init_custom)


class ReadsChild(nn.Module):
    """Its initializer touches a child's parameter: outside the contract, must raise."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(3))
        self.child = nn.Linear(3, 3)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.bias.copy_(self.child.weight.sum(0))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.rope = Rope()
        self.custom = Custom()
        self.out = nn.Linear(DIM, 3)


def _assert_same_state(reference: nn.Module, model: nn.Module) -> None:
    ref = reference.state_dict(keep_vars=True)
    got = model.state_dict(keep_vars=True)
    assert list(ref) == list(got)
    for name, value in got.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        assert full.dtype == ref[name].dtype, name
        assert torch.equal(full.detach().cpu(), ref[name].detach()), name


# --- single process ---------------------------------------------------------------------------


def test_init_parameters_equals_real_construction_and_rng_state() -> None:
    torch.manual_seed(7)
    reference = Net()
    ref_next = torch.rand(4)
    with init_empty_weights(include_buffers=True):
        model = Net()
    assert model.block.qkv.weight.is_meta
    assert model.rope.freqs.is_meta
    weight = model.block.qkv.weight
    weight.engine_tag = "kept"  # type: ignore[attr-defined]
    torch.manual_seed(7)
    assert init_parameters(model) is model
    assert torch.equal(torch.rand(4), ref_next)  # the generator advanced exactly as construction
    _assert_same_state(reference, model)
    assert model.block.qkv.weight is weight  # parameter objects keep their identity
    assert weight.engine_tag == "kept"  # type: ignore[attr-defined]
    assert weight.requires_grad
    assert model.block.head.weight is model.block.emb.weight  # still tied
    assert torch.equal(model.block.emb.weight[1], torch.zeros(DIM))  # padding_idx honoured


def test_init_parameters_bf16_and_buffers_left_real() -> None:
    torch.manual_seed(11)
    torch.set_default_dtype(torch.bfloat16)
    try:
        reference = Net()
        with init_empty_weights():  # buffers real: computed in __init__, kept
            model = Net()
        torch.manual_seed(11)
        init_parameters(model)
    finally:
        torch.set_default_dtype(torch.float32)
    assert not model.rope.freqs.is_meta
    assert model.block.up.weight.dtype == torch.bfloat16
    _assert_same_state(reference, model)


def test_init_parameters_model_runs_forward_backward() -> None:
    torch.manual_seed(0)
    reference = Block()
    with init_empty_weights():
        model = Block()
    torch.manual_seed(0)
    init_parameters(model)
    tokens = torch.randint(0, VOCAB, (2, 5))
    reference(tokens).sum().backward()
    model(tokens).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None
        assert q.grad is not None
        assert torch.equal(p.grad, q.grad), name


TORCH_LAYERS = {
    "conv2d": lambda: nn.Conv2d(3, 5, 3),
    "conv_transpose": lambda: nn.ConvTranspose1d(3, 4, 2),
    "batchnorm": lambda: nn.BatchNorm1d(7),
    "groupnorm": lambda: nn.GroupNorm(2, 4),
    "lstm": lambda: nn.LSTM(4, 6, 2),
    "gru": lambda: nn.GRU(4, 5),
    "bilinear": lambda: nn.Bilinear(3, 4, 5),
    "prelu": lambda: nn.PReLU(3),
    "embedding_bag": lambda: nn.EmbeddingBag(10, 4),
    "multihead_attention": lambda: nn.MultiheadAttention(8, 2),
    "transformer_layer": lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0),
}


@pytest.mark.parametrize("name", sorted(TORCH_LAYERS))
def test_torch_layers_match_real_construction(name: str) -> None:
    make = TORCH_LAYERS[name]
    torch.manual_seed(3)
    reference = make()
    with init_empty_weights(include_buffers=True):
        model = make()
    torch.manual_seed(3)
    init_parameters(model)
    _assert_same_state(reference, model)
    if name in ("lstm", "gru"):  # weakly referenced parameters: the module still runs
        x = torch.randn(5, 2, 4)
        assert torch.equal(model(x)[0], reference(x)[0])


def test_raw_parameter_without_initializer_raises() -> None:
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(2, 2), RawParam())
    with pytest.raises(ValueError, match=r"'1\.w' of RawParam .* no initializer"):
        init_parameters(model)


def test_buffer_without_protocol_raises() -> None:
    with init_empty_weights(include_buffers=True):
        model = RopeNoProtocol()
    with pytest.raises(ValueError, match=r"buffer 'freqs'.*reset_buffers"):
        init_parameters(model)


def test_initializer_reading_other_module_raises() -> None:
    with init_empty_weights():
        model = ReadsChild()
    with pytest.raises(ValueError, match="initializer of module"):
        init_parameters(model)


def test_partial_writer_raises() -> None:
    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.empty(2))
            self.b = nn.Parameter(torch.empty(2))

        def reset_parameters(self) -> None:
            nn.init.ones_(self.a)

    with init_empty_weights():
        model = Half()
    with pytest.raises(ValueError, match=r"param 'b' .* did not write it"):
        init_parameters(model)


def test_reinitialize_after_to_empty() -> None:
    torch.manual_seed(2)
    reference = Block()
    with init_empty_weights():
        model = Block()
    model.to_empty(device="cpu")  # garbage values, and the tie is broken by to_empty
    model.head.weight = model.emb.weight
    torch.manual_seed(2)
    init_parameters(model, reinitialize=True)
    _assert_same_state(reference, model)
    kept = nn.Linear(3, 3)
    before = kept.weight.detach().clone()
    with init_empty_weights():
        mixed = nn.Sequential(kept, nn.Linear(3, 2))
    init_parameters(mixed)  # without reinitialize, materialized tensors keep their values
    assert torch.equal(mixed[0].weight, before)


def test_no_meta_tensor_raises() -> None:
    with pytest.raises(
        ValueError, match=r"no parameter or buffer on the meta device.*reinitialize=True"
    ):
        init_parameters(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"expects an nn\.Module"):
        init_parameters(torch.zeros(2))  # type: ignore[type-var]


def test_frozen_flag_kept_and_partial_dtensor_rejected() -> None:
    with init_empty_weights():
        model = nn.Linear(4, 3)
    model.bias.requires_grad_(False)
    init_parameters(model)
    assert not model.bias.requires_grad
    assert model.weight.requires_grad
    with fake_world(2, rank=1):
        mesh = init_device_mesh("cpu", (2,))
        with init_empty_weights():
            model = nn.Linear(4, 3)
        local = torch.empty(3, 4, device="meta")
        model.weight = nn.Parameter(DTensor.from_local(local, mesh, [Partial()]))
        with pytest.raises(ValueError, match="Partial placement"):
            init_parameters(model)


def test_register_init_fn_validates() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        register_init_fn(int, _init_custom)  # type: ignore[arg-type]


def test_init_on_device_cpu_and_meta() -> None:
    with init_on_device("meta"):
        model = Rope()
    assert model.scale.is_meta
    assert not model.freqs.is_meta
    assert isinstance(model.scale, nn.Parameter)
    with init_on_device(torch.device("meta"), include_buffers=True):
        model = Rope()
    assert model.freqs.is_meta
    with init_on_device("cpu"):
        assert nn.Linear(2, 2).weight.device.type == "cpu"
    # the patch is removed after the block
    assert not nn.Linear(2, 2).weight.is_meta


# --- distributed: DTensor parameters -----------------------------------------------------------


def _distribute_params(model: nn.Module, mesh: object, placements_for: object) -> None:
    """Replace every parameter by a DTensor (meta local shard), keeping tied parameters tied."""
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in seen:
                placements = placements_for(name, param)  # type: ignore[operator]
                dt = distribute_tensor(param, mesh, placements, src_data_rank=None)  # type: ignore[arg-type]
                seen[id(param)] = nn.Parameter(dt, requires_grad=param.requires_grad)
            module._parameters[name] = seen[id(param)]


def _shard0(name: str, param: torch.Tensor) -> list[Placement]:
    return [Shard(0)]


def _shard_last(name: str, param: torch.Tensor) -> list[Placement]:
    return [Shard(param.dim() - 1)]


def _two_d(name: str, param: torch.Tensor) -> list[Placement]:
    if param.dim() == 2:
        return [Shard(0), Shard(1)]
    return [Replicate(), Shard(0)]


def _strided(name: str, param: torch.Tensor) -> list[Placement]:
    # FSDP x TP style: the tensor is sharded first over mesh dim 1, then over mesh dim 0.
    return [_StridedShard(0, split_factor=2), Shard(0)]


_PLACEMENTS = {"shard0": _shard0, "shard_last": _shard_last, "2d": _two_d, "strided": _strided}


def _check_dtensor_init(shape: tuple[int, ...], kind: str) -> None:
    torch.manual_seed(5)
    reference = Net()
    torch.manual_seed(rank_seed(1))  # a different generator state on every rank before building
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[: len(shape)])
    if kind.startswith("mesh2_"):  # a 1-D mesh of 2 ranks: the "tp" axis of the 2x2 mesh
        mesh, kind = mesh["tp"], kind.removeprefix("mesh2_")
    with init_empty_weights():
        model = Net()
    _distribute_params(model, mesh, _PLACEMENTS[kind])
    assert isinstance(model.block.qkv.weight, DTensor)
    weight = model.block.qkv.weight
    weight.engine_tag = "kept"  # type: ignore[attr-defined]
    torch.manual_seed(5)
    init_parameters(model)
    assert model.block.qkv.weight is weight
    assert weight.engine_tag == "kept"  # type: ignore[attr-defined]
    assert weight.requires_grad
    assert model.block.head.weight is model.block.emb.weight
    local = model.block.up.weight.to_local()
    assert not local.is_meta
    expected = distribute_tensor(
        reference.block.up.weight.detach(),
        mesh,
        model.block.up.weight.placements,
        src_data_rank=None,
    ).to_local()
    assert torch.equal(local, expected)
    for param in model.parameters():  # only the local shard is kept: no view of a full tensor
        shard = param.to_local()
        assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size()
    _assert_same_state(reference, model)


@pytest.mark.parametrize("kind", ["shard0", "shard_last"])
@distributed(world_size=3)
def test_init_dtensor_ws3_uneven(kind: str) -> None:
    _check_dtensor_init((3,), kind)


@pytest.mark.parametrize(
    ("shape", "kind"),
    [((4,), "shard0"), ((2, 2), "2d"), ((2, 2), "strided"), ((2, 2), "mesh2_shard_last")],
)
@distributed(world_size=4)
def test_init_dtensor_ws4_2x2_and_mesh2(shape: tuple[int, ...], kind: str) -> None:
    _check_dtensor_init(shape, kind)


@distributed(world_size=3)
def test_init_then_torch_fully_shard_trains_like_one_process() -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = Block()
    with init_empty_weights():
        model = Block()
    fully_shard(model)
    torch.manual_seed(0)
    init_parameters(model)
    _assert_same_state(reference, model)
    # one step on different data per rank; the reference sees the whole global batch
    torch.manual_seed(rank_seed(2))
    tokens = torch.randint(0, VOCAB, (2, 5))
    gathered = [torch.empty_like(tokens) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tokens)
    model(tokens).sum().backward()
    reference(torch.cat(gathered)).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(p.grad, DTensor)
        assert q.grad is not None
        torch.testing.assert_close(
            p.grad.full_tensor() * dist.get_world_size(), q.grad, rtol=1e-5, atol=1e-5, msg=name
        )


def _clear_dtensor_caches() -> None:
    """Work around stale DTensor caches in a reused worker (to move into the harness).

    torch caches sharding propagation and redistribution plans keyed by DeviceMesh equality,
    which ignores process-group names; the harness destroys a test's groups afterwards, so an
    equal mesh built by a later test in the same worker would be handed specs that still name the
    destroyed groups ("Could not resolve the process group registered under the name 5").
    """
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


@distributed(world_size=4)
def test_init_after_torch_tp_and_fsdp_2d() -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _clear_dtensor_caches()
    torch.manual_seed(4)
    reference = Block()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with init_empty_weights():
        model = Block()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    placements = model.up.weight.placements
    assert len(placements) == 2  # torch chose the 2-D (dp, tp) layout
    assert isinstance(placements[1], Shard)
    torch.manual_seed(4)
    init_parameters(model)
    _assert_same_state(reference, model)

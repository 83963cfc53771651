"""init_parameters with HuggingFace-style initializers (writes through .data), partial writes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hp_dtensor import (
    Shard,
    distribute_tensor,
    init_device_mesh,
    init_empty_weights,
    init_parameters,
    register_init_fn,
)
from hp_dtensor.testing import fake_world


class HFStyle(nn.Module):
    """A model initialized like HuggingFace's ``_init_weights``: through ``.data``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 7)
        self.norm = nn.LayerNorm(7)
        self.register_buffer("positions", torch.zeros(5, dtype=torch.long))

    def init_weights(self) -> None:
        for module in self.modules():
            _hf_init(module)


def _hf_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=0.02)
        assert module.bias is not None
        module.bias.data.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.data = torch.randn(module.num_embeddings, module.embedding_dim) * 0.02
    elif isinstance(module, nn.LayerNorm):
        module.weight.data.fill_(1.0)
        module.bias.data.zero_()
    elif isinstance(module, HFStyle):
        module.positions.data.copy_(torch.arange(1, 6))


@pytest.fixture
def hf_init() -> object:
    for cls in (nn.Linear, nn.Embedding, nn.LayerNorm, HFStyle):
        register_init_fn(cls, _hf_init)
    yield
    from hp_dtensor import init as init_module

    for cls in (nn.Linear, nn.Embedding, nn.LayerNorm, HFStyle):
        init_module._INIT_FNS.pop(cls, None)


def _reference(seed: int) -> HFStyle:
    """One process, built for real, then initialized the HuggingFace way."""
    torch.manual_seed(seed)
    with init_empty_weights():  # skip the constructors' own draws, like HF's _init_weights flow
        model = HFStyle()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_data_writes_accepted_and_equal_one_process(hf_init: object) -> None:
    expected = _reference(7)
    with init_empty_weights(include_buffers=True):
        model = HFStyle()
    torch.manual_seed(7)
    init_parameters(model, device="cpu")
    for (name, got), (_, want) in zip(
        model.state_dict().items(), expected.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name
    assert torch.equal(model.positions, torch.arange(1, 6))


def test_data_writes_sharded_local_shard_equals_one_process(hf_init: object) -> None:
    expected = _reference(3)
    with fake_world(3, rank=2):
        mesh = init_device_mesh("cpu", (3,))
        with init_empty_weights():
            model = HFStyle()
        for module, name in ((model.embed, "weight"), (model.proj, "weight"), (model.proj, "bias")):
            meta = getattr(module, name)
            sharded = distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(sharded))
        torch.manual_seed(3)
        init_parameters(model, device="cpu")
        for name in ("embed.weight", "proj.weight", "proj.bias"):
            local = model.get_parameter(name).to_local()
            want = torch.chunk(expected.get_parameter(name), 3)[2]  # uneven: 11 and 7 rows
            assert torch.equal(local, want), name


class PartlyWritten(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(torch.empty(4, 3))

    def reset_parameters(self) -> None:
        if self.how == "data-slice":
            self.weight.data[:, :2].normal_()
        elif self.how == "view":
            with torch.no_grad():
                self.weight[0].fill_(1.0)
        else:
            self.weight.data.normal_()


@pytest.mark.parametrize(("how", "unset"), [("data-slice", 4), ("view", 9)])
def test_partly_written_tensor_is_an_error(how: str, unset: int) -> None:
    with init_empty_weights():
        model = PartlyWritten(how)
    with pytest.raises(ValueError, match=rf"param 'weight' .* partly written .*{unset} of 12"):
        init_parameters(model, device="cpu")


def test_fully_written_through_data_is_fine() -> None:
    with init_empty_weights():
        model = PartlyWritten("all")
    torch.manual_seed(0)
    init_parameters(model, device="cpu")
    torch.manual_seed(0)
    assert torch.equal(model.weight, torch.empty(4, 3).normal_())

"""hp-fsdp through HF Accelerate's FSDP2 path (``hp_fsdp.integrations.use_hp_fsdp``).

The same Accelerate loop (prepare, backward, ``clip_grad_norm_``, step, ``get_state_dict``,
``save_state`` / ``load_state``) runs on a tiny random ``LlamaForCausalLM`` with torch's FSDP2 and
then with the switch installed, on 2 and 3 gloo ranks with different data on each rank: losses,
gradient norms and the full weights ``get_state_dict`` returns are bitwise equal, and the model was
sharded by hp-fsdp (no torch FSDP2 unit in it). Accelerate 1.16 ignores the FSDP plugin on a CPU
machine; the helpers set its state to FSDP after construction (see ``_integration_helpers``).
Bad input: switching while a torch-sharded model is alive, a client using a name hp-fsdp lacks or
binding one at import time, and a bad ``HP_FSDP_BACKEND``.
"""

from __future__ import annotations

import gc
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

import hp_fsdp
from hp_dtensor.testing import distributed, load_test_module, rank_seed
from hp_fsdp.integrations import (
    _switch,
    client_fsdp_uses,
    hp_fsdp_active,
    install_from_env,
    restore_torch_fsdp,
    use_hp_fsdp,
)

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

STEPS = 3
ROOT = Path(__file__).resolve().parents[3]


def _h() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_integration_helpers.py"), "hp_fsdp_integration_helpers"
    )


def _batches(tok: Any, n: int) -> list[torch.Tensor]:
    h = _h()
    out = []
    for step in range(n):
        enc = tok(h.texts(rank_seed(step), 2), return_tensors="pt")
        out.append(enc["input_ids"])
    return out


def _accelerate_loop(ckpt: str, mixed_precision: str) -> dict[str, Any]:
    """One Accelerate FSDP2 run; returns what the test compares."""
    from accelerate import Accelerator  # type: ignore[import-untyped]
    from accelerate.utils import FullyShardedDataParallelPlugin  # type: ignore[import-untyped]

    h = _h()
    tok = h.tokenizer()
    batches = _batches(tok, STEPS + 1)
    with h.accelerate_env():
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            reshard_after_forward=True,
            state_dict_type="SHARDED_STATE_DICT",
        )
        acc = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision=mixed_precision)
        h.force_fsdp_on_cpu(acc, plugin)
        model = h.tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        prepared: Any = acc.prepare(model, opt)
        # Accelerate's own check, against whatever torch.distributed.fsdp.FSDPModule is now
        assert isinstance(prepared[0], torch_fsdp.FSDPModule)
        model, opt = prepared
        units = h.hp_units(model)
        losses, norms = [], []
        # three steps, save_state, a fourth step, load_state, the fourth step again
        for i, ids in enumerate([*batches[:STEPS], batches[STEPS], batches[STEPS]]):
            if i == STEPS + 1:
                acc.load_state(ckpt)
            out = model(input_ids=ids, labels=ids)
            acc.backward(out.loss)
            norms.append(acc.clip_grad_norm_(model.parameters(), 0.5).item())
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
            if i == STEPS - 1:
                acc.save_state(ckpt)
        full = acc.get_state_dict(model)
        result = {"units": units, "losses": losses, "norms": norms, "keys": sorted(full)}
        result["full"] = {k: v.clone() for k, v in full.items()}
        del model, opt, acc, full, prepared, out
        gc.collect()
    return result


def _compare(ckpt_root: str, mixed_precision: str) -> None:
    import torch.distributed as dist

    rank_dir = f"{ckpt_root}/{mixed_precision}"

    def torch_llamas() -> int:
        return _switch._torch_sharded_roots(torch_fsdp.FSDPModule).count("FSDPLlamaForCausalLM")

    before = torch_llamas()
    theirs = _accelerate_loop(f"{rank_dir}/torch", mixed_precision)
    gc.collect()
    # this run's torch-sharded model is gone; the warm pool may hold other tests' models
    assert torch_llamas() == before
    assert not hp_fsdp_active()
    with use_hp_fsdp(allow_torch_sharded=True) as switch:
        assert torch_fsdp.fully_shard is hp_fsdp.fully_shard  # type: ignore[comparison-overlap]
        assert "FSDPModule" in switch.names
        ours = _accelerate_loop(f"{rank_dir}/hp", mixed_precision)
    assert torch_fsdp.fully_shard.__module__ == "torch.distributed.fsdp"
    assert not hp_fsdp_active()
    # 2 decoder layers, the embedding, norm and lm_head (one list unit) and the root
    assert ours["units"] == (6, 0), ours["units"]
    assert theirs["units"] == (0, 6), theirs["units"]
    assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    assert ours["norms"] == theirs["norms"]
    # the step after load_state repeats the step after save_state exactly
    assert ours["losses"][STEPS + 1] == ours["losses"][STEPS]
    assert ours["losses"][STEPS] != ours["losses"][STEPS - 1]
    assert ours["keys"] == theirs["keys"]
    if dist.get_rank() == 0:  # full_state_dict with cpu_offload: rank 0 holds the weights
        assert len(ours["full"]) == 2 + 9 * 2 + 1  # embed, norm, lm_head + 9 per layer
        for k in ours["keys"]:
            assert torch.equal(ours["full"][k], theirs["full"][k]), k


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@distributed(world_size=2, timeout=180)
def test_accelerate_fsdp2_loop_bitwise_equal_to_torch_ws2(mixed_precision: str) -> None:
    import tempfile

    import torch.distributed as dist

    root = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(root, src=0)
    _compare(root[0], mixed_precision)


@distributed(world_size=3, timeout=180)
def test_accelerate_fsdp2_loop_bitwise_equal_to_torch_ws3() -> None:
    import tempfile

    import torch.distributed as dist

    root = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(root, src=0)
    _compare(root[0], "no")


# --------------------------------------------------------------------------- the switch itself


def test_switch_rebinds_exactly_the_names_accelerate_and_trainer_use() -> None:
    uses = client_fsdp_uses()
    fsdp2 = set(_switch.fsdp2_names())
    used = {u.name.rsplit(".", 1)[1] for u in uses} & fsdp2
    assert used == {
        "CPUOffloadPolicy",
        "FSDPModule",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "fully_shard",
        "register_fsdp_forward_method",
    }
    before = {n: getattr(torch_fsdp, n) for n in torch_fsdp.__all__}
    with use_hp_fsdp() as switch:
        assert set(switch.names) == used
        for name in torch_fsdp.__all__:
            expected = getattr(hp_fsdp, name) if name in used else before[name]
            assert getattr(torch_fsdp, name) is expected, name
        with use_hp_fsdp() as inner:  # nested: no-op, the outer one restores
            assert inner.names == switch.names
        assert hp_fsdp_active()
    assert {n: getattr(torch_fsdp, n) for n in torch_fsdp.__all__} == before
    assert restore_torch_fsdp() is False


def test_torch_policy_made_before_the_switch_still_converts() -> None:
    from hp_fsdp.policies import to_mp_policy, to_offload_policy

    mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    off = torch_fsdp.CPUOffloadPolicy(pin_memory=False)
    with use_hp_fsdp():
        assert to_mp_policy(mp) == hp_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        assert to_offload_policy(off) == hp_fsdp.CPUOffloadPolicy(pin_memory=False)


@distributed(world_size=2)
def test_switch_refuses_while_a_torch_sharded_model_is_alive() -> None:
    # the warm pool may hold torch-sharded models of earlier tests: look for this one by name
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    torch_fsdp.fully_shard(model)
    with pytest.raises(RuntimeError, match=r"already sharded by torch's fully_shard are alive \("):
        use_hp_fsdp()
    assert not hp_fsdp_active()
    assert "FSDPSequential" in _switch._torch_sharded_roots(torch_fsdp.FSDPModule)
    del model
    gc.collect()
    assert "FSDPSequential" not in _switch._torch_sharded_roots(torch_fsdp.FSDPModule)
    with use_hp_fsdp(allow_torch_sharded=True):
        assert hp_fsdp_active()
    with pytest.raises(TypeError, match="allow_torch_sharded must be a bool, got str"):
        use_hp_fsdp(allow_torch_sharded="yes")  # type: ignore[arg-type]


def _fake_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    pkg = tmp_path / "fake_fsdp_client"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        _switch, "CLIENT_MODULES", (*_switch.CLIENT_MODULES, "fake_fsdp_client.train")
    )


def test_switch_names_a_client_name_hp_fsdp_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_client(
        tmp_path,
        monkeypatch,
        """
        import torch.distributed as dist

        def prepare(model):
            from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
            return dist.fsdp.fully_shard(model)
        """,
    )
    with pytest.raises(
        RuntimeError,
        match=r"fake_fsdp_client.train:5 uses .*_fsdp_state.FSDPState, an FSDP2 internal",
    ):
        use_hp_fsdp()
    assert not hp_fsdp_active()


def test_switch_refuses_a_client_binding_fully_shard_at_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_client(
        tmp_path,
        monkeypatch,
        """
        from torch.distributed.fsdp import fully_shard
        """,
    )
    with pytest.raises(
        RuntimeError,
        match=r"fake_fsdp_client.train:2 binds torch.distributed.fsdp.fully_shard at import",
    ):
        use_hp_fsdp()
    assert not hp_fsdp_active()


def test_install_from_env() -> None:
    assert install_from_env({}) is False
    assert install_from_env({"HP_FSDP_BACKEND": "torch"}) is False
    try:
        assert install_from_env({"HP_FSDP_BACKEND": "hp"}) is True
        assert torch_fsdp.fully_shard is hp_fsdp.fully_shard  # type: ignore[comparison-overlap]
    finally:
        restore_torch_fsdp()
    with pytest.raises(ValueError, match=r"HP_FSDP_BACKEND must be 'hp' or 'torch'.*'deepspeed'"):
        install_from_env({"HP_FSDP_BACKEND": "deepspeed"})
    with pytest.raises(TypeError, match="modules must be a tuple"):
        client_fsdp_uses(["accelerate.accelerator"])  # type: ignore[arg-type]


def test_switched_names_are_parity_rows() -> None:
    """Every name the switch rebinds is a provided row of the parity map (same torch name)."""
    tomllib = pytest.importorskip("tomllib")
    path = ROOT / "docs" / "parity" / "fsdp.toml"
    if not path.is_file():
        pytest.skip("docs/parity not in this checkout")
    rows = tomllib.loads(path.read_text())["interface"]
    provided = {
        r["torch"].rsplit(".", 1)[1]
        for r in rows
        if "torch" in r and "hp" in r and r["torch"].startswith("torch.distributed.fsdp.")
    }
    with use_hp_fsdp() as switch:
        missing = set(switch.names) - provided
    assert not missing, missing


def test_module_runner_installs_the_switch_and_runs_the_program(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch.distributed.fsdp as f\n"
        "print(f.fully_shard.__module__, f.FSDPModule.__module__, sys.argv[1:])\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "hp_fsdp.integrations", str(script), "--lr", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[0] == "hp_fsdp.api hp_fsdp.fsdp_module ['--lr', '1']"
    from hp_fsdp.integrations.__main__ import main

    with pytest.raises(ValueError, match=r"usage: python -m hp_fsdp.integrations"):
        main([])
    assert not hp_fsdp_active()

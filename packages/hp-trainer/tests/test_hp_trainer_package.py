"""Package-level checks for hp-trainer."""

import importlib.metadata

import hp_trainer


def test_version_matches_metadata() -> None:
    assert hp_trainer.__version__ == importlib.metadata.version("hp-trainer")


def test_all_names_resolve() -> None:
    for name in hp_trainer.__all__:
        assert hasattr(hp_trainer, name), name


def test_import_does_not_import_dynamo() -> None:
    """Every rank and every launcher imports hp_trainer: torch._dynamo and torch._inductor
    (~1.6 of ~3.6 CPU s) wait until something compiles, and hp-pp until something pipelines."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import hp_trainer, hp_trainer.cli\n"
        "heavy = ('torch._dynamo', 'torch._inductor', 'torch.distributed.pipelining', 'hp_pp')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

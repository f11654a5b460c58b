"""The example scripts keep the newest checkpoints by default instead of every one."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

from tests.helpers.process import ROOT


def test_example_train_keeps_the_newest_five_by_default(
    trainer: ModuleType, tmp_path: Path, deterministic_torch: None
) -> None:
    save_dir = tmp_path / "run"
    argv = ["train", "--save-dir", str(save_dir), "--steps", "40", "--save-every", "5", "--samples", "256",
            "--hidden", "16", "--no-fsync", "--quiet"]
    assert trainer.parse_args(argv).keep_last == 5
    assert trainer.main(argv) == 0
    assert trainer.committed_steps(save_dir) == [20, 25, 30, 35, 40]
    everything = tmp_path / "all"
    argv[2] = str(everything)
    assert trainer.main([*argv, "--keep-last", "0"]) == 0  # 0: every checkpoint, as the library's default
    assert trainer.committed_steps(everything) == list(range(5, 41, 5))


def test_child_command_passes_the_run_configs_retention(trainer: ModuleType) -> None:
    cfg = trainer.RunConfig(save_dir="x")
    assert cfg.keep_last is None  # the tests' runs resume from every checkpoint
    cmd = trainer.child_command(cfg, None)
    assert cmd[cmd.index("--keep-last") + 1] == "0"
    cmd = trainer.child_command(trainer.RunConfig(save_dir="x", keep_last=2), None)
    assert cmd[cmd.index("--keep-last") + 1] == "2"


def test_fsdp_example_has_the_same_keep_last_option() -> None:
    """examples/train_fsdp.py (run under torchrun in tests/system/distributed/test_distributed.py) parses --keep-last
    with the demo's default and hands it to its CheckpointConfig."""
    source = (ROOT / "examples" / "train_fsdp.py").read_text()
    tree = ast.parse(source)
    options = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "--keep-last"
    ]
    assert len(options) == 1
    defaults = {k.arg: ast.unparse(k.value) for k in options[0].keywords}
    assert defaults["default"] == "demo.KEEP_LAST"
    assert "keep_last=cfg.keep_last" in source

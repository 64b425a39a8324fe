"""`import sisrl.trainer` (and its plug-ins package) must never import TRL or verl."""

from __future__ import annotations

import subprocess
import sys


def test_trainer_import_needs_no_framework() -> None:
    code = (
        "import sys, sisrl.trainer, sisrl.trainer.plugins, sisrl.trainer.losses, sisrl.trainer.sis\n"
        "loaded = sorted(m for m in ('trl', 'verl', 'ray', 'vllm') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

"""Re-export of `sisrl.common.models` for trainer/demo.py and trainer/crossworld.py, which still import it from
here; remove once they import `sisrl.common.models` (a trainer module must not import the gateway's)."""

from sisrl.common.models import SMOLLM2, build_tiny_policy, load_tokenizer, resolve_policy_path, smollm2_dir

__all__ = ["SMOLLM2", "build_tiny_policy", "load_tokenizer", "resolve_policy_path", "smollm2_dir"]

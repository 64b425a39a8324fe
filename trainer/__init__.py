"""sisrl.trainer."""

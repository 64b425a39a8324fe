"""sisrl.trainer.plugins."""

"""sisrl.services."""

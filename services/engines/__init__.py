"""sisrl.services.engines."""

"""sisrl.services.routes."""

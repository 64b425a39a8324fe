"""One router per resource: /retrieve, /health, /metrics."""

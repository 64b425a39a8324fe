"""One router per resource of the policy server."""

"""`python -m sisrl.services.engines.openai_server` (see `cli.py`)."""

from sisrl.services.engines.openai_server.cli import main

main()

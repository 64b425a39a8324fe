"""A small OpenAI-completions-compatible server over the local engine (a CPU policy server, vLLM's wire format).

    python -m sisrl.services.engines.openai_server --model smollm2-135m-instruct --port 8001

Routes: `POST /v1/completions` (prompt as token ids, `logprobs=K`, `return_tokens_as_token_ids`,
`return_token_ids`, stop strings, seed), `POST /v1/load_weights` (safetensors dir under `--checkpoint-root`),
`GET /v1/models`, `GET /health`, `GET /metrics`. Each completion response carries `X-Policy-Version`.
Set `SISRL_ENGINE_API_TOKEN` (at least 16 characters; or `SISRL_ENGINE_API_TOKEN_FILE`, a file holding it) to
require `Authorization: Bearer <token>` on every route but `/health`. Completions are bounded by `--max-in-flight`,
`--max-queued` (429 with Retry-After beyond) and `--request-timeout-s`, and cancelled when their client goes away
(sisrl.common.admission).
"""

from sisrl.services.engines.openai_server.app import create_app
from sisrl.services.engines.openai_server.cli import main, parse_args
from sisrl.services.engines.openai_server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "main", "parse_args"]

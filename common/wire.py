"""Constants of the wire contracts between the parts (docs/design.md, "Wire contracts"): one definition each.

A part reads these instead of restating them, so the trainer's defaults, the gateway's limits and the
engines' conventions cannot drift apart.
"""

from __future__ import annotations

LOOPBACK = "127.0.0.1"
RETRIEVER_PORT = 8000  # `sisrl-retriever serve` (Search-R1's retrieval server uses 8000 too)
ENGINE_PORT = 8001  # `python -m sisrl.services.engines.openai_server`
GATEWAY_PORT = 8100  # `sisrl-gateway serve`
RETRIEVER_URL = f"http://{LOOPBACK}:{RETRIEVER_PORT}"
GATEWAY_URL = f"http://{LOOPBACK}:{GATEWAY_PORT}"
# Training runs live under this folder (trainer `run_dir` default `runs/run`), and the gateway loads pushed
# weights only from under its checkpoint root, which defaults to the same folder.
RUNS_ROOT = "runs"

# Log-probs are floored here (vLLM's OpenAI server uses the same floor): tokens top-p removed carry a finite,
# JSON-safe value instead of -inf.
MIN_LOGPROB = -9999.0
# K: top-K ids/log-probs of q recorded per sampled token. The gateway refuses more than MAX_LOGPROBS_K.
DEFAULT_LOGPROBS_K = 20
MAX_LOGPROBS_K = 100

# Every field of a trajectory as the gateway serves it (`GET /v1/batches/{id}`, `GET /v1/rollouts/{id}`, which
# adds `sis`: the newest SIS record, or null); the trainer reads a subset under the same names.
TRAJECTORY_FIELDS = (
    "id", "batch_id", "item_id", "group_id", "run", "step", "data_source", "question", "golden_answers",
    "prompt_ids", "response_ids", "loss_mask", "behaviour_logprobs", "topk_ids", "topk_logprobs", "token_versions",
    "turns",
    "finish_reason", "answer", "reward", "reward_parts", "policy_version", "timings", "error",
)

# SIS records (trainer -> gateway, `POST /v1/sis_records`): the trainer's last decision per response token.
SIS_NOT_POLICY = -1  # loss mask 0: inserted by the environment, counted nowhere
SIS_REJECTED = 0  # y_t in V_K, failed the accept test u <= w_t / M_t
SIS_ACCEPTED = 1
SIS_OUTSIDE = 2  # y_t outside V_K: always rejected
MAX_SIS_RECORDS = 512  # records per request; `GatewayClient.post_sis_records` splits longer lists

"""Wire models of the retrieval server; the shapes are Search-R1's (`search_r1/search/retrieval_server.py`),
which verl's SearchTool and SkyRL's search env also send and parse (docs/design.md, "Retrieval")."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sisrl.retriever.settings import MAX_TOPK


class RetrieveRequest(BaseModel):
    """`{"queries": [str], "topk": int, "return_scores": bool}`; `{"query": str}` (one query) is accepted too."""

    # extra="ignore": clients add fields of their own (e.g. request ids).
    # Exactly one of `queries` / `query` (the `oneOf` below puts the rule in the schema). Neither is nullable:
    # absent means "not given", an explicit null is a 422 like any other wrong type.
    # strict: a 0 is not a bool and "3" not an int (the schema's types are the accepted ones, see _integral_number).
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"oneOf": [
        {"required": ["queries"], "not": {"required": ["query"]}},
        {"required": ["query"], "not": {"required": ["queries"]}},
    ]})

    queries: list[str] = Field(None, min_length=1, description="queries, answered in order")  # type: ignore[arg-type]
    query: str = Field(None, description="a single query, instead of `queries`")  # type: ignore[assignment]
    topk: int | None = Field(None, ge=1, le=MAX_TOPK, description="passages per query; default: server setting")
    return_scores: bool = Field(False, description="wrap each passage as {document, score}")

    @field_validator("topk", mode="before")
    @classmethod
    def _integral_number(cls, value: object) -> object:
        # JSON Schema's `integer` includes 3.0; strict mode alone would refuse it
        return int(value) if isinstance(value, float) and value.is_integer() else value

    @model_validator(mode="after")
    def _one_form(self) -> RetrieveRequest:
        if (self.queries is None) == (self.query is None):
            raise ValueError("give exactly one of 'queries' (a non-empty list of strings) or 'query' (a string)")
        return self

    def query_list(self) -> list[str]:
        return self.queries if self.queries is not None else [self.query or ""]


class Document(BaseModel):
    id: str
    contents: str = Field(description='"Title"\\ntext, as in the corpus')


class ScoredDocument(BaseModel):
    document: Document
    score: float = Field(description="inner product of the L2-normalised query and passage vectors")


class RetrieveResponse(BaseModel):
    """One inner list per query, in request order; items are ScoredDocument with `return_scores`, else Document."""

    result: list[list[ScoredDocument]] | list[list[Document]]


class Health(BaseModel):
    status: str
    passages: int
    dim: int
    encoder: str
    index_type: str
    startup_seconds: float
    encoder_dtype: str = Field(description="dtype the query encoder runs in (`auto` resolved for this machine)")
    encoder_backend: str = Field(description="runtime of the query encoder: torch | torch-int8 | onnx | onnx-int8 "
                                 "(`auto` resolved); the int8 ones report encoder_dtype float32 (what is between "
                                 "their int8 products)")
    encoder_forward: str = Field("eager", description="how the torch encoder runs its forward: traced (one "
                                 "TorchScript graph, `--trace`) | eager (sentence-transformers); onnx for ONNX Runtime")
    faiss_version: str
    faiss_simd: str = Field(description="SIMD level of the loaded faiss build (e.g. AVX2, AVX512, NONE)")

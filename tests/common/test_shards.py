"""Sharded safetensors (`common/shards.py`): the shard plan by hand, the writer's order and memory, the index, and
reading back tensor by tensor through the index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sisrl.common.shards import INDEX_NAME, ShardWriter, iter_safetensors, plan_shards, safetensors_files


def test_plan_fills_shards_in_order_and_gives_an_oversized_tensor_its_own() -> None:
    # 10 bytes per shard: a 4 + b 5 = 9 fit; c 3 would make 12, so a new shard; d 20 > 10 alone; e 1 after it
    sizes = [("a", 4), ("b", 5), ("c", 3), ("d", 20), ("e", 1)]
    assert plan_shards(sizes, 10) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d", "e"]]
    with pytest.raises(ValueError, match="max_shard_bytes must be >= 1, got 0"):
        plan_shards(sizes, 0)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(4, 4, generator=gen), "w2": torch.randn(8, generator=gen),
            "w3": torch.randn(2, 3, generator=gen).to(torch.bfloat16)}


def test_writer_writes_each_shard_when_full_and_an_index_readers_follow(tmp_path: Path) -> None:
    tensors = _tensors()  # 64, 32 and 12 bytes
    plan = plan_shards([(n, t.nbytes) for n, t in tensors.items()], 64)
    assert plan == [["w1"], ["w2", "w3"]]
    writer = ShardWriter(tmp_path, plan)
    writer.add("w1", tensors["w1"])
    assert (tmp_path / "model-00001-of-00002.safetensors").is_file() and writer.held_bytes == 0
    writer.add("w2", tensors["w2"])
    assert writer.held_bytes == 32 and not (tmp_path / "model-00002-of-00002.safetensors").exists()
    with pytest.raises(ValueError, match="'w1' out of plan order: expected 'w3'"):
        writer.add("w1", tensors["w1"])
    writer.add("w3", tensors["w3"])
    writer.finish()
    assert writer.peak_held_bytes == 64
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index == {"metadata": {"total_size": 108}, "weight_map": {
        "w1": "model-00001-of-00002.safetensors", "w2": "model-00002-of-00002.safetensors",
        "w3": "model-00002-of-00002.safetensors"}}
    read = dict(iter_safetensors(tmp_path))
    assert read.keys() == tensors.keys() and all(torch.equal(read[n], t) for n, t in tensors.items())


def test_finish_refuses_a_plan_not_done_and_the_index_decides_the_files(tmp_path: Path) -> None:
    tensors = _tensors()
    writer = ShardWriter(tmp_path, [["w1", "w2"], ["w3"]])
    writer.add("w1", tensors["w1"])
    with pytest.raises(ValueError, match="2 planned tensors never arrived, first 'w2'"):
        writer.finish()
    writer.add("w2", tensors["w2"])
    writer.add("w3", tensors["w3"])
    writer.finish()
    (tmp_path / "stray.safetensors").write_bytes(b"not read: the index does not name it")
    assert [f.name for f in safetensors_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                             "model-00002-of-00002.safetensors"]
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="1 missing shard.*model-00002-of-00002"):
        safetensors_files(tmp_path)
    (tmp_path / INDEX_NAME).write_text("{}")
    with pytest.raises(ValueError, match="not a safetensors index with a weight_map"):
        safetensors_files(tmp_path)

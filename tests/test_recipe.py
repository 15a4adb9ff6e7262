"""The shipped drafter's recipe (scripts/recipe/train_smollm2_drafters.py): training on
cached target features refuses, before it loads anything heavy, data whose sequences are in
none of the feature files (it once failed four steps into a run, on a forgotten file)."""

import json
import re

import mlx.core as mx
import pytest

from dflash2_mlx.train import features
from scripts.recipe import train_smollm2_drafters as recipe


def test_train_names_the_sequences_no_feature_file_holds(tmp_path, monkeypatch):
    records = [{"id": i, "prompt_ids": [1, 2, 3 + i], "response_ids": [7, 8, 9, 10]} for i in range(3)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    feature_files = []
    for k in (0, 1):  # one file a record; the third record's file is "forgotten"
        ids = records[k]["prompt_ids"] + records[k]["response_ids"]
        path = tmp_path / f"features-{k}.safetensors"
        mx.save_safetensors(str(path), {"features.0": mx.zeros((len(ids), 4), dtype=mx.float16),
                                        "tokens.0": mx.array(ids, dtype=mx.int32)})
        feature_files.append(path)
    # The recipe points the trainer at its feature files; the real features come back after.
    monkeypatch.setattr(features, "target_features", features.target_features)
    message = f"1 sequences of {data} (record 2 first) are in none of the feature files"
    with pytest.raises(SystemExit, match=re.escape(message)):
        recipe.main(["train", "--version", "2", str(data), str(feature_files[0]),
                     "--more-features", str(feature_files[1]), str(tmp_path / "run"), "--steps", "1"])
    assert not (tmp_path / "run").exists()

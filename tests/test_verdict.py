"""``make train``'s last line: dev success first -> last evaluation against chance (Trainer.verdict), read from
metrics.jsonl. The bar is computed here by hand: chance 1/4 on 60 episodes, 3 standard errors of a chance-level
policy: 0.25 + 3 * sqrt(0.25 * 0.75 / 60) = 0.4177."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from crl.config import load_config
from crl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def verdict(tmp_path, devs, *overrides):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "dev/success": d}) + "\n" for s, d in devs)
                                            + json.dumps({"step": 7, "train/success": 1.0}) + "\n")
    return Trainer.verdict(SimpleNamespace(run_dir=tmp_path, cfg=load_config(ROOT / "configs" / "default.yaml", list(overrides))))


@pytest.mark.parametrize("last, word", [(0.95, "LEARNED"), (0.42, "LEARNED"), (0.41, "NOT LEARNED"), (0.25, "NOT LEARNED")])
def test_verdict_against_chance(tmp_path, last, word):
    line = verdict(tmp_path, [(0, 0.233), (50, 0.5), (100, last)], "eval.episodes=60")
    assert line.startswith(f"verdict: dev success 0.233 (iteration 0) -> {last:.3f} (iteration 100) on 60 episodes; chance 0.250: {word} ")
    assert "> 0.418" in line


def test_verdict_without_a_chance_level_or_evaluation(tmp_path):
    assert "no chance level known" in verdict(tmp_path, [(0, 0.1), (3, 0.2)], "env.name=sequential_records")
    assert verdict(tmp_path, []) is None

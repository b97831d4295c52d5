"""Smoke test of bench/mask_build_vs_flex.py --quick: anyattn's tile map and Flex's
create_block_mask (CPU) agree per query block, and the JSON is written."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.nn.attention.flex_attention")

ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_agrees_with_flex(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("mask_build_vs_flex",
                                                  ROOT / "bench" / "mask_build_vs_flex.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "quick.json"
    monkeypatch.setattr(sys, "argv", ["mask_build_vs_flex.py", "--quick", "--only", "chunked",
                                      "document_causal", "head_window", "--json", str(out)])
    mod.main()
    rows = json.loads(out.read_text())["rows"]
    assert {r["mask"] for r in rows} == {"chunked", "document_causal",
                                         "document_causal B=4", "head_window H=4"}
    assert all(r["agree"] and r["partial"] > 0 for r in rows)

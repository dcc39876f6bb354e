"""`zeroshard layout`: the report, --json, and a model given as a JSON list of shapes."""

from __future__ import annotations

import json

from zeroshard.cli.main import main
from zeroshard.layout import Layout


def test_report_of_the_demo_model(capsys):
    assert main(["layout", "--world-size", "2", "768"]) == 0
    out = capsys.readouterr().out
    assert "policy native, 16-byte alignment" in out
    assert out.count("group ") == 2  # decayed weights, and norms/biases
    assert "D=768" in out and "hold padding only" in out


def test_json_prints_a_layout_that_reads_back(capsys):
    assert main(["layout", "--world-size", "4", "--json"]) == 0
    layout = Layout.from_json(capsys.readouterr().out)
    assert layout.world_size == 4 and len(layout.groups) == 2


def test_model_from_json_shapes_with_the_deepspeed_policy(tmp_path, capsys):
    model = tmp_path / "shapes.json"
    model.write_text(json.dumps([[266240]]))
    assert main(["layout", "--model", str(model), "--policy", "deepspeed", "--world-size", "768"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("768"))
    # tail padding 1024, partition 348, 3 ranks with padding of which 2 hold nothing else
    assert row.split()[1:3] == ["1,024", "348"] and "3 (2 hold padding only)" in row


def test_bad_model_file_is_one_line_error(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["layout", "--model", str(missing)]) == 2
    assert f"{missing}: no such file" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("[[3, ")
    assert main(["layout", "--model", str(broken)]) == 2
    assert "not valid JSON" in capsys.readouterr().err

"""`fastdecode generate --json-schema / --grammar` and batch lines with their own response_format
(the embedded SmolLM2-135M)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fastdecode.cli import main

pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(autouse=True)
def embedded_model():
    from fastdecode.api import default_model_path
    from fastdecode.errors import ModelNotFoundError

    try:
        default_model_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


def test_generate_with_a_schema_file_and_a_grammar_file(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "g.gbnf").write_text('root ::= "yes" | "no"\n')
    result = CliRunner().invoke(main, ["generate", "-p", "Is it ok?", "--max-new-tokens", "20",
                                       "--json-schema", str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    assert isinstance(json.loads(result.output)["ok"], bool)
    result = CliRunner().invoke(main, ["generate", "-p", "Yes or no?", "--grammar", str(tmp_path / "g.gbnf")])
    assert result.exit_code == 0 and result.output.strip() in ("yes", "no"), result.output
    (tmp_path / "bad.json").write_text('{"type": "strin"}')
    result = CliRunner().invoke(main, ["generate", "-p", "x", "--json-schema", str(tmp_path / "bad.json")])
    assert result.exit_code == 2 and "Invalid type" in result.output


def test_batch_lines_carry_their_own_response_format(tmp_path):
    lines = [{"id": "a", "prompt": "Is it ok?", "response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "s", "schema": SCHEMA}}},
             {"id": "b", "prompt": "Yes or no?", "response_format": {"type": "choice", "choice": ["yes", "no"]}},
             {"id": "c", "prompt": "Say hi"},
             {"id": "d", "prompt": "x", "response_format": {"type": "regex", "regex": "("}}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["batch", str(source), "-o", str(out), "--max-new-tokens", "16", "--chat"])
    assert result.exit_code == 1 and "1 failed" in result.output, result.output  # line d's bad regex
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert isinstance(json.loads(records["a"]["output"])["ok"], bool)
    assert records["b"]["output"] in ("yes", "no")
    assert records["c"]["output"]
    assert "unclosed group" in records["d"]["error"]

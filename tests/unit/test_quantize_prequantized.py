"""``--quantize int8|int4`` on a GGUF that is already quantized is refused (before loading), with
a message saying what the file holds and what to do instead; a float GGUF still quantizes."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from click.testing import CliRunner  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

import fastdecode  # noqa: E402
from fastdecode.cli import main  # noqa: E402
from fastdecode.errors import InvalidOptionError  # noqa: E402
from tiny_gguf import write_gguf  # noqa: E402


def test_quantize_on_a_quantized_gguf_is_refused(tmp_path):
    path = write_gguf(tmp_path / "tiny-q8.gguf", "llama-gqa", QT.Q8_0)
    for quantize in ("int8", "int4"):
        with pytest.raises(InvalidOptionError, match=r"already quantized: its \d+ matrices are .*Q8_0") as caught:
            fastdecode.load(str(path), quantize=quantize)
        assert "quantize='dequantize'" in str(caught.value) and "Leave quantize out" in str(caught.value)
    result = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", "hi", "--quantize", "int8"])
    assert result.exit_code == 2 and "already quantized" in result.output
    assert fastdecode.load(str(path)).generate_ids([[1, 2, 3]], max_new_tokens=2)  # natively, as before
    assert fastdecode.load(str(path), quantize="dequantize").generate_ids([[1, 2, 3]], max_new_tokens=2)


def test_quantize_on_a_float_gguf_still_quantizes(tmp_path):
    from fastdecode.layers.quantized import QuantizedWeight

    path = write_gguf(tmp_path / "tiny-f16.gguf", "llama-gqa", QT.F16)
    weights = fastdecode.load(str(path), quantize="int8").checkpoint.weights
    assert any(isinstance(w, QuantizedWeight) and w.kind == "int8" for w in weights.values())

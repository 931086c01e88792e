"""Text <-> token ids, chat templates and streaming detokenization, split by concern:

* ``core``: the ``Tokenizer`` wrapper over the Rust ``tokenizers`` library, and its Hugging Face
  constructors (a model folder, an in-memory ``transformers`` tokenizer);
* ``from_gguf``: the tokenizer a GGUF file's metadata describes (``pretokenizers``: its word
  splits, as data);
* ``chat_template``: chat templates rendered as ``transformers`` renders them;
* ``stream``: streaming detokenization (``IncrementalDetokenizer``, on ``DecodeStream``).
"""

from .core import Tokenizer
from .stream import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

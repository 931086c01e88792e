"""Constrained decoding: request forms -> an llguidance grammar (forms.py), compiled once per
tokenizer and text, one matcher state per row (compiler.py). The sampler masks each constrained
row's logits with its state's allowed tokens (decoding/sampling.py)."""

from .compiler import CompiledGrammar, GrammarCompiler, GrammarState, ModelGrammars
from .forms import grammar_text, response_format_from

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarState", "ModelGrammars", "grammar_text",
           "response_format_from"]

"""Requests (engine/requests.py): the engine, chat and the server build sequences from a
RequestFactory, never from the public Generator, and no module below the API reaches a
Generator private."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fastdecode
from fastdecode.engine import Engine
from fastdecode.engine.requests import RequestFactory
from fastdecode.errors import InvalidOptionError, PromptTooLongError, TokenizerError
from engine_helpers import run_arrivals

SRC = Path(fastdecode.__file__).parent
API = SRC / "api.py"
# Privates the Generator had before the factory took them over: none may come back as a back-reference.
FORMER_PRIVATES = {"_options", "_check_prompts", "_eos_ids", "_require_tokenizer", "_check_memory",
                   "_submit_all", "_loops", "_runs_in_engine", "_final_text", "_grammars"}


def _generator_privates() -> set[str]:
    """Names of Generator's private methods and attributes, read from api.py."""
    tree = ast.parse(API.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Generator"]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _holder_name(node: ast.expr) -> str:
    """The last name of ``x`` / ``a.b.x`` (what an attribute is read from)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _private_reaches(source: str, privates: set[str]) -> list[tuple[int, str]]:
    """(line, "holder._name") for every private read from a generator-named object, and for every
    Generator private name read from anything but ``self``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        holder = _holder_name(node.value)
        on_generator = holder.lower() in ("gen", "generator") or holder.lower().endswith("generator")
        if on_generator or (node.attr in privates and holder != "self"):
            found.append((node.lineno, f"{holder}.{node.attr}"))
    return sorted(found)


def test_no_module_below_the_api_reaches_a_generator_private():
    privates = _generator_privates() | FORMER_PRIVATES
    assert "_options" in privates  # what the check looks for
    found = [f"{path.relative_to(SRC)}:{line}: {what}" for path in sorted(SRC.rglob("*.py")) if path != API
             for line, what in _private_reaches(path.read_text(), privates)]
    assert not found, "Generator privates reached from outside api.py:\n" + "\n".join(found)


def test_the_guard_above_can_fail():
    """The check flags what it is meant to flag (a test that cannot fail proves nothing)."""
    code = ("def f(generator, gen, self):\n    generator._options({})\n    gen._eos_ids(None)\n"
            "    x.requests._loops\n    self._loops\n    self.generator._x\n")
    assert _private_reaches(code, FORMER_PRIVATES) == [(2, "generator._options"), (3, "gen._eos_ids"),
                                                       (4, "requests._loops"), (6, "generator._x")]


def test_the_engine_never_imports_the_api():
    for path in sorted((SRC / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("api", "fastdecode.api") and "api" not in [a.name for a in node.names
                                                                                        if node.module is None], path
            if isinstance(node, ast.Import):
                assert all(a.name != "fastdecode.api" for a in node.names), path


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return fastdecode.load(tiny_folder)


def test_an_engine_from_the_model_and_a_factory_equals_the_generators(tiny):
    """An engine needs the model and a RequestFactory, no Generator: the same tokens as generate."""
    factory = RequestFactory(tiny.config, tiny.tokenizer, tiny.defaults, tiny.model.dtype, tiny.model.device)
    prompt = tiny.encode_prompt("the cat sat on")
    options = {"max_new_tokens": 6, "do_sample": True, "seed": 11, "top_k": 5}
    (ours,) = run_arrivals(Engine(tiny.model, factory), {0: [(prompt, options)]})
    assert ours == tiny.generate_ids([prompt], **options)[0]


def test_build_resolves_everything_before_a_sequence_exists(tiny):
    factory = tiny.requests
    request = factory.build([3, 4, 5], {"max_new_tokens": 4, "stop": ["cat"], "logprobs": 2, "seed": 9,
                                        "do_sample": True})
    assert request.prompt == [3, 4, 5] and request.logprobs == 2 and request.config.seed is None
    assert request.seed is not None and request.eos_ids == factory.eos_ids(request.config)
    assert request.text_watcher() is not None  # stop strings are watched on text
    assert factory.build([3], {"ignore_eos": True}).eos_ids == []
    assert factory.build([3], {"eos_token_id": [7, 8]}).eos_ids == [7, 8]
    with pytest.raises(InvalidOptionError, match="logprobs"):
        factory.build([3], {"logprobs": -1})
    with pytest.raises(InvalidOptionError, match="vocabulary"):
        factory.build([3], {"logprobs": tiny.config.vocab_size + 1})
    with pytest.raises(InvalidOptionError, match="outside the vocabulary"):
        factory.build([tiny.config.vocab_size], {})
    with pytest.raises(PromptTooLongError):
        factory.build([3], {"max_new_tokens": tiny.config.max_position_embeddings})


def test_a_call_gives_each_return_sequence_its_own_seed(tiny):
    config = tiny.requests.generation_config({"do_sample": True, "seed": 4, "num_return_sequences": 3})
    requests = tiny.requests.build_call([[3, 4], [5]], config)
    assert [r.prompt for r in requests] == [[3, 4]] * 3 + [[5]] * 3
    assert len({r.seed for r in requests[:3]}) == 3 and [r.seed for r in requests[:3]] == [r.seed for r in requests[3:]]
    assert all(r.config.num_return_sequences == 1 and r.config.seed is None for r in requests)


def test_a_factory_without_a_tokenizer_refuses_text_work_by_name(tiny):
    factory = RequestFactory(tiny.config, None)
    assert factory.build([3, 4], {"max_new_tokens": 2}).text_watcher() is None  # token ids need none
    with pytest.raises(TokenizerError, match="no tokenizer"):
        factory.build([3, 4], {"stop": ["x"]})
    with pytest.raises(TokenizerError, match="no tokenizer"):
        factory.encode_prompt("hello")

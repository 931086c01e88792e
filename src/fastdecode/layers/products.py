"""``Products``: how one forward runs its products, handed to every ``linear`` call explicitly.

Three things decide a product's arithmetic and speed besides its operands, and all travel here, in
the step plan a model receives (engine/plan.py), never in hidden state (no module switch, no
``ContextVar``):

- **row roles**: which rows of the forward's flattened [R, C] rows are prompt rows (prompt chunks,
  encoder sources, scoring: exact float32 products unless the kernel choice says int8) and which
  are generated rows (decode steps, beams: the int8 / fixed-order kernels). Layers/quantized.py and
  layers/linear.py say why;
- **the thread budget**: the thread count of whoever runs the forward. The forward's own small ops
  run on one thread (layers/threads.py); big products and attention get this many;
- **the kernel choice** (``KernelChoice``): the model's, chosen once at load (``fastdecode.load(...,
  prompt_rows=...)``): prompt rows of quantized weights exact or int8, and the reference paths
  (quantized or float kernels off) that tests and benchmarks compare against.

``linear`` and the attention ops take it as a required argument, so a call site that forgets
cannot silently get other numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidOptionError
from .float_rows_choice import DEFAULT_IN_PLACE_ROWS, machine_in_place_rows, valid_limits
from .gemm_choice import FLOAT_GEMMS, machine_float_choice

ALL_PROMPT = "all prompt rows"
PROMPT_ROWS = ("int8-mlp", "exact", "int8")  # KernelChoice.prompt_rows; the first: load's default


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """Which kernels a model's products take: chosen at load, held by the model (``model.kernels``)
    and carried by every forward's ``Products``.

    - ``prompt_rows``: how prompt rows of quantized weights are multiplied: "exact" (the reference
      runs' choice): by the weights' exact float32 values (layers/quantized.py says why); "int8":
      rounded to int8 per 32 inputs and multiplied by the integer kernels, as generated rows are
      (llama.cpp's choice: a 512-token prompt on Qwen2.5-Coder-1.5B Q4_K_M 1.9-3.4x as fast; near ties
      may flip, and on SmolLM2-135M the README's question is answered with a loop); "int8-mlp" (what
      ``load`` takes by default): the MLP's products (gate, up, down: ~75-90% of a block's multiply-adds)
      on int8, the attention's (Q/K/V, O) exact, where rounding errors enter every later position
      through the cached keys and values (measured in README.md: the int8 answers' loops go away, and a
      512-token Qwen 1.5B prompt runs at int8's rate on 2 threads);
    - ``quantized_kernels``: False: every quantized product takes the exact path (the reference of
      tests that check a conversion at 1e-4);
    - ``float_kernel``: False: generated rows of float32 matrices take the GEMM as prompt rows do
      (the path before layers/fmatmul.cpp: tests and benchmarks compare against it);
    - ``float_gemm``: the float32 GEMM of prompt rows (layers/gemm.py), "onednn" or "mkl": at load,
      the one this machine runs faster (layers/gemm_choice.py measures it once per machine);
    - ``prompt_kernel``: prompt rows of the float matrices the float kernel serves (layers/linear.py) take
      it too, on the kernel thread pool as generated rows do, no OpenMP team beside it; each row's result
      then depends only on the row, as a generated row's. At load: where the kernel runs prompt rows about
      as fast as the faster GEMM (layers/gemm_choice.py);
    - ``in_place_rows``: (spread, aliased): up to how many rows (9 or more) the float kernel reads the weights in
      place rather than from packed copies, where their rows spread over L1's sets and where they share them
      (layers/float_rows_choice.py); the same bits either way, only the speed differs. At load: this machine's,
      measured once."""

    prompt_rows: str = "exact"
    quantized_kernels: bool = True
    float_kernel: bool = True
    float_gemm: str = "onednn"
    prompt_kernel: bool = False
    in_place_rows: tuple[int, int] = DEFAULT_IN_PLACE_ROWS

    def __post_init__(self) -> None:
        if self.prompt_rows not in PROMPT_ROWS:
            raise InvalidOptionError(f"prompt_rows must be one of {', '.join(PROMPT_ROWS)}, got {self.prompt_rows!r}")
        if self.float_gemm not in FLOAT_GEMMS:
            raise InvalidOptionError(f"float_gemm must be one of {', '.join(FLOAT_GEMMS)}, got {self.float_gemm!r}")
        for name in ("quantized_kernels", "float_kernel", "prompt_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidOptionError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if valid_limits(self.in_place_rows) != self.in_place_rows:
            raise InvalidOptionError(
                f"in_place_rows must be a tuple of two ints from 8 to 64, got {self.in_place_rows!r}")

    def exact_prompts(self, in_mlp: bool) -> bool:
        """Whether prompt rows of a quantized weight take its exact values (``in_mlp``: the weight is
        one of a block's MLP products, ``QuantizedWeight.in_mlp``)."""
        return self.prompt_rows == "exact" or (self.prompt_rows == "int8-mlp" and not in_mlp)

    @classmethod
    def at_load(cls, prompt_rows: str | None, kernels: KernelChoice | None) -> KernelChoice:
        """The choice of ``load(..., prompt_rows=, kernels=)``: ``prompt_rows`` alone ("int8-mlp" when
        None) with this machine's float products (its faster float GEMM, whether prompt rows take the
        float kernel, the kernel's in-place row limits), or the whole ``kernels`` choice (reference runs);
        InvalidOptionError when both are given."""
        if kernels is None:
            prompt_rows = PROMPT_ROWS[0] if prompt_rows is None else prompt_rows
            cls(prompt_rows=prompt_rows)  # a bad value fails before anything is measured
            float_gemm, prompt_kernel = machine_float_choice()
            return cls(prompt_rows=prompt_rows, float_gemm=float_gemm, prompt_kernel=prompt_kernel,
                       in_place_rows=machine_in_place_rows())
        if prompt_rows is not None:
            raise InvalidOptionError("give prompt_rows or kernels (a KernelChoice, which has prompt_rows), not both")
        if not isinstance(kernels, KernelChoice):
            raise InvalidOptionError(f"kernels must be a KernelChoice, got {kernels!r}")
        return kernels


class RowRoles:
    """Which rows of one forward's products (its flattened [R, C] rows) are prompt rows."""

    __slots__ = ("rows", "prompt", "generated", "prompt_rows")

    def __init__(self, is_prompt: list[bool], device: torch.device | str = "cpu"):
        self.rows = len(is_prompt)
        self.prompt_rows = frozenset(i for i, p in enumerate(is_prompt) if p)  # the same, on the host
        self.prompt = torch.tensor([i for i, p in enumerate(is_prompt) if p], dtype=torch.long, device=device)
        self.generated = torch.tensor([i for i, p in enumerate(is_prompt) if not p], dtype=torch.long, device=device)


@dataclass(frozen=True, slots=True, eq=False)
class Products:
    """``roles``: None (every row generated), ``ALL_PROMPT``, or a ``RowRoles`` (a step mixing both);
    ``threads``: the forward's thread budget (0 inside torch.compile: the op reads torch's count);
    ``kernels``: the model's ``KernelChoice`` (required everywhere: a caller cannot forget it)."""

    roles: RowRoles | str | None
    threads: int
    kernels: KernelChoice

    def __post_init__(self) -> None:
        if not isinstance(self.kernels, KernelChoice):
            raise TypeError(f"Products takes the model's KernelChoice, got {self.kernels!r}")

    @classmethod
    def generated(cls, threads: int, *, kernels: KernelChoice) -> Products:
        """Every row generated (decode steps, beams)."""
        return cls(None, threads, kernels)

    @classmethod
    def prompt(cls, threads: int, *, kernels: KernelChoice) -> Products:
        """Every row a prompt row (a prompt, an encoder source, a scored text)."""
        return cls(ALL_PROMPT, threads, kernels)

    @classmethod
    def of_rows(cls, is_prompt: bool | list[bool], threads: int, device: torch.device | str = "cpu", *,
                kernels: KernelChoice) -> Products:
        """``is_prompt``: one bool for every row, or one per flattened row (a step mixing both)."""
        if not isinstance(is_prompt, bool) and (all(is_prompt) or not any(is_prompt)):
            is_prompt = all(is_prompt)  # one role for the whole forward
        if isinstance(is_prompt, bool):
            return cls(ALL_PROMPT if is_prompt else None, threads, kernels)
        return cls(RowRoles(is_prompt, device), threads, kernels)

    @property
    def all_prompt(self) -> bool:
        return self.roles is ALL_PROMPT

    def is_prompt_row(self, row: int) -> bool:
        """Whether flat row ``row`` of the forward is a prompt row."""
        if isinstance(self.roles, RowRoles):
            return row in self.roles.prompt_rows
        return self.roles is ALL_PROMPT

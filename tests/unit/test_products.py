"""The contract of ``layers/products.py``: every product is handed its rows' roles and the thread budget
explicitly (issue 30: no hidden state picks the arithmetic), so a call that forgets them fails loudly."""

from __future__ import annotations

import pytest
import torch

from fastdecode.cache.view import NoCache
from fastdecode.layers.attention import attention
from fastdecode.layers.linear import linear
from fastdecode.layers.products import ALL_PROMPT, KernelChoice, Products, RowRoles
from fastdecode.layers.quantized import quantize_matrix, quantized_linear


def test_a_product_without_products_is_a_type_error():
    x, weight = torch.randn(2, 64), torch.randn(64, 32).t()  # [out, in] view of an [in, out] buffer
    with pytest.raises(TypeError, match="products"):
        linear(x, weight)
    with pytest.raises(TypeError):
        quantized_linear(x, quantize_matrix(torch.randn(32, 64), "int8"), None)  # no products
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="threads"):
        attention(q, q, q, None, 0.5)
    with pytest.raises(TypeError):
        NoCache()


CHOICE = KernelChoice()


def test_one_role_for_every_row_collapses_and_a_mix_keeps_each_rows():
    assert (Products.of_rows([True, True], 2, kernels=CHOICE).roles is ALL_PROMPT
            and Products.of_rows(True, 2, kernels=CHOICE).all_prompt)
    assert (Products.of_rows([False, False], 2, kernels=CHOICE).roles is None
            and Products.generated(1, kernels=CHOICE).roles is None)
    mixed = Products.of_rows([True, False, True], 3, kernels=CHOICE)
    assert isinstance(mixed.roles, RowRoles) and mixed.threads == 3
    assert mixed.roles.prompt.tolist() == [0, 2] and mixed.roles.generated.tolist() == [1]

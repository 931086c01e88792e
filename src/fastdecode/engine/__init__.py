"""The engine: sequences, a step scheduler with continuous batching, and the slot cache.

``Generator.engine(...)`` builds one (from the model and its ``RequestFactory``, engine/requests.py);
``Generator.generate`` / ``stream`` run through one.
"""

from .core import Engine
from .sequence import Sequence, TokenEvent

__all__ = ["Engine", "Sequence", "TokenEvent"]

"""How a step's logits become a token, and when a sequence stops: the logit processors
(``processors``), the seeded per-row ``TokenSelector`` (``sampling``) and the stop-string watcher
(``stopping``). Below the engine, which applies them to every row it samples; no tensors of a model
or a cache here."""

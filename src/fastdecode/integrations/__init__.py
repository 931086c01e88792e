"""Bridges to other systems; each module imports its system lazily and is optional (an extra).

``fastdecode.integrations.ray``: batch generation as a Ray Data ``map_batches`` stage (the ``ray``
extra); ``fastdecode.integrations.ray_batch``: ``fastdecode batch --ray`` on top of it;
``fastdecode.integrations.ray_serve``: ``fastdecode serve --ray``, the server on Ray Serve.
"""

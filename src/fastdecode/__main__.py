"""`python -m fastdecode`: the same as the `fastdecode` command (and `python -m fastdecode.cli`)."""

from .cli import main

main()

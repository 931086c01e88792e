"""`python -m fastdecode.cli`: the same as the `fastdecode` command."""

from . import main

main()

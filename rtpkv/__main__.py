"""`python -m rtpkv ...` is the `rtpkv` command."""

from rtpkv.cli import main

main()

"""`python -m rtpkv ...`: the `rtpkv` command."""

from rtpkv.cli import main

if __name__ == "__main__":
    main()

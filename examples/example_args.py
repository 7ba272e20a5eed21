"""The examples' command line: an optional MODEL_DIR (default: the tiny demo checkpoint), with
--help, so `--help` is never taken for a model path."""

import argparse
from typing import Optional

from rtpkv.model_factory.tiny import model_or_demo


def model_path(doc: Optional[str], argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                        help="a checkpoint directory or hub id (default: the tiny demo one)")
    return model_or_demo(parser.parse_args(argv).model_dir)

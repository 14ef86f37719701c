"""`python -m spark_cli.native.rpc_main --host H --port N`: an RPC server process (tests, `spark rpc-server`)."""

from __future__ import annotations

import argparse
import sys

from ..errors import SparkError
from .rpc import serve


def main() -> int:
    ap = argparse.ArgumentParser(description="ggml RPC server on this machine's CPU backend")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50052)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    try:
        serve(a.host, a.port, a.threads)
    except SparkError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

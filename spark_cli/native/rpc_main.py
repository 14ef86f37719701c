"""`python -m spark_cli.native.rpc_main --host H --port N [--mem SIZE]`: an RPC server process (tests, `spark rpc-server`)."""

from __future__ import annotations

import argparse
import sys

from ..core.units import parse_size
from ..errors import SparkError
from .rpc import serve


def main() -> int:
    ap = argparse.ArgumentParser(description="ggml RPC server on this machine's CPU backend")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50052)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mem", default=None, help="memory the device reports, e.g. 2GiB (default: the host's RAM)")
    a = ap.parse_args()
    try:
        mem = parse_size(a.mem, "--mem") if a.mem else None
        serve(a.host, a.port, a.threads, mem)
    except SparkError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

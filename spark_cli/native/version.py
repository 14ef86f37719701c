"""What `spark --version` reports: Spark, llama-cpp-python and the native build key.

scripts/build_native.py writes the key of the build it installs into the llama_cpp
package folder (NATIVE_KEY_FILE); reading it needs no import of the library.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from .. import __version__

NATIVE_KEY_FILE = ".spark-native-key"
# the sdist scripts/build_native.py downloads into $SPARK_HOME/downloads and builds (models/llama_vocab.py reads it)
LLAMA_CPP_SDIST = "llama_cpp_python-0.3.36.tar.gz"


def llama_cpp_version() -> str | None:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None


def native_key() -> str | None:
    """Key of the installed native build (sdist + native/ + CMake flags), None if not built by Spark."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    p = Path(spec.origin).parent / NATIVE_KEY_FILE
    try:
        return p.read_text().strip() or None
    except OSError:
        return None


def version_line() -> str:
    lc = llama_cpp_version()
    key = native_key()
    native = f"native {key}" if key else "native: not built by scripts/build_native.py"
    return f"spark {__version__}, llama-cpp-python {lc or 'not installed'}, {native}"

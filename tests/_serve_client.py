"""A Starlette test client over the server's real app and worker, with a fake engine (no model)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def fake_client(make_engine: Callable[[], object], sleep_idle: float | None = None, no_generation: str | None = None,
                **state) -> Iterator:
    """The app of `spark serve` over a worker whose engine `make_engine` returns (again after each
    sleep: `sleep_idle`, --sleep-idle-seconds; `no_generation`: why it generates nothing, a reranker's);
    `state`: more ServerState fields (api_key, cors, ...)."""
    from starlette.testclient import TestClient

    from spark_cli.serve.app import ServerState, create_app
    from spark_cli.serve.learn import Learner
    from spark_cli.serve.stats import ServerStats
    from spark_cli.serve.worker import Worker

    stats = ServerStats()
    worker = Worker(make_engine, set(), stats, Learner(Path("none.gguf"), None, enabled=False), max_queue=2,
                    sleep_idle=sleep_idle, no_generation=no_generation)
    worker.start()
    try:
        assert worker.ready.wait(30)
        with TestClient(create_app(ServerState(worker, stats, "fake.gguf", **state)),
                        base_url="http://127.0.0.1:8080", raise_server_exceptions=False) as tc:
            yield tc
    finally:
        worker.shutdown(1)

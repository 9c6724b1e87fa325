"""A replica's routes (`pipelines.serve.app.Routes` over a `Service`) on uvicorn in a process of its own, for the
SIGTERM test of tests/test_serve_faults.py. Each decoding round is slowed by 0.1 s so that requests are in flight
when the signal comes. On SIGTERM the engine starts draining (`Engine.begin_drain`), as a process manager's stop
would, and uvicorn then waits for the open streams, which the drain ends with a final event.

    python tests/serve_sigterm_server.py TARGET_DIR DRAFT_DIR PORT DRAIN_S
"""

import sys
import time

import uvicorn

from eagle_core.decoding import DecodingState
from pipelines.serve.config import ServeConfig
from pipelines.serve.service import Service
from serve_helpers import replica_app  # this script's folder (tests/) is first on sys.path


def main() -> None:
    target, draft, port, drain_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    real_step = DecodingState.step

    def slow_step(self, mode):
        time.sleep(0.1)
        return real_step(self, mode)

    DecodingState.step = slow_step
    service = Service(ServeConfig(target=target, draft=draft, model_name="tiny", dtype="float32", device="cpu",
                                  top_k=2, depth=2, total_tokens=4, max_batch_size=4, max_context=256,
                                  max_tokens_limit=200, torch_threads=1, drain_s=drain_s))
    api = replica_app(service)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            service.engine.begin_drain(service.config.drain_s)
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning")).run()
    service.close()


if __name__ == "__main__":
    main()

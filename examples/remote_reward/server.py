"""A reward server that ``reward=remote`` can call, for docs/recipes/remote-reward.md.

    python -m examples.remote_reward.server --port 8765 &
    python run.py reward=remote reward.url=http://127.0.0.1:8765/score reward.key=score

The protocol (slime_hydra/rewards/remote.py): the run POSTs ``{"prompt", "response", "label",
"metadata"}`` for every sample and reads back a JSON number, or an object from which ``reward.key``
picks the reward. Connection errors, timeouts, 5xx, 408 and 429 are retried ``reward.max_retries``
times with backoff; another 4xx stops the run. Put a reward model behind ``score`` (batch the
requests it receives concurrently); this one checks the answer of the built-in digits task, so it
runs on CPU.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

from fastapi import FastAPI
from pydantic import BaseModel

app = FastAPI(title="digits reward")


class Scored(BaseModel):
    prompt: Any  # text, or chat messages
    response: str
    label: Optional[Any] = None
    metadata: Dict[str, Any] = {}


@app.post("/score")
def score(req: Scored) -> Dict[str, Any]:
    answer = req.response.strip()[:1]
    correct = req.label is not None and answer == str(req.label).strip()
    return {"score": float(correct), "answered": answer.isdigit()}


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

"""Run as a script: send rounds of large requests at once while probing /health on one
connection, then print a JSON report. A process of its own, so that the clients' work never
shares the server's GIL and the probes time the server alone.

    python probe_under_load.py URL ROUNDS < requests.json   # [[path, body], ...] per round
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def main(url: str, rounds: int, requests: list[tuple[str, object]]) -> dict[str, object]:
    encoded = [(path, json.dumps(body).encode()) for path, body in requests]
    senders = [httpx.Client(base_url=url, timeout=120) for _ in encoded]
    answers: list[tuple[int, str]] = []

    def send(client: httpx.Client, path: str, body: bytes) -> None:
        resp = client.post(path, content=body, headers={"content-type": "application/json"})
        answers.append((resp.status_code, resp.text[:300]))

    with httpx.Client(base_url=url, timeout=30) as probe:
        for client in senders:
            client.get("/health").raise_for_status()
        quiet = []
        for _ in range(20):
            started = time.perf_counter()
            probe.get("/health").raise_for_status()
            quiet.append(time.perf_counter() - started)
        busy: list[float] = []
        started_all = time.perf_counter()
        for _ in range(rounds):
            threads = [threading.Thread(target=send, args=(c, *e)) for c, e in zip(senders, encoded)]
            for thread in threads:
                thread.start()
            while any(t.is_alive() for t in threads):
                started = time.perf_counter()
                probe.get("/health").raise_for_status()
                busy.append(time.perf_counter() - started)
                time.sleep(0.005)
            for thread in threads:
                thread.join()
    return {"quiet": quiet, "busy": busy, "elapsed": time.perf_counter() - started_all, "answers": answers}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), json.load(sys.stdin))))

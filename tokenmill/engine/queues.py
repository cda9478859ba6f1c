"""Waiting-queue policies: first come first served, or priority (lower value first, then arrival)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from tokenmill.engine.request import Request


class RequestQueue(Protocol):
    def push(self, request: Request) -> None: ...
    def push_front(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._items.append(request)

    def push_front(self, request: Request) -> None:
        self._items.appendleft(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def priority_key(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_index)


class PriorityQueue:
    """A heap on (priority, arrival). A preempted request keeps its key, so it goes back in place."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], Request]] = []

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[1] for item in sorted(self._heap, key=lambda item: item[0]))


QUEUE_POLICIES: dict[str, type[FCFSQueue] | type[PriorityQueue]] = {
    "fcfs": FCFSQueue,
    "priority": PriorityQueue,
}

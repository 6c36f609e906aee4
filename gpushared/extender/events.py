"""Events on pods, as the extender's workers tell a pod's owner what they did to it and why."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gpushared.core.shared.bodies import PodBody, key_of
from gpushared.kube.api import Api
from gpushared.kube.errors import KubeError

log = logging.getLogger(__name__)

#: (pod, reason, message): an Event on the pod, or nothing (tests, a worker without an API)
Event = Callable[[PodBody, str, str], Awaitable[None]]


async def no_event(pod: PodBody, reason: str, message: str) -> None:
    return None


def pod_events(api: Api, *, component: str, normal: frozenset[str] = frozenset()) -> Event:
    """Events on pods from ``component``, written on a worker thread (the synchronous client); one that fails
    is logged. Reasons in ``normal`` are Normal, every other a Warning."""

    async def event(pod: PodBody, reason: str, message: str) -> None:
        try:
            await asyncio.to_thread(
                api.pod_event, pod, reason=reason, message=message, warning=reason not in normal, component=component
            )
        except KubeError as exc:
            log.info("event %s on pod %s/%s not written: %s", reason, *key_of(pod), exc)

    return event

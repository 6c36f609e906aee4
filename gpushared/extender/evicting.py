"""Evicting a preemption's victims: one by one through the Eviction API, each told why, for every path that
preempts (the extender's own evictions, the claim allocator's).

The Eviction API enforces PodDisruptionBudgets: a 429 means nothing went and the room is not coming, so the
rest are not tried and the caller drops its hold. Any other failure (a timeout, a cut connection) may have
landed, so the caller keeps its hold and evicts no one more for the pod until it is placed or the hold
expires. A victim gone meanwhile (404, or 409: deleted and made again) is counted and passed over.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence

from gpushared.core.shared.bodies import Key, PodBody, key_of
from gpushared.extender.events import Event
from gpushared.kube.aioapi import AsyncApi
from gpushared.kube.errors import KubeError

log = logging.getLogger(__name__)


class Evicted(enum.Enum):
    #: every victim evicted (or gone meanwhile)
    ALL = "all"
    #: a PodDisruptionBudget refused one (429): the rest were not tried
    REFUSED = "refused"
    #: one failed otherwise, and may have landed: the rest were not tried
    FAILED = "failed"


async def evict_victims(
    api: AsyncApi,
    victims: Sequence[str],
    bodies: Mapping[str, PodBody],
    *,
    preemptor: Key,
    why: str,
    counts: MutableMapping[str, int],
    event: Event,
    spawn: Callable[[Awaitable[None]], None],
    policy_v1: bool = True,
) -> Evicted:
    """Evict ``victims`` (UIDs; ``bodies``: the pods by UID, as the cache shows them), each told ``why`` in a
    ``Preempted`` Event; counted in ``counts`` (evicted, gone, refused, failed)."""
    for victim in victims:
        body = bodies.get(victim)
        if body is None:
            counts["gone"] += 1
            continue
        namespace, name = key_of(body)
        try:
            await api.evict_pod(namespace, name, uid=victim, policy_v1=policy_v1)
        except KubeError as exc:
            if exc.status in (404, 409):
                counts["gone"] += 1
                continue
            log.warning("pod %s/%s not evicted for %s/%s: %s", namespace, name, *preemptor, exc)
            refused = exc.status == 429
            counts["refused" if refused else "failed"] += 1
            return Evicted.REFUSED if refused else Evicted.FAILED
        counts["evicted"] += 1
        log.info("pod %s/%s %s", namespace, name, why)
        spawn(event(body, "Preempted", why))
    return Evicted.ALL

"""Poisoned annotations on create and on edit."""

from __future__ import annotations

from faultsuite.harness import World, wait
from faultsuite.scenarios.breaker import Breaker
from gpushared import contract
from tests.builders import pod

#: What tenants write into the annotations the contract reads (issue #39): each would once crash the daemon
#: or stop the extender's ledger rebuild, or answer 500.
POISONS = {
    contract.ALIYUN_GPU_MEM_IDX: "1" * 5000,
    contract.POD_ALLOCATION: '{"version":1,"unit":"GiB","containers":[{"name":"c0","gpus":[{"index":'
    + "1" * 5000
    + ',"uuid":"x","amount":1}]}]}',
    contract.POD_MPS_THREAD_PERCENTAGE: "9" * 9000,
    contract.ALIYUN_FRAMEWORK_ALLOCATION: "{}",
    contract.ALIYUN_GPU_MEM_POD: "[" * 50_000,
}


class Poisoned(Breaker):
    """Poisoned annotations on create and on edit. Before the load: pods created bound to nodes (around the
    extender) with each poison, and pending pods with each. At the break: the owners of 20 pods the load
    bound write the poisons into them, one replica is killed and started again (its ledgers are rebuilt
    from those pods: the rebuild once stopped at a poisoned pod and forgot the rest), and the pending
    poisoned pods are filtered, prioritized and bound (once answered 500)."""

    def __init__(self, world: World, total: int) -> None:
        super().__init__(world, total)
        self.pending = []
        for i, (key, value) in enumerate(POISONS.items()):
            world.api.create(pod(f"poisoned-bound-{i}", 1, node=world.nodes[i], annotations={key: value}))
            world.bypassed.add(f"poisoned-bound-{i}")
            self.pending.append(world.api.create(pod(f"poisoned-{i}", 2, annotations={key: value})))
            world.bypassed.add(f"poisoned-{i}")  # created with its annotations by its owner, not by a bind

    def break_(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.world.api.client())
        with self.world.lock:
            victims = list(self.world.written)[:20]
        for i, name in enumerate(victims):
            key, value = list(POISONS.items())[i % len(POISONS)]
            core.patch_namespaced_pod(name, "default", {"metadata": {"annotations": {key: value}}})
        self.notes.append(f"poisoned the annotations of {len(victims)} bound pods")
        victim = self.world.replicas[0]
        self.world.kill(victim)
        self.world.restart(victim)
        wait(lambda: victim.get("/readyz")[0] == 200, 60, f"{victim.name} ready again")
        for body in self.pending:
            for replica in self.world.replicas:
                for verb, request in (
                    ("filter", {"Pod": body, "NodeNames": self.world.nodes}),
                    ("prioritize", {"Pod": body, "NodeNames": self.world.nodes}),
                ):
                    status, _ = replica.post(verb, request)
                    if status >= 500 and status != 503:
                        with self.world.lock:
                            self.world.server_errors.append(f"{verb} of {body['metadata']['name']}: {status}")
                status, _ = replica.bind(body, self.world.nodes[0])
                if status >= 500 and status != 503:
                    with self.world.lock:
                        self.world.server_errors.append(f"bind of {body['metadata']['name']}: {status}")

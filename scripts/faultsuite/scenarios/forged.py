"""Owners of bound pods edit their allocation."""

from __future__ import annotations

from faultsuite.scenarios.breaker import Breaker
from gpushared import contract


class Forged(Breaker):
    """Owners of bound pods edit their allocation: to 0, and to another GPU."""

    def break_(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.world.api.client())
        with self.world.lock:
            victims = list(self.world.written.items())[:20]
        for i, (name, written) in enumerate(victims):
            allocation = written.get(contract.POD_ALLOCATION, "")
            if i % 2:
                forged = allocation.replace('"amount":', '"amount":0,"was":')
            else:
                forged = allocation.replace('"index":', '"index":1,"was":')
            patch = {"metadata": {"annotations": {contract.POD_ALLOCATION: forged, contract.ALIYUN_GPU_MEM_POD: "0"}}}
            core.patch_namespaced_pod(name, "default", patch)
        self.notes.append(f"forged the allocation of {len(victims)} bound pods")

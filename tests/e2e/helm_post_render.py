"""helm's ``--post-renderer`` for the local cluster: the chart's manifests on stdin, the same with only the
edits this cluster forces (tests/e2e/manifests.py, ``local_chart``) on stdout. Its one argument is JSON:
the Kubernetes version, the extender's URL and port, the API server's port, the second scheduler's ports.

    helm install ... --post-renderer <python> --post-renderer-args=-m \\
        --post-renderer-args=tests.e2e.helm_post_render --post-renderer-args='{"version": ...}'
"""

from __future__ import annotations

import json
import sys

import yaml

from tests.e2e.manifests import Wiring, local_chart
from tests.e2e.versions import Version


def main(argv: list[str]) -> int:
    (raw,) = argv
    given = json.loads(raw)
    wiring = Wiring(
        version=Version.parse(given["version"]),
        extender_url=given["extender_url"],
        apiserver_port=int(given["apiserver_port"]),
        secure_port=int(given["secure_port"]),
        health_port=int(given["health_port"]),
    )
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    sys.stdout.write(yaml.safe_dump_all(local_chart(docs, wiring, extender_port=int(given["extender_port"]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

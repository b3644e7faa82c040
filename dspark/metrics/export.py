"""`GET /metrics`: the cluster's dspark and vLLM-named series, gathered from every node's Ray metrics agent.

Each process records through `ray.util.metrics` (see metrics.py); the agents export `ray_vllm_*` and
`ray_dspark_*`. This reads every live node's agent, keeps those families, gives them back their vLLM names
(`ray_vllm_x` → `vllm:x`, `ray_dspark_x` → `dspark_x`) and our labels, and drops Ray's bookkeeping labels
(the node stays as `node`, the process as `worker`, so two processes never collide on one series). Any
ingress replica answers the same, whole-cluster text. Prometheus may scrape this, or the agents directly
through Ray's file discovery (then the names keep Ray's form).
"""

from __future__ import annotations

import logging
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

_RENAMES = (("ray_vllm_", "vllm:"), ("ray_dspark_", "dspark_"))
_DROPPED_LABELS = {"Component", "SessionName", "Version", "JobId", "otel_scope_name", "otel_scope_schema_url",
                   "otel_scope_version"}
_LABEL_RENAMES = {"NodeAddress": "node", "WorkerId": "worker"}
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _renamed(name: str) -> str | None:
    for prefix, replacement in _RENAMES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return None


def _relabel(labels: str) -> str:
    out = []
    for key, value in _LABEL.findall(labels):
        if key in _DROPPED_LABELS:
            continue
        if key == "WorkerId":
            value = value[:12]
        out.append(f'{_LABEL_RENAMES.get(key, key)}="{value}"')
    return "{" + ",".join(out) + "}" if out else ""


def convert(texts: list[str]) -> str:
    """Merge agents' exposition texts into one, our families only, renamed; HELP/TYPE once per family."""
    families: dict[str, dict] = {}
    for text in texts:
        family: dict | None = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                _, kind, name, *rest = line.split(" ", 3)
                new = _renamed(name)
                if new is None:
                    family = None
                    continue
                family = families.setdefault(new, {"help": "", "type": "untyped", "samples": []})
                family["help" if kind == "HELP" else "type"] = rest[0] if rest else ""
                continue
            if not line or line.startswith("#") or family is None:
                continue
            cut = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
            if cut < 0:
                continue
            new = _renamed(line[:cut])
            if new is None:
                continue
            if line[cut] == "{":
                end = line.rindex("}")
                labels, value = _relabel(line[cut + 1:end]), line[end + 1:].strip()
            else:
                labels, value = "", line[cut:].strip()
            family["samples"].append(f"{new}{labels} {value}")
    lines = []
    for name, fam in sorted(families.items()):
        lines.append(f"# HELP {name} {fam['help']}")
        lines.append(f"# TYPE {name} {fam['type']}")
        lines.extend(fam["samples"])
    return "\n".join(lines) + "\n"


def _fetch(url: str, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - cluster-internal agents
            return resp.read().decode("utf-8", "replace")
    except Exception as exc:  # noqa: BLE001 - a node that does not answer is left out, and logged
        log.warning("metrics agent %s did not answer: %r", url, exc)
        return ""


def agent_urls() -> list[str]:
    """The metrics endpoint of every live node's Ray agent."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]


def cluster_metrics_text(timeout_s: float = 3.0) -> str:
    urls = agent_urls()
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(urls)))) as pool:
        texts = list(pool.map(lambda u: _fetch(u, timeout_s), urls))
    return convert(texts)

"""The `args` of a Serve config's application, as the benches that start a cluster take them."""

from __future__ import annotations

from pathlib import Path


def load_serve_args(path: Path, app_name: str | None = None) -> dict:
    """The `args` of an application of a Serve config file (the first one, or `app_name`)."""
    import yaml

    apps = yaml.safe_load(path.read_text())["applications"]
    app = next((a for a in apps if app_name in (None, a.get("name"))), None)
    if app is None:
        raise ValueError(f"{path}: no application named {app_name!r}")
    return dict(app.get("args") or {})

"""`serve run` of the shipped configs/serve.yaml with `target:` pointing at a Hugging Face folder and a drafter
trained for it (`dspark train`'s exported checkpoint), as a platform team starts it, then the official `openai`
client against it: a completion, a chat, a streamed chat. JSON last.

    python scripts/serve_run_target.py --target /path/to/qwen3 --drafter /path/to/dspark-qwen3

The YAML written is the shipped one with only what this target needs changed (printed in the JSON): the target,
its drafter, one arm (the shipped mtp1 arm has no checkpoint for another target). Serve's own proxy is the front
door (HAProxy is not needed for this check); the `serve run` process is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import yaml

from dspark.actors.transport import free_port
from dspark.cluster.ingress.front_door import front_door_env

ROOT = Path(__file__).resolve().parents[1]


def _app_yaml(target: str, drafter: str, model_name: str, port: int, dtype: str) -> tuple[dict, dict]:
    doc = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    doc["http_options"] = {**doc["http_options"], "host": "127.0.0.1", "port": port}
    (app,) = doc["applications"]
    changes = {"target": target, "model_name": model_name, "drafter": "dspark", "drafter_kwargs": {"path": drafter},
               "dtype": dtype, "ab_arms": [], "request_log": None}
    app["args"] = {**app["args"], **changes}
    return doc, changes


def _wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(f"not healthy within {timeout_s} s")


def _ask(client: openai.OpenAI, model: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True})
    completion_s = time.perf_counter() - t0
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return {"models": [m.id for m in client.models.list().data],
            "completion": {"text": done.choices[0].text, "finish_reason": done.choices[0].finish_reason,
                           "usage": done.usage.model_dump(), "dspark": (done.model_extra or {}).get("dspark"),
                           "wall_s": round(completion_s, 2)},
            "chat": {"content": chat.choices[0].message.content, "usage": chat.usage.model_dump(),
                     "dspark": (chat.model_extra or {}).get("dspark")},
            "stream_equals_chat": streamed == chat.choices[0].message.content}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="Hugging Face causal-LM folder.")
    parser.add_argument("--drafter", required=True, help="DSpark checkpoint folder trained for the target.")
    parser.add_argument("--model-name", default=None, help="The `model` clients send (default: the folder's name).")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args()
    model = args.model_name or Path(args.target).name
    port = free_port("127.0.0.1")
    doc, changes = _app_yaml(str(Path(args.target).resolve()), str(Path(args.drafter).resolve()), model, port,
                             args.dtype)
    with tempfile.TemporaryDirectory(prefix="dspark-serve-") as tmp:
        config = Path(tmp) / "serve.yaml"
        config.write_text(yaml.safe_dump(doc))
        env = {**os.environ, **front_door_env("proxy"), "PYTHONPATH": str(ROOT)}
        serve_bin = Path(sys.executable).with_name("serve")
        log = open(Path(tmp) / "serve_run.log", "w")  # noqa: SIM115 - closed in finally
        proc = subprocess.Popen([str(serve_bin), "run", str(config)], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        base_url = f"http://127.0.0.1:{port}"
        try:
            ready_s = _wait_healthy(base_url, proc, args.timeout_s)
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
            result = {"target": json.loads((Path(args.target) / "config.json").read_text())["architectures"][0],
                      "drafter_target": json.loads((Path(args.drafter) / "config.json").read_text()).get("target"),
                      "serve_yaml_changes": changes, "ready_s": round(ready_s, 1),
                      **_ask(client, model, args.max_tokens)}
        except Exception:
            log.flush()
            print((Path(tmp) / "serve_run.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            os.killpg(proc.pid, signal.SIGINT)  # serve run shuts its cluster down on Ctrl-C
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Serve the speculative decoder (target + EAGLE-3 draft) behind an OpenAI-compatible HTTP API on Ray Serve.

  python jobs/serve.py --target smollm2-135m --draft eagle_core/drafts/smollm2-135m-instruct --port 8000
  python jobs/serve.py --draft models:/smollm2-eagle3@production --set max_batch_size=8 --set num_cpus=2
  python jobs/serve.py --engine vllm --draft models:/smollm2-eagle3@champion --set num_speculative_tokens=3
  ray job submit --address http://127.0.0.1:8265 -- python jobs/serve.py --draft ...   (stays up)

Binds 127.0.0.1 unless --host says otherwise. Runs until SIGTERM / SIGINT (or `ray job stop`), then deletes
the application; --no-block deploys and returns (the application stays up in a long-lived cluster).
Set EAGLE3_SERVE_API_KEY (or EAGLE3_SERVE_API_KEY_FILE, or --set api_key_file=PATH: a file the replicas can
read) to require `Authorization: Bearer <key>`. Serving without a key where this cluster's Serve proxy binds a
non-loopback address is refused unless --insecure-no-auth says so; the address checked is the one the proxy
really binds (a Serve instance already running keeps its own, whatever --host asks for).
"""

import argparse
import os
import signal
import sys
import threading


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set wants key=value, got {item!r}")
        out[key.strip()] = value
    return out


def served_draft(draft: str, target: str) -> str | None:
    """The draft `--draft` names: 'shipped' is the one shipped for a named target (none for other targets), 'none'
    or '' plain decoding, anything else a folder, URL or registry URI as given."""
    from eagle_core.shipped import SHIPPED, shipped_draft

    if draft == "shipped":
        return str(shipped_draft(target)) if target in SHIPPED else None
    return None if draft in ("none", "") else draft


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target: 'smollm2-135m', a .gguf file, an HF folder (path or URL), a hub id or models:/<name>@<alias>")
    p.add_argument("--draft", default="shipped",
                   help="draft folder (path or URL), models:/<name>@<alias>, 'shipped' (the draft the project ships for "
                        "a named target; plain decoding for other targets) or 'none' (plain decoding)")
    p.add_argument("--engine", choices=("eagle3", "vllm"), default="eagle3",
                   help="what decodes: this project's decoder (EAGLE-2 dynamic trees) or vLLM with the draft as its "
                        "EAGLE-3 speculator (--set num_speculative_tokens=K; default the draft's TTT depth)")
    p.add_argument("--name", default="eagle3", help="Serve application name")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (an all-interfaces address exposes the server to the network: only behind auth)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the Serve app")
    p.add_argument("--route-prefix", default="/", help="URL prefix the app answers under")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any ServeConfig / DeploymentOptions field, e.g. max_batch_size=8, num_cpus=2")
    p.add_argument("--no-block", action="store_true", help="deploy and return")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without an API key (anyone who reaches the port may use it)")
    args = p.parse_args(argv)
    sets = parse_sets(args.set)
    if "api_key" in sets:
        from pipelines.serve.config import API_KEY_IN_ARGS

        raise SystemExit(API_KEY_IN_ARGS)
    has_key = bool(sets.get("api_key_file")) or any(
        os.environ.get(k) for k in ("EAGLE3_SERVE_API_KEY", "EAGLE3_SERVE_API_KEY_FILE"))
    from ray import serve

    from pipelines.cluster import connect
    from pipelines.serve.app import build_app, proxy_bind
    from pipelines.serve.config import is_loopback, keyless_exposure

    problem = keyless_exposure(args.host, args.port, has_key, args.insecure_no_auth)
    if problem:  # before connecting: nothing is started
        raise SystemExit(problem)
    connect(args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    host, port = proxy_bind()  # a Serve instance already running keeps its own address: check that one
    problem = keyless_exposure(host, port, has_key, args.insecure_no_auth)
    if problem:
        raise SystemExit(problem)
    if (host, port) != (args.host, args.port):
        print(f"[serve] this cluster's Serve proxy already runs on {host}:{port} (not --host {args.host} --port "
              f"{args.port}: a running Serve instance keeps its address)", file=sys.stderr, flush=True)
    if not has_key and not is_loopback(host):
        print(f"[serve] WARNING: serving on {host} WITHOUT AUTHENTICATION (--insecure-no-auth): anyone who "
              "reaches this port can use the model", file=sys.stderr, flush=True)
        sets["insecure_no_auth"] = "true"
    draft = served_draft(args.draft, args.target)
    app_args = {"target": args.target, "engine_name": args.engine, **({"draft": draft} if draft else {}), **sets}
    app = build_app(app_args)
    serve.run(app, name=args.name, route_prefix=args.route_prefix, blocking=False)
    url = f"http://{host}:{port}{args.route_prefix.rstrip('/')}"
    print(f"[serve] {args.name} ready: {url}/v1/completions, {url}/v1/chat/completions, {url}/metrics", flush=True)
    if args.no_block:
        return

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print(f"[serve] stopping {args.name}", flush=True)
    serve.delete(args.name)


if __name__ == "__main__":
    main()

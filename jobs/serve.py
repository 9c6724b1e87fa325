"""Serve the speculative decoder (target + EAGLE-3 draft) behind an OpenAI-compatible HTTP API on Ray Serve.

  python jobs/serve.py --target smollm2-135m --draft eagle_core/drafts/smollm2-135m-instruct --port 8000
  python jobs/serve.py --draft models:/smollm2-eagle3@production --set max_batch_size=8 --set num_cpus=2
  ray job submit --address http://127.0.0.1:8265 -- python jobs/serve.py --draft ...   (stays up)

Binds 127.0.0.1 unless --host says otherwise. Runs until SIGTERM / SIGINT (or `ray job stop`), then deletes
the application; --no-block deploys and returns (the application stays up in a long-lived cluster).
Set EAGLE3_SERVE_API_KEY to require `Authorization: Bearer <key>`.
"""

import argparse
import signal
import threading


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set wants key=value, got {item!r}")
        out[key.strip()] = value
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target: 'smollm2-135m', a .gguf file, an HF folder (path or URL), a hub id or models:/<name>@<alias>")
    p.add_argument("--draft", default=None, help="draft folder (path or URL) or models:/<name>@<alias>; omit for plain decoding")
    p.add_argument("--name", default="eagle3", help="Serve application name")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (an all-interfaces address exposes the server to the network: only behind auth)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--route-prefix", default="/")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any ServeConfig / DeploymentOptions field, e.g. max_batch_size=8, num_cpus=2")
    p.add_argument("--no-block", action="store_true", help="deploy and return")
    args = p.parse_args(argv)

    from ray import serve

    from pipelines.cluster import connect
    from pipelines.serve.app import build_app

    connect(args.address)
    app_args = {"target": args.target, **({"draft": args.draft} if args.draft else {}), **parse_sets(args.set)}
    app = build_app(app_args)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name=args.name, route_prefix=args.route_prefix, blocking=False)
    url = f"http://{args.host}:{args.port}{args.route_prefix.rstrip('/')}"
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

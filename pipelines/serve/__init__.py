"""Ray Serve deployment of the tree-verifying speculative decoder behind an OpenAI-compatible HTTP API.

config   ServeConfig (what a replica does) and DeploymentOptions (how Serve places it)
models   target/draft from a folder, a target name, or models:/<name>@<alias>
engine   continuous batching over eagle_core.decoding.DecodingState, with the load fallback tree -> chain -> plain
metrics  spec-decode metric definitions, Prometheus + Ray export
protocol OpenAI request validation, error bodies, responses, server-sent events
service  one replica's logic, Ray-free;  app: the Serve deployment and `build_app`
"""

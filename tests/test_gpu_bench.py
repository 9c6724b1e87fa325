"""bench/gpu.py on the CPU with tiny shapes: a self-describing result whose ratios come from its own measured times,
the published 8B shapes, out-of-memory and the time budget handled, nothing imported from Ray/MLflow/pyarrow."""

import json
import math
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

import bench.gpu as gpu

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("ray", "mlflow", "pyarrow", "pipelines")


def numbers(node, where=""):
    """(path, value) of every int/float leaf (bools are flags, not measurements)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from numbers(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from numbers(v, f"{where}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield where, node


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9)


def test_tiny_run_writes_a_self_describing_result_from_its_own_timings(tmp_path):
    out = tmp_path / "gpu.json"
    # What transformers itself loads is not the benchmark's: 5.19 (vLLM 0.32's pin) imports scikit-learn in its
    # generation utilities where it is installed (here: MLflow's), which loads pandas and pyarrow; a bare CUDA box
    # has none of them. The forbidden modules are those loaded beyond transformers' own imports.
    code = ("import sys, transformers.generation.candidate_generator; "
            f"known = {{m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}}}; "
            "import bench.gpu as g; rc = g.main(['--tiny', '--out', sys.argv[1]]); "
            f"print('FORBIDDEN', sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} and m not in known)); "
            "sys.exit(rc)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FORBIDDEN []" in done.stdout

    r = json.loads(out.read_text())
    assert r["benchmark"] == "bench.gpu" and r["tiny"] is True
    assert r["command"] == f"python -m bench.gpu --tiny --out {out}"
    datetime.fromisoformat(r["date"])
    assert {"line", "device", "torch", "transformers", "python"} <= set(r["machine"])
    assert r["failures"] == [] and r["skipped"] == []
    bad = [(k, v) for k, v in numbers(r) if not v > 0]
    assert not bad, bad

    widths = [str(w) for w in gpu.TINY["widths"]]
    assert set(r["targets"]) == set(gpu.TARGETS)
    for name, t in r["targets"].items():
        assert t["config_class"] == gpu.TARGETS[name][0] and t["shape"]["hidden_size"] == 64
        d = t["decode"]
        for forward in ("verify", "transformers_forward"):
            ms, ratio = d[forward]["ms"], d[forward]["over_one_token"]
            assert list(ms) == widths
            assert all(close(ratio[w], ms[w] / ms["1"]) for w in widths), (forward, ms, ratio)
        assert all(close(d["verify_over_transformers"][w], d["verify"]["ms"][w] / d["transformers_forward"]["ms"][w])
                   for w in widths)
        p = d["plain"]
        assert all(close(d["verify"]["over_plain_step"][w], d["verify"]["ms"][w] / p["our_step_ms"]) for w in widths)
        assert close(p["transformers_forward_ms"], d["transformers_forward"]["ms"]["1"])
        assert close(p["ours_over_transformers"], p["our_step_ms"] / p["transformers_forward_ms"])
        depth = d["draft"]["depth_ms"]
        assert close(d["draft"]["level_ms"], (depth["7"] - depth["1"]) / 6)
        e = t["extraction"]
        assert close(e["tokens_per_s"], e["batch"] * e["tokens_per_row"] / (e["ms"] / 1000))
        assert e["peak_memory_gib"] is None  # CPU: no allocator statistics, and no made-up number

    ttt = r["ttt"]
    assert ttt["draft_of"] == gpu.TTT_TARGET and ttt["draft_shape"]["ttt_steps"] == 7
    assert list(ttt["by_length"]) == [str(n) for n in gpu.TINY["ttt_lengths"]]
    for length, step in ttt["by_length"].items():
        assert step["tokens"] == int(length) and step["loss_finite"]
        assert close(step["tokens_per_s"], step["tokens"] / (step["step_ms"] / 1000))

    md = out.with_suffix(".md").read_text()
    assert r["command"] in md and r["date"] in md
    for name in gpu.TARGETS:
        assert f"## {name}" in md
    assert "| ours, × one token |" in md and "## TTT training step" in md
    ratio64 = r["targets"]["qwen3-8b"]["decode"]["verify"]["over_one_token"]["64"]
    assert f"{ratio64:.2f}" in md


@pytest.mark.parametrize("name, params", [("llama3.1-8b", 8_030_261_248), ("qwen3-8b", 8_190_735_360)])
def test_targets_have_the_published_shapes(name, params):
    import transformers

    config = gpu.target_config(name, tiny=False)
    with torch.device("meta"):  # no memory: the shapes only
        model = getattr(transformers, gpu.TARGETS[name][0].replace("Config", "ForCausalLM"))(config)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight  # untied, as published


@pytest.mark.parametrize("name", list(gpu.TARGETS))
def test_meta_built_target_has_real_rotary_frequencies_and_random_weights(name):
    """to_empty leaves buffers as garbage: the rotary frequencies must be recomputed, norms 1, weights random."""
    import transformers

    model = gpu.build_target(name, tiny=True, device=torch.device("cpu"), dtype=torch.bfloat16)
    config = gpu.target_config(name, tiny=True)
    reference = getattr(transformers, gpu.TARGETS[name][0].replace("Config", "ForCausalLM"))(config)
    for (bname, ours), (_, theirs) in zip(model.named_buffers(), reference.named_buffers()):
        assert ours.dtype == torch.float32 and torch.equal(ours, theirs), bname
    if name == "llama3.1-8b":  # the llama3 rope scaling is in force, not plain RoPE
        assert config.rope_parameters["rope_type"] == "llama3"
    for pname, p in model.named_parameters():
        if "norm" in pname:
            assert torch.all(p == 1), pname
        else:
            assert 0.015 < p.float().std() < 0.025, pname
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 9)[None]).logits
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("raised, rc", [(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB"), 0),
                                        (ValueError("a shape mismatch"), 1)])
def test_a_failing_ttt_length_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, raised, rc):
    real = gpu.train_step

    def train_step(draft, batch, *args, **kwargs):
        if batch["input_ids"].shape[1] == 64:
            raise raised
        return real(draft, batch, *args, **kwargs)

    monkeypatch.setattr(gpu, "train_step", train_step)
    out = tmp_path / "gpu.json"
    assert gpu.main(["--tiny", "--targets", "", "--out", str(out)]) == rc
    r = json.loads(out.read_text())
    steps = r["ttt"]["by_length"]
    assert list(steps) == ["32", "64", "128"]
    assert steps["64"]["out_of_memory"] is (rc == 0) and str(raised) in steps["64"]["error"]
    assert steps["32"]["tokens_per_s"] > 0 and steps["128"]["tokens_per_s"] > 0  # the lengths after it still ran
    assert r["failures"] == ([] if rc == 0 else ["ttt.by_length.64: ValueError: a shape mismatch"])
    md = out.with_suffix(".md").read_text()
    assert ("| 64 | out of memory: " if rc == 0 else "| 64 | failed: ") in md


def test_the_time_budget_skips_what_remains_and_says_so(tmp_path, monkeypatch):
    real_step, real_used, spent = gpu.ttt_step, gpu.Budget.used, []

    def ttt_step(*args):  # the first length uses up the budget
        spent.append(True)
        return real_step(*args)

    monkeypatch.setattr(gpu, "ttt_step", ttt_step)
    monkeypatch.setattr(gpu.Budget, "used", lambda self: 1e9 if spent else real_used(self))
    out = tmp_path / "gpu.json"
    assert gpu.main(["--tiny", "--targets", "", "--budget-s", "60", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["ttt"]["by_length"]) == ["32"]
    assert [s["what"] for s in r["skipped"]] == ["TTT step at 64 tokens", "TTT step at 128 tokens"]
    assert all("time budget" in s["why"] for s in r["skipped"])
    assert "- TTT step at 128 tokens: time budget" in out.with_suffix(".md").read_text()

    out0 = tmp_path / "none.json"
    assert gpu.main(["--tiny", "--budget-s", "0", "--out", str(out0)]) == 0  # nothing fits: a file that says so
    r0 = json.loads(out0.read_text())
    assert r0["targets"] == {} and r0["ttt"] is None
    assert [s["what"].split(" ")[0] for s in r0["skipped"]] == [*gpu.TARGETS, "TTT"]


def test_without_cuda_the_full_run_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path / "gpu.json")]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_make_target_runs_it_without_the_venv_setup():
    makefile = (REPO / "Makefile").read_text()
    block = makefile[makefile.index("\ngpu-bench:"):].split("\n\n")[0]
    assert "-m bench.gpu" in block and "$(STAMP)" not in block.splitlines()[1]

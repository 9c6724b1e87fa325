"""bench/ttt.py: the per-run child at a tiny length, failures recorded without losing the other runs, the summary's
ratios, the eager stand-in for SpecForge's Triton loss, and (only where a SpecForge checkout is given in
$SPECFORGE_DIR) SpecForge's own step on our weights: the harness check and a timed bf16 step."""

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

import bench.ttt as ttt

REPO = Path(__file__).resolve().parents[1]
SPECFORGE = os.environ.get("SPECFORGE_DIR")


def args_for(tmp_path, **kw):
    base = dict(iters=1, warmup=0, device="cpu", mem_limit_gib=8.0, timeout=300.0, reference=None,
                reference_commit=None, lengths=[16], impls=["ours"], dtypes=["float32"], check_length=32, argv=[],
                shape="smollm2", profile=0)
    return Namespace(**{**base, **kw})


def row(impl, length, dtype="float32", seconds=10.0, cpu=8.0, mem=2**30, error=None):
    if error:
        return {"impl": impl, "seq_len": length, "dtype": dtype, "error": error}
    return {"impl": impl, "seq_len": length, "dtype": dtype, "step_seconds": seconds, "step_cpu_seconds": cpu,
            "tokens_per_s": length / seconds, "tokens_per_cpu_s": length / cpu, "peak_mem_bytes": mem}


def test_the_child_times_our_step_at_a_tiny_length(tmp_path):
    r = ttt.run_child("ours", 16, args_for(tmp_path), "float32")
    assert "error" not in r, r
    assert (r["impl"], r["seq_len"], r["dtype"], r["ttt_steps"]) == ("ours", 16, "float32", 7)
    assert r["step_seconds"] > 0 and r["step_cpu_seconds"] > 0
    assert r["tokens_per_s"] == pytest.approx(16 / r["step_seconds"])
    assert r["tokens_per_cpu_s"] == pytest.approx(16 / r["step_cpu_seconds"])
    # AdamW's state alone (about 10M float32 weights, two moments) is in the step's peak: more than 50 MiB.
    assert r["peak_mem_bytes"] > 50 * 2**20
    assert r["vocab_covers_every_target"] is True
    assert r["compiled_graphs_after_steps"] == r["compiled_graphs_after_prewarm"] == 0


def test_a_run_past_its_timeout_is_recorded_as_such(tmp_path):
    r = ttt.run_child("ours", 16, args_for(tmp_path, timeout=0.5), "bfloat16")
    assert r == {"impl": "ours", "seq_len": 16, "dtype": "bfloat16", "error": "timed out after 0.5 s"}


def test_one_failed_run_keeps_the_others_and_notes_the_failure(tmp_path, monkeypatch):
    def fake_child(impl, length, args, dtype="float32"):
        if impl == "naive":
            return row(impl, length, dtype, error="out of memory (limit 8.0 GiB): can't allocate")
        return row(impl, length, dtype, seconds=5.0 if impl == "ours" else 20.0)

    monkeypatch.setattr(ttt, "run_child", fake_child)
    out = tmp_path / "ttt.json"
    ttt.bench_speed(args_for(tmp_path, lengths=[64, 128], impls=["ours", "naive"], dtypes=["float32"]), out)
    result = json.loads(out.read_text())
    assert [(r["impl"], r["seq_len"]) for r in result["runs"]] == [("ours", 64), ("naive", 64), ("ours", 128),
                                                                     ("naive", 128)]
    for s in result["summary"]:
        assert s["naive_error"].startswith("out of memory")
        assert s["vs_naive_note"] == "naive failed; see runs"
        assert s["ours_tokens_per_s"] == pytest.approx(s["seq_len"] / 5.0)
    md = out.with_suffix(".md").read_text()
    assert "out of memory" in md and "| 64 | float32 | 12.80 | n/a |" in md


def test_summary_ratios_per_length_and_dtype():
    rows = [
        row("ours", 2048, "float32", seconds=10.0, cpu=16.0, mem=3 * 2**30),
        row("specforge", 2048, "float32", seconds=25.0, cpu=40.0, mem=6 * 2**30),
        row("naive", 2048, "float32", seconds=30.0, cpu=48.0, mem=12 * 2**30),
        row("ours", 2048, "bfloat16", seconds=8.0, cpu=12.0, mem=2 * 2**30),
        row("specforge", 2048, "bfloat16", error="timed out after 900 s"),
        # a row from before the dtype axis: a float32 one
        {k: v for k, v in row("ours", 512, seconds=10.0, cpu=5.0, mem=2**28).items() if k != "dtype"},
        row("naive", 512, "float32", seconds=20.0, cpu=10.0, mem=2**29),
    ]
    summary = ttt.speed_ratios(rows)
    assert [(s["seq_len"], s["dtype"]) for s in summary] == [(512, "float32"), (2048, "float32"),
                                                             (2048, "bfloat16")]
    old, fp32, bf16 = summary
    assert old["speedup_ours_over_naive_cpu_time"] == pytest.approx(2.0)
    assert old["peak_mem_ratio_ours_over_naive"] == pytest.approx(0.5)
    assert "specforge_tokens_per_s" not in old and "vs_specforge_note" not in old
    assert fp32["speedup_ours_over_specforge_wall"] == pytest.approx(2.5)
    assert fp32["speedup_ours_over_specforge_cpu_time"] == pytest.approx(2.5)
    assert fp32["peak_mem_ratio_ours_over_specforge"] == pytest.approx(0.5)
    assert fp32["speedup_ours_over_naive_wall"] == pytest.approx(3.0)
    assert fp32["specforge_peak_mem_mib"] == pytest.approx(6 * 1024)
    assert bf16["specforge_error"] == "timed out after 900 s"
    assert bf16["vs_specforge_note"] == "specforge failed; see runs"
    assert "speedup_ours_over_specforge_wall" not in bf16
    assert bf16["ours_tokens_per_cpu_s"] == pytest.approx(2048 / 12.0)


def plain_loss(logits, target, mask):
    """The definition: mean over all B*T rows of mask * -sum_v target * log_softmax(logits) (float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(mask * (target * logp).sum(-1, keepdim=True)).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_log_softmax_loss_matches_its_definition_and_gradient(monkeypatch, dtype):
    monkeypatch.setattr(ttt.EagerLogSoftmaxLoss, "rows", 3)  # several blocks, the last one short
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g) * 3).to(dtype)
    target = torch.softmax(torch.randn(2, 5, 11, generator=g), -1)
    mask = (torch.rand(2, 5, 1, generator=g) > 0.4).long()
    assert 0 < int(mask.sum()) < 10
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss = ttt.EagerLogSoftmaxLoss.apply(a, target, mask)
    ref = plain_loss(b, target, mask)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    (2.5 * loss).backward()
    (2.5 * ref).backward()
    assert a.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol)
    assert a.grad[~mask.bool().expand_as(a)].abs().max() == 0  # masked rows: no gradient


def test_specforge_inputs_shift_ids_and_teacher_by_one_and_the_mask_by_two():
    L = 10
    batch = dict(input_ids=torch.arange(L)[None], loss_mask=torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1]]),
                 aux_hidden=torch.randn(1, L, 6), target_last_hidden=torch.arange(L, dtype=torch.float)[None, :, None],
                 target_lm_head_weight=torch.randn(5, 1))
    sf = ttt.specforge_inputs(batch)
    assert sf["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]]
    assert sf["target_hidden_for_compact"][0, :, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    assert sf["loss_mask"].shape == (1, L, 1)
    assert sf["loss_mask"][0, :, 0].tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0]
    assert sf["hidden_states"] is batch["aux_hidden"]


def test_specforge_commit_of_an_exported_tree_is_the_given_one(tmp_path):
    assert ttt.specforge_commit(tmp_path, "abc123") == "abc123"
    assert ttt.specforge_commit(tmp_path).startswith("unknown")


def test_a_folder_that_is_no_specforge_checkout_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        ttt.main(["--impls", "ours", "specforge", "--reference", str(tmp_path), "--out", str(tmp_path / "t.json")])


@pytest.mark.skipif(not SPECFORGE or not Path(SPECFORGE, "specforge/algorithms/eagle3/model.py").is_file(),
                    reason="no SpecForge checkout: set SPECFORGE_DIR to one (e.g. `git -C <mirror> archive HEAD | "
                           "tar -x -C /tmp/specforge`) to run SpecForge's step")
def test_specforge_step_on_our_weights_matches_ours_and_runs_timed(tmp_path):
    # In a child: SpecForge's modules go into sys.modules. torch.compile is off here to keep the test fast (the
    # benchmark compiles what SpecForge compiles); the harness check itself does not depend on it.
    code = ("import json, sys, bench.ttt as t; "
            "c = t.harness_check(sys.argv[1], 32, 'cpu'); "
            "r = t.run_one('specforge', 16, 1, 0, 'cpu', 8.0, 'bfloat16', sys.argv[1]); "
            "print(json.dumps({'check': c, 'run': r}))")
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code, SPECFORGE], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    check, run = out["check"], out["run"]
    assert check["weights"]["ours_not_mapped"] == [] and check["weights"]["specforge_not_loaded"] == []
    assert check["step_counts_ours"] == check["step_counts_specforge"] == [30 - k for k in range(7)]
    assert check["ok"], check
    assert max(check["step_loss_relative_difference"]) < 1e-4
    assert max(check["logits_relative_difference"]) < 1e-4
    assert max(check["grad_relative_difference"].values()) < 1e-4
    assert (run["impl"], run["dtype"], run["seq_len"]) == ("specforge", "bfloat16", 16)
    assert run["step_seconds"] > 0 and run["weights_not_mapped"] == []


def test_the_smollm2_row_of_the_shape_table_is_the_embedded_target():
    from transformers import AutoConfig

    from eagle_core.target import materialize_hf_folder

    embedded = AutoConfig.from_pretrained(materialize_hf_folder("smollm2-135m"))
    table = ttt.target_config("smollm2")
    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "vocab_size", "num_hidden_layers", "max_position_embeddings"):
        assert getattr(table, name) == getattr(embedded, name), name
    assert table.rope_parameters["rope_theta"] == embedded.rope_parameters["rope_theta"]
    assert table.rms_norm_eps == pytest.approx(embedded.rms_norm_eps)


@pytest.mark.parametrize("shape, hidden, intermediate, vocab, draft_vocab",
                         [("llama3.1-8b", 4096, 14336, 128256, 32000), ("qwen3-8b", 4096, 12288, 151936, 32000),
                          ("smollm2", 576, 1536, 49152, 8192)])
def test_each_shape_builds_its_published_draft_with_its_recipes_vocabulary(shape, hidden, intermediate, vocab,
                                                                             draft_vocab):
    from eagle_core.draft import DraftConfig

    settings = ttt.shape_settings(shape)
    cfg = DraftConfig.from_target(ttt.target_config(shape), draft_vocab_size=settings["draft_vocab_size"],
                                  ttt_steps=settings["ttt_steps"])
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.target_vocab_size, cfg.draft_vocab_size, cfg.ttt_steps) == (
        hidden, intermediate, vocab, draft_vocab, 7)
    words = ttt.describe_shape(shape)
    assert f"hidden {hidden}," in words and f"target vocab {vocab}," in words and f"draft vocab {draft_vocab}" in words


def test_the_tiny_shape_runs_end_to_end_with_its_profile_in_the_result(tmp_path):
    out = tmp_path / "tiny.json"
    ttt.main(["--shape", "tiny", "--lengths", "24", "--impls", "ours", "--dtypes", "float32", "--profile", "5",
              "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["shape"]["name"] == "tiny" and result["shape"]["hidden_size"] == 64
    assert result["what"].startswith("one TTT training step") and "the tiny draft (hidden 64," in result["what"]
    [run] = result["runs"]
    assert "error" not in run, run
    assert (run["shape"], run["seq_len"], run["draft_vocab_size"]) == ("tiny", 24, 256)
    prof = run["profile_step"]
    assert prof["sorted_by"] == "self_cpu_time_total" and len(prof["top"]) == 5
    assert prof["top"][0]["self_ms"] >= prof["top"][-1]["self_ms"] > 0
    md = out.with_suffix(".md").read_text()
    assert "## Profile of one step" in md and "the tiny draft" in md


def test_which_specforge_loss_and_flex_backend_a_cpu_run_says_it_used():
    assert not ttt.triton_loss_runs("cpu")
    assert "eager stand-in" in ttt.specforge_loss_note("cpu")
    assert "cannot run" in ttt.flex_note("cpu")
    rows = [row("ours", 2048, seconds=10.0), row("specforge", 2048, seconds=20.0),
            row("specforge-flex", 2048, error="NotImplementedError: FlexAttention does not support backward on CPU")]
    [s] = ttt.speed_ratios(rows)
    assert s["speedup_ours_over_specforge_wall"] == pytest.approx(2.0)
    assert s["specforge_flex_error"].startswith("NotImplementedError")
    assert s["vs_specforge_flex_note"] == "specforge-flex failed; see runs"
    md = ttt.markdown({"device": "cpu", "command": "c", "date": "d", "machine": "m", "torch": "t",
                       "load_avg_1min_at_end": 0.0, "what": "w", "summary": [s], "runs": rows, "peak_memory": "p",
                       "note": "n"})
    sdpa, flex = md.split("## ours vs SpecForge (flex_attention)")
    assert "| 2048 | float32 |" in sdpa and "FlexAttention" not in sdpa
    assert "FlexAttention does not support backward" in flex

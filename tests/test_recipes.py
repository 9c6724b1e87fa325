"""Recipes (eagle_core.recipe): shipped files, the rule for other targets, the library defaults they own, `--recipe`
on every job, and the dry-run plan of jobs/extract.py and jobs/train.py (pipelines.preflight)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_core.recipe import (REFERENCE, RecipeError, TargetShape, derive_recipe, gpus_for_weights,
                               load_recipe, recipe_naming, resolve_recipe, shipped_recipes)

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# Target folders: configs only (and SmolLM2's tokenizer), no weights
# --------------------------------------------------------------------------------------------------

def config_folder(path: Path, config, tokenizer) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert not list(path.glob("*.safetensors"))
    return path


@pytest.fixture(scope="module")
def llama_8b_dir(tmp_path_factory, smollm2_tokenizer):
    """Llama-3.1-8B's config alone: the rule and the plan need no weights."""
    from transformers import LlamaConfig

    return config_folder(tmp_path_factory.mktemp("llama8b"), LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
        smollm2_tokenizer)


@pytest.fixture(scope="module")
def qwen3_8b_dir(tmp_path_factory, smollm2_tokenizer):
    from transformers import Qwen3Config

    return config_folder(tmp_path_factory.mktemp("qwen3-8b"), Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False), smollm2_tokenizer)


@pytest.fixture(scope="module")
def gpt_oss_20b_dir(tmp_path_factory, smollm2_tokenizer):
    from transformers import GptOssConfig

    return config_folder(tmp_path_factory.mktemp("gpt-oss-20b"), GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4), smollm2_tokenizer)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * (1 + i % 5)}]}
            for i in range(30)]
    rows.append({"messages": "not a conversation"})  # quarantined: read, not a row
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


# --------------------------------------------------------------------------------------------------
# Shipped recipes and the library's defaults
# --------------------------------------------------------------------------------------------------

def test_shipped_recipes_load_and_name_their_sources():
    assert set(shipped_recipes()) >= {"reference", "smollm2-135m-instruct", "llama3.1-8b-instruct", "qwen3-8b",
                                      "gpt-oss-20b", "gemma3-270m"}
    for name in shipped_recipes():
        recipe = load_recipe(name)
        assert recipe.name == name and recipe.source and recipe.schedule == "cosine"
    peers = {"llama3.1-8b-instruct": "SpecForge", "qwen3-8b": "speculators", "gpt-oss-20b": "SpecForge",
             "reference": "SpecForge"}
    for name, peer in peers.items():
        assert peer in load_recipe(name).source, name


def test_recipe_values_are_the_tuned_and_published_ones():
    smol = load_recipe("smollm2-135m-instruct")
    assert (smol.draft_vocab_size, smol.lr, smol.max_length, smol.tokens_per_batch, smol.ttt_steps) == (
        8192, 1e-3, 1024, 2048, 7)
    assert load_recipe("gemma3-270m").draft_vocab_size == 32000 and load_recipe("gemma3-270m").lr == smol.lr
    assert (REFERENCE.draft_vocab_size, REFERENCE.lr, REFERENCE.ttt_steps) == (32000, 1e-4, 7)
    llama = load_recipe("llama3.1-8b-instruct")
    assert (llama.draft_vocab_size, llama.lr, llama.max_length) == (32000, 1e-4, 4096)
    assert (load_recipe("qwen3-8b").lr, load_recipe("qwen3-8b").max_length) == (3e-5, 8192)
    # SpecForge's [1, 11, 21] (SGLang's convention: the decoder layer) are output_hidden_states indices + 1
    assert load_recipe("gpt-oss-20b").aux_layer_ids == (2, 12, 22)


def test_library_defaults_are_the_reference_recipes():
    from eagle_core.draft import DraftConfig
    from eagle_core.ttt import TrainConfig
    from pipelines.distill import DistillConfig
    from pipelines.extract import ExtractConfig
    from pipelines.train import TrainJobConfig

    job = TrainJobConfig(features="x")
    distill = DistillConfig()
    assert DraftConfig.draft_vocab_size == job.draft_vocab_size == distill.draft_vocab_size == 32000
    assert TrainConfig.lr == job.lr == distill.lr == REFERENCE.lr
    assert DraftConfig.ttt_steps == REFERENCE.ttt_steps
    assert job.warmup_ratio == REFERENCE.warmup_ratio and job.tokens_per_batch == REFERENCE.tokens_per_batch
    assert ExtractConfig().max_length == distill.max_length == REFERENCE.max_length


@pytest.mark.parametrize("text, error", [
    ("lr = 1e-4", "missing keys"),
    ("typo_key = 1", "unknown keys"),
    ("this is not toml", "not valid TOML"),
])
def test_a_broken_recipe_file_is_refused_with_the_reason(tmp_path, text, error):
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=error):
        load_recipe(str(path))


def test_bad_values_and_unknown_names_are_refused(tmp_path):
    text = (ROOT / "eagle_core/recipes/reference.toml").read_text()
    for old, new, error in [('lr = 1e-4', 'lr = 3.0', "lr must be in"),
                            ('schedule = "cosine"', 'schedule = "linear"', "schedule must be one of"),
                            ('draft_vocab_size = 32000', 'draft_vocab_size = 0', "draft_vocab_size must be"),
                            ('aux_layer_ids = []', 'aux_layer_ids = [1, 2]', "three non-negative")]:
        path = tmp_path / "bad.toml"
        path.write_text(text.replace(old, new))
        with pytest.raises(RecipeError, match=error):
            load_recipe(path)
    with pytest.raises(RecipeError, match="no recipe 'llama-9000'.*reference"):
        load_recipe("llama-9000")


def test_a_recipe_file_of_ones_own_is_used_by_path(tmp_path):
    text = (ROOT / "eagle_core/recipes/reference.toml").read_text()
    path = tmp_path / "mine.toml"
    path.write_text(text.replace('name = "reference"', 'name = "mine"').replace("lr = 1e-4", "lr = 2e-4"))
    recipe = resolve_recipe(str(path), "smollm2-135m")
    assert (recipe.name, recipe.lr, recipe.why) == ("mine", 2e-4, "given by --recipe")


# --------------------------------------------------------------------------------------------------
# The rule
# --------------------------------------------------------------------------------------------------

def test_named_targets_get_their_recipe_by_the_rule():
    assert resolve_recipe(None, "smollm2-135m").name == "smollm2-135m-instruct"
    assert resolve_recipe(None, "HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2-135m-instruct"
    assert resolve_recipe(None, "gemma3-270m").name == "gemma3-270m"
    assert resolve_recipe(None, "meta-llama/Llama-3.1-8B-Instruct").name == "llama3.1-8b-instruct"
    assert recipe_naming("/models/Qwen3-8B").name == "qwen3-8b"  # a folder named like its hub id
    assert recipe_naming("/models/target") is None
    assert resolve_recipe(None, None).name == "reference"


def test_an_8b_shaped_random_config_gets_the_reference_recipe(llama_8b_dir):
    recipe = resolve_recipe(None, str(llama_8b_dir))
    assert "by the rule" in recipe.why and recipe.name == "rule (reference)"
    assert (recipe.draft_vocab_size, recipe.lr, recipe.max_length, recipe.gpus_per_target) == (
        32000, REFERENCE.lr, REFERENCE.max_length, 1)


def test_the_rule_scales_vocabulary_and_gpus_with_the_target(tiny_target_dir):
    tiny = resolve_recipe(None, str(tiny_target_dir))  # 49152-token vocabulary, a few thousand parameters
    smol = load_recipe("smollm2-135m-instruct")
    assert (tiny.lr, tiny.max_length, tiny.draft_vocab_size) == (smol.lr, smol.max_length, 32000)
    small_vocab = TargetShape("t", "llama", 64, 4, 512, 10_000)
    assert derive_recipe(small_vocab).draft_vocab_size == 512
    # 140 GB of bf16 weights over GPUs whose weights share is 0.8 x 80 GiB: 3 GPUs; 0.8 x 141 GiB: 2
    big = TargetShape("t", "llama", 8192, 80, 128256, 70_000_000_000)
    assert derive_recipe(big).gpus_per_target == gpus_for_weights(140_000_000_000) == 3
    assert derive_recipe(big, gpu_memory_gib=141).gpus_per_target == 2
    assert gpus_for_weights(16_000_000_000) == 1


def test_recipe_values_flow_into_options_only_where_no_flag_is_given():
    from pipelines.cli import FROM_RECIPE, fill_from_recipe

    values = fill_from_recipe({"lr": FROM_RECIPE, "ttt_steps": 3}, REFERENCE, {"lr": "lr", "ttt_steps": "ttt_steps"})
    assert values == {"lr": REFERENCE.lr, "ttt_steps": 3}


# --------------------------------------------------------------------------------------------------
# --dry-run: the plan
# --------------------------------------------------------------------------------------------------

def plan_text(capsys, main, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_train_dry_run_with_the_llama_recipe_on_a_tiny_random_llama(tiny_target_dir, corpus):
    """The command as a user types it (a subprocess: the script's own path, imports and exit code)."""
    cmd = [sys.executable, "jobs/train.py", "--recipe", "llama3.1-8b-instruct", "--target", str(tiny_target_dir),
           "--dry-run"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[train] plan (dry run" in out.stdout and "recipe: llama3.1-8b-instruct: draft vocab 32000" in out.stdout
    assert "config and meta-device model load: ok" in out.stdout and "GPUs per target copy: 1" in out.stdout
    with_corpus = subprocess.run(cmd + ["--corpus", corpus, "--epochs", "2"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=300)
    assert with_corpus.returncode == 0, with_corpus.stderr
    assert "30 rows" in with_corpus.stdout and "steps: 2 (2 epoch(s)" in with_corpus.stdout


@pytest.mark.parametrize("recipe, folder, hidden, layers", [
    ("llama3.1-8b-instruct", "llama_8b_dir", 4096, 32),
    ("qwen3-8b", "qwen3_8b_dir", 4096, 36),
    ("gpt-oss-20b", "gpt_oss_20b_dir", 2880, 24),
])
def test_train_dry_run_on_the_recipe_targets_configs(request, capsys, corpus, recipe, folder, hidden, layers):
    from jobs.train import main
    from pipelines.preflight import count_corpus, target_tokenizer

    target = str(request.getfixturevalue(folder))
    out = plan_text(capsys, main, ["--recipe", recipe, "--target", target, "--corpus", corpus, "--dry-run",
                                   "--use-gpu", "--gpus-per-extract-worker", "1"])
    r = load_recipe(recipe)
    count = count_corpus(corpus, target_tokenizer(target), r.max_length)
    per_token = 4 * hidden * 2  # bf16 on GPUs
    assert f"hidden {hidden}, {layers} layers" in out and f"recipe: {r.summary()}" in out
    assert f"{count.rows} rows, {count.tokens:,} tokens" in out and count.rows == 30
    assert f"{per_token:,} bytes per token (4 x {hidden} x bfloat16)" in out
    steps = math.ceil(count.tokens * (1 - 0.05) / r.tokens_per_batch)
    assert f"steps: {steps} (1 epoch(s)" in out
    params = TargetShape.of(target).parameters
    assert (7.5e9 < params < 8.5e9) if "8b" in recipe else (20e9 < params < 22.5e9)
    assert "GPUs per target copy: 1 in force, 1 needed" in out


def test_8k_hidden_features_at_sharegpt_scale_advise_streaming(llama_8b_dir):
    from pipelines.preflight import CorpusCount, RunPlan

    shape = TargetShape.of(str(llama_8b_dir))
    plan = RunPlan(job="extract", target="llama", shape=shape, recipe=REFERENCE, corpus="sharegpt",
                   count=CorpusCount(rows=100_000, read=100_000, tokens=40_000_000, loss_tokens=1, sampled=256),
                   rows=100_000, tokens=40_000_000, dtype="bfloat16", target_copies=8, gpus_per_target=1,
                   gpu_memory_gib=80)
    assert plan.bytes_per_token == 32 * 1024  # 4 x 4096 x 2 bytes: ~32 KiB per token
    assert plan.feature_bytes > 1 << 40
    assert any("streaming training (jobs/train.py --corpus)" in a for a in plan.advice())
    small = RunPlan(**{**plan.__dict__, "tokens": 1_000_000, "notes": []})
    assert not any("streaming" in a for a in small.advice())
    short = RunPlan(**{**plan.__dict__, "gpus_per_target": 1, "gpu_memory_gib": 16, "notes": []})
    assert any("need 2 GPU(s) of 16 GiB" in a for a in short.advice())


def test_extract_dry_run_on_the_embedded_target(capsys):
    from jobs.extract import main

    out = plan_text(capsys, main, ["--dry-run", "--limit", "40", "--dtype", "float32"])
    assert "recipe smollm2-135m-instruct" in out and "the shipped recipe for smollm2-135m" in out
    assert "40 records read" in out and "cut at 1024 each" in out
    assert "9,216 bytes per token (4 x 576 x float32)" in out


def test_train_dry_run_from_features_reads_the_manifest(tmp_path, capsys, tiny_target_dir):
    from jobs.train import main
    from pipelines.feature_files import FeatureManifest, write_manifest

    write_manifest(str(tmp_path), FeatureManifest(
        target=str(tiny_target_dir), target_hidden_size=64, target_vocab_size=49152, aux_layer_ids=[2, 2, 1],
        dtype="float32", rows=100, tokens=50_000, loss_tokens=20_000, shards=[], token_counts={}))
    out = plan_text(capsys, main, ["--features", str(tmp_path), "--dry-run", "--epochs", "3"])
    assert "by the rule" in out and "100 rows, 50,000 tokens" in out
    assert f"steps: {3 * math.ceil(50_000 * 0.95 / 2048)} (3 epoch(s)" in out  # the SmolLM2-scale 2048 per step


def test_a_target_or_recipe_that_does_not_load_stops_the_plan(tmp_path, capsys):
    from jobs.train import main

    with pytest.raises(SystemExit, match="does not load"):
        main(["--target", str(tmp_path / "nothing-here"), "--dry-run"])
    with pytest.raises(SystemExit, match="no recipe 'nope'"):
        main(["--target", "smollm2-135m", "--recipe", "nope", "--dry-run"])
    with pytest.raises(SystemExit, match="give --features"):
        main(["--target", "smollm2-135m"])


def test_train_flags_override_the_recipe(capsys, monkeypatch):
    """Without --dry-run the job config gets the recipe's values except where a flag was given."""
    import jobs.train as train

    seen = []
    monkeypatch.setattr(train, "run_train", lambda config: seen.append(config) or {"draft": "d"})
    monkeypatch.setattr("pipelines.cluster.connect", lambda address: None)
    assert train.main(["--corpus", "sharegpt", "--target", "smollm2-135m", "--lr", "5e-4"]) == 0
    (config,) = seen
    assert (config.lr, config.draft_vocab_size, config.tokens_per_batch, config.warmup_ratio) == (
        5e-4, 8192, 2048, 0.03)
    assert config.extract["max_length"] == 1024


def test_demo_and_retrain_carry_the_recipe():
    from jobs.demo import recipe_overrides
    from jobs.retrain import apply_recipe

    smol = load_recipe("smollm2-135m-instruct")
    extract, train = recipe_overrides(smol)
    assert extract == {} and (train["draft_vocab_size"], train["tokens_per_batch"]) == (8192, 2048)
    args = apply_recipe({"extract": {"max_length": 512}, "train": {"ttt_steps": 3}, "warm_start": True}, smol)
    assert args["extract"]["max_length"] == 512 and args["train"]["ttt_steps"] == 3
    assert args["train"]["draft_vocab_size"] == 8192 and "lr" not in args["train"]  # --warm-start-lr governs
    scratch = apply_recipe({"extract": {}, "train": {}, "warm_start": False}, load_recipe("gpt-oss-20b"))
    assert scratch["train"]["lr"] == 1e-4 and scratch["extract"]["aux_layer_ids"] == [2, 12, 22]


def test_every_job_and_benchmark_option_has_help(monkeypatch):
    """Each jobs/*.py and bench/*.py command line, as its main() builds it: no option without help text."""
    import argparse
    import importlib

    class Built(Exception):
        pass

    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise Built

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    modules = [f"{folder}.{p.stem}" for folder in ("jobs", "bench") for p in sorted((ROOT / folder).glob("*.py"))
               if p.stem not in ("__init__", "common")]
    checked = []
    for name in modules:
        module = importlib.import_module(name)
        if not hasattr(module, "main"):
            continue
        parsers.clear()
        with pytest.raises(Built):
            module.main([])
        (parser,) = parsers
        bare = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"
                and not (a.help or "").replace("(default: %(default)s)", "").strip()]
        assert not bare, f"{name}: options without help: {bare}"
        checked.append(name)
    assert {"jobs.extract", "jobs.train", "jobs.distill", "jobs.retrain", "jobs.demo", "bench.serve"} <= set(checked)


# --------------------------------------------------------------------------------------------------
# docs/recipes.md: its table is the files' values, its commands run (or parse, where they need a cluster)
# --------------------------------------------------------------------------------------------------

DOC = ROOT / "docs" / "recipes.md"


def test_the_docs_table_shows_every_recipe_as_its_file_says():
    rows = [line.split("|")[1:-1] for line in DOC.read_text().splitlines() if line.startswith("| `")]
    shown = {}
    for cells in rows:
        cells = [c.strip() for c in cells]
        shown[cells[0].strip("`")] = cells
    assert set(shown) == set(shipped_recipes())
    for name, cells in shown.items():
        r = load_recipe(name)
        vocab, lr, max_length, tokens, ttt, aux, gpus, tree = cells[2:10]
        assert (int(vocab), float(lr), int(max_length), int(tokens), int(ttt), int(gpus)) == (
            r.draft_vocab_size, r.lr, r.max_length, r.tokens_per_batch, r.ttt_steps, r.gpus_per_target), name
        assert aux == ("default" if r.aux_layer_ids is None else ", ".join(map(str, r.aux_layer_ids))), name
        assert tree == f"{r.tree.top_k}/{r.tree.depth}/{r.tree.total_tokens}", name


def doc_commands() -> list[tuple[str, bool]]:
    """(command, runs here) for every `python ...` line of the doc's code blocks; a block runs here when the text
    before it says the test suite runs it, and is only parsed when that text says what it needs."""
    parts = DOC.read_text().split("```")
    out = []
    for before, block in zip(parts[0::2], parts[1::2]):
        runs = "(the test suite runs them)" in before.strip().splitlines()[-1]
        needs = "(needs:" in before.strip().splitlines()[-1]
        for line in block.strip().splitlines():
            if line.startswith("python "):
                assert runs or needs, f"a command that neither runs here nor says what it needs: {line}"
                out.append((line, runs))
    return out


def test_every_docs_command_parses_and_the_local_ones_run(capsys):
    """The local ones run in this process, through the job's `main` (they ran as subprocesses until the suite had to
    fit 15 minutes; a job run as its script, path and exit code included, is
    test_train_dry_run_with_the_llama_recipe_on_a_tiny_random_llama's and tests/test_extract.py's)."""
    import importlib
    import shlex

    commands = doc_commands()
    assert sum(runs for _, runs in commands) == 3 and len(commands) == 5
    for command, runs in commands:
        argv = shlex.split(command)[1:]
        module = importlib.import_module(argv[0].removesuffix(".py").replace("/", "."))
        module.build_parser().parse_args(argv[1:])  # a flag the job does not have fails here
        if runs:
            assert "plan (dry run" in plan_text(capsys, module.main, argv[1:]), command

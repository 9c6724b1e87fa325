"""Ray Train TTT job on a local cluster with the tiny target: data-parallel equivalence, determinism, resume after
a kill, and the MLflow run (params, per-step metrics, exported draft, registry version)."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipelines.extract import ExtractConfig, run_extract
from pipelines.train import TrainJobConfig, pack_batches, plan_steps, run_train, split_heldout

REPO = Path(__file__).resolve().parents[1]
STEPS_COMPARED = ("loss", "acc_0")


def write_corpus(path: Path, n: int = 16) -> Path:
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question {i}: what is {i} plus {i + 1}? Please explain."},
                 {"from": "gpt", "value": f"{i} plus {i + 1} is {2 * i + 1}, because adding one more gives it."}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "And times two?"}, {"from": "gpt", "value": f"That is {4 * i + 2}."}]
        rows.append(json.dumps({"id": f"conv{i}", "conversations": turns}))
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """MLflow store for this module (EAGLE3_WORK); restored afterwards."""
    folder = tmp_path_factory.mktemp("train-work")
    old = os.environ.get("EAGLE3_WORK")
    os.environ["EAGLE3_WORK"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("EAGLE3_WORK", None)
    else:
        os.environ["EAGLE3_WORK"] = old


@pytest.fixture(scope="module")
def peaked_target_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama whose next-token distribution is peaked (lm_head scaled up).

    A plain random tiny model predicts near-uniformly, so the TTT loss sits at its entropy floor from the
    first step and a wrong trajectory would look like a right one; a peaked target leaves a lot to learn.
    """
    from eagle_core.target import make_tiny_llama

    folder = tmp_path_factory.mktemp("peaked-target")
    model = make_tiny_llama(vocab_size=len(smollm2_tokenizer), num_hidden_layers=4, seed=5, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def features(ray_cluster, work, tmp_path_factory, peaked_target_dir):
    """Features of 16 short conversations from the tiny target (4 shards, logged to MLflow for lineage)."""
    folder = tmp_path_factory.mktemp("train-features")
    config = ExtractConfig(corpus=str(write_corpus(folder / "corpus.jsonl")), output=str(folder / "features"),
                           target=str(peaked_target_dir), regenerate=False, rows_per_shard=4, cpus_per_worker=0.5,
                           max_length=64, mlflow_experiment="test-extract")
    run_extract(config)
    return config.output


def job(features, output, **overrides) -> TrainJobConfig:
    cfg = dict(features=features, output=str(output), epochs=2, lr=3e-3, warmup_steps=2, tokens_per_batch=160,
               ttt_steps=3, draft_vocab_size=256, eval_fraction=0.2, checkpoint_every=3, keep_checkpoints=2,
               cpus_per_worker=0.5, mlflow_experiment="test-train", registered_model_name="test-draft", log_every=100)
    cfg.update(overrides)
    return TrainJobConfig(**cfg)


def history(run_id: str, key: str) -> list[float]:
    from pipelines import tracking

    client = tracking.configure().tracking.MlflowClient()
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    by_step = {m.step: m.value for m in points}  # a step logged twice (replayed after a restore) keeps the last
    return [by_step[s] for s in sorted(by_step)]


def weights(summary: dict) -> dict:
    """The exported draft's tensors, wherever the run wrote it (a local folder or an object-store URL)."""
    from eagle_core.target import local_folder

    return load_file(str(local_folder(summary["draft"]) / "model.safetensors"))


@pytest.fixture(scope="module")
def clean(features, tmp_path_factory):
    """An uninterrupted single-worker run: the reference for every comparison below."""
    return run_train(job(features, tmp_path_factory.mktemp("clean")))


def test_plan_is_independent_of_world_size():
    # The global batches (and so the trajectory) may not depend on W; only their split over ranks does.
    rows = [{"id": f"c{i}", "file": f"f{i // 4}", "row": i % 4, "length": 10 + 7 * (i % 5)} for i in range(23)]
    train, held = split_heldout(rows, 0.2)
    assert len(held) == 5 and {r["id"] for r in train}.isdisjoint(r["id"] for r in held)
    batches = pack_batches(train, 60)
    for world in (1, 2, 3):
        per_rank = plan_steps(batches, world)
        for step, batch in enumerate(batches):
            got = sorted((e["file"], e["row"]) for entries in per_rank for e in entries if e["step"] == step)
            assert got == sorted((r["file"], r["row"]) for r in batch)


def test_the_draft_kind_builds_its_draft_and_enters_the_fingerprint_only_where_set(tiny_target_dir, tmp_path):
    """`--draft-kind eagle3.1` / `p-eagle` (issue 55): the job's draft has EAGLE 3.1's two norms / P-EAGLE's parallel
    drafting; an unknown kind is refused by
    name; the kind enters the training fingerprint only where it is not eagle3 (earlier outputs keep theirs)."""
    from transformers import AutoConfig

    from pipelines.train.driver import training_fingerprint
    from pipelines.train.model import draft_config

    tconfig = AutoConfig.from_pretrained(tiny_target_dir)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    kinds = {}
    for kind in ("eagle3", "eagle3.1", "p-eagle"):
        config = TrainJobConfig(features=None, corpus=str(corpus), target=str(tiny_target_dir), draft_kind=kind)
        cfg = draft_config(config, tconfig, [1, 2, 3])
        kinds[kind] = ((cfg.norm_before_fc, cfg.norm_output, cfg.parallel_drafting),
                       training_fingerprint(config).get("draft_kind"))
    assert kinds == {"eagle3": ((False, False, False), None), "eagle3.1": ((True, True, False), "eagle3.1"),
                     "p-eagle": ((False, False, True), "p-eagle")}
    with pytest.raises(ValueError, match="draft_kind must be one of"):
        TrainJobConfig(features="x", draft_kind="eagle4")


def test_the_plan_and_the_lineage_reach_the_workers_unchanged():
    """Both travel to the workers (and into summary.json) as JSON."""
    from pipelines.train import Lineage, TrainPlan
    from pipelines.train.plan import make_plan

    rows = [{"id": f"c{i}", "file": f"f{i // 4}", "row": i % 4, "length": 10 + 7 * (i % 5)} for i in range(23)]
    train, held = split_heldout(rows, 0.2)
    plan, per_epoch, per_rank_eval = make_plan(train, held, job("x", "out", tokens_per_batch=60), world=2)
    assert (plan.mode, plan.train_rows, plan.eval_rows) == ("files", 18, 5)
    assert len(plan.steps_per_epoch) == len(per_epoch) == 2 and len(per_rank_eval) == 2  # epochs; ranks
    assert all(sum(map(len, ranks)) == 18 for ranks in per_epoch)  # every training row, once per epoch
    assert TrainPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    lineage = Lineage(target="t", features="f", aux_layer_ids=[2, 3, 4], features_mlflow_run_id="r")
    assert Lineage.from_json(json.loads(json.dumps(lineage.to_json()))) == lineage
    assert "aux_layer_ids" not in lineage.draft_extra() and lineage.draft_extra()["features_mlflow_run_id"] == "r"


def test_two_unpacked_workers_follow_the_packed_single_worker_trajectory(features, clean, tmp_path):
    """Data parallelism and sequence packing end to end (Ray Train, features mode; packing's unit tests are in
    test_train_packing.py), in one run: two workers with one conversation per row follow the single-worker run,
    which packs (the default, rows of each step's longest conversation): the same loss and step-0 accuracy curves
    and the same draft. (Two runs checked the two apart until the suite had to fit 15 minutes: a two-worker packed
    run, and this one. A mistake in either the split over ranks or the packing shows here, unless the two cancel.)
    The two workers run with micro_batch_tokens: with these 62-64-token conversations, one each per step, so the
    micro-batch plan agrees over the ranks through Ray Train's process group but nothing splits; the split and the
    accumulation are checked in test_train_packing.py and in the two-process test below."""
    assert job(features, tmp_path).pack_length == "longest"  # what the `clean` run packed with
    two = run_train(job(features, tmp_path / "two", num_workers=2, pack_length=None, micro_batch_tokens=64))
    assert two["total_steps"] == clean["total_steps"] >= 8
    for key in STEPS_COMPARED:
        one_curve, two_curve = history(clean["mlflow_run_id"], key), history(two["mlflow_run_id"], key)
        assert len(one_curve) == len(two_curve) == clean["total_steps"]
        assert torch.allclose(torch.tensor(two_curve), torch.tensor(one_curve), rtol=1e-4, atol=1e-5), key
    # the curve must actually move, or the comparison above proves nothing
    loss = history(clean["mlflow_run_id"], "loss")
    assert loss[-1] < 0.8 * loss[0]
    a, b = weights(clean), weights(two)
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), rtol=1e-3, atol=1e-5), name


def test_a_killed_run_resumes_and_a_killed_worker_restarts_to_the_clean_result(features, clean, s3_endpoint, tmp_path,
                                                                              monkeypatch):
    """Both recoveries, each from its latest checkpoint, on a run whose output (Ray Train's storage, checkpoints,
    the exported draft, summary.json) is on S3 (moto on 127.0.0.1):
    - across runs: SIGKILL the worker after step 4 with max_failures=0 (the run fails; its last checkpoint is step
      3), then the CLI with --resume continues from step 3;
    - within a run: that resumed run (the jobs' default max_failures > 0) loses its worker again after step 7 and
      Ray Train restarts it from the step-6 checkpoint inside the same call.
    The result equals the uninterrupted run's bit for bit."""
    import uuid

    from jobs.train import main
    from pipelines.storage import exists, join, read_bytes
    from pipelines.train.faults import FAULT_ENV

    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    output = f"s3://eagle3/train-killed-{uuid.uuid4().hex[:8]}"
    assert clean["total_steps"] > 7 and job(features, output).max_failures > 0
    storage = join(output, "ray", f"train-{output.rsplit('/', 1)[-1]}")
    monkeypatch.setenv(FAULT_ENV, "4")  # test-only hook (pipelines/train/faults.py), not a job option
    # The worker dies and max_failures=0: the run fails, at the injected fault. A run that failed before it, for
    # another reason, gets one more attempt (seen once in a CI run on the loaded 2-core machine: a Ray worker lost
    # with a system error before the first step; the job's default max_failures > 0 retries that in a deployment).
    for attempt in range(2):
        with pytest.raises(Exception) as failed:
            run_train(job(features, output, max_failures=0, resume=attempt > 0))
        if exists(join(storage, "fault_injected-4")):
            break
    assert exists(join(storage, "fault_injected-4")), f"the first run failed before its fault: {failed.value!r}"
    assert exists(join(storage, "checkpoint-0000003", "state.json"))  # the checkpoint the resume starts from
    monkeypatch.setenv(FAULT_ENV, "7")
    argv = ["--features", features, "--output", str(output), "--resume", "--epochs", "2", "--lr", "3e-3",
            "--warmup-steps", "2", "--tokens-per-batch", "160", "--ttt-steps", "3", "--draft-vocab-size", "256",
            "--eval-fraction", "0.2", "--checkpoint-every", "3", "--cpus-per-worker", "0.5",
            "--mlflow-experiment", "test-train", "--registered-model-name", "test-draft",
            "--serving-gate", "off"]  # vLLM cannot load the tiny target (head size 16)
    assert main(argv) == 0
    resumed = json.loads(read_bytes(f"{output}/summary.json"))
    assert resumed["restored_from"] == [3, 6] and resumed["checkpoint"].startswith(output)
    assert resumed["step"] == clean["step"]
    # Deterministic given the seed: the killed run's first steps, computed from scratch, and the steps replayed
    # after each restore match bit for bit, and the final draft equals the uninterrupted one exactly.
    assert history(resumed["mlflow_run_id"], "loss") == history(clean["mlflow_run_id"], "loss")
    a, b = weights(clean), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mlflow_run_holds_params_metrics_model_and_version(features, clean, peaked_target_dir):
    from eagle_core.checkpoint import load_draft
    from eagle_core.target import load_target
    from pipelines import tracking
    from pipelines.feature_files import load_manifest

    mlflow = tracking.configure()
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(clean["mlflow_run_id"])
    manifest = load_manifest(features)
    params = run.data.params
    assert params["features_mlflow_run_id"] == manifest.mlflow_run_id
    assert len(params["features_manifest_sha256"]) == 64
    assert params["lr"] == "0.003" and params["ttt_steps"] == "3" and params["num_workers"] == "1"
    # Every step's metrics, once per step. Ray Train may restart a lost worker from its last checkpoint inside the
    # run (the job's default max_failures > 0; seen once in CI on the loaded 2-core machine: restored_from [3]);
    # the replayed steps are logged again at the same step numbers, so distinct steps are counted.
    def steps(key: str) -> list[int]:
        return sorted({m.step for m in client.get_metric_history(run.info.run_id, key)})

    every_step = list(range(1, clean["total_steps"] + 1))
    for key in ["loss", "loss_2", "acc_0", "acc_2", "lr", "tokens_per_s", "accept_length"]:
        assert steps(key) == every_step, key
    evaluated = steps("eval_acc_0")  # untrained, then at the end of each of the 2 epochs
    assert len(evaluated) == 3 and evaluated[0] == 0 and evaluated[-1] == clean["total_steps"]
    artifacts = {a.path for folder in ("draft", "draft-speculators", "plots")
                 for a in client.list_artifacts(run.info.run_id, folder)}
    assert {"draft/model.safetensors", "draft/config.json", "draft-speculators/model.safetensors",
            "plots/loss_curves.png", "plots/acceptance_per_position.png"} <= artifacts
    version = client.get_model_version("test-draft", str(clean["model_version"]))
    assert version.run_id == run.info.run_id
    # every run registers a new version and moves the alias to it: it names the newest one
    newest = max(int(v.version) for v in client.search_model_versions("name='test-draft'"))
    assert int(client.get_model_version_by_alias("test-draft", "candidate").version) == newest
    # The registered artifact is a draft the tiny target accepts (aux layers, sizes, vocab checked on load).
    folder = mlflow.artifacts.download_artifacts(f"{version.source}")
    model, _ = load_target(str(peaked_target_dir), device="cpu", dtype="float32")
    draft = load_draft(folder, target=model)
    assert draft.config.draft_vocab_size == 256
    assert draft.config.extra["features_mlflow_run_id"] == manifest.mlflow_run_id


def _data_parallel_rank(rank: int, world: int, out: str) -> None:
    """One process of the data-parallel check: 5 train_steps on its share of a fixed global batch, under FSDP2 and
    under DDP (one draft each, the same initial weights); with two processes each rank runs its share in two
    micro-batches (gradient accumulation, syncing on the last: `gradient_sync`), rank 1's second one a dummy row as
    `loop.rank_batches` pads a rank with fewer micro-batches than the fullest."""
    import pickle

    import torch.distributed as dist

    from eagle_core.draft import Eagle3Draft
    from eagle_core.target import make_tiny_llama
    from eagle_core.teacher import with_targets
    from eagle_core.ttt import TrainConfig, make_optimizer, make_scheduler, train_step
    from eagle_core.ttt_batch import step_counts
    from pipelines.train import TTTObjective, all_reduce, collate, full_state, wrap_objective
    from pipelines.train.model import gradient_sync

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    target = make_tiny_llama()
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    B, L = 4, 12
    full = dict(input_ids=torch.randint(0, 512, (B, L), generator=g), loss_mask=(torch.rand(B, L, generator=g) > 0.3).long(),
                attention_mask=torch.ones(B, L, dtype=torch.long), aux_hidden=torch.randn(B, L, 192, generator=g),
                last_hidden=torch.randn(B, L, 64, generator=g))
    if world == 1:
        shares = [full]
    else:  # rank 0: rows 0 and 2 apart; rank 1: rows 1 and 3 together, then a dummy row
        dummy = collate([], {"target_hidden_size": 64, "dtype": "float32"}, 2, cpu)
        shares = ([{k: v[i:i + 1] for k, v in full.items()} for i in (0, 2)] if rank == 0 else
                  [{k: v[1::2] for k, v in full.items()}, dummy])
    head = target.lm_head.weight
    results = {}
    for strategy in ("fsdp", "ddp"):
        torch.manual_seed(0)
        draft = Eagle3Draft.from_target(target, draft_vocab_size=128, ttt_steps=2)
        objective = wrap_objective(TTTObjective(draft, autocast=False), strategy, world, cpu)
        cfg = TrainConfig(lr=1e-2, total_steps=5, ttt_steps=2)
        optimizer = make_optimizer(draft, cfg)
        scheduler = make_scheduler(optimizer, cfg)
        losses = []
        for _ in range(5):
            micro = [with_targets(share, head, draft.d2t) for share in shares]
            counts = all_reduce(sum(step_counts(b, 2).double() for b in micro), cpu)
            for b in micro:
                b["step_denominators"] = (counts / world).float()
            metrics = train_step(draft, micro, head, optimizer, scheduler, cfg,
                                 forward=lambda _d, *a, **k: objective(*a, **k),
                                 gradient_sync=lambda last: gradient_sync(objective, last))
            losses.append(float(all_reduce(torch.tensor([metrics["loss"]]), cpu)) / world)
        model, _ = full_state(draft, objective, optimizer, strategy == "fsdp" and world > 1)
        results[strategy] = (losses, {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()
                                      if k not in ("embed_tokens.weight", "d2t", "t2d")})
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)
    dist.destroy_process_group()


def test_data_parallel_over_two_processes_in_micro_batches_follows_one_process(tmp_path):
    """FSDP2 and DDP (gloo, CPU) on a global batch split in two, each rank's share in two micro-batches (one of them
    a dummy row), == one process on all of it in one batch: the same losses, gathered weights agree."""
    import pickle

    import torch.multiprocessing as mp

    results = {}
    for world in (1, 2):
        out = tmp_path / f"dp-{world}.pkl"
        mp.start_processes(_data_parallel_rank, args=(world, str(out)), nprocs=world, start_method="spawn")
        results[world] = pickle.loads(out.read_bytes())
    for strategy in ("fsdp", "ddp"):
        (one_losses, one), (two_losses, two) = results[1][strategy], results[2][strategy]
        assert torch.allclose(torch.tensor(one_losses), torch.tensor(two_losses), rtol=1e-5), strategy
        assert one_losses[-1] < one_losses[0]
        for name in one:
            assert torch.allclose(torch.from_numpy(one[name]), torch.from_numpy(two[name]), atol=1e-4), (strategy, name)


# ---------------------------------------------------------------------------------------------------
# unit checks of the loop's pieces (no Ray): held-out weighting, log lines, collectives on the training device


def _tiny_draft_and_batch(ttt_steps: int = 3):
    from eagle_core.draft import Eagle3Draft
    from eagle_core.target import make_tiny_llama

    target = make_tiny_llama()
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(target, draft_vocab_size=128, ttt_steps=ttt_steps)
    g = torch.Generator().manual_seed(1)
    B, L = 3, 12
    batch = dict(input_ids=torch.randint(0, 512, (B, L), generator=g),
                 loss_mask=(torch.rand(B, L, generator=g) > 0.3).long(),
                 attention_mask=torch.ones(B, L, dtype=torch.long),
                 aux_hidden=torch.randn(B, L, 192, generator=g), last_hidden=torch.randn(B, L, 64, generator=g))
    return draft, batch, target.lm_head.weight.detach()


@pytest.mark.parametrize("decay", [0.5, 1.0])
def test_heldout_loss_weights_ttt_steps_by_the_configured_decay(decay):
    """eval_loss is the training objective on held-out rows: step k weighs step_decay**k (not a fixed 0.8**k)."""
    from eagle_core.teacher import with_targets
    from eagle_core.ttt import ttt_forward
    from pipelines.train import TTTObjective, evaluate

    draft, batch, head = _tiny_draft_and_batch()
    metrics = evaluate(TTTObjective(draft, autocast=False), draft, [dict(batch)], head, 3, decay, torch.device("cpu"))
    assert metrics["eval_loss"] == pytest.approx(sum(decay ** k * metrics[f"eval_loss_{k}"] for k in range(3)))
    with torch.no_grad():  # one batch: the held-out loss is exactly the objective trained with that decay
        b = with_targets(dict(batch), head, draft.d2t)
        out = ttt_forward(draft, b["input_ids"], b["loss_mask"], b["aux_hidden"], b["last_hidden"], head,
                          attention_mask=b["attention_mask"], ttt_steps=3, step_decay=decay, targets=b["targets"])
    assert metrics["eval_loss"] == pytest.approx(float(out.loss), rel=1e-5)


def test_progress_lines_reach_the_driver_once(capsys, caplog, monkeypatch):
    """A Ray Train worker patches `print` to log through the root logger and, as `sys.stdout` is wrapped there,
    to print as well: a printed progress line reached the driver twice. Reproduce that worker and count."""
    import builtins
    import logging

    from ray.train.v2._internal.logging.patch_print import redirected_print

    from pipelines.train.report import log_held_out, log_step

    caplog.set_level(logging.INFO)  # Ray Train's worker root logger: INFO, to the console
    monkeypatch.setattr(builtins, "print", redirected_print)
    log_step(3, 10, {"loss": 1.0, "acc_0": 0.5, "tokens_per_s": 100.0})
    log_held_out(3, {"eval_acc_0": 0.25, "eval_accept_length": 1.25}, 1)
    monkeypatch.undo()
    printed = capsys.readouterr()
    for line in ("[train] step 3/10 loss 1.0000", "[train] step 3 held-out: acc [0.25]"):
        emitted = printed.out.count(line) + printed.err.count(line) + sum(line in m for m in caplog.messages)
        assert emitted == 1, (line, printed, caplog.messages)


@pytest.fixture
def fake_two_rank_world(monkeypatch):
    """torch.distributed says 2 ranks; every all_reduce records (tensor device, calling module, calling function)
    and leaves the tensor as is (as if the other rank contributed zeros / the same maximum)."""
    import inspect

    import torch.distributed as dist

    calls = []

    def all_reduce(t, op=None, group=None, async_op=False):
        caller = inspect.currentframe().f_back
        calls.append((t.device, caller.f_globals["__name__"], caller.f_code.co_name))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


def test_all_reduce_runs_on_the_training_device(fake_two_rank_world):
    """The helper hands the collective a tensor on the device it is given, wherever the tensor was (nccl: cuda)."""
    from pipelines.train import all_reduce

    out = all_reduce(torch.ones(3), torch.device("meta"))  # a device no tensor here lives on
    assert out.device.type == "meta" and [c[0].type for c in fake_two_rank_world] == ["meta"]


def test_every_collective_of_the_loop_goes_through_the_device_helper(fake_two_rank_world):
    """Step metrics, held-out evaluation, the streaming stop flag and held-out count: each collective is the
    helper's, on the training device passed in."""
    from pipelines.train import TTTObjective, evaluate
    from pipelines.train import TrainPlan
    from pipelines.train.batches import StreamedBatches
    from pipelines.train.metrics import global_step_metrics

    device = torch.device("cpu")
    draft, batch, head = _tiny_draft_and_batch(ttt_steps=2)
    local = {"loss": 1.0, "loss_0": 0.6, "loss_1": 0.5, "acc_0": 0.5, "acc_1": 0.25, "tokens": 10, "lr": 0.1,
             "grad_norm": 1.0}
    assert global_step_metrics(local, 2, 2, device)["loss"] == 0.5
    evaluate(TTTObjective(draft, autocast=False), draft, [batch], head, 2, 0.8, device)

    class Stream:
        def iter_rows(self):
            return iter([{"id": f"c{i}", "input_ids": [1] * 8} for i in range(5)])

    plan = TrainPlan(mode="stream", eval_ids=["c1"])
    batches = StreamedBatches(plan, tokens_per_batch=32, world=2, device=device, get_shard=lambda name: Stream())
    steps = list(batches.epoch(0, {"rows_consumed": 0, "step_in_epoch": 0}))
    assert [len(s.rows) for s in steps] == [2, 2] and len(list(batches.held_out())) == 1
    assert len(fake_two_rank_world) == 1 + 1 + 3 + 1  # metrics, evaluation, 3 stop flags, held-out count
    assert {c[1:] for c in fake_two_rank_world} == {("pipelines.train.collectives", "all_reduce")}
    assert {c[0] for c in fake_two_rank_world} == {device}


def test_no_collective_bypasses_the_device_helper():
    """Only collectives.py calls torch.distributed's collectives (DDP/FSDP's own run on the model's device)."""
    import re

    pattern = re.compile(r"\b(dist|torch\.distributed)\.(all_reduce|all_gather\w*|broadcast\w*|reduce\w*|barrier)\(")
    offenders = [p.name for p in (REPO / "pipelines" / "train").glob("*.py")
                 if p.name != "collectives.py" and pattern.search(p.read_text())]
    assert offenders == []


def test_a_read_task_imports_no_torch():
    """Ray Data read tasks unpickle `read_planned_rows` (by reference: its module is imported in every fresh read
    worker). Importing torch, eagle_core and transformers there cost seconds a worker on a busy small machine."""
    import subprocess
    import sys

    code = ("import pickle, sys; from pipelines.train.shards import read_planned_rows; "
            "pickle.loads(pickle.dumps(read_planned_rows)); "
            "print(sorted(m for m in ('torch', 'transformers', 'eagle_core', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]", out.stdout


def test_streaming_decodes_features_in_the_actors_dtype(ray_cluster, work, tmp_path, peaked_target_dir):
    """Streaming (features=None, a corpus): extraction actors feed the trainer directly. With dtype "auto"
    the driver fixes one dtype for the actors and the trainer (bf16 where native, e.g. on avx512_bf16 CPUs):
    a trainer decoding the bytes in another dtype fails on the first batch."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", n=8)
    config = job(None, tmp_path / "out", corpus=str(corpus), target=str(peaked_target_dir), epochs=1,
                 extract={"regenerate": False, "rows_per_shard": 4, "cpus_per_worker": 0.5, "max_length": 64})
    summary = run_train(config)
    weights = load_file(str(Path(summary["draft"]) / "model.safetensors"))
    assert summary["total_steps"] >= 1 and all(torch.isfinite(w).all() for w in weights.values())


def test_finish_run_exports_the_draft_to_an_object_store_url(tmp_path, tiny_target_dir):
    """An fsspec output that is not a local folder (here memory://; s3:// or gs:// in a cluster) gets both
    exported layouts uploaded file by file, and the summary points at them: no local --output required."""
    from types import SimpleNamespace

    import fsspec
    from ray.train import Checkpoint

    from eagle_core.checkpoint import load_draft, save_draft
    from eagle_core.draft import Eagle3Draft
    from eagle_core.target import load_target
    from pipelines.train.driver import finish_run

    target, _ = load_target(str(tiny_target_dir), device="cpu", dtype="float32")
    ckpt = tmp_path / "checkpoint"
    save_draft(Eagle3Draft.from_target(target, draft_vocab_size=64), ckpt / "draft")
    (ckpt / "state.json").write_text(json.dumps({"step": 7}))
    result = SimpleNamespace(checkpoint=Checkpoint.from_directory(str(ckpt)), metrics={"loss": 1.5}, error=None)
    output = "memory://eagle3-test/finish-run"
    summary = finish_run(TrainJobConfig(features="unused", output=output), result, None, str(tiny_target_dir))

    fs = fsspec.filesystem("memory")
    assert summary["draft"] == f"{output}/draft" and summary["step"] == 7
    for layout in ("draft", "draft-speculators"):
        assert fs.exists(f"/eagle3-test/finish-run/{layout}/config.json")
    local = tmp_path / "downloaded"
    fs.get("/eagle3-test/finish-run/draft/", str(local), recursive=True)
    assert load_draft(local, target=target).config.draft_vocab_size == 64


def test_a_resume_with_other_data_or_settings_is_refused(features, clean, tmp_path):
    """The run state records the training fingerprint; a --resume whose settings would change the draft is refused
    naming the fields, before any training. Settings that do not (workers, checkpoint cadence) are not compared."""
    import shutil

    from pipelines.feature_files import FingerprintMismatch
    from pipelines.train.driver import training_fingerprint

    output = tmp_path / "resumed"
    shutil.copytree(clean["draft"].rsplit("/draft", 1)[0], output)  # a finished run's folder, state included
    state = json.loads((output / "train_run.json").read_text())
    assert state["fingerprint"] == clean["fingerprint"] == training_fingerprint(job(features, output))
    with pytest.raises(FingerprintMismatch, match=r"lr: 0\.003 -> 0\.001.*ttt_steps: 3 -> 2"):
        run_train(job(features, output, resume=True, lr=1e-3, ttt_steps=2))
    same = training_fingerprint(job(features, output, num_workers=2, checkpoint_every=7, warmup_ratio=0.5))
    assert same == clean["fingerprint"]  # warmup_steps is set: the ratio does not take effect

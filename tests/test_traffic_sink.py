"""The traffic sink (`pipelines.traffic.TrafficSink`): served conversations become feature shards that the training
job's reader takes as an extraction's; the sink never fails or holds up its caller.

Properties: the shards, manifest and fingerprint are read by pipelines.train's reader (manifest, target check,
scan, planned-row read, row decoding, collate) and hold what an extraction of the same token sequences holds (ids,
the template's loss mask, features within fp32 rounding); a draft trained on them reaches the held-out accuracy
that the same draft trained on the extraction's rows reaches; a sink that is off writes nothing; a store that fails
or hangs loses no caller's call, holds none up and counts every dropped record; a writer killed between its
temporary file and the rename leaves no shard a reader lists; sampling, redaction, the size cap and retention do
what their options say.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pyarrow as pa
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from eagle_core.capture import RowFeatures
from eagle_core.chat import prompt_ids, served_loss_mask, text_ids, tokenize_conversation
from pipelines.feature_files import committed_shards, load_manifest
from pipelines.traffic import TrafficSink
from pipelines.traffic_config import TrafficConfig

REPO = Path(__file__).resolve().parents[1]
H = 8  # the fake target's hidden size
FAKE_TARGET = SimpleNamespace(hidden_size=H, vocab_size=100, num_hidden_layers=6)
FAKE_FINGERPRINT = {"target_weights_hash": "w", "tokenizer_hash": "t", "max_length": 64, "dtype": "float32",
                    "aux_layer_ids": [2, 3, 3], "regeneration": {"with": "serve"}, "corpus": "traffic"}


def fake_sink(url, **options) -> TrafficSink:
    """A sink for a fake 6-layer target of hidden size 8 (nothing loaded)."""
    start = options.pop("start", True)
    redact = options.pop("redact", None)
    return TrafficSink(TrafficConfig(url=url, target="fake", **options), target_config=FAKE_TARGET,
                       fingerprint=FAKE_FINGERPRINT, redact=redact, start=start)


def fake_features(n: int) -> RowFeatures:
    return RowFeatures(torch.randn(n, 3 * H), torch.randn(n, H))


def offer(sink, n: int, prompt_len: int = 5, answer_len: int = 4, **kw) -> list[bool]:
    return [sink.record(list(range(1, prompt_len + 1)), list(range(50, 50 + answer_len)),
                        features=fake_features(prompt_len + answer_len - 1), **kw) for _ in range(n)]


# ---- read by training exactly like an extraction -------------------------------------------------------------

def test_served_loss_mask_is_the_templates_on_a_multi_turn_chat(smollm2_tokenizer):
    """Prompt ids (history + generation prompt) + answer ids (the reply and its end of turn) carry exactly the
    mask `tokenize_conversation` gives the whole conversation: the earlier assistant turn and the answer are 1."""
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Name a color."}]
    reply = "Blue is a color."
    prompt = prompt_ids(tok, messages)
    answer = text_ids(tok, reply) + [tok.convert_tokens_to_ids("<|im_end|>")]
    mask = served_loss_mask(tok, messages, prompt, len(answer))
    full = tokenize_conversation(tok, messages + [{"role": "assistant", "content": reply}])
    assert prompt + answer == full.input_ids[: len(prompt) + len(answer)]
    assert mask == full.loss_mask[: len(mask)]
    assert sum(mask[: len(prompt)]) > 0 and all(mask[len(prompt):])
    assert served_loss_mask(None, None, prompt, len(answer)) == [0] * len(prompt) + [1] * len(answer)


HEAD_SCALE = 30.0  # the served target's lm_head, sharpened (the `served` fixture says why)
SUBJECTS = ["colors", "planets", "rivers", "metals", "birds", "fruits"]


@pytest.fixture(scope="module")
def served(tiny_target_dir, smollm2_tokenizer, tmp_path_factory):
    """Eight chats (one multi-turn; answers of 7, 5 and six of 16 tokens) decoded greedily together, with capture,
    by a tiny target (SmolLM2's tokenizer and template), recorded by the sink, read back by the training job's
    reader; beside them a fresh extraction (`eagle_core.features.featurize`) of the same token sequences. Built once
    for the module.

    The target is the session's tiny Llama with its lm_head scaled by HEAD_SCALE: a random Llama's next-token
    distribution over 49 152 tokens is nearly flat (top probability ~4e-5), so TTT's soft labels (the target's
    distribution) carry almost nothing for a handful of steps to learn. Scaling the head leaves the greedy answers
    and every hidden state (the features) as they were."""
    from transformers import AutoModelForCausalLM

    from decode_helpers import random_draft
    from eagle_core.features import featurize
    from pipelines.train.batches import decode_row
    from pipelines.train.plan import scan_features
    from pipelines.train.shards import read_items, read_planned_rows
    from test_traffic_capture import decode_capturing

    tok = smollm2_tokenizer
    folder = tmp_path_factory.mktemp("sharp-target")
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    chats = [[{"role": "user", "content": "Name three primary colors."}],
             [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "What is 2 + 2?"}]]
    chats += [[{"role": "user", "content": f"Name three {subject}."}] for subject in SUBJECTS]
    prompts = [prompt_ids(tok, m) for m in chats]
    with torch.inference_mode():
        decoded = decode_capturing(model, random_draft(model, 1024), prompts, [7, 5] + [16] * len(SUBJECTS),
                                   ["tree", "plain"])
    url = str(tmp_path_factory.mktemp("served") / "traffic")
    sink = TrafficSink(TrafficConfig(url=url, target=str(folder), rows_per_shard=4), tokenizer=tok,
                       dtype=torch.float32)
    recorded = [sink.record(prompt, answer, RowFeatures(aux, last), messages=messages, request_id=f"chat-{i}")
                for i, (messages, prompt, (answer, aux, last)) in enumerate(zip(chats, prompts, decoded))]
    sink.close()

    # the training job's reader, step by step (pipelines.train.driver._files_data without Ray)
    manifest = load_manifest(url)
    scanned = scan_features(url, [s.name for s in manifest.shards])
    entries = [{**r, "step": 0, "slot": k} for k, r in enumerate(scanned)]
    meta = {"target_hidden_size": manifest.target_hidden_size, "dtype": manifest.dtype}
    table = read_planned_rows(pa.Table.from_pylist(read_items(entries)))
    rows = {r["id"]: decode_row(r, meta) for r in table.to_pylist()}

    tokenized = [(f"chat-{i}", prompt + answer, served_loss_mask(tok, messages, prompt, len(answer)))
                 for i, (messages, prompt, (answer, _, _)) in enumerate(zip(chats, prompts, decoded))]
    with torch.inference_mode():
        reference = featurize(model, tokenized, manifest.aux_layer_ids)
    # out of inference mode (a draft trains on them): the extraction's rows as the reader decodes a row
    extracted = {r.id: {"id": r.id, "slot": 0, "input_ids": r.input_ids.long(), "loss_mask": r.loss_mask.long(),
                        "aux_hidden": r.aux_hidden.clone(), "last_hidden": r.last_hidden.clone()} for r in reference}
    return SimpleNamespace(model=model, folder=folder, chats=chats, prompts=prompts, url=url, sink=sink,
                           recorded=recorded, manifest=manifest, scanned=scanned, meta=meta, rows=rows,
                           reference=reference, extracted=extracted)


def test_sink_shards_train_like_an_extraction(served):
    """Eight chats decoded with capture go through the sink; the training job's reader takes its output as it takes
    an extraction's, and every row equals the extraction's row of the same sequence
    (`eagle_core.features.featurize`): ids, mask, features (fp32 rounding), the last position aside (never
    computed: zeros, which no TTT step reads)."""
    from eagle_core.target import default_aux_layer_ids
    from pipelines.extract import ExtractConfig, extraction_fingerprint
    from pipelines.train.batches import collate
    from pipelines.train.driver import check_features_target
    from pipelines.train.plan import split_heldout

    model, url, manifest, rows, n_chats = served.model, served.url, served.manifest, served.rows, len(served.chats)
    assert all(served.recorded)
    assert served.sink.stats()["rows"] == n_chats and served.sink.stats()["dropped"] == {}
    check_features_target(url, manifest, str(served.folder))
    assert manifest.rows == n_chats and len(manifest.shards) == 2 and manifest.dtype == "float32"
    assert manifest.aux_layer_ids == default_aux_layer_ids(model.config.num_hidden_layers)
    extraction = extraction_fingerprint(ExtractConfig(target=str(served.folder)), served.folder, model.config, "cpu")
    assert set(manifest.fingerprint) == set(extraction)  # the same fields, compared the same way
    same = ("target_weights_hash", "target_config_hash", "tokenizer_hash", "aux_layer_ids")
    assert {k: manifest.fingerprint[k] for k in same} == {k: extraction[k] for k in same}
    train_rows, eval_rows = split_heldout(served.scanned, 0.5)
    assert len(train_rows) + len(eval_rows) == n_chats and train_rows and eval_rows
    assert sorted(rows) == sorted(r["id"] for r in served.scanned)

    for ref in served.reference:
        got = rows[ref.id]
        assert got["input_ids"].tolist() == ref.input_ids.tolist()
        assert got["loss_mask"].tolist() == ref.loss_mask.tolist()
        n = len(ref.input_ids) - 1
        torch.testing.assert_close(got["aux_hidden"][:n], ref.aux_hidden[:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["last_hidden"][:n], ref.last_hidden[:n], rtol=1e-5, atol=1e-5)
        assert got["aux_hidden"][n].abs().sum() == 0 or torch.allclose(got["aux_hidden"][n], ref.aux_hidden[n])
    assert rows["chat-1"]["loss_mask"][: len(served.prompts[1])].sum() > 0  # the earlier assistant turn trains too
    batch = collate(list(rows.values()), served.meta, ttt_steps=3, device="cpu")
    assert batch["aux_hidden"].shape[-1] == 3 * model.config.hidden_size


TRAIN_STEPS, TTT_STEPS, DRAFT_VOCAB, LR = 24, 2, 256, 1e-2


def test_a_draft_trained_on_sink_rows_reaches_the_extractions_held_out_accuracy(served):
    """The same random draft (the job's `build_draft`, seed 0) trained TRAIN_STEPS optimiser steps (the job's
    `train_step` on the job's collated batches, TTT_STEPS TTT steps, fp32) once on the sink's training rows and
    once on the fresh extraction's rows of the same conversations, then evaluated (the job's `evaluate`) on the
    extraction's rows of the held-out conversations (the job's id-hash split): the same held-out accuracy per TTT
    step, and both drafts learned.

    Tolerances. Accuracy: equal within one held-out position per TTT step (an argmax near a tie may flip between two
    float runs). Held-out loss: within 1e-3 relative. The sink's features equal the extraction's within 1e-5 relative
    (fp32 summation order, previous test) and the two runs' held-out losses differ by ~1e-6 relative (measured).
    Measured with the sink's training rows perturbed: noise of 1e-5 of each position's largest feature moved the
    held-out loss by ~8e-6 relative (passes: the error this comparison allows), 1e-4 by ~5e-4 (passes), 1e-3 by
    ~9e-3 and 2 positions (fails), all features scaled by 1.01 by ~3e-3 (fails), features shifted by one position
    by ~19 % and 11 positions (fails). LR keeps that growth small: at 3e-2 the unperturbed runs already differ by
    ~5e-5 and learn less."""
    from collections import Counter

    from eagle_core.ttt import make_optimizer, make_scheduler, train_step
    from pipelines.train.batches import collate
    from pipelines.train.config import TrainJobConfig
    from pipelines.train.lineage import Lineage
    from pipelines.train.metrics import evaluate
    from pipelines.train.model import TTTObjective, build_draft, load_target_heads, vocab_from_counts
    from pipelines.train.plan import split_heldout

    cpu = torch.device("cpu")
    manifest = served.manifest
    train_ids, eval_ids = ([r["id"] for r in part] for part in split_heldout(served.scanned, 0.5))
    config = TrainJobConfig(features=served.url, target=str(served.folder), draft_vocab_size=DRAFT_VOCAB,
                            ttt_steps=TTT_STEPS, lr=LR, warmup_steps=0)
    tcfg = config.train_config(TRAIN_STEPS)
    heads = load_target_heads(str(served.folder), cpu)
    head = heads["lm_head"]
    # the draft vocabulary from the manifest's loss-token counts, as the job builds it; the extraction's rows count
    # the same tokens, so a draft trained on either has the same vocabulary
    extracted_counts = Counter()
    for r in served.extracted.values():
        extracted_counts.update(r["input_ids"][r["loss_mask"].bool()].tolist())
    assert dict(extracted_counts) == manifest.token_counts
    d2t, t2d = vocab_from_counts(manifest.token_counts, served.model.config.vocab_size, DRAFT_VOCAB)
    lineage = Lineage.of_features(served.url, manifest)

    def batch(rows: list[dict]) -> dict:  # one conversation per row, as `loop.host_batches` lays a step out
        return collate(rows, served.meta, TTT_STEPS, cpu, config.row_length([len(r["input_ids"]) for r in rows]))

    def held_out(draft) -> dict:
        held = batch([served.extracted[i] for i in eval_ids])
        return evaluate(TTTObjective(draft, autocast=False), draft, [held], head, TTT_STEPS, config.step_decay, cpu)

    def trained_on(rows: dict) -> tuple[dict, list[dict]]:
        draft = build_draft(config, served.model.config, heads, d2t, t2d, lineage)  # seeded: the same start
        objective = TTTObjective(draft, autocast=False)
        optimizer = make_optimizer(draft, tcfg)
        scheduler = make_scheduler(optimizer, tcfg)
        # every step trains on the same rows: the teacher (the target's distribution from their last_hidden) is
        # computed once, as `loop.train_one_step`'s `prepare` would compute it each step
        step_batch = objective.teacher(batch([rows[i] for i in train_ids]), head)
        history = [train_step(draft, step_batch, head, optimizer, scheduler, tcfg,
                              forward=lambda _draft, *a, **k: objective(*a, **k)) for _ in range(TRAIN_STEPS)]
        return held_out(draft), history

    untrained = held_out(build_draft(config, served.model.config, heads, d2t, t2d, lineage))
    on_sink, sink_history = trained_on(served.rows)
    on_extraction, extraction_history = trained_on(served.extracted)

    positions = on_sink["eval_positions"]
    assert positions == on_extraction["eval_positions"] > 0
    accuracies = {k: (untrained[f"eval_acc_{k}"], on_sink[f"eval_acc_{k}"], on_extraction[f"eval_acc_{k}"])
                  for k in range(TTT_STEPS)}
    print(f"held-out accuracy per TTT step (untrained, on the sink's rows, on the extraction's) over "
          f"{positions:.0f} positions: {accuracies}; held-out loss {untrained['eval_loss']:.4f} -> "
          f"{on_sink['eval_loss']:.6f} / {on_extraction['eval_loss']:.6f}; training loss "
          f"{sink_history[0]['loss']:.4f} -> {sink_history[-1]['loss']:.4f} / {extraction_history[-1]['loss']:.4f}")
    for k, (before, sink_acc, extraction_acc) in accuracies.items():
        assert abs(sink_acc - extraction_acc) <= 1 / positions + 1e-9, (k, sink_acc, extraction_acc)
    assert on_sink["eval_loss"] == pytest.approx(on_extraction["eval_loss"], rel=1e-3)
    # both learned: well above the untrained draft's held-out accuracy, and the held-out loss fell
    for trained in (on_sink, on_extraction):
        assert trained["eval_acc_0"] > untrained["eval_acc_0"] + 0.1, (untrained["eval_acc_0"], trained["eval_acc_0"])
        assert trained["eval_loss"] < 0.8 * untrained["eval_loss"]


# ---- off, failing stores, a killed writer --------------------------------------------------------------------

def test_sink_off_writes_nothing(tmp_path):
    sink = TrafficSink(TrafficConfig(url=None))
    assert offer(sink, 3) == [False] * 3
    sink.flush()
    sink.close()
    assert sink.stats()["dropped"] == {} and list(tmp_path.iterdir()) == []


class FullDiskFS(MemoryFileSystem):
    """Every write fails as a full disk does."""

    protocol = "fulldisk"

    def pipe_file(self, path, value, **kwargs):
        raise OSError(28, "No space left on device")


class SlowFS(MemoryFileSystem):
    """Every write takes 0.2 s (a store that hangs, against calls that take microseconds)."""

    protocol = "slowstore"

    def pipe_file(self, path, value, **kwargs):
        time.sleep(0.2)
        return super().pipe_file(path, value, **kwargs)


class StalledFS(MemoryFileSystem):
    """Every write waits until `release` is set (a store that stopped answering)."""

    protocol = "stalledstore"
    release = threading.Event()

    def pipe_file(self, path, value, **kwargs):
        StalledFS.release.wait(120)
        return super().pipe_file(path, value, **kwargs)


fsspec.register_implementation("fulldisk", FullDiskFS, clobber=True)
fsspec.register_implementation("slowstore", SlowFS, clobber=True)
fsspec.register_implementation("stalledstore", StalledFS, clobber=True)


def live_tensor_bytes() -> int:
    """Bytes of every real torch storage this process's Python objects reach (each storage once). Tensors without
    memory of their own (meta, or the fake tensors a torch.compile earlier in the same test worker leaves behind) hold
    no bytes and are skipped."""
    import gc

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # fake/functional tensors: no data pointer
                continue
    return sum(storages.values())


def test_a_stalled_store_holds_no_more_than_the_byte_bound():
    """Issue 54 (7): 1 000 records behind a store whose writes never return. The count bound (1 024 records) would
    hold every one of them; the byte bound holds what fits in `max_pending_bytes` (the shard being written
    included) and drops the rest, counted, without holding the caller up. Measured on what the process really keeps:
    the bytes of every tensor storage still reachable (each record's features are 8 x 32 floats, 1 KiB). The same
    bound on a GPU host measured by `python -m bench.sink_memory` (a benchmark, not a timed test)."""
    bound = 16 * 1024
    StalledFS.release.clear()
    before = live_tensor_bytes()
    sink = fake_sink(f"stalledstore://{uuid.uuid4().hex}/traffic", rows_per_shard=4, max_pending_bytes=bound)
    try:
        assert sum(offer(sink, 1000)) < 40
        time.sleep(0.2)  # the writer has taken what it will take
        held = live_tensor_bytes() - before
        stats = sink.stats()
        assert held <= bound, f"{held} bytes of tensors held behind a stalled store (bound {bound})"
        assert stats["pending_bytes"] <= bound
        assert stats["dropped"]["pending_bytes"] > 900
    finally:
        StalledFS.release.set()
        sink.close(timeout=30)
    stats = sink.stats()
    assert stats["offered"] == 1000 == stats.get("rows", 0) + sum(stats["dropped"].values())
    assert stats["pending_bytes"] == 0


def test_a_full_store_loses_no_call_and_counts_every_drop():
    sink = fake_sink(f"fulldisk://{uuid.uuid4().hex}/traffic", rows_per_shard=4)
    started = time.perf_counter()
    assert all(offer(sink, 10))  # queued: the caller is never told about the store
    caller_s = time.perf_counter() - started
    sink.close()
    stats = sink.stats()
    assert stats["dropped"] == {"store_error": 10} and stats.get("rows", 0) == 0
    assert "No space left" in stats["last_error"]
    assert caller_s < 1.0, f"10 calls took {caller_s:.2f} s"


def test_a_hanging_store_never_holds_the_caller_up():
    """A store that takes 0.2 s per write: every call returns at once; what the bounded queue cannot hold is
    dropped and counted, nothing else is lost."""
    sink = fake_sink(f"slowstore://{uuid.uuid4().hex}/traffic", rows_per_shard=1, max_pending=2)
    worst = 0.0
    for _ in range(20):
        started = time.perf_counter()
        offer(sink, 1)
        worst = max(worst, time.perf_counter() - started)
    sink.close(timeout=30)
    stats = sink.stats()
    assert worst < 0.1, f"a call waited {worst:.3f} s"
    assert stats["dropped"].get("queue_full", 0) > 0
    assert stats["offered"] == 20 == stats.get("rows", 0) + sum(stats["dropped"].values())


KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from test_traffic_sink import fake_sink, offer

    real_replace = os.replace
    def stall(src, dst):  # the temporary file is written and synced; the rename never comes
        if dst.endswith(".parquet"):
            open({marker!r}, "w").close()
            time.sleep(600)
        return real_replace(src, dst)
    os.replace = stall
    sink = fake_sink({url!r}, rows_per_shard=2, start=False)
    offer(sink, 2)
    sink.flush()
""")


def test_a_writer_killed_mid_write_leaves_no_shard_a_reader_sees(tmp_path):
    from pipelines.train.plan import scan_features

    url, marker = str(tmp_path / "traffic"), tmp_path / "stalled"
    script = KILLED_WRITER.format(tests=str(REPO / "tests"), marker=str(marker), url=url)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, "the writer exited before its commit"
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # between the temporary file and the rename
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    leftovers = sorted(p.name for p in (tmp_path / "traffic" / "features").iterdir())
    assert leftovers and all(".parquet.tmp-" in name for name in leftovers)
    assert committed_shards(url) == set() and not (tmp_path / "traffic" / "manifest.json").exists()
    assert scan_features(url) == []
    # the next writer in the same folder: its own shard only, listed by the manifest
    sink = fake_sink(url, rows_per_shard=2)
    offer(sink, 2)
    sink.close()
    manifest = load_manifest(url)
    assert [s.rows for s in manifest.shards] == [2] and committed_shards(url) == {manifest.shards[0].name}
    assert len(scan_features(url, [manifest.shards[0].name])) == 2


# ---- the options ---------------------------------------------------------------------------------------------

def test_sampling_redaction_size_cap_and_retention(tmp_path):
    # sampling: a seeded draw per conversation; every offer is counted once
    sink = fake_sink(str(tmp_path / "sampled"), sample_rate=0.5, seed=1, start=False)
    queued = sum(offer(sink, 40))
    sink.flush()
    stats = sink.stats()
    assert 5 < queued < 35 and stats["offered"] == 40 and stats["sampled_out"] == 40 - queued == 40 - stats["rows"]

    # redaction: the hook drops one conversation; one whose token ids it rewrites loses its features (dropped)
    def redact(conversation):
        if conversation.meta.get("secret"):
            return None
        if conversation.meta.get("rewrite"):
            conversation.answer_ids = [7] * len(conversation.answer_ids)
        return conversation

    sink = fake_sink(str(tmp_path / "redacted"), redact=redact, start=False)
    offer(sink, 1, meta={"secret": True})
    offer(sink, 1, meta={"rewrite": True})
    offer(sink, 2)
    sink.flush()
    assert sink.stats()["dropped"] == {"redacted": 1, "no_features": 1} and sink.stats()["rows"] == 2
    assert TrafficSink(TrafficConfig(url=None, redact="os.path:join")).redact is os.path.join

    # size cap: one row (1 056 bytes of ids and features) fits; once its shard is committed the next would pass
    # the cap, so it is dropped and counted
    sink = fake_sink(str(tmp_path / "capped"), max_bytes=1500, rows_per_shard=1, start=False)
    offer(sink, 3)
    sink.flush()
    stats = sink.stats()
    assert stats["rows"] == 1 and stats["dropped"] == {"size_cap": 2}

    # retention by count: the oldest shards leave the manifest and the store
    url = str(tmp_path / "kept")
    sink = fake_sink(url, max_shards=2, rows_per_shard=1, retention_grace_s=0, start=False)
    names = []
    for _ in range(4):
        offer(sink, 1)
        sink.flush()
        names.append(load_manifest(url).shards[-1].name)
        time.sleep(0.002)  # distinct creation times
    assert [s.name for s in load_manifest(url).shards] == names[2:] and committed_shards(url) == set(names[2:])
    assert sink.stats()["shards_removed"] == 2 and not any((tmp_path / "kept" / "retired").iterdir())

    # retention by age: from the creation time in the shard names
    now_ms = int(time.time() * 1000)
    old, new = f"shard-{now_ms - 90_000:013d}-w-0", f"shard-{now_ms - 1_000:013d}-w-1"
    aged = fake_sink(str(tmp_path / "aged"), max_age_s=60, start=False)
    assert aged.shards.expired([old, new]) == [old]


def test_retention_never_deletes_a_shard_a_manifest_lists_nor_one_a_training_read_started_on(tmp_path, monkeypatch):
    """Issue 54 (8), two replicas on one folder, each keeping one shard. (a) Replica B lists the folder, then stalls
    before writing its manifest; meanwhile A commits and retires B's shard; then B's manifest (naming that shard)
    lands. Every shard any manifest has listed must still be in the store: a retired shard leaves only after the
    grace period and only when the manifest there no longer lists it (A's next refresh rewrites it). (b) A training
    run that read the manifest before the retirement reads all its shards within the grace period."""
    import pipelines.traffic_retention as traffic_retention
    from pipelines.train.plan import scan_features

    url = str(tmp_path / "traffic")
    a = fake_sink(url, max_shards=1, rows_per_shard=1, retention_grace_s=0.5, start=False)
    b = fake_sink(url, max_shards=1, rows_per_shard=1, retention_grace_s=0.5, start=False)
    offer(b, 1)
    b.flush()
    first = load_manifest(url)
    started = threading.Event()
    go = threading.Event()
    real_write = traffic_retention.write_manifest

    def stalled_write(output, manifest):
        if threading.current_thread().name == "replica-b":
            started.set()
            assert go.wait(30)
        real_write(output, manifest)

    monkeypatch.setattr(traffic_retention, "write_manifest", stalled_write)
    time.sleep(0.002)
    b_thread = threading.Thread(target=b.shards.refresh, name="replica-b")  # lists the folder, then stalls
    b_thread.start()
    assert started.wait(30)
    offer(a, 1)
    a.flush()  # commits its shard, retires B's (max_shards=1)
    go.set()
    b_thread.join(30)  # B's manifest, from its listing before the retirement
    listed = {s.name for s in load_manifest(url).shards}
    assert listed <= committed_shards(url), "a manifest names a deleted shard"
    assert len(scan_features(url, [s.name for s in first.shards])) == 1  # (b): a read begun on the first manifest
    time.sleep(0.6)  # past the grace period
    offer(a, 1)
    a.flush()
    for _ in range(2):  # the next refreshes: stale listings rewritten, then what nothing lists is removed
        a.shards.refresh()
        assert {s.name for s in load_manifest(url).shards} <= committed_shards(url)
    time.sleep(0.6)
    a.shards.refresh()
    assert committed_shards(url) == {s.name for s in load_manifest(url).shards} and len(committed_shards(url)) == 1


def test_short_or_foreign_features_are_dropped_not_written(tmp_path):
    """Features must cover every position but the last (which may not have been computed) and be the target's
    dtype and widths; anything else is counted, never written."""
    sink = fake_sink(str(tmp_path / "t"), start=False)
    sink.record([1, 2, 3], [4, 5], features=fake_features(3))  # 5 tokens, 3 positions
    sink.record([1, 2, 3], [4, 5], features=RowFeatures(torch.randn(5, 3 * H).double(), torch.randn(5, H).double()))
    sink.record([1, 2, 3], [4, 5])  # none
    sink.record([1, 2, 3], [4, 5], features=fake_features(5))
    sink.flush()
    assert sink.stats()["dropped"] == {"bad_features": 2, "no_features": 1} and sink.stats()["rows"] == 1


def test_record_is_thread_safe_under_concurrent_callers(tmp_path):
    sink = fake_sink(str(tmp_path / "t"), rows_per_shard=8)
    threads = [threading.Thread(target=offer, args=(sink, 10)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.close()
    assert sink.stats()["offered"] == 40 == sink.stats()["rows"] and load_manifest(str(tmp_path / "t")).rows == 40

